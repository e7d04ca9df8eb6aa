"""The library builds from a clean cache, loads without a GPU and says why it falls back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import build

REPO = Path(__file__).resolve().parents[3]
EXPORTS = (
    "hc_abi_version",
    "hc_cudart_version",
    "hc_error_string",
    "hc_device_count",
    "hc_host_offsets",
    "hc_vector_width",
    "hc_plan_direct",
    "hc_batch_memcpy_available",
    "hc_transfer_kernel",
    "hc_transfer_direct",
)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device path")


def test_builds_into_clean_cache_then_reuses_it(lib_path, kernel_cache):
    assert lib_path.is_file() and lib_path.parent.parent == kernel_cache
    assert lib_path.parent.name == build.build_key(
        build.SOURCE.read_bytes(), build.toolchain().version
    )
    mtime = lib_path.stat().st_mtime_ns
    assert build.build(kernel_cache) == lib_path
    assert lib_path.stat().st_mtime_ns == mtime  # cache hit, no recompile
    assert not [p for p in lib_path.parent.iterdir() if p.name.startswith(".build-")]


def test_build_key_tracks_source_toolchain_and_flags():
    src = build.SOURCE.read_bytes()
    key = build.build_key(src, "cuda_13.2")
    assert key == build.build_key(src, "cuda_13.2")
    assert key != build.build_key(src + b"\n// edit", "cuda_13.2")
    assert key != build.build_key(src, "cuda_13.0")
    assert key != build.build_key(src, "cuda_13.2", build.FLAGS + ("-G",))


def test_library_links_only_system_libraries(lib_path):
    if shutil.which("ldd") is None:
        pytest.skip("ldd not available")
    out = subprocess.run(["ldd", str(lib_path)], capture_output=True, text=True, check=True).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert not [n for n in names if "cuda" in n or "torch" in n], out


def test_exports_and_abi(lib, lib_path):
    assert lib.cudart_version() >= 12080
    for name in EXPORTS:
        assert hasattr(lib._lib, name), name
    assert lib.error(-2) == "inconsistent transfer arguments (code -2)"


@no_gpu
def test_device_count_reports_no_device(lib):
    status, count = lib.device_count()
    assert status != 0 or count == 0
    if status:
        assert lib.error(status)  # a real cudaGetErrorString message
    assert not lib.batch_memcpy_available()


@no_gpu
def test_backend_info_says_cpu_fallback_with_reason(fresh_backend, lib_path):
    info = kernels.backend_info()
    assert info["backend"] == "cpu-fallback"
    assert info["reason"].startswith("no CUDA device: ")
    assert info["library"] == str(lib_path)
    assert info["batch_memcpy"] is False


def test_backend_info_without_nvcc(fresh_backend, monkeypatch, tmp_path):
    monkeypatch.setenv("HICACHE_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setenv("HICACHE_KERNELS_NVCC", str(tmp_path / "missing" / "nvcc"))
    info = kernels.backend_info()
    assert info == {
        "backend": "cpu-fallback",
        "reason": f"kernel library unavailable: nvcc not found; {build.INSTALL_HINT}",
        "library": None,
        "cudart_version": None,
        "batch_memcpy": False,
    }


def test_backend_disabled_by_env(fresh_backend, monkeypatch):
    monkeypatch.setenv("HICACHE_KERNELS_DISABLE", "1")
    info = kernels.backend_info()
    assert (info["backend"], info["library"]) == ("cpu-fallback", None)
    assert "HICACHE_KERNELS_DISABLE" in info["reason"]


def test_nvcc_failure_is_a_build_error(monkeypatch, tmp_path, lib_path):
    broken = tmp_path / "transfer.cu"
    broken.write_text(build.SOURCE.read_text() + "\nthis is not C++;\n")
    monkeypatch.setattr(build, "SOURCE", broken)
    with pytest.raises(build.BuildError, match="nvcc failed"):
        build.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_cli_build_uses_cache(lib_path, kernel_cache):
    env = {**os.environ, "HICACHE_KERNELS_CACHE": str(kernel_cache)}
    proc = subprocess.run(
        [sys.executable, "-m", "kernels", "build"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == str(lib_path)


def _cuobjdump() -> Path | None:
    # nvcc wheels ship no cuobjdump; Triton's wheel (a torch dependency) does.
    try:
        import triton
    except ImportError:
        return None
    exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return exe if exe.is_file() else None


def test_sass_uses_wide_cache_bypassing_accesses(lib_path):
    exe = _cuobjdump()
    if exe is None:
        pytest.skip("no cuobjdump (from a CUDA toolkit or the triton wheel) to inspect SASS")
    listing = subprocess.run(
        [str(exe), "-lelf", "-lptx", str(lib_path)], capture_output=True, text=True, check=True
    ).stdout
    for arch in ("sm_80", "sm_90", "sm_100"):
        assert f"{arch}.cubin" in listing
    assert "sm_90.ptx" in listing
    sass = subprocess.run(
        [str(exe), "-sass", "-arch", "sm_90", str(lib_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "LDG.E.NA.128.CONSTANT" in sass  # ld.global.nc.L1::no_allocate.v4
    assert "STG.E.EF.128" in sass  # st.global.cs.v4 (to host)
    assert "STG.E.128.STRONG.GPU" in sass  # st.global.cg.v4 (to device)
    assert "LDG.E.128 " not in sass  # no plain L1-allocating wide loads
