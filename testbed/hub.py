"""A local Hugging Face Hub: serves checkpoint directories the way the Hub API does, so the real
``huggingface_hub`` client (HF_ENDPOINT pointed here) downloads from it.

Routes (what ``snapshot_download`` and ``hf_hub_download`` call):

- ``GET /api/models/<repo>/revision/<rev>``: repo info with the commit ``sha``;
- ``GET /api/models/<repo>/tree/<rev>?recursive=...``: every file (path, size, oid);
- ``HEAD|GET /<repo>/resolve/<rev>/<path>``: the file, with ``X-Repo-Commit``, ``ETag`` and
  ``Content-Length`` (and ``Range`` for resumed downloads).

A repo added with a token answers 401 to requests without ``Authorization: Bearer <token>``.
Every request is recorded (``requests``), and ``hold(pattern)`` keeps the bodies of matching
files waiting until ``release()``, so a test can look at a download in flight.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    root: Path
    commit: str
    branches: dict[str, str]
    token: str | None = None
    files: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str | None


class LocalHub:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self._held: str | None = None
        self._release = threading.Event()
        self.holding = threading.Event()  # set once a held body is waiting
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="local-hub")

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "LocalHub":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, root: Path, *, branch: str = "main", token: str | None = None) -> str:
        """Serve the files under ``root`` as ``repo_id`` at ``branch``; returns the commit sha."""
        files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        for name, path in files.items():
            digest.update(name.encode() + b"\0" + str(path.stat().st_size).encode())
        commit = digest.hexdigest()
        self.repos[repo_id] = Repo(root, commit, {branch: commit}, token, files)
        return commit

    def hold(self, pattern: str) -> None:
        """Bodies of files whose path matches ``pattern`` wait until ``release()``."""
        self._held = pattern
        self._release.clear()
        self.holding.clear()

    def release(self) -> None:
        self._release.set()

    def seen(self, since: int = 0) -> list[Seen]:
        with self._lock:
            return list(self.requests[since:])

    # ---- serving -----------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlsplit(h.path)
        path = unquote(url.path)
        with self._lock:
            self.requests.append(Seen(h.command, path, h.headers.get("Authorization")))
        m = re.fullmatch(r"/api/models/(.+)/(revision|tree)/([^/]+)(/.*)?", path)
        if m:
            repo, why = self._repo(h, m.group(1), m.group(3))
            if repo is None:
                return self._error(h, *why)
            commit = repo.branches.get(m.group(3), m.group(3))
            if m.group(2) == "revision":
                doc = {"id": m.group(1), "modelId": m.group(1), "sha": commit, "private": repo.token is not None,
                       "siblings": [{"rfilename": n} for n in repo.files]}
            else:
                doc = [{"type": "file", "path": n, "size": p.stat().st_size, "oid": self._oid(p)}
                       for n, p in repo.files.items()]
            return self._send(h, 200, json.dumps(doc).encode(), {"Content-Type": "application/json"}, body)
        m = re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", path)
        if m:
            repo, why = self._repo(h, m.group(1), m.group(2))
            if repo is None:
                return self._error(h, *why)
            file = repo.files.get(m.group(3))
            if file is None:
                return self._error(h, 404, "EntryNotFound", f"{m.group(3)} does not exist")
            return self._file(h, repo, file, m.group(3), body)
        self._error(h, 404, "RepoNotFound", "no such route")

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> tuple[Repo | None, tuple]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, (404, "RepoNotFound", f"Repository {repo_id} not found")
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            return None, (401, "GatedRepo", "Access to this repository is restricted: authenticate")
        if revision not in repo.branches and revision != repo.commit:
            return None, (404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, ()

    @staticmethod
    def _oid(path: Path) -> str:
        return hashlib.sha1(path.read_bytes()).hexdigest()

    def _file(self, h: BaseHTTPRequestHandler, repo: Repo, file: Path, name: str, body: bool) -> None:
        size = file.stat().st_size
        start, end = 0, size
        rng = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range") or "")
        if rng:
            start = int(rng.group(1))
            end = int(rng.group(2)) + 1 if rng.group(2) else size
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{self._oid(file)}"',
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if rng:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if body and self._held and fnmatch.fnmatch(name, self._held):
            self.holding.set()
            self._release.wait()
        data = file.read_bytes()[start:end] if body else b""
        headers["Content-Length"] = str(end - start)
        h.send_response(206 if rng else 200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _send(self, h: BaseHTTPRequestHandler, code: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        h.send_response(code)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _error(self, h: BaseHTTPRequestHandler, code: int, kind: str, message: str) -> None:
        self._send(h, code, json.dumps({"error": message}).encode(),
                   {"Content-Type": "application/json", "X-Error-Code": kind, "X-Error-Message": message},
                   h.command == "GET")
