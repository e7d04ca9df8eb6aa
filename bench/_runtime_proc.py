"""Starting and stopping a real ``python -m cache_runtime serve`` for the runtime benchmarks, and what
the benchmarks share about it: the demo checkpoint, the weight bytes a decode step reads, peak RSS."""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.support.runtime_proc import RuntimeProcess, free_port, peak_rss_bytes  # noqa: E402,F401 (re-exported)
# The demo checkpoint (python -m cache_runtime.synth --preset demo): random weights, Llama-3 KV geometry,
# ~247 M parameters in bf16. Written on first use; the synth CLI leaves an up-to-date one alone.
# the embedded default checkpoint scripts/setup.sh writes (written here too when absent)
MODELS_DIR = Path(os.environ.get("HICACHE_MODELS_DIR") or Path.home() / ".cache" / "hicache-operator" / "models")
DEMO_CHECKPOINT = MODELS_DIR / "demo"
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


def ensure_demo_checkpoint(path: Path = DEMO_CHECKPOINT) -> Path:
    """The demo checkpoint at ``path``, written by the synth CLI if missing or stale (a no-op otherwise)."""
    subprocess.run([sys.executable, "-m", "cache_runtime.synth", "--preset", "demo", "--out", str(path)],
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, stdout=subprocess.DEVNULL)
    return path


def resolve_model_path(value: str | None) -> str:
    """``None`` or ``demo``: the demo checkpoint (written if absent); ``builtin:*`` or a directory as given."""
    if value in (None, "demo"):
        return str(ensure_demo_checkpoint())
    return value


def _safetensors_headers(model_dir: Path) -> dict[str, dict]:
    tensors: dict[str, dict] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        tensors.update(header)
    return tensors


def matmul_weight_bytes(model_dir: str | Path, dtype_bytes: int | None = None) -> dict:
    """Bytes of every matmul weight a decode step reads (2-D ``*.weight`` tensors, the LM head included;
    the input embedding is a row lookup, not read whole), at the checkpoint's dtype or ``dtype_bytes``."""
    tensors = _safetensors_headers(Path(model_dir))
    params = embed = 0
    stored = 0
    for name, t in tensors.items():
        if not name.endswith(".weight") or len(t["shape"]) != 2:
            continue
        numel = 1
        for d in t["shape"]:
            numel *= d
        if "embed_tokens" in name:
            embed += numel
            continue
        params += numel
        stored += numel * _DTYPE_BYTES[t["dtype"]]
    total = sum(_numel(t["shape"]) for t in tensors.values())
    return {"matmul_params": params, "embedding_params": embed, "total_params": total,
            "matmul_weight_bytes": params * dtype_bytes if dtype_bytes else stored}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_bytes": mem, "loadavg_at_start": os.getloadavg(),
            "python": platform.python_version(), "cpu_flags": _vector_flags(), "cpu_kernels": _cpu_kernels(),
            "lscpu": _lscpu()}


def _lscpu() -> dict:
    """lscpu's model name and full flag list: which machine a figure came from."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {"model_name": fields.get("Model name", "").strip(), "flags": fields.get("Flags", "").split()}


def gemm_calibration(log_path: Path) -> str | None:
    """The runtime's CPU GEMM calibration line from its log (the row limit it measured at load)."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [line.split("CPU GEMM calibrated", 1)[1] for line in lines if "CPU GEMM calibrated" in line]
    return "CPU GEMM calibrated" + found[-1] if found else None


_VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16")


def _vector_flags() -> list[str]:
    """The vector-instruction flags of /proc/cpuinfo that decide the runtime's CPU kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in _VECTOR_FLAGS if x in have]
    except OSError:
        pass
    return []


def _cpu_kernels() -> str | None:
    """The native CPU kernel variant the runtime uses on this machine (None: torch only)."""
    if os.environ.get("HICACHE_CPU_KERNELS") == "0":
        return None
    sys.path.insert(0, str(REPO))
    from cache_runtime import cpu_kernels

    return cpu_kernels.variant()


def start_runtime(flags: list[str], log_path: Path, env: dict | None = None) -> RuntimeProcess:
    """A runtime on a free loopback port, healthy (a real checkpoint loads in seconds, but 2 busy
    cores stretch that: up to 300 s)."""
    return RuntimeProcess(flags, log_path, env=env, ready_timeout=300).start()


async def stream_generate(client: httpx.AsyncClient, body: dict) -> AsyncIterator[tuple[float, dict]]:
    """The events of a streamed ``/generate`` (``body`` with ``"stream": True``), each with its arrival time."""
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"])
            yield time.perf_counter(), ev


def no_nan(v):
    """JSON has no NaN: an undefined statistic (no samples) is written as null."""
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, dict):
        return {k: no_nan(x) for k, x in v.items()}
    if isinstance(v, list):
        return [no_nan(x) for x in v]
    return v
