"""The order of ``reconcile``'s writes. Its ``alongside`` work (a swap step, which also restarts
pods on an older template) runs during the child applies when every pod runs the current
template, else after them, told the template's restart hash only once the StatefulSet carries
it; the StatefulSet's apply is left to the caller (to overlap the status write) only when no pod
is to be restarted.

The Kube here records calls in order (the decision under test is the ordering, a pure matter);
the same path runs against a real API server in tests/e2e/test_backend_swap.py.
"""

from __future__ import annotations

import threading

from op_helpers import RecordingKube, body, gpu_node

from hicache_operator.api import labels
from hicache_operator.control.pipeline import plan, reconcile

SPEC = {"image": "hicache-runtime:0.1.0", "replicas": 2, "maxTotalTokens": 4096,
        "rollout": {"maxUnavailable": 1}}
NODES = [gpu_node("gpu-0")]


def pods_with(restart_hash: str) -> list[dict]:
    return [{"metadata": {"name": f"demo-{i}", "uid": f"u{i}", "annotations": {labels.RESTART_HASH: restart_hash}},
             "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
            for i in range(2)]


def test_the_step_runs_while_children_are_applied_when_no_pod_restarts():
    desired = plan(body(SPEC), NODES).desired
    kube = RecordingKube(desired.restart_hash)
    seen: list[list[str]] = []

    def alongside(p, pods, restart_hash):
        assert kube.applying.wait(10)
        seen.append(list(kube.calls))  # what had finished when the step ran
        kube.release.set()
        return "stepped"
    result = reconcile(kube, body(SPEC), NODES, apply=True, now="2026-01-01T00:00:00Z",
                       cached_pods=pods_with(desired.restart_hash), alongside=alongside)
    assert result.alongside == "stepped"
    assert not any(c.startswith("apply") for c in seen[0]), seen  # no apply had completed yet
    assert "apply StatefulSet" in kube.calls


def test_a_step_that_may_restart_pods_runs_after_the_new_template_is_applied():
    desired = plan(body(SPEC), NODES).desired
    kube = RecordingKube(desired.restart_hash)
    kube.release.set()
    seen: list[tuple[list[str], str | None]] = []

    def alongside(p, pods, restart_hash):
        seen.append((list(kube.calls), restart_hash))
        return "stepped"
    reconcile(kube, body(SPEC), NODES, apply=True, now="2026-01-01T00:00:00Z",
              cached_pods=pods_with("an-older-template"), alongside=alongside)
    calls, restart_hash = seen[0]
    assert "apply StatefulSet" in calls and restart_hash == desired.restart_hash


def test_no_step_runs_while_the_statefulset_does_not_carry_the_new_template_yet():
    """Neither a restart into a template the StatefulSet does not carry nor a live swap of a pod whose
    template is about to change (its page format may be the old one: the new L3 namespace is not its)."""
    kube = RecordingKube("the-statefulsets-older-template")
    kube.release.set()
    seen: list[str | None] = []
    reconcile(kube, body(SPEC), NODES, apply=False, now="2026-01-01T00:00:00Z",
              cached_pods=pods_with("an-older-template"), alongside=lambda p, pods, h: seen.append(h))
    assert seen == []


def test_the_step_is_joined_even_when_an_apply_fails():
    desired = plan(body(SPEC), NODES).desired
    kube = RecordingKube(desired.restart_hash)
    finished = threading.Event()

    def failing_apply(obj):
        raise RuntimeError("API server unavailable")
    kube.apply = failing_apply

    def alongside(p, pods, restart_hash):
        threading.Event().wait(0.2)
        finished.set()
    try:
        reconcile(kube, body(SPEC), NODES, apply=True, now="2026-01-01T00:00:00Z",
                  cached_pods=pods_with(desired.restart_hash), alongside=alongside)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failed apply was swallowed")
    assert finished.is_set()  # never two steps of one deployment at once


def test_the_workload_apply_is_left_to_the_caller_only_when_nothing_restarts():
    desired = plan(body(SPEC), NODES).desired
    kube = RecordingKube(None)
    kube.release.set()
    result = reconcile(kube, body(SPEC), NODES, apply=True, now="2026-01-01T00:00:00Z",
                       cached_pods=[], defer_workload=True)
    assert "apply StatefulSet" not in kube.calls and "apply ConfigMap" in kube.calls and "secret" in kube.calls
    assert result.status["observedGeneration"] == 1
    result.workload()  # the StatefulSet, then the wait for the Services and the PDB
    assert sorted(c for c in kube.calls if c.startswith("apply")) == [
        "apply ConfigMap", "apply Deployment", "apply PodDisruptionBudget", "apply Role", "apply RoleBinding",
        "apply Service", "apply Service", "apply Service", "apply ServiceAccount", "apply StatefulSet"]

    stale = RecordingKube(desired.restart_hash, pods=pods_with("an-older-template"))
    stale.release.set()
    result = reconcile(stale, body(SPEC), NODES, apply=True, now="2026-01-01T00:00:00Z",
                       cached_pods=pods_with("an-older-template"), defer_workload=True)
    assert result.workload is None  # a step that restarts pods reads the live template: applied first
    assert "apply StatefulSet" in stale.calls


def test_the_statefulset_waits_for_what_its_pods_read_but_not_for_the_services():
    kube = RecordingKube(None)
    slow = threading.Event()
    plain_apply = kube.apply

    def apply(obj):
        if obj["kind"] == "Service":
            assert slow.wait(10)  # a ClusterIP allocation on a busy API server
        kube.release.set()
        return plain_apply(obj)
    kube.apply = apply
    result = reconcile(kube, body(SPEC), NODES, apply=True, now="2026-01-01T00:00:00Z",
                       cached_pods=[], defer_workload=True)
    finished = threading.Thread(target=result.workload)
    finished.start()
    for _ in range(100):
        if "apply StatefulSet" in kube.calls:
            break
        threading.Event().wait(0.05)
    assert kube.calls.index("apply ConfigMap") < kube.calls.index("apply StatefulSet")
    assert kube.calls.index("secret") < kube.calls.index("apply StatefulSet")
    assert "apply Service" not in kube.calls
    assert finished.is_alive()  # the reconcile is not over while a Service is being created
    slow.set()
    finished.join(10)
    assert kube.calls.count("apply Service") == 3


def test_the_routers_account_and_rbac_are_applied_before_anything_starts_pods():
    """A router started without its RoleBinding is refused its pod watch and looks again only a
    minute later; a pod whose ServiceAccount is missing is refused by the API server."""
    kube = RecordingKube(None)
    started: list[str] = []
    plain_apply = kube.apply

    def apply(obj):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            started.append(",".join(kube.calls))
        kube.release.set()
        return plain_apply(obj)
    kube.apply = apply
    reconcile(kube, body(SPEC), NODES, apply=True, now="2026-01-01T00:00:00Z", cached_pods=[])
    assert len(started) == 2
    for before in started:
        assert {"apply ServiceAccount", "apply Role", "apply RoleBinding"} <= set(before.split(",")), before

