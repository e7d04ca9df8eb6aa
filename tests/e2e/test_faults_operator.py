"""The API server restarts under the running operator: the operator survives and reconciles again.

Uses its own LocalCluster (not the session one, which other modules share): its kube-apiserver
child is stopped, left down long enough for the operator's watches and calls to fail, and started
again with the same flags, port and etcd, as a control-plane restart or upgrade would do.
"""
from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import yaml

from localcluster.cluster import LocalCluster
from localcluster.nodes import default_nodes
from testbed import REPO
from testbed.kube import condition, kget, wait_for
from testbed.operator_proc import OperatorProcess

pytestmark = pytest.mark.e2e
DOWN_SECONDS = 8


def restart_component(cluster: LocalCluster, name: str, down_seconds: float = 0) -> None:
    """Kill one control-plane child and start it again with the flags it had (apiserver only here).

    SIGKILL: a crashed or OOM-killed apiserver (its graceful shutdown would drain watches for a minute)."""
    starters = {"kube-apiserver": cluster._start_apiserver}
    proc = cluster.procs[name]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(down_seconds)
    starters[name]()
    cluster._wait(lambda: cluster._get("/readyz") == 200, 60, f"{name} ready again")


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory):
    if os.environ.get("HICACHE_E2E_KUBECONFIG"):
        pytest.skip("restarts a control plane this run started")
    c = LocalCluster(tmp_path_factory.mktemp("faults-cluster"), nodes=default_nodes(2, 0)).start()
    c.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    c.wait_established("hicachedeployments.hicache.dev")
    yield c
    c.stop()


def _sample(name: str) -> dict:
    doc = yaml.safe_load((REPO / "manifests" / "samples" / "bundled-minimal.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"].update(name=name, namespace="default")
    return doc


def _reconciled(cluster, name: str) -> bool:
    res = cluster.kubectl("get", "hcd", name, "-o", "json", check=False)
    if res.returncode:
        return False
    obj = yaml.safe_load(res.stdout)
    return condition(obj, "ConfigValid") == "True" and cluster.kubectl(
        "get", "statefulset", name, check=False).returncode == 0


def test_operator_recovers_after_api_server_restart(own_cluster, tmp_path):
    op = OperatorProcess(own_cluster, tmp_path, reconcile_interval=5).start()
    try:
        own_cluster.kubectl_apply([_sample("before")])
        wait_for(lambda: _reconciled(own_cluster, "before"), timeout=90, what="first object reconciled")

        restart_component(own_cluster, "kube-apiserver", down_seconds=DOWN_SECONDS)
        assert op.alive(), op.tail()

        own_cluster.kubectl_apply([_sample("after")])
        wait_for(lambda: _reconciled(own_cluster, "after"), timeout=120, what="an object created after the restart")
        # Edits to an object from before the restart are still watched.
        own_cluster.kubectl("scale", "hcd/before", "--replicas=2")
        wait_for(lambda: kget(own_cluster, "statefulset", "before")["spec"]["replicas"] == 2, timeout=90,
                 what="scale of the older object applied")
        assert op.alive(), op.tail()
    finally:
        op.stop()
