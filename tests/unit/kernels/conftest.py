"""Fixtures for the kernels tests: one clean build per session."""

from __future__ import annotations

import pytest

from kernels import build, library


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
    """An empty cache dir; the session's library is compiled into it from scratch."""
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def lib_path(kernel_cache):
    try:
        build.toolchain()
    except build.BuildError as exc:
        pytest.skip(f"cannot build kernels/transfer.cu: {exc}")
    return build.build(kernel_cache)


@pytest.fixture(scope="session")
def lib(lib_path):
    return library.load(lib_path)


@pytest.fixture
def fresh_backend(monkeypatch, kernel_cache):
    """Make backend() decide again, against the session's cache, and forget afterwards."""
    monkeypatch.setenv("HICACHE_KERNELS_CACHE", str(kernel_cache))
    monkeypatch.delenv("HICACHE_KERNELS_DISABLE", raising=False)
    monkeypatch.delenv("HICACHE_KERNELS_NVCC", raising=False)
    monkeypatch.setattr(library, "_backend", None)
