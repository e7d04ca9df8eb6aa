"""The real `sglang` package as a test oracle, one installed version per directory.

`scripts/install-sglang.sh` puts each version in `.venv-sglang/<version>` (pip --target,
--no-deps) next to a shared `deps` directory. Code that imports sglang runs in a child
process whose PYTHONPATH names one version, so two versions never meet in one interpreter and
the test process itself never imports sglang. The child reads a JSON request on stdin and
writes one JSON document on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from testbed import REPO

ORACLE_ROOT = Path(os.environ.get("SGLANG_ORACLE_DIR", REPO / ".venv-sglang"))


def installed(version: str) -> bool:
    return (ORACLE_ROOT / version / ".installed").is_file()


def pythonpath(version: str) -> str:
    if not installed(version):
        raise FileNotFoundError(
            f"sglang {version} is not installed under {ORACLE_ROOT}; run scripts/install-sglang.sh")
    return os.pathsep.join([str(ORACLE_ROOT / version), str(ORACLE_ROOT / "deps"), str(REPO)])


def run(version: str, script: str, request: Any, *, timeout: float = 300, env: dict[str, str] | None = None) -> Any:
    """Run ``script`` (Python source) under sglang ``version``: it reads ``request`` as JSON from
    stdin and prints its JSON answer as the last line of stdout. Raises with the child's stderr
    tail when it fails."""
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child_env.update(env or {})
    child_env["PYTHONPATH"] = pythonpath(version)
    # SGLang reads its own env knobs at import; keep the child off any GPU and off the network.
    child_env.setdefault("CUDA_VISIBLE_DEVICES", "")
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(request), capture_output=True,
                          text=True, timeout=timeout, env=child_env)
    if proc.returncode != 0:
        raise RuntimeError(f"sglang {version} child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"sglang {version} child printed nothing; stderr:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def demo_checkpoint() -> Path:
    """The checkpoint scripts/setup.sh writes; SGLang reads its config.json while resolving args.
    Found through the account's home, not $HOME: pods run with HOME=/tmp."""
    import pwd

    models = os.environ.get("HICACHE_MODELS_DIR") or Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "hicache-operator" / "models"
    return Path(models) / "demo"


def for_cpu(argv: list[str]) -> list[str]:
    """An operator-rendered argv made resolvable on a CPU machine: the model path becomes the local
    checkpoint (a model id cannot be fetched here) and ``--device cpu`` is appended."""
    out = list(argv)
    if "--model-path" in out:
        out[out.index("--model-path") + 1] = str(demo_checkpoint())
    return out + ["--device", "cpu"]


def resolve(version: str, argvs: list[list[str]], extra: list[dict] | None = None) -> list[dict]:
    """SGLang ``version``'s answer for each argv (see sglang_child.py); ``extra`` adds per-case fields."""
    cases = [{"argv": for_cpu(a), **((extra or [{}] * len(argvs))[i])} for i, a in enumerate(argvs)]
    return run(version, (Path(__file__).with_name("sglang_child.py")).read_text(), {"cases": cases}, timeout=900)


def container_env(container: dict, pod_ip: str = "10.1.2.3") -> dict[str, str]:
    """A container's env as the kubelet resolves it: downward-API addresses as ``pod_ip``, the pod
    name as ``pod-0``, Secret values as ``key-<secret name>``."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = {"metadata.name": "pod-0"}.get(e["valueFrom"]["fieldRef"]["fieldPath"], pod_ip)
        else:
            env[e["name"]] = f"key-{e['valueFrom']['secretKeyRef']['name']}"
    return env


def container_argv(container: dict, pod_ip: str = "10.1.2.3") -> list[str]:
    """A container's args as its process sees them: ``$(VAR)`` expanded from ``container_env`` the
    way the kubelet does."""
    from localcluster.podspec import expand

    env = container_env(container, pod_ip)
    return [expand(a, env) for a in container["args"]]
