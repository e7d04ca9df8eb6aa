"""Compile transfer.cu with nvcc into a cached shared library.

The library is keyed by a hash of the source, the nvcc version, the CUDA
runtime headers it compiles against and the flags, so editing the kernel or
changing toolchains never loads a stale build. It links the CUDA runtime
statically and needs only libc/libstdc++ at load time, which is why a CPU-only
CI machine can build and load it.

nvcc comes from a CUDA toolkit (12.8 or newer: the code uses the 12.8 driver
entry-point ABI) or from PyPI. Of the PyPI wheels only the pinned release
links: CUDA 12's ``nvidia-cuda-nvcc-cu12`` ships ptxas but no nvcc, and the
13.0 wheels' ``nvcc.profile`` looks for ``libcudart_static.a`` in a toolkit
directory layout the wheels do not have. Every candidate is checked before it
is used, and a refusal names the pin.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("transfer.cu")
LIBRARY_NAME = "libhicache_kernels.so"

# SASS for A100, H100/H200 and B200, plus sm_90 PTX so a newer GPU can JIT it.
GENCODE = (
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
    "-gencode=arch=compute_100,code=sm_100",
)
FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-cudart=static",
    "-Xcompiler=-fPIC,-fvisibility=hidden",
    *GENCODE,
)
# The PyPI nvcc that builds this library; pyproject.toml's kernels-build extra and the
# Dockerfile pin the same wheels (tests/unit/kernels/test_build.py keeps them equal).
NVCC_WHEEL_PIN = "13.2.86"
NVCC_WHEELS = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime")
MIN_TOOLKIT = (12, 8)
INSTALL_HINT = (
    "pip install "
    + " ".join(f"{w}=={NVCC_WHEEL_PIN}" for w in NVCC_WHEELS)
    + " (the kernels-build extra: pip install -e '.[kernels-build]'), "
    f"or install a CUDA toolkit >= {MIN_TOOLKIT[0]}.{MIN_TOOLKIT[1]}, "
    "or point HICACHE_KERNELS_NVCC at such an nvcc"
)


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message says which and how to fix it."""


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path
    version: str  # last line of `nvcc --version`, e.g. "Build cuda_13.2.r13.2/..."
    release: str  # e.g. "13.2, V13.2.86"
    cudart: str  # CUDART_VERSION of the runtime headers nvcc compiles against, e.g. "13020"


def cache_root() -> Path:
    """Outside the repository, shared by every checkout of the same user."""
    explicit = os.environ.get("HICACHE_KERNELS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache-operator" / "kernels"


def _wheel_roots() -> list[Path]:
    """The `nvidia` namespace directories the nvidia-* wheels install into."""
    return [Path(p) / "nvidia" for p in sys.path if p and (Path(p) / "nvidia").is_dir()]


def _is_wheel_nvcc(nvcc: Path) -> bool:
    return nvcc.parent.name == "bin" and nvcc.parent.parent.parent.name == "nvidia"


def candidates() -> list[Path]:
    """Every nvcc this machine offers, in order of preference (only the explicit one if set)."""
    explicit = os.environ.get("HICACHE_KERNELS_NVCC")
    if explicit:
        return [Path(explicit)] if Path(explicit).is_file() else []
    found: list[Path] = []
    on_path = shutil.which("nvcc")
    if on_path:
        found.append(Path(on_path))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            found.append(Path(os.environ[var]) / "bin" / "nvcc")
    found.append(Path("/usr/local/cuda/bin/nvcc"))
    found.extend(root / "cu13" / "bin" / "nvcc" for root in _wheel_roots())
    unique = []
    for c in found:
        if c.is_file() and c.resolve() not in {u.resolve() for u in unique}:
            unique.append(c)
    return unique


def _parse_release(release: str) -> tuple[int, int] | None:
    try:
        major, minor = release.split(",")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _headers_cudart(nvcc: Path) -> str:
    header = nvcc.parent.parent / "include" / "cuda_runtime_api.h"
    try:
        for line in header.read_text(errors="replace").splitlines():
            if line.startswith("#define CUDART_VERSION"):
                return line.split()[-1]
    except OSError:
        pass
    return "?"


def probe(nvcc: Path) -> Toolchain:
    """Run `nvcc --version`; BuildError if it does not run."""
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{nvcc} --version failed: {exc}") from exc
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    release = next((ln.split("release", 1)[1].strip() for ln in lines if "release" in ln), "?")
    return Toolchain(
        nvcc=nvcc,
        version=lines[-1] if lines else "?",
        release=release,
        cudart=_headers_cudart(nvcc),
    )


def refusal(tc: Toolchain) -> str | None:
    """Why this nvcc cannot build the library, or None if it can."""
    got = _parse_release(tc.release)
    if _is_wheel_nvcc(tc.nvcc):
        if got != _parse_release(NVCC_WHEEL_PIN):
            return (
                f"{tc.nvcc} is the nvidia-cuda-nvcc {tc.release} wheel; only the "
                f"{NVCC_WHEEL_PIN} wheels link this library (13.0's look for "
                "libcudart_static.a in a toolkit layout the wheels do not have)"
            )
        return None
    if got is None or got < MIN_TOOLKIT:
        return (
            f"{tc.nvcc} is nvcc {tc.release}; the library needs CUDA "
            f">= {MIN_TOOLKIT[0]}.{MIN_TOOLKIT[1]} (cuMemcpyBatchAsync, driver entry points)"
        )
    return None


def _cuda12_wheels() -> list[Path]:
    return [r / "cuda_nvcc" for r in _wheel_roots() if (r / "cuda_nvcc").is_dir()]


def toolchain() -> Toolchain:
    """The first nvcc that can build the library; BuildError naming the pin otherwise."""
    reasons = []
    for nvcc in candidates():
        try:
            tc = probe(nvcc)
        except BuildError as exc:
            reasons.append(str(exc))
            continue
        why = refusal(tc)
        if why is None:
            return tc
        reasons.append(why)
    if not reasons:
        explicit = os.environ.get("HICACHE_KERNELS_NVCC")
        reasons.append(f"HICACHE_KERNELS_NVCC={explicit} is not a file" if explicit else "nvcc not found")
    reasons += [
        f"{d} is the CUDA 12 wheel nvidia-cuda-nvcc-cu12, which ships ptxas but no nvcc"
        for d in _cuda12_wheels()
    ]
    raise BuildError("; ".join(reasons) + f". Fix: {INSTALL_HINT}")


def build_key(source: bytes, tc: Toolchain, flags: tuple[str, ...] = FLAGS) -> str:
    h = hashlib.sha256()
    for part in (source, tc.version.encode(), tc.cudart.encode(), "\0".join(flags).encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:24]


def library_path(tc: Toolchain, root: Path | None = None) -> Path:
    key = build_key(SOURCE.read_bytes(), tc)
    return (root or cache_root()) / key / LIBRARY_NAME


def build(root: Path | None = None, *, force: bool = False) -> Path:
    """Return the cached library, compiling it first if needed.

    Concurrent callers (several runtime processes starting at once) serialise
    on a lock file and the winner's output is renamed into place atomically.
    """
    tc = toolchain()
    target = library_path(tc, root)
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and not force:
            return target
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [str(tc.nvcc), *FLAGS, "-o", tmp, str(SOURCE)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                out = (proc.stderr or proc.stdout)[-4000:]
                hint = f"\n{INSTALL_HINT}" if "cudart_static" in out else ""
                raise BuildError(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{out}{hint}")
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildError(f"running nvcc failed: {exc}") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
