"""Compile transfer.cu with nvcc into a cached shared library.

The library is keyed by a hash of the source, the nvcc version and the flags,
so editing the kernel or changing toolchains never loads a stale build. It
links the CUDA runtime statically and needs only libc/libstdc++ at load time,
which is why a CPU-only CI machine can build and load it. nvcc may come from
a CUDA toolkit or from PyPI (the ``nvidia-cuda-nvcc`` wheel, whose
``nvcc.profile`` already points at the headers and static cudart of the
``nvidia-cuda-runtime`` wheel installed beside it).
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
INSTALL_HINT = (
    "install a CUDA toolkit, or from PyPI: pip install nvidia-cuda-nvcc nvidia-cuda-runtime "
    "(same CUDA minor version, e.g. ==13.2.*), or point HICACHE_KERNELS_NVCC at nvcc"
)


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message says which and how to fix it."""


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path
    version: str  # last line of `nvcc --version`, e.g. "Build cuda_13.2.r13.2/..."
    release: str  # e.g. "13.2, V13.2.86"


def cache_root() -> Path:
    """Outside the repository, shared by every checkout of the same user."""
    explicit = os.environ.get("HICACHE_KERNELS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache-operator" / "kernels"


def _wheel_nvcc_candidates() -> list[Path]:
    # The nvidia-* wheels install under the `nvidia` namespace package:
    # CUDA 13 wheels in nvidia/cu13/bin, CUDA 12 ones in nvidia/cuda_nvcc/bin.
    roots = [Path(p) / "nvidia" for p in sys.path if p]
    found = []
    for root in roots:
        for rel in ("cu13/bin/nvcc", "cuda_nvcc/bin/nvcc"):
            if (root / rel).is_file():
                found.append(root / rel)
    return found


def find_nvcc() -> Path | None:
    explicit = os.environ.get("HICACHE_KERNELS_NVCC")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    candidates: list[Path] = []
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    candidates.extend(_wheel_nvcc_candidates())
    return next((c for c in candidates if c.is_file()), None)


def toolchain() -> Toolchain:
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError(f"nvcc not found; {INSTALL_HINT}")
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{nvcc} --version failed: {exc}") from exc
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    release = next((ln.split("release", 1)[1].strip() for ln in lines if "release" in ln), "?")
    return Toolchain(nvcc=nvcc, version=lines[-1] if lines else "?", release=release)


def build_key(source: bytes, tc_version: str, flags: tuple[str, ...] = FLAGS) -> str:
    h = hashlib.sha256()
    for part in (source, tc_version.encode(), "\0".join(flags).encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:24]


def library_path(tc: Toolchain, root: Path | None = None) -> Path:
    key = build_key(SOURCE.read_bytes(), tc.version)
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
                raise BuildError(
                    f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n"
                    f"{(proc.stderr or proc.stdout)[-4000:]}"
                )
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildError(f"running nvcc failed: {exc}") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
