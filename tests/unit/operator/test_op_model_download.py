"""The model-download init container's script, run as the pods run it (a process with HF_ENDPOINT
and HF_TOKEN in its env) against a local Hub served the way the Hub API serves it, by the real
huggingface_hub client."""

from __future__ import annotations

import ast
import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cache_runtime.synth.checkpoint import write_checkpoint
from hicache_operator.plan.model import download as model_download
from testbed.hub import LocalHub

SCRIPT = Path(model_download.__file__)
TOKEN = "hf_local_test_token"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    write_checkpoint(root / "ckpt", "tiny-llama", max_shard_bytes=200_000)
    (root / "ckpt" / ".synth-stamp.json").unlink()
    (root / "ckpt" / "original").mkdir()
    (root / "ckpt" / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)
    return root / "ckpt"


@pytest.fixture
def hub(checkpoint):
    with LocalHub() as h:
        h.add("org/tiny", checkpoint, token=TOKEN)
        yield h


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(hub: LocalHub, dest: Path, *extra: str, token: str | None = TOKEN, revision: str = "main",
          port: int = 0) -> subprocess.Popen:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(dest.parent), "HF_ENDPOINT": hub.endpoint, "POD_IP": "127.0.0.1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    if token is not None:
        env["HF_TOKEN"] = token
    argv = [sys.executable, str(SCRIPT), "--repo", "org/tiny", "--revision", revision, "--dest", str(dest),
            "--port", str(port or free_port()), "--ignore", "original/*", *extra]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(hub: LocalHub, dest: Path, *extra: str, **kw) -> tuple[int, str, str]:
    p = start(hub, dest, *extra, **kw)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def weights(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.iterdir() if p.is_file())


def test_downloads_once_with_the_token_then_never_calls_the_hub_again(hub, checkpoint, tmp_path):
    dest = tmp_path / "cache" / "org--tiny" / "main"
    code, out, err = run(hub, dest)
    assert code == 0, err
    for name in weights(checkpoint):
        assert (dest / name).read_bytes() == (checkpoint / name).read_bytes(), name
    assert not (dest / "original").exists()  # --ignore
    marker = json.loads((dest / model_download.MARKER).read_text())
    assert marker["commit"] == hub.repos["org/tiny"].commit and marker["files"] == len(weights(checkpoint))
    assert marker["bytes"] == sum((checkpoint / n).stat().st_size for n in weights(checkpoint))
    seen = hub.seen()
    assert seen and all(s.authorization == f"Bearer {TOKEN}" for s in seen)
    assert TOKEN not in out + err

    before = len(hub.seen())
    code, out, err = run(hub, dest, token=None)
    assert code == 0, err
    assert hub.seen(before) == [] and "nothing to download" in out


def test_allow_patterns_keep_only_what_they_name(hub, checkpoint, tmp_path):
    dest = tmp_path / "only-json"
    code, _, err = run(hub, dest, "--allow", "*.json")
    assert code == 0, err
    assert sorted(p.name for p in dest.iterdir() if p.is_file() and p.name != model_download.MARKER) == \
        sorted(n for n in weights(checkpoint) if n.endswith(".json"))


@pytest.mark.parametrize("token, revision, says", [
    (None, "main", "set modelSource.huggingFace.tokenSecretRef to a Secret whose token has access"),
    ("hf_wrong", "main", "set modelSource.huggingFace.tokenSecretRef to a Secret whose token has access"),
    (TOKEN, "v9", "has no revision 'v9': check modelSource.huggingFace.revision"),
])
def test_a_failure_ends_with_one_line_naming_the_field_to_change(hub, tmp_path, token, revision, says):
    code, _, err = run(hub, tmp_path / "dest", token=token, revision=revision)
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: org/tiny@") and says in last, err
    assert not (tmp_path / "dest" / model_download.MARKER).exists()


def test_patterns_that_match_nothing_are_refused_before_any_download(hub, tmp_path):
    code, _, err = run(hub, tmp_path / "dest", "--allow", "*.bin")
    assert code == 1 and "matches modelSource.huggingFace allowPatterns / ignorePatterns" in err
    assert not any(s.path.startswith("/org/tiny/resolve/") for s in hub.seen())


def progress(port: int) -> dict | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{model_download.PROGRESS_PATH}", timeout=2).json()
    except httpx.HTTPError:
        return None


def wait(cond, what: str):
    from testbed.kube import wait_for
    return wait_for(cond, timeout=60, what=what, interval=0.1)


def test_progress_is_served_while_it_downloads_and_a_second_pod_waits_for_the_first(hub, checkpoint, tmp_path):
    dest = tmp_path / "shared" / "org--tiny" / "main"
    total = sum((checkpoint / n).stat().st_size for n in weights(checkpoint))
    hub.hold("*.safetensors")
    first_port, second_port = free_port(), free_port()
    first = start(hub, dest, port=first_port)
    try:
        hub.holding.wait(60)
        report = wait(lambda: (lambda r: r if r and r["phase"] == "downloading" else None)(progress(first_port)),
                      "the first download's progress")
        assert report["repo"] == "org/tiny" and report["revision"] == "main"
        assert report["bytesTotal"] == total and report["bytesDone"] < total
        second = start(hub, dest, port=second_port)
        wait(lambda: (progress(second_port) or {}).get("phase") == "waiting", "the second pod waiting on the lock")
    finally:
        hub.release()
    assert first.wait(120) == 0, first.stderr.read()
    assert second.wait(120) == 0, second.stderr.read()
    bodies = [s.path for s in hub.seen() if s.method == "GET" and s.path.startswith("/org/tiny/resolve/")]
    assert sorted(bodies) == sorted(set(bodies)), "a file was downloaded twice"
    assert (dest / model_download.MARKER).exists()


def test_the_script_needs_nothing_but_the_standard_library_and_huggingface_hub():
    """The ConfigMap mounts it alone, into any engine's image: no package around it."""
    tree = ast.parse(SCRIPT.read_text())
    modules = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert modules - {"__future__", "huggingface_hub"} <= set(sys.stdlib_module_names), modules
