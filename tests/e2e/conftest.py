"""Fixtures for end-to-end tests on the local control plane."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cluster.localcluster import LocalCluster, default_nodes


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """A running local control plane with 6 GPU nodes and 1 CPU node, shared by the session."""
    if os.environ.get("HICACHE_E2E_KUBECONFIG"):
        pytest.skip("external-cluster mode is handled by tests that take `kube`")
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=default_nodes(6, 1))
    c.start()
    print(f"\nlocal control plane ready in {c.startup_seconds:.1f}s")
    yield c
    if request.session.testsfailed:
        c.print_logs()
        for log in sorted(Path(c.workdir / "pods").glob("*/container.log")):
            print(f"----- pod log {log.parent.name} -----\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
    c.stop()
