"""Fixtures for end-to-end tests on the local control plane."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from localcluster.cluster import LocalCluster
from localcluster.nodes import default_nodes

E2E = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Within each e2e module, tests run in file order; pytest-randomly still shuffles the modules
    (and every other test). Each e2e test passes alone (its fixtures bring the cluster to the
    state it needs), but a module's fixtures are costly to move back and forth (a Helm release
    installed and upgraded, a fleet swapped), so file order moves them once. Runs after
    pytest-randomly's shuffle, which it leaves in place across modules; without the plugin
    (-p no:randomly) the order asked for stands (e.g. node ids given in reverse)."""
    if not config.pluginmanager.hasplugin("randomly"):
        return
    e2e = [i for i, item in enumerate(items) if E2E in Path(str(item.path)).parents]
    ordered = sorted((items[i] for i in e2e), key=lambda item: (str(item.path), _position(item)))
    by_module: dict[str, list[pytest.Item]] = {}
    for item in ordered:
        by_module.setdefault(str(item.path), []).append(item)
    for i in e2e:
        items[i] = by_module[str(items[i].path)].pop(0)


def _position(item: pytest.Item) -> tuple[int, tuple[int, ...]]:
    """Where the test is in its file; parametrized cases in the order they are declared."""
    callspec = getattr(item, "callspec", None)
    return item.location[1] or 0, tuple(callspec.indices.values()) if callspec else ()


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


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    """The operator, started once per module that asks for it, with the CRD installed."""
    from testbed.operator_proc import start_operator

    op = start_operator(cluster, tmp_path_factory.mktemp("operator"))
    yield op
    op.stop()


@pytest.fixture
def ns(cluster, request):
    """A namespace of the test's own, deleted (without waiting) after it."""
    from testbed.kube import namespace_for

    name = namespace_for(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")[:8].strip("_").replace("_", "-"),
                         request.node.name)
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
