"""Pods that serve without the operator, and pod-template changes rolled pod by pod, drained first.

Real control plane and runtime processes at their pod IPs; the load client routes like a gateway
(only to endpoints the client Service's EndpointSlices mark ready) and retries nothing.
"""
from __future__ import annotations

import json

import pytest

from testbed.gateway import Gateway
from testbed.kube import kget, wait_for
from testbed.operator_proc import start_operator
from tests.e2e.helpers import skip_without_pod_network_or_mooncake

pytestmark = pytest.mark.e2e
NS = "rolling-e2e"
REPLICAS = 3


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    skip_without_pod_network_or_mooncake(cluster)
    op = start_operator(cluster, tmp_path_factory.mktemp("rolling"), reconcile_interval=5)
    cluster.kubectl("create", "namespace", NS)
    yield {"cluster": cluster, "op": op}
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    op.stop()


def deployment(name: str, image: str = "hicache-runtime:test") -> dict:
    return {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
            "metadata": {"name": name, "namespace": NS, "annotations": {"hicache.dev/process-backed": "true"}},
            "spec": {"image": image, "replicas": REPLICAS, "pageSize": 4, "maxTotalTokens": 4096,
                     "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 60},
                     # clients here route by the client Service's EndpointSlices (test_router.py: through the router)
                     "router": {"enabled": False}}}


def pods(c, name: str) -> list[dict]:
    return [p for p in kget(c, "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={name}")["items"]
            if not p["metadata"].get("deletionTimestamp")]


def serving_ips(c, name: str) -> set[str]:
    """The addresses the client Service routes to: ready endpoints of its EndpointSlices."""
    slices = kget(c, "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={name}")["items"]
    return {a for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")
            for a in e.get("addresses") or []}


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def all_serving(c, name: str, count: int) -> bool:
    ps = pods(c, name)
    ips = {p["status"].get("podIP") for p in ps}
    return len(ps) == count and all(ready(p) for p in ps) and ips == serving_ips(c, name)


def status(c, name: str) -> dict:
    return kget(c, "hcd", name, "-n", NS).get("status") or {}


def test_new_and_restarted_pods_serve_while_the_operator_is_down(env):
    c, op = env["cluster"], env["op"]
    c.kubectl_apply([deployment("standalone")])
    wait_for(lambda: all_serving(c, "standalone", REPLICAS), timeout=180, what="fleet serving")
    op.stop()
    try:
        old = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(c, "standalone")}
        c.kubectl("delete", "pod", "standalone-0", "-n", NS, "--wait=false")
        c.kubectl("scale", "statefulset", "standalone", "-n", NS, f"--replicas={REPLICAS + 1}")
        wait_for(lambda: all_serving(c, "standalone", REPLICAS + 1) and
                 {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(c, "standalone")}["standalone-0"]
                 != old["standalone-0"], timeout=180, what="a recreated and a new pod serving, no operator")
    finally:
        op.start()
    # the operator back: the StatefulSet returns to spec.replicas, every pod serving, no swap started
    wait_for(lambda: all_serving(c, "standalone", REPLICAS), timeout=180, what="fleet back to spec.replicas")
    wait_for(lambda: status(c, "standalone").get("readyReplicas") == REPLICAS, timeout=60, what="status caught up")
    assert not (status(c, "standalone").get("backendSwap") or {}).get("pods")


def test_an_image_change_rolls_pod_by_pod_drained_with_zero_failed_requests(env):
    c, name = env["cluster"], "imagechange"
    c.kubectl_apply([deployment(name)])
    wait_for(lambda: all_serving(c, name, REPLICAS), timeout=180, what="fleet serving")
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(c, name)}
    gw = Gateway(c.api_client(), NS, name, concurrency=3).start()
    out_at_once: list[int] = []
    try:
        wait_for(lambda: len(gw.report.outcomes) > 10, timeout=60, what="load flowing")
        c.kubectl("patch", "hcd", name, "-n", NS, "--type=merge",
                  "-p", json.dumps({"spec": {"image": "hicache-runtime:test-2"}}))

        def rolled() -> bool:
            ps = pods(c, name)
            out_at_once.append(REPLICAS - len(serving_ips(c, name)))
            return (len(ps) == REPLICAS and all(p["spec"]["containers"][0]["image"] == "hicache-runtime:test-2"
                                                for p in ps)
                    and all_serving(c, name, REPLICAS) and status(c, name).get("updatedReplicas") == REPLICAS)
        wait_for(rolled, timeout=300, interval=0.5, what="every pod on the new image, serving")
    finally:
        report = gw.stop()
    print("load during the rolling update:", report.summary())
    assert not report.failures, report.failures[:3]
    assert len(report.outcomes) > 30
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(c, name)}
    assert all(after[n] != before[n] for n in before)  # every pod restarted
    assert max(out_at_once) <= 1, out_at_once  # maxUnavailable 1 (polled: a lower bound on the truth)
    events = kget(c, "events", "-n", NS, "--field-selector", f"involvedObject.name={name}")["items"]
    restarted = [e for e in events if e["reason"] == "PodRestarted"]
    assert len(restarted) >= REPLICAS and any(e["reason"] == "PodDraining" for e in events)
    assert not (status(c, name).get("backendSwap") or {}).get("pods")
    assert {cond["type"]: cond for cond in status(c, name)["conditions"]}["Progressing"]["status"] == "False"
