"""The order of a reconcile's writes (``pipeline.reconcile``). Its swap step (which also restarts
pods on an older template) runs during the child applies when every pod runs the current
template, else after them, told the template's restart hash only once the StatefulSet carries
it; when no pod is to be restarted the StatefulSet's apply goes out while the status is
written. Each phase runs once: one render and one status derivation per reconcile.

The Kube here records calls in order (the decision under test is the ordering, a pure matter);
the same path runs against a real API server in tests/e2e/test_backend_swap.py.
"""

from __future__ import annotations

import threading

from op_helpers import RecordingKube, StepRecorder, body, context, gpu_node, seen

from hicache_operator.api import labels
from hicache_operator.control import stepping
from hicache_operator.control.pipeline import plan, reconcile
from hicache_operator.plan import render
from hicache_operator.plan import status as status_
from hicache_operator.rollout import act

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
    at_step: list[list[str]] = []

    def step(given):
        assert kube.applying.wait(10)
        at_step.append(list(kube.calls))  # what had finished when the step ran
        kube.release.set()
        return act.StepResult({"phase": "Complete"})
    result = reconcile(context(kube, StepRecorder(step)), seen(body(SPEC), NODES, pods_with(desired.restart_hash)))
    assert result.step is not None and result.status["backendSwap"] == {"phase": "Complete"}
    assert not any(c.startswith("apply") for c in at_step[0]), at_step  # no apply had completed yet
    assert "apply StatefulSet" in kube.calls and result.written


def test_a_step_that_may_restart_pods_runs_after_the_new_template_is_applied():
    desired = plan(body(SPEC), NODES).desired
    kube = RecordingKube(desired.restart_hash)
    kube.release.set()
    at_step: list[tuple[list[str], str | None]] = []
    recorder = StepRecorder(lambda given: at_step.append((list(kube.calls), given.restart_hash)) or act.StepResult({}))
    reconcile(context(kube, recorder), seen(body(SPEC), NODES, pods_with("an-older-template")))
    calls, restart_hash = at_step[0]
    assert "apply StatefulSet" in calls and restart_hash == desired.restart_hash
    assert calls.index("apply StatefulSet") < len(calls) and "status" not in calls  # the status comes last
    assert kube.calls.index("apply StatefulSet") < kube.calls.index("status")


def test_no_step_runs_while_the_statefulset_does_not_carry_the_new_template_yet():
    """Neither a restart into a template the StatefulSet does not carry nor a live swap of a pod whose
    template is about to change (its page format may be the old one: the new L3 namespace is not its)."""
    kube = RecordingKube("the-statefulsets-older-template")
    kube.release.set()
    recorder = StepRecorder()
    reconcile(context(kube, recorder), seen(body(SPEC), NODES, pods_with("an-older-template"), apply=False))
    assert recorder.given == []


def test_the_step_is_joined_even_when_an_apply_fails():
    desired = plan(body(SPEC), NODES).desired
    kube = RecordingKube(desired.restart_hash)
    finished = threading.Event()

    def failing_apply(obj):
        raise RuntimeError("API server unavailable")
    kube.apply = failing_apply

    def step(given):
        threading.Event().wait(0.2)
        finished.set()
        return act.StepResult({})
    try:
        reconcile(context(kube, StepRecorder(step)), seen(body(SPEC), NODES, pods_with(desired.restart_hash)))
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failed apply was swallowed")
    assert finished.is_set()  # never two steps of one deployment at once
    assert "status" not in kube.calls


def test_the_statefulset_goes_out_while_the_status_is_written_only_when_nothing_restarts():
    kube = RecordingKube(None)
    kube.release.set()
    plain_apply = kube.apply

    def apply(obj):
        if obj["kind"] == "StatefulSet":  # returns only once the status write has gone out beside it
            for _ in range(200):
                if "status" in kube.calls:
                    break
                threading.Event().wait(0.01)
        return plain_apply(obj)
    kube.apply = apply
    result = reconcile(context(kube), seen(body(SPEC), NODES, []))
    assert result.written and result.status["observedGeneration"] == 1
    assert kube.calls.index("status") < kube.calls.index("apply StatefulSet")
    assert sorted(c for c in kube.calls if c.startswith("apply")) == [
        "apply ConfigMap", "apply Deployment", "apply PodDisruptionBudget", "apply Role", "apply RoleBinding",
        "apply Service", "apply Service", "apply Service", "apply ServiceAccount", "apply StatefulSet"]

    desired = plan(body(SPEC), NODES).desired
    stale = RecordingKube(desired.restart_hash, pods=pods_with("an-older-template"))
    stale.release.set()
    reconcile(context(stale), seen(body(SPEC), NODES, pods_with("an-older-template")))
    assert stale.calls.index("apply StatefulSet") < stale.calls.index("status")  # a restart reads the live template

    after_failure = RecordingKube(None)
    after_failure.release.set()
    reconcile(context(after_failure), seen(body(SPEC), NODES, [], failing=True))
    assert after_failure.calls.index("apply StatefulSet") < after_failure.calls.index("status")


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
    reconciling = threading.Thread(target=reconcile, args=(context(kube), seen(body(SPEC), NODES, [])))
    reconciling.start()
    for _ in range(100):
        if "apply StatefulSet" in kube.calls:
            break
        threading.Event().wait(0.05)
    assert kube.calls.index("apply ConfigMap") < kube.calls.index("apply StatefulSet")
    assert kube.calls.index("secret") < kube.calls.index("apply StatefulSet")
    assert "apply Service" not in kube.calls
    assert reconciling.is_alive()  # the reconcile is not over while a Service is being created
    slow.set()
    reconciling.join(10)
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
    reconcile(context(kube), seen(body(SPEC), NODES, []))
    assert len(started) == 2
    for before in started:
        assert {"apply ServiceAccount", "apply Role", "apply RoleBinding"} <= set(before.split(",")), before


def test_one_reconcile_renders_the_pod_template_once_and_derives_the_status_once(monkeypatch):
    """Whatever it learns late (spec.replicas of an invalid spec, its swap step, the runtimes'
    L3 reads), a reconcile renders once and derives the status once, from one observation."""
    derived, renders, templates = [], [], []
    plain_derive, plain_render, plain_template = status_.derive, render.render, render.statefulset.operator_template
    monkeypatch.setattr(status_, "derive", lambda o: derived.append(o) or plain_derive(o))
    monkeypatch.setattr(render, "render", lambda *a, **k: renders.append(a) or plain_render(*a, **k))
    monkeypatch.setattr(render.statefulset, "operator_template",
                        lambda *a, **k: templates.append(a) or plain_template(*a, **k))
    desired = plan(body(SPEC), NODES).desired
    for pods, apply in ((pods_with(desired.restart_hash), True), (pods_with("an-older-template"), True),
                        ([], False)):
        kube = RecordingKube(desired.restart_hash)
        kube.release.set()
        for calls in (derived, renders, templates):
            calls.clear()
        recorder = StepRecorder()
        result = reconcile(context(kube, recorder), seen(body(SPEC), NODES, pods, apply=apply))
        assert len(derived) == 1 and result.status.observed is derived[0]
        assert len(renders) == 1 and len(templates) == 1
        assert len(recorder.given) == (1 if pods else 0)  # the step ran in this reconcile
    for calls in (derived, renders):
        calls.clear()
    invalid = {**SPEC, "replicas": -1}
    result = reconcile(context(RecordingKube(None), StepRecorder()), seen(body(invalid), NODES, []))
    assert len(derived) == 1 and renders == []
    assert next(c for c in result.status["conditions"] if c["type"] == "ConfigValid")["status"] == "False"


def test_a_swap_step_derives_its_storage_target_from_the_spec_once(monkeypatch):
    calls = []
    plain = render.storage_config
    monkeypatch.setattr(render, "storage_config", lambda spec: calls.append(spec) or plain(spec))
    p = plan(body({**SPEC, "hicache": {"storage": {"backend": "file"}}}), NODES)
    kube = RecordingKube(p.desired.restart_hash)
    recorder = StepRecorder()
    calls.clear()
    stepping.swap_step(context(kube, recorder), seen(body(SPEC), NODES, []), p.outcome.spec, p.desired.storage_hash,
                       pods_with(p.desired.restart_hash), p.desired.restart_hash)
    assert len(calls) == 1
    given = recorder.given[0]
    assert given.target == plain(p.outcome.spec) and given.target_fp == p.desired.storage_hash
