"""The model-download init container: a Hugging Face repo into the fleet's cache claim, once.

The operator ships this file to the pods in ConfigMap ``<name>-model`` and runs it with the
engine's image, so it needs only the standard library and ``huggingface_hub`` (>= 0.23; the bundled
runtime's image and SGLang's have it). The token comes from ``HF_TOKEN`` and the Hub from
``HF_ENDPOINT`` (both read by huggingface_hub), never from the command line.

A finished download leaves ``MARKER`` in its directory; a pod that finds it exits at once without
a network call, so restarts and new pods download nothing. Pods that start together take a lock
beside the directory: one downloads, the others wait and find the marker. While it runs it serves
its progress as JSON on ``GET PROGRESS_PATH`` at ``$POD_IP:--port`` (the engine's port, free until
the engine starts), which the operator shows in the HiCacheDeployment's status, and logs it every
``--log-every`` seconds. A failure ends with one line naming what to change.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MARKER = ".hicache-download.json"
PROGRESS_PATH = "/hicache/model-download"
COMMIT = re.compile(r"[0-9a-f]{40}")


class Progress:
    """What the progress endpoint and the log lines report."""

    def __init__(self, repo: str, revision: str, dest: Path) -> None:
        self.repo, self.revision, self.dest = repo, revision, dest
        self.phase = "resolving"  # resolving -> waiting (another pod downloads) -> downloading -> done
        self.total: int | None = None

    def done_bytes(self) -> int:
        """Bytes on disk under the destination, partial files included (capped at the total)."""
        size = 0
        for root, _, files in os.walk(self.dest):
            for name in files:
                try:
                    size += os.stat(os.path.join(root, name)).st_size
                except OSError:
                    pass
        return min(size, self.total) if self.total is not None else size

    def report(self) -> dict:
        return {"repo": self.repo, "revision": self.revision, "phase": self.phase,
                "bytesDone": self.done_bytes(), "bytesTotal": self.total}

    def line(self) -> str:
        r = self.report()
        total = f" of {r['bytesTotal'] / 2**30:.2f} GiB" if r["bytesTotal"] is not None else ""
        return f"{self.repo}@{self.revision}: {r['phase']}, {r['bytesDone'] / 2**30:.2f} GiB{total}"


def read_marker(dest: Path, repo: str, revision: str) -> dict | None:
    try:
        done = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return done if done.get("repo") == repo and done.get("revision") == revision else None


def serve_progress(progress: Progress, host: str, port: int) -> ThreadingHTTPServer | None:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return

        def do_GET(self) -> None:
            found = self.path.split("?")[0] == PROGRESS_PATH
            body = json.dumps(progress.report() if found else {"error": "not found"}).encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:  # progress is a courtesy; the download goes on without it
        print(f"progress not served on {host}:{port}: {exc}", flush=True)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def download(args: argparse.Namespace, progress: Progress) -> dict:
    """Resolve, list, lock, download, mark; returns the marker."""
    from huggingface_hub import HfApi, RepoFile, snapshot_download
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi()
    commit = args.revision if COMMIT.fullmatch(args.revision) else api.repo_info(args.repo, revision=args.revision).sha
    sizes = {f.path: f.size for f in api.list_repo_tree(args.repo, revision=commit, recursive=True)
             if isinstance(f, RepoFile)}
    wanted = list(filter_repo_objects(sizes, allow_patterns=args.allow or None, ignore_patterns=args.ignore or None))
    if not wanted:
        raise LookupError(f"no file of {args.repo} matches modelSource.huggingFace allowPatterns / ignorePatterns")
    progress.total = sum(sizes[p] for p in wanted)
    dest = progress.dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    progress.phase = "waiting"
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = read_marker(dest, args.repo, args.revision)
        if done is not None:
            return done
        progress.phase = "downloading"
        snapshot_download(args.repo, revision=commit, local_dir=dest, allow_patterns=args.allow or None,
                          ignore_patterns=args.ignore or None)
        done = {"repo": args.repo, "revision": args.revision, "commit": commit, "files": len(wanted),
                "bytes": progress.total}
        tmp = dest / f"{MARKER}.tmp"
        tmp.write_text(json.dumps(done))
        tmp.replace(dest / MARKER)
    progress.phase = "done"
    return done


def explain(exc: BaseException, args: argparse.Namespace) -> str:
    """One line: what failed and which field to change."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, GatedRepoError):
        return (f"{args.repo} is gated or private and the token cannot read it ({detail}): set "
                "modelSource.huggingFace.tokenSecretRef to a Secret whose token has access")
    if isinstance(exc, RepositoryNotFoundError):
        return f"{args.repo} is not on the Hub or needs a token ({detail}): check spec.model and tokenSecretRef"
    if isinstance(exc, RevisionNotFoundError):
        return f"{args.repo} has no revision {args.revision!r}: check modelSource.huggingFace.revision"
    return f"{type(exc).__name__}: {detail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", required=True)
    ap.add_argument("--revision", required=True)
    ap.add_argument("--dest", required=True, type=Path)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--allow", action="append", default=[])
    ap.add_argument("--ignore", action="append", default=[])
    ap.add_argument("--log-every", type=float, default=30.0)
    args = ap.parse_args(argv)
    done = read_marker(args.dest, args.repo, args.revision)
    if done is not None:
        print(f"{args.repo}@{args.revision}: already in {args.dest} (commit {done['commit']}), nothing to download",
              flush=True)
        return 0
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # our own lines instead
    progress = Progress(args.repo, args.revision, args.dest)
    server = serve_progress(progress, os.environ.get("POD_IP") or "0.0.0.0", args.port)
    stop = threading.Event()

    def log() -> None:
        while not stop.wait(args.log_every):
            print(progress.line(), flush=True)
    threading.Thread(target=log, daemon=True).start()
    try:
        done = download(args, progress)
    except Exception as exc:
        print(f"error: {args.repo}@{args.revision}: {explain(exc, args)}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop.set()
        if server is not None:
            server.shutdown()
    print(f"{args.repo}@{args.revision}: {done['files']} files, {done['bytes']} bytes in {args.dest} "
          f"(commit {done['commit']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
