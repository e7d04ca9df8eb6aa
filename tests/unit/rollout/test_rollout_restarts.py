"""Restarts for a new pod template, planned with swaps: drained first, deleted once idle, within
the shared maxUnavailable budget, highest ordinal first."""

from __future__ import annotations

from .test_rollout_planner import FILE, MOONCAKE, Operator, pod, reasons

from hicache_operator.rollout import DeletePod, SetServingGate


def acts(plan):
    out = []
    for a in plan.actions:
        if isinstance(a, SetServingGate):
            out.append(("gate", a.pod, a.serving))
        elif isinstance(a, DeletePod):
            out.append(("delete", a.pod))
        else:
            out.append((type(a).__name__.lower(), a.pod))
    return out


def stale(name, **kw):
    return pod(name, stale_template=True, **kw)


def test_a_stale_pod_is_drained_then_deleted_and_its_record_ends_when_it_is_gone():
    op = Operator(FILE, max_unavailable=1)
    first = op.step([stale("c-0"), pod("c-1")])
    assert acts(first) == [("gate", "c-0", False)] and "PodDraining" in reasons(first)
    assert op.record("c-0")["purpose"] == "restart" and op.record("c-0")["stage"] == "Draining"
    # out of serving but still running a request: no deletion yet
    assert acts(op.step([stale("c-0", gate=False, ready=None, running=1), pod("c-1")])) == []
    drained = op.step([stale("c-0", gate=False, ready=None), pod("c-1")])
    assert acts(drained) == [("delete", "c-0")] and op.record("c-0")["stage"] == "Restarting"
    # the StatefulSet created it again from the new template: a new uid, starting
    back = op.step([pod("c-0", uid="uid-new", ready=False), pod("c-1")])
    assert op.record("c-0") is None and "PodRestarted" in reasons(back)
    assert acts(back) == []  # the new pod serves from its template's label; nothing to admit


def test_restarts_go_highest_ordinal_first_within_the_budget_shared_with_swaps():
    op = Operator(FILE, max_unavailable=2)
    plan = op.step([stale("c-0"), stale("c-1"), stale("c-2"), pod("c-3", MOONCAKE)])
    assert acts(plan) == [("gate", "c-2", False), ("gate", "c-1", False)]  # the swap of c-3 waits
    op2 = Operator(FILE, max_unavailable=1)
    assert acts(op2.step([stale("c-0"), pod("c-1", ready=False)])) == []  # c-1 unready: budget spent


def test_a_stale_pod_that_does_not_serve_is_deleted_at_once_without_a_drain():
    op = Operator(FILE, max_unavailable=2)
    plan = op.step([stale("c-0", ready=False), stale("c-1", reachable=False, ready=False), stale("c-2")])
    # both were unavailable already; with them the budget of 2 is spent, so c-2 waits
    assert sorted(acts(plan)) == [("delete", "c-0"), ("delete", "c-1")]


def test_a_stale_pod_on_the_wrong_backend_is_restarted_not_swapped():
    op = Operator(FILE)
    op.step([stale("c-0", runs=MOONCAKE)])
    assert op.record("c-0")["purpose"] == "restart"
    assert acts(op.step([stale("c-0", runs=MOONCAKE, gate=False, ready=None)])) == [("delete", "c-0")]


def test_a_drain_that_times_out_restarts_the_pod_anyway():
    op = Operator(FILE, drain_timeout=10)
    op.step([stale("c-0")])
    plan = op.step([stale("c-0", gate=False, ready=None, running=3)], seconds=11)
    assert acts(plan) == [("delete", "c-0")] and "DrainTimeout" in reasons(plan)


def test_a_pod_still_there_after_its_deletion_is_deleted_again():
    op = Operator(FILE)
    op.step([stale("c-0")])
    op.step([stale("c-0", gate=False, ready=None)])
    assert op.record("c-0")["stage"] == "Restarting"
    assert acts(op.step([stale("c-0", gate=False, ready=None)])) == [("delete", "c-0")]


def test_restarts_are_no_swap_and_go_on_after_a_failed_one():
    op = Operator(FILE)
    op.step([stale("c-0")])
    plan = op.step([stale("c-0", gate=False, ready=None)])
    in_progress = {c.type: c for c in plan.conditions}["BackendSwapInProgress"]
    assert op.status["phase"] != "InProgress" and in_progress.status != "True"
    failed = Operator(FILE)
    failed.status = {"phase": "Failed", "target": failed_target(), "targetBackend": "file",
                     "startedAt": "2025-03-01T11:00:00+00:00",
                     "failure": {"pod": "c-9", "cause": "AttachFailed", "message": "x",
                                 "at": "2025-03-01T11:00:00+00:00"}}
    assert acts(failed.step([stale("c-0")])) == [("gate", "c-0", False)]


def test_a_stale_pod_out_of_serving_without_a_record_is_adopted_for_its_restart():
    op = Operator(FILE)
    assert acts(op.step([stale("c-0", gate=False, ready=None)])) == []  # the record is persisted first
    assert op.record("c-0")["purpose"] == "restart"
    assert acts(op.step([stale("c-0", gate=False, ready=None)])) == [("delete", "c-0")]


def failed_target() -> str:
    from hicache_operator.fleet.storage_config import storage_fingerprint
    return storage_fingerprint(FILE)
