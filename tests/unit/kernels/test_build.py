"""The library builds from a clean cache, loads without a GPU and says why it falls back."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tomllib
import venv
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
DOCKERFILE = REPO / "Dockerfile"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device path")


def test_builds_into_clean_cache_then_reuses_it(lib_path, kernel_cache):
    assert lib_path.is_file() and lib_path.parent.parent == kernel_cache
    assert lib_path.parent.name == build.build_key(build.SOURCE.read_bytes(), build.toolchain())
    mtime = lib_path.stat().st_mtime_ns
    assert build.build(kernel_cache) == lib_path
    assert lib_path.stat().st_mtime_ns == mtime  # cache hit, no recompile
    assert not [p for p in lib_path.parent.iterdir() if p.name.startswith(".build-")]


def test_build_key_tracks_source_toolchain_headers_and_flags():
    src = build.SOURCE.read_bytes()
    tc = build.Toolchain(Path("nvcc"), "cuda_13.2", "13.2, V13.2.86", "13020")
    key = build.build_key(src, tc)
    assert key == build.build_key(src, dataclasses.replace(tc, nvcc=Path("other/nvcc")))
    assert key != build.build_key(src + b"\n// edit", tc)
    assert key != build.build_key(src, dataclasses.replace(tc, version="cuda_13.0"))
    assert key != build.build_key(src, dataclasses.replace(tc, cudart="13050"))  # runtime wheel upgraded
    assert key != build.build_key(src, tc, build.FLAGS + ("-G",))


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
    missing = tmp_path / "missing" / "nvcc"
    monkeypatch.setenv("HICACHE_KERNELS_NVCC", str(missing))
    info = kernels.backend_info()
    assert info == {
        "backend": "cpu-fallback",
        "reason": f"kernel library unavailable: HICACHE_KERNELS_NVCC={missing} is not a file. "
        f"Fix: {build.INSTALL_HINT}",
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


def _fake_nvcc(root: Path, release: str, *, wheel: bool, compile_error: str = "") -> Path:
    """An executable answering `--version` like nvcc `release` (e.g. "13.0, V13.0.88"), laid out
    like the PyPI wheel (<site>/nvidia/cu13/bin/nvcc) or a toolkit (<root>/bin/nvcc); any other
    call prints `compile_error` and fails, as a link that cannot find its libraries does."""
    nvcc = root / ("nvidia/cu13/bin/nvcc" if wheel else "bin/nvcc")
    nvcc.parent.mkdir(parents=True)
    major_minor = release.split(",")[0]
    nvcc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then\n'
        f"  echo 'Cuda compilation tools, release {release}'\n"
        f"  echo 'Build cuda_{major_minor}.r{major_minor}/compiler.0_0'\n"
        "  exit 0\n"
        "fi\n"
        f"echo '{compile_error}' >&2\n"
        "exit 1\n"
    )
    nvcc.chmod(0o755)
    return nvcc


def _only(monkeypatch, *, path: str = "", sys_path: list[str] | None = None) -> None:
    """Look for nvcc nowhere but `path` (PATH) and `sys_path` (wheels)."""
    for var in ("HICACHE_KERNELS_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", path)
    monkeypatch.setattr(sys, "path", sys_path or [])
    if Path("/usr/local/cuda/bin/nvcc").is_file():
        pytest.skip("a toolkit at /usr/local/cuda is always a candidate")


def test_pins_agree_across_pyproject_dockerfile_and_build():
    """One pin: build.NVCC_WHEEL_PIN; pyproject's kernels-build extra and the Docker build use it."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "kernels-build"
    ]
    want = {f"{w}=={build.NVCC_WHEEL_PIN}" for w in build.NVCC_WHEELS}
    assert set(extra) == want
    docker = DOCKERFILE.read_text()
    for pin in want:
        assert pin in docker, pin
    assert all(pin in build.INSTALL_HINT for pin in want)


@pytest.mark.parametrize(
    "release,wheel,why",
    [
        ("13.0, V13.0.88", True, "only the 13.2.86 wheels link this library"),
        ("13.5, V13.5.37", True, "only the 13.2.86 wheels link this library"),
        ("12.4, V12.4.131", False, "needs CUDA >= 12.8"),
        ("12.8, V12.8.93", False, None),
        ("13.2, V13.2.51", True, None),
    ],
)
def test_each_nvcc_is_checked_before_use(tmp_path, monkeypatch, release, wheel, why):
    nvcc = _fake_nvcc(tmp_path, release, wheel=wheel)
    monkeypatch.setenv("HICACHE_KERNELS_NVCC", str(nvcc))
    if why is None:
        assert build.toolchain().nvcc == nvcc
        return
    with pytest.raises(build.BuildError) as exc:
        build.toolchain()
    assert why in str(exc.value) and str(nvcc) in str(exc.value)
    assert str(exc.value).endswith(f"Fix: {build.INSTALL_HINT}")


def test_a_wrong_nvcc_first_on_path_is_skipped_for_the_pinned_wheel(tmp_path, monkeypatch):
    good = _fake_nvcc(tmp_path / "site", "13.2, V13.2.86", wheel=True)
    bad = _fake_nvcc(tmp_path / "toolkit", "12.4, V12.4.131", wheel=False)
    _only(monkeypatch, path=str(bad.parent), sys_path=[str(tmp_path / "site")])
    assert build.candidates() == [bad, good]
    assert build.toolchain().nvcc == good


def test_cuda12_wheel_is_named_when_no_nvcc_is_found(tmp_path, monkeypatch):
    ptxas = tmp_path / "site" / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("")
    _only(monkeypatch, sys_path=[str(tmp_path / "site")])
    with pytest.raises(build.BuildError) as exc:
        build.toolchain()
    msg = str(exc.value)
    assert msg.startswith("nvcc not found; ")
    assert "nvidia-cuda-nvcc-cu12, which ships ptxas but no nvcc" in msg
    assert msg.endswith(f"Fix: {build.INSTALL_HINT}")


def test_link_failure_names_the_pin(tmp_path, monkeypatch):
    nvcc = _fake_nvcc(
        tmp_path, "13.2, V13.2.86", wheel=True,
        compile_error="/usr/bin/ld: cannot find -lcudart_static: No such file or directory",
    )
    monkeypatch.setenv("HICACHE_KERNELS_NVCC", str(nvcc))
    with pytest.raises(build.BuildError) as exc:
        build.build(tmp_path / "cache")
    assert "cannot find -lcudart_static" in str(exc.value)
    assert str(exc.value).endswith(build.INSTALL_HINT)


@pytest.mark.slow
@pytest.mark.parametrize("pin,builds", [(build.NVCC_WHEEL_PIN, True), ("13.0.88", False)])
def test_clean_venv_builds_only_with_the_pinned_wheels(tmp_path, pin, builds):
    """A fresh venv with nothing but the nvcc wheels (no torch): `python -m kernels build`
    compiles with the pinned release and refuses 13.0 naming the pin. Needs PyPI, which the
    tests' private network namespace does not reach: run with HICACHE_NO_NETNS=1."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    wheels = [f"{w}=={pin}" for w in build.NVCC_WHEELS]
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", *wheels], capture_output=True, text=True,
                         timeout=900)
    if pip.returncode and ("NewConnectionError" in pip.stderr or "No matching distribution" in pip.stderr
                           or "Network is unreachable" in pip.stderr):
        pytest.skip(f"PyPI not reachable: {pip.stderr.strip().splitlines()[-1]}")
    assert pip.returncode == 0, pip.stderr
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HICACHE_KERNELS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([str(py), "-m", "kernels", "build"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    if builds:
        assert proc.returncode == 0, proc.stderr
        so, _, detail = proc.stdout.partition("  ")
        assert Path(so).is_file() and str(env_dir) in detail and f"V{pin}" in detail
    else:
        assert proc.returncode == 1
        assert f"nvidia-cuda-nvcc {pin[:4]}" in proc.stderr and build.INSTALL_HINT in proc.stderr
