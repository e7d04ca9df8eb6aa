"""What a benchmark records beside its figures: the machine it ran on, the runtime's CPU GEMM
calibration, and results made JSON-safe."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


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
    from cache_runtime import cpu_kernels

    return cpu_kernels.variant()


def no_nan(v):
    """JSON has no NaN: an undefined statistic (no samples) is written as null."""
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, dict):
        return {k: no_nan(x) for k, x in v.items()}
    if isinstance(v, list):
        return [no_nan(x) for x in v]
    return v
