"""Builds ``build/libhicache_cpu.so`` from the C++ sources beside this file with g++.

``ops.cpp`` is compiled once per variant (its namespace, vector width and instruction-set flags),
``api.cpp`` and ``pool.cpp`` (the worker threads) without instruction-set flags, so the library
loads on any x86-64 CPU and picks a variant at run time. The build is skipped when the library was
built from the same sources, flags and compiler (a stamp beside it).

    python cache_runtime/cpu_kernels/build.py [--force]     (stdlib only: no torch import)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "build"
LIBRARY = OUT_DIR / "libhicache_cpu.so"
SOURCES = ("common.h", "ops.cpp", "pool.cpp", "api.cpp")
COMMON = ["-O3", "-std=gnu++17", "-fPIC", "-pthread", "-fno-math-errno", "-Wall", "-Wno-unused-function", "-Wno-psabi"]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# (namespace and Ops symbol, floats per vector, flags)
VARIANTS = {"avx2": (8, AVX2), "avx2_w16": (16, AVX2), "avx512": (16, AVX512)}


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


def sources_digest() -> str:
    """sha256 of the sources, compiled into the library: a library built from other sources is not loaded."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((HERE / name).read_bytes())
    return h.hexdigest()


def _units() -> list[tuple[str, list[str]]]:
    units = [(f"ops_{name}.o", [str(HERE / "ops.cpp"), *flags, f"-DHC_NS=ns_{name}", f"-DHC_VW={width}",
                                f"-DHC_OPS_SYMBOL=ops_{name}", f'-DHC_VARIANT_NAME="{name}"'])
             for name, (width, flags) in VARIANTS.items()]
    units.append(("api.o", [str(HERE / "api.cpp"), f'-DHC_SOURCES="{sources_digest()}"']))
    units.append(("pool.o", [str(HERE / "pool.cpp")]))
    return units


def _stamp(cxx: str) -> str:
    h = hashlib.sha256()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h.update(repr((COMMON, _units(), version)).encode())
    return h.hexdigest()


def build(force: bool = False, quiet: bool = False) -> Path:
    """The library, built if missing or stale; raises RuntimeError when it cannot be built here."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the CPU kernels are x86-64 only (this machine: {platform.machine()})")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    stamp_file = OUT_DIR / "stamp"
    stamp = _stamp(cxx)
    if not force and LIBRARY.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        if not quiet:
            print(f"{LIBRARY} up to date")
        return LIBRARY
    OUT_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as tmp:
        def compile_one(unit: tuple[str, list[str]]) -> str:
            obj, args = unit
            cmd = [cxx, *COMMON, "-c", *args, "-o", str(Path(tmp) / obj)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{' '.join(cmd)}\n{res.stderr}")
            return str(Path(tmp) / obj)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, _units()))
        tmp_lib = Path(tmp) / LIBRARY.name
        cmd = [cxx, "-shared", "-pthread", *objects, "-o", str(tmp_lib)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{' '.join(cmd)}\n{res.stderr}")
        os.replace(tmp_lib, LIBRARY)  # atomic: a process loading the old one keeps its mapping
    stamp_file.write_text(stamp)
    if not quiet:
        print(f"built {LIBRARY}")
    return LIBRARY


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    a = p.parse_args(argv)
    try:
        build(force=a.force)
    except RuntimeError as exc:
        print(f"CPU kernels not built: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
