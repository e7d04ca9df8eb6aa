"""Specs the cluster cannot run as asked, from kubectl apply to the status and Events a user reads:
a fleet no node can hold says which resource every node lacks (never "add node memory"), a pod
whose memory the operator cannot size is a Warning, and maxUnavailable 0 is refused at apply."""
from __future__ import annotations


import pytest

from testbed.kube import kget, wait_for

pytestmark = pytest.mark.e2e


def apply(cluster, ns: str, name: str, spec: dict, check: bool = True):
    doc = {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
           "metadata": {"name": name, "namespace": ns}, "spec": {"image": "hicache-runtime:test", **spec}}
    return cluster.kubectl_apply([doc], check=check)


def conditions(cluster, ns: str, name: str) -> dict[str, dict]:
    obj = kget(cluster, "hcd", name, "-n", ns)
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def warnings(cluster, ns: str, name: str) -> list[dict]:
    events = kget(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    return [e for e in events if e["type"] == "Warning"]


@pytest.mark.parametrize("name,spec,lacking", [
    ("tp16", {"parallelism": {"tp": 16}}, "8 nvidia.com/gpu allocatable, needs 16"),
    ("nowhere", {"nodeSelector": {"pool": "does-not-exist"}}, "nodeSelector pool=does-not-exist not matched"),
])
def test_a_fleet_no_node_can_hold_says_what_every_node_lacks(cluster, operator, ns, name, spec, lacking):
    apply(cluster, ns, name, spec)
    degraded = wait_for(lambda: (lambda c: c.get("Degraded") if c.get("Degraded", {}).get("status") == "True"
                                 else None)(conditions(cluster, ns, name)), timeout=60, what="Degraded")
    assert degraded["reason"] == "NoEligibleNodes", degraded
    assert lacking in degraded["message"] and "node memory" not in degraded["message"], degraded
    conds = conditions(cluster, ns, name)
    assert conds["ConfigValid"]["status"] == "True"  # nodes may still arrive: a warning, not a refusal
    wait_for(lambda: any(e["reason"] == "NoEligibleNodesYet" for e in warnings(cluster, ns, name)),
             timeout=30, what="NoEligibleNodesYet Warning Event")
    assert kget(cluster, "hcd", name, "-n", ns)["status"]["sizing"]["ineligible"]


def test_a_pod_without_a_memory_request_is_a_warning(cluster, operator, ns):
    apply(cluster, ns, "unsized", {"engine": "sglang", "engineVersion": "0.5.23", "model": "example-org/unknown"})
    event = wait_for(lambda: next((e for e in warnings(cluster, ns, "unsized") if e["reason"] == "NoMemoryRequest"),
                                  None), timeout=60, what="NoMemoryRequest Warning Event")
    assert "example-org/unknown has no known KV shape" in event["message"]
    sts = wait_for(lambda: kget(cluster, "statefulsets", "-n", ns)["items"] or None, what="StatefulSet")
    assert "memory" not in sts[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]


@pytest.mark.parametrize("value", [0, "0%"])
def test_max_unavailable_zero_is_refused_at_apply(cluster, operator, ns, value):
    res = apply(cluster, ns, "wedge", {"rollout": {"maxUnavailable": value}}, check=False)
    assert res.returncode != 0
    assert "rollout.maxUnavailable must be a count of at least 1" in res.stderr, res.stderr
