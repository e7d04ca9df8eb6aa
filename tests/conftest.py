"""Session-wide test setup.

Every pytest run moves itself into a fresh private network namespace before any
thread starts (when it can: root). Process-backed pods then get addresses that exist
only there, so no test traffic can reach any address outside loopback and that
namespace. Set HICACHE_E2E_KUBECONFIG to run the e2e tests against an existing
cluster (e.g. kind) instead of the local control plane.
"""
from __future__ import annotations

import os

import pytest

from localcluster import netns


def pytest_configure(config: pytest.Config) -> None:
    # Runtimes the tests start (in process, as processes, as pods) keep the CPU GEMM's built-in
    # row limits instead of timing this machine at load: tests that compare greedy outputs across
    # processes need one dispatch everywhere; tests/unit/runtime/test_cpu_kernels.py checks the timing.
    os.environ.setdefault("HICACHE_CPU_LINEAR_MAX_ROWS", "default")
    if os.environ.get("HICACHE_NO_NETNS") != "1":
        netns.enter_private_netns()


def pytest_report_header(config: pytest.Config) -> str:
    mode = "private network namespace" if netns.is_private_netns() else "host network (loopback only)"
    return f"hicache: tests run in a {mode}"
