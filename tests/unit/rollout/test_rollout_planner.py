"""Table-driven walks through the planner, one step at a time, each naming
the exact actions, records, events and conditions it expects."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from hicache_operator.rollout import ActionOutcome, Attach, Detach, SwapPlan, RolloutSettings, SetServingGate, SwapState, apply_outcomes, plan_step
from hicache_operator.fleet.storage_config import ReportedBackend, attach_payload
from hicache_operator.rollout.act.runtime_client import BackendError, NotIdle, Unauthorized, Unreachable

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
FILE = {"backend": "file", "prefetch_policy": "best_effort", "write_policy": "write_through", "extra_config": {}}
MOONCAKE = {"backend": "mooncake", "prefetch_policy": "timeout", "write_policy": "write_through",
            "extra_config": {"master_server_address": "master:50051"}}
NONE = {"backend": "none"}


def reported(cfg):
    if cfg is None or cfg["backend"] == "none":
        return ReportedBackend(backend=None)
    return ReportedBackend.from_response({
        "hicache_storage_backend": cfg["backend"],
        "hicache_storage_backend_extra_config": json.dumps(cfg.get("extra_config", {})),
        "hicache_storage_prefetch_policy": cfg.get("prefetch_policy"),
        "hicache_write_policy": cfg.get("write_policy"),
    })


def pod(name, runs=FILE, *, uid=None, gate=True, ready=True, running=0, queued=0, reachable=True, **more):
    """A pod observation; `runs` is the config its runtime reports."""
    return {
        "name": name, "uid": uid or f"uid-{name}", "serving_gate": gate, "endpoint_ready": ready,
        "backend": reported(runs) if reachable else None,
        "in_flight": running if reachable else None, "queued": queued if reachable else None,
        "runtime_error": None if reachable else "connection refused", **more,
    }


class Operator:
    """Calls the planner like the handlers do: one step per call, the clock
    moving on, outcomes applied and the state persisted as JSON."""

    def __init__(self, target, *, max_unavailable=1, drain_timeout=60.0, **settings):
        self.target = target
        self.settings = RolloutSettings(max_unavailable=max_unavailable, drain_timeout_seconds=drain_timeout,
                                        **settings)
        self.now = T0
        self.status = None

    def step(self, pods, *, seconds=1.0, errors=None, persist=True) -> SwapPlan:
        """errors: pod name -> exception raised by that pod's action."""
        self.now += timedelta(seconds=seconds)
        observed = [{"observed_at": self.now - timedelta(milliseconds=1), **p} for p in pods]
        plan = plan_step(self.target, observed, self.settings, self.status, self.now)
        outcomes = [ActionOutcome.failed(a, errors[a.pod]) if errors and a.pod in errors else ActionOutcome(a)
                    for a in plan.actions]
        if persist:
            self.status = json.loads(json.dumps(apply_outcomes(plan.state, outcomes).to_status()))
        return plan

    def record(self, name):
        return (self.status or {}).get("pods", {}).get(name)


def acts(plan):
    """Actions in a compact comparable form."""
    out = []
    for a in plan.actions:
        if isinstance(a, SetServingGate):
            out.append(("gate", a.pod, a.serving))
        elif isinstance(a, Detach):
            out.append(("detach", a.pod))
        else:
            out.append(("attach", a.pod, a.payload["hicache_storage_backend"]))
    return out


def reasons(plan):
    return [e.reason for e in plan.events]


def condition(plan, kind):
    found = {c.type: c for c in plan.conditions}[kind]
    return found.status, found.reason, found.message


def swap_one_pod(op, name, source, target, others=()):
    """Drive `name` from `source` to `target` through the happy path; returns the plans."""
    others = list(others)
    plans = [op.step([pod(name, source), *others])]
    assert acts(plans[-1]) == [("gate", name, False)]
    plans.append(op.step([pod(name, source, gate=False, ready=False), *others]))
    assert acts(plans[-1]) in ([("detach", name)], [("attach", name, target["backend"])])
    if acts(plans[-1])[0][0] == "detach":
        plans.append(op.step([pod(name, None, gate=False, ready=False), *others]))
        assert acts(plans[-1]) == ([("attach", name, target["backend"])] if target["backend"] != "none" else
                                   [("gate", name, True)])
    if plans[-1].actions and isinstance(plans[-1].actions[0], Attach):
        plans.append(op.step([pod(name, target, gate=False, ready=False), *others]))
        assert acts(plans[-1]) == [("gate", name, True)]
    plans.append(op.step([pod(name, target, gate=True, ready=True), *others]))
    assert op.record(name) is None
    return plans


# ----------------------------------------------------------------------------- steady state and new pods

def test_fleet_already_on_target_needs_nothing():
    op = Operator(FILE)
    plan = op.step([pod("c-0"), pod("c-1")])
    assert plan.actions == [] and plan.events == []
    assert plan.state.phase.value == "Complete"
    assert (plan.state.progress, plan.state.current_backend, plan.state.target_backend) == ("2/2", "file", "file")
    assert condition(plan, "BackendSwapInProgress")[:2] == ("False", "Complete")
    assert condition(plan, "BackendSwapFailed")[0] == "False"
    assert plan.requeue_after is None


def test_new_pods_are_admitted_whether_reachable_or_not():
    op = Operator(FILE)
    plan = op.step([pod("c-0", gate=None, ready=None), pod("c-1", gate=None, ready=None, reachable=False)])
    assert plan.actions == [SetServingGate("c-0", "uid-c-0", True), SetServingGate("c-1", "uid-c-1", True)]
    assert plan.state.pods == {}
    assert condition(plan, "BackendSwapInProgress")[:2] == ("Unknown", "WaitingForPods")
    assert "c-1 (runtime: connection refused)" in condition(plan, "BackendSwapInProgress")[2]
    assert plan.requeue_after == op.settings.poll_seconds


def test_a_new_fleet_coming_up_on_its_first_target_reports_no_swap_complete():
    op = Operator(FILE)
    plan = op.step([pod("c-0", gate=None, ready=None), pod("c-1", gate=None, ready=None)])
    assert reasons(plan) == [] and plan.state.phase.value == "InProgress"
    op.step([pod("c-0", ready=False), pod("c-1", ready=False)])
    plan = op.step([pod("c-0"), pod("c-1")])
    assert plan.state.phase.value == "Complete" and reasons(plan) == []  # nothing was swapped
    assert condition(plan, "BackendSwapInProgress")[:2] == ("False", "Complete")
    # the next target is a swap like any other, reported when it completes
    op.target = MOONCAKE
    plans = swap_one_pod(op, "c-0", FILE, MOONCAKE, others=[pod("c-1", MOONCAKE)])
    assert reasons(plans[0])[0] == "BackendSwapStarted" and reasons(plans[-1]) == ["BackendSwapComplete"]


def test_a_first_target_that_needs_a_swap_reports_it_complete():
    op = Operator(MOONCAKE)
    plans = swap_one_pod(op, "c-0", FILE, MOONCAKE, others=[pod("c-1", MOONCAKE)])
    assert "BackendSwapComplete" in reasons(plans[-1])


STORE_DOWN = "StorageUnavailable: mooncake master master:50051 not reachable within 5.0s"


def unattached(name, *, on_target=True, **more):
    """A pod whose runtime could not attach the backend on its command line at start and serves
    from L1+L2 (it reports none, with why); ``on_target``: that command line carried the target."""
    down = ReportedBackend.from_response({"hicache_storage_backend": None, "hicache_storage_degraded": STORE_DOWN})
    return {**pod(name, None, **more), "backend": down, "started_on_target": on_target}


def test_a_new_fleet_whose_store_is_down_at_start_is_not_swapped_and_is_listed_unattached():
    op = Operator(MOONCAKE)
    plan = op.step([unattached("c-0", gate=None, ready=None), unattached("c-1", gate=None, ready=None)])
    assert acts(plan) == [("gate", "c-0", True), ("gate", "c-1", True)] and reasons(plan) == []
    plan = op.step([unattached("c-0"), unattached("c-1")])
    assert plan.actions == [] and reasons(plan) == []  # no pod taken out of serving, no swap Events
    assert plan.state.phase.value == "Complete" and plan.state.unattached == {"c-0": STORE_DOWN, "c-1": STORE_DOWN}
    assert condition(plan, "BackendSwapInProgress")[:2] == ("False", "StorageUnavailable")
    assert condition(plan, "BackendSwapFailed")[0] == "False" and plan.requeue_after is None
    plan = op.step([pod("c-0", MOONCAKE), unattached("c-1")])  # c-0 restarted once the store was back
    assert list(plan.state.unattached) == ["c-1"] and plan.actions == []


def test_a_pod_whose_start_failure_is_of_an_older_target_is_swapped_as_usual():
    op = Operator(FILE)
    op.step([pod("c-0", FILE), pod("c-1", FILE)])
    plan = op.step([unattached("c-0", on_target=False), pod("c-1", FILE)])
    assert acts(plan) == [("gate", "c-0", False)] and plan.state.unattached == {}


def test_a_start_failure_is_read_only_where_no_backend_is_attached():
    said = {"hicache_storage_degraded": STORE_DOWN}
    assert ReportedBackend.from_response({"hicache_storage_backend": None, **said}).start_failure == STORE_DOWN
    attached = ReportedBackend.from_response({"hicache_storage_backend": "mooncake", **said})  # L3 down later
    assert attached.start_failure is None
    assert ReportedBackend.from_response({"hicache_storage_backend": None}).start_failure is None


def test_new_pod_with_a_stale_config_is_swapped_before_it_ever_serves_even_with_the_budget_full():
    op = Operator(MOONCAKE, max_unavailable=1)
    plan = op.step([pod("c-0", MOONCAKE, ready=False), pod("c-1", FILE, gate=None, ready=None)])
    assert acts(plan) == [("gate", "c-1", False)]
    assert op.record("c-1")["stage"] == "Draining"


# ----------------------------------------------------------------------------- the happy path

def test_one_pod_walks_drain_detach_attach_verify_readmit():
    op = Operator(MOONCAKE, drain_timeout=60)
    p1 = op.step([pod("c-0", FILE, running=2, queued=1)])
    assert acts(p1) == [("gate", "c-0", False)]
    assert reasons(p1) == ["PodDraining"]
    assert op.record("c-0")["previous"] == FILE
    assert condition(p1, "BackendSwapInProgress") == ("True", "Swapping", "0/1 pods run mooncake; in progress: c-0 (Draining)")

    # gate applied, endpoint still ready: wait
    assert acts(op.step([pod("c-0", FILE, gate=False, ready=True, running=2)])) == []
    # unrouted but requests still running: wait
    assert acts(op.step([pod("c-0", FILE, gate=False, ready=False, running=1)])) == []
    # queued only: still wait
    assert acts(op.step([pod("c-0", FILE, gate=False, ready=False, queued=1)])) == []
    # drained: a different backend is attached, so detach first
    p = op.step([pod("c-0", FILE, gate=False, ready=False)])
    assert acts(p) == [("detach", "c-0")]
    assert op.record("c-0")["stage"] == "Swapping"
    p = op.step([pod("c-0", None, gate=False, ready=False)])
    assert p.actions == [Attach("c-0", "uid-c-0", attach_payload(MOONCAKE))]
    p = op.step([pod("c-0", MOONCAKE, gate=False, ready=False)])
    assert p.actions == [SetServingGate("c-0", "uid-c-0", True, runs=MOONCAKE)]  # for the pod's annotations
    assert reasons(p) == ["PodSwapped"]
    # gate True but endpoint not yet ready: still counted as in progress
    p = op.step([pod("c-0", MOONCAKE, gate=True, ready=False)])
    assert acts(p) == [] and op.record("c-0")["stage"] == "Readmitting"
    assert p.state.phase.value == "InProgress"
    p = op.step([pod("c-0", MOONCAKE)])
    assert p.state.pods == {} and p.state.phase.value == "Complete"
    assert reasons(p) == ["BackendSwapComplete"]
    assert p.state.progress == "1/1"


@pytest.mark.parametrize("source, target, calls", [
    (FILE, MOONCAKE, ["detach", "attach"]),
    (NONE, FILE, ["attach"]),
    (FILE, NONE, ["detach"]),
    (FILE, {**FILE, "write_policy": "write_through_selective"}, ["attach"]),  # policies update in place
    (FILE, {**FILE, "extra_config": {"prefetch_threshold": 64}}, ["detach", "attach"]),  # extra needs a detach
])
def test_runtime_calls_depend_on_what_is_attached(source, target, calls):
    op = Operator(target)
    plans = swap_one_pod(op, "c-0", source, target)
    made = [a[0] for p in plans for a in acts(p) if a[0] in ("detach", "attach")]
    assert made == calls
    assert plans[-1].state.phase.value == "Complete"


def test_pods_go_one_at_a_time_in_name_order_and_progress_counts():
    op = Operator(MOONCAKE)
    names = ["c-10", "c-2", "c-1"]
    done: list[str] = []
    for name in ["c-1", "c-2", "c-10"]:
        rest = [pod(n, MOONCAKE if n in done else FILE) for n in names if n != name]
        plans = swap_one_pod(op, name, FILE, MOONCAKE, rest)
        done.append(name)
        assert plans[-1].state.progress == f"{len(done)}/3"
    assert plans[-1].state.phase.value == "Complete"
    assert plans[-1].state.current_backend == "mooncake"


def test_current_backend_column_lists_what_pods_report_mid_rollout():
    op = Operator(MOONCAKE, max_unavailable=1)
    plan = op.step([pod("c-0", MOONCAKE), pod("c-1", FILE), pod("c-2", reachable=False)])
    assert plan.state.current_backend == "file,mooncake"
    assert plan.state.progress == "1/3"


# ----------------------------------------------------------------------------- budget

def test_budget_counts_pods_unready_for_other_reasons():
    op = Operator(MOONCAKE, max_unavailable=1)
    plan = op.step([pod("c-0", MOONCAKE, ready=False), pod("c-1"), pod("c-2")])
    assert acts(plan) == []
    assert plan.state.phase.value == "InProgress"


def test_an_unready_pod_that_needs_a_swap_goes_first_and_is_free():
    op = Operator(MOONCAKE, max_unavailable=1)
    plan = op.step([pod("c-0"), pod("c-1", ready=False)])
    assert acts(plan) == [("gate", "c-1", False)]


def test_budget_of_two_takes_two_and_a_percentage_resolves_against_the_fleet():
    assert acts(Operator(MOONCAKE, max_unavailable=2).step([pod(f"c-{i}") for i in range(4)])) == [
        ("gate", "c-0", False), ("gate", "c-1", False)]
    assert len(Operator(MOONCAKE, max_unavailable="50%").step([pod(f"c-{i}") for i in range(6)]).actions) == 3
    assert len(Operator(MOONCAKE, max_unavailable="10%").step([pod(f"c-{i}") for i in range(6)]).actions) == 1


def test_absent_pods_count_against_the_budget():
    op = Operator(MOONCAKE, max_unavailable=1, desired_replicas=3)
    assert acts(op.step([pod("c-0"), pod("c-1")])) == []
    op = Operator(MOONCAKE, max_unavailable=1)
    terminating = pod("c-2", deletion_timestamp=T0)
    assert acts(op.step([pod("c-0"), pod("c-1"), terminating])) == []


def test_unreachable_pods_are_never_started():
    op = Operator(MOONCAKE, max_unavailable=2)
    plan = op.step([pod("c-0", reachable=False), pod("c-1")])
    assert acts(plan) == [("gate", "c-1", False)]


# ----------------------------------------------------------------------------- failures

def start_and_drain(op, name="c-0", others=()):
    op.step([pod(name), *others])
    return op.step([pod(name, FILE, gate=False, ready=False), *others])


def test_drain_timeout_readmits_the_pod_unchanged_and_stops_the_rollout():
    op = Operator(MOONCAKE, drain_timeout=30)
    op.step([pod("c-0"), pod("c-1")])
    assert acts(op.step([pod("c-0", gate=False, ready=False, running=3), pod("c-1")], seconds=10)) == []
    plan = op.step([pod("c-0", gate=False, ready=False, running=3), pod("c-1")], seconds=25)
    assert acts(plan) == [("gate", "c-0", True)]
    assert reasons(plan)[:2] == ["BackendSwapFailed", "PodRolledBack"]
    assert plan.state.failure.pod == "c-0" and plan.state.failure.cause == "DrainTimeout"
    assert "3 running, 0 queued" in plan.state.failure.message
    status, reason, message = condition(plan, "BackendSwapFailed")
    assert (status, reason) == ("True", "DrainTimeout") and message.startswith("pod c-0:")
    assert condition(plan, "BackendSwapInProgress")[:2] == ("False", "Failed")

    # c-0 back in serving; c-1 still needs the swap but the rollout stays stopped
    plan = op.step([pod("c-0"), pod("c-1")])
    assert acts(plan) == [] and plan.state.phase.value == "Failed" and plan.requeue_after is None
    # ...until the target changes
    op.target = {**MOONCAKE, "prefetch_policy": "best_effort"}
    plan = op.step([pod("c-0"), pod("c-1")])
    assert acts(plan) == [("gate", "c-0", False)]
    assert plan.state.phase.value == "InProgress" and plan.state.failure is None
    assert reasons(plan) == ["BackendSwapStarted", "PodDraining"]


def test_attach_refused_rolls_the_pod_back_to_its_previous_backend():
    op = Operator(MOONCAKE)
    start_and_drain(op)
    assert acts(op.step([pod("c-0", None, gate=False, ready=False)])) == [("attach", "c-0", "mooncake")]
    refusal = BackendError("PUT /hicache/storage-backend: 400 Failed to attach HiCache storage backend. "
                           "master unreachable", status=400)
    op.step([pod("c-0", None, gate=False, ready=False)], errors={"c-0": refusal})
    assert op.record("c-0")["fatal"] is True
    plan = op.step([pod("c-0", None, gate=False, ready=False)])
    assert plan.actions == [Attach("c-0", "uid-c-0", attach_payload(FILE))]
    assert plan.state.failure.cause == "AttachFailed"
    assert "master unreachable" in plan.state.failure.message
    plan = op.step([pod("c-0", FILE, gate=False, ready=False)])
    assert acts(plan) == [("gate", "c-0", True)] and reasons(plan) == ["PodRolledBack"]
    plan = op.step([pod("c-0", FILE)])
    assert plan.state.pods == {} and plan.state.phase.value == "Failed"


def test_verify_mismatch_rolls_back():
    op = Operator(MOONCAKE)
    start_and_drain(op)
    op.step([pod("c-0", None, gate=False, ready=False)])  # attach
    wrong = {**MOONCAKE, "prefetch_policy": "best_effort"}
    plan = op.step([pod("c-0", wrong, gate=False, ready=False)])
    assert plan.state.failure.cause == "VerifyMismatch"
    assert "prefetch=best_effort" in plan.state.failure.message
    assert acts(plan) == [("detach", "c-0")]
    assert acts(op.step([pod("c-0", None, gate=False, ready=False)])) == [("attach", "c-0", "file")]
    assert acts(op.step([pod("c-0", FILE, gate=False, ready=False)])) == [("gate", "c-0", True)]


@pytest.mark.parametrize("error", [Unreachable("read timeout"), NotIdle("Reject attach: not idle #queue-req=1 #running-req=0", 1, 0)])
def test_a_retryable_attach_error_is_retried(error):
    op = Operator(MOONCAKE)
    start_and_drain(op)
    op.step([pod("c-0", None, gate=False, ready=False)], errors={"c-0": error})
    plan = op.step([pod("c-0", None, gate=False, ready=False)])
    assert acts(plan) == [("attach", "c-0", "mooncake")]
    assert plan.state.phase.value == "InProgress"


def test_runtime_calls_are_bounded():
    op = Operator(MOONCAKE, max_runtime_calls=2)
    start_and_drain(op)  # detach (1)
    op.step([pod("c-0", None, gate=False, ready=False)], errors={"c-0": Unreachable("reset")})  # attach (2)
    plan = op.step([pod("c-0", None, gate=False, ready=False)])
    assert plan.state.failure.cause == "AttachFailed"
    assert "after 2 calls: reset" in plan.state.failure.message


def test_unauthorized_is_fatal():
    op = Operator(MOONCAKE)
    op.step([pod("c-0")])
    op.step([pod("c-0", gate=False, ready=False)], errors={"c-0": Unauthorized("401")})
    plan = op.step([pod("c-0", gate=False, ready=False)])
    assert plan.state.failure.cause == "DetachFailed"
    assert acts(plan) == [("gate", "c-0", True)]  # still on file: nothing to restore


def test_runtime_gone_mid_swap_fails_after_the_timeout_and_still_readmits():
    op = Operator(MOONCAKE, drain_timeout=20)
    start_and_drain(op)
    gone = pod("c-0", gate=False, ready=False, reachable=False)
    assert acts(op.step([gone], seconds=10)) == []
    plan = op.step([gone], seconds=15)
    assert plan.state.failure.cause == "RuntimeUnreachable"
    assert acts(op.step([gone], seconds=10)) == []  # rolling back waits for the runtime too...
    plan = op.step([gone], seconds=15)
    assert acts(plan) == [("gate", "c-0", True)]  # ...then gives up rather than leave it drained
    assert "RollbackFailed" in reasons(plan)
    assert "rollback failed" in plan.state.failure.message


def test_failure_aborts_pods_still_draining_and_lets_swapping_ones_finish():
    op = Operator(MOONCAKE, max_unavailable=3)
    op.step([pod("c-0"), pod("c-1"), pod("c-2")])
    op.step([pod("c-0", None, gate=False, ready=False), pod("c-1", gate=False, ready=False),
             pod("c-2", gate=False, ready=False, running=1)])  # c-0 was already detached: it attaches
    plan = op.step([pod("c-0", None, gate=False, ready=False), pod("c-1", None, gate=False, ready=False),
                    pod("c-2", gate=False, ready=False, running=1)],
                   errors={"c-0": BackendError("400 refused", 400)})
    plan = op.step([pod("c-0", None, gate=False, ready=False), pod("c-1", None, gate=False, ready=False),
                    pod("c-2", gate=False, ready=False, running=1)])
    assert plan.state.failure.pod == "c-0"
    assert acts(plan) == [("attach", "c-0", "file"), ("attach", "c-1", "mooncake"), ("gate", "c-2", True)]
    assert "PodSwapAborted" in reasons(plan)


# ----------------------------------------------------------------------------- crashes and resumption

def test_crash_after_detach_before_persisting_resumes_with_attach_and_keeps_previous():
    op = Operator(MOONCAKE)
    op.step([pod("c-0")])
    op.step([pod("c-0", gate=False, ready=False)], persist=False)  # detach ran; state not saved
    assert op.record("c-0")["stage"] == "Draining"
    plan = op.step([pod("c-0", None, gate=False, ready=False)])
    assert acts(plan) == [("attach", "c-0", "mooncake")]
    assert op.record("c-0")["previous"] == FILE


def test_crash_after_taking_a_pod_out_adopts_it_without_touching_its_runtime_in_that_step():
    op = Operator(MOONCAKE)
    op.step([pod("c-0"), pod("c-1")], persist=False)  # gate False ran; state lost
    plan = op.step([pod("c-0", gate=False, ready=False), pod("c-1")])
    assert acts(plan) == [] and reasons(plan) == ["PodAdopted"]
    assert op.record("c-0")["previous"] == FILE
    assert acts(op.step([pod("c-0", gate=False, ready=False), pod("c-1")])) == [("detach", "c-0")]


def test_orphan_that_needs_nothing_is_readmitted():
    op = Operator(FILE)
    plan = op.step([pod("c-0", gate=False, ready=False)])
    assert acts(plan) == [("gate", "c-0", True)]
    assert op.record("c-0")["stage"] == "Readmitting"


def test_crash_after_readmission_does_not_take_the_pod_out_again_outside_the_budget():
    op = Operator(MOONCAKE, max_unavailable=1)
    start_and_drain(op, others=[pod("c-1")])  # detach persisted
    op.step([pod("c-0", None, gate=False, ready=False), pod("c-1")])  # attach persisted
    op.step([pod("c-0", MOONCAKE, gate=False, ready=False), pod("c-1")], persist=False)  # readmit, lost
    op.target = FILE  # and the target is reverted
    plan = op.step([pod("c-0", MOONCAKE), pod("c-1", ready=False)])
    assert acts(plan) == [] and op.record("c-0") is None  # c-1 is out: c-0 must wait its turn


def test_stale_swapping_record_never_touches_a_pod_back_in_its_endpoints():
    op = Operator(MOONCAKE)
    start_and_drain(op)
    op.target = FILE
    plan = op.step([pod("c-0", MOONCAKE, gate=True, ready=False)])
    assert acts(plan) == [("gate", "c-0", False)]


def test_observations_not_newer_than_the_last_action_are_ignored():
    op = Operator(MOONCAKE)
    op.step([pod("c-0"), pod("c-1")])
    stale = {**pod("c-0", gate=False, ready=False), "observed_at": op.now}
    plan = op.step([stale, pod("c-1")])
    assert acts(plan) == [] and op.record("c-0")["stage"] == "Draining"
    assert op.record("c-0")["since"] == op.record("c-0")["actedAt"]


def test_readmission_completes_on_the_watches_alone_without_a_newer_runtime_read():
    """The operator reuses the verify step's runtime read while a readmitted pod's endpoint turns
    ready: gate and endpoint come from the watches, so that read need not be newer."""
    op = Operator(FILE)
    op.step([pod("c-0", NONE)])
    op.step([pod("c-0", NONE, gate=False, ready=False)])  # drained: attach
    op.step([pod("c-0", FILE, gate=False, ready=False)])  # verified: gate True
    assert op.record("c-0")["stage"] == "Readmitting"
    old_read = {**pod("c-0", FILE, gate=True, ready=False), "observed_at": T0}
    assert acts(op.step([old_read])) == [] and op.record("c-0")["stage"] == "Readmitting"
    plan = op.step([{**pod("c-0", FILE), "observed_at": T0}])
    assert op.record("c-0") is None and plan.state.phase.value == "Complete"


def test_a_record_whose_pod_is_seen_serving_again_is_forgotten_and_the_pod_competes_afresh():
    op = Operator(MOONCAKE, max_unavailable=1)
    op.step([pod("c-0"), pod("c-1")])
    plan = op.step([pod("c-0"), pod("c-1", ready=False)])  # gate patch lost; c-1 went unready meanwhile
    assert acts(plan) == [("gate", "c-1", False)] and op.record("c-0") is None
    assert op.record("c-1")["stage"] == "Draining"


def test_unreadable_state_is_discarded_with_a_warning():
    op = Operator(MOONCAKE)
    op.status = {"phase": "Sideways", "pods": 3}
    plan = op.step([pod("c-0")])
    assert reasons(plan)[0] == "SwapStateDiscarded" and acts(plan) == [("gate", "c-0", False)]


# ----------------------------------------------------------------------------- pods coming and going

def test_pod_replaced_mid_swap_drops_the_record_and_admits_the_new_pod():
    op = Operator(MOONCAKE)
    start_and_drain(op)
    plan = op.step([pod("c-0", MOONCAKE, uid="uid-new", gate=None, ready=None)])
    assert reasons(plan) == ["PodLeftSwap"]
    assert acts(plan) == [("gate", "c-0", True)]
    assert plan.state.pods == {}


@pytest.mark.parametrize("leaving", [[], [pod("c-0", deletion_timestamp=T0, gate=False, ready=False)],
                                     [pod("c-0", phase="Failed", gate=False, ready=False)]])
def test_pod_gone_mid_swap_drops_the_record_without_actions(leaving):
    op = Operator(MOONCAKE)
    start_and_drain(op, others=[pod("c-1", MOONCAKE)])
    plan = op.step([*leaving, pod("c-1", MOONCAKE)])
    assert acts(plan) == [] and plan.state.pods == {}
    assert reasons(plan)[0] == "PodLeftSwap"


# ----------------------------------------------------------------------------- target changes

def test_target_changes_while_detached_and_the_pod_attaches_the_newest_target():
    op = Operator(MOONCAKE)
    start_and_drain(op)  # detach
    newest = {**FILE, "prefetch_policy": "timeout"}
    op.target = newest
    plan = op.step([pod("c-0", None, gate=False, ready=False)])
    assert plan.actions == [Attach("c-0", "uid-c-0", attach_payload(newest))]
    assert reasons(plan) == ["BackendSwapStarted"]
    assert acts(op.step([pod("c-0", newest, gate=False, ready=False)])) == [("gate", "c-0", True)]


def test_revert_while_draining_readmits_without_runtime_calls():
    op = Operator(MOONCAKE)
    op.step([pod("c-0"), pod("c-1")])
    op.target = FILE
    plan = op.step([pod("c-0", gate=False, ready=True, running=2), pod("c-1")])
    assert acts(plan) == [("gate", "c-0", True)]
    assert op.record("c-0")["stage"] == "Readmitting"


def test_revert_swaps_back_pods_already_on_the_new_target():
    op = Operator(FILE)
    plan = op.step([pod("c-0", MOONCAKE), pod("c-1", FILE)])
    assert acts(plan) == [("gate", "c-0", False)]
    assert op.record("c-0")["previous"] == MOONCAKE


def test_new_target_after_failure_sends_a_rolling_back_pod_through_drain_again():
    op = Operator(MOONCAKE, drain_timeout=10)
    start_and_drain(op)  # detach
    op.step([pod("c-0", None, gate=False, ready=False)], errors={"c-0": BackendError("400 no", 400)})
    op.step([pod("c-0", None, gate=False, ready=False)], errors={"c-0": Unreachable("boom")})  # rollback attach
    assert op.record("c-0")["stage"] == "RollingBack"
    op.target = NONE
    plan = op.step([pod("c-0", None, gate=False, ready=False)])
    assert plan.state.phase.value == "InProgress" and plan.state.failure is None
    assert acts(plan) == [("gate", "c-0", True)]  # detached is what `none` means: readmit


# ----------------------------------------------------------------------------- readmission

def test_endpoint_that_never_returns_warns_and_releases_the_record():
    op = Operator(MOONCAKE, drain_timeout=20)
    op.step([pod("c-0")])
    op.step([pod("c-0", gate=False, ready=False)])
    op.step([pod("c-0", None, gate=False, ready=False)])
    op.step([pod("c-0", MOONCAKE, gate=False, ready=False)])
    assert acts(op.step([pod("c-0", MOONCAKE, ready=False)], seconds=10)) == []
    plan = op.step([pod("c-0", MOONCAKE, ready=False)], seconds=15)
    assert reasons(plan) == ["PodNotReady"] and plan.state.pods == {}
    assert plan.state.phase.value == "InProgress"  # not Complete while the pod is not serving


# ----------------------------------------------------------------------------- inputs and outputs

def observed(p):
    return {"observed_at": T0, **p}


@pytest.mark.parametrize("kwargs, match", [
    ({"now": datetime(2025, 1, 1)}, "timezone-aware"),
    ({"pods": [observed(pod("a")), observed(pod("a"))]}, "observed twice"),
    ({"target": {**MOONCAKE, "extra_config": {"local_hostname": "n1"}}}, "hostname"),
    ({"target": {"backend": "hf3fs"}}, "not one of"),
    ({"settings": {"max_unavailable": 0}}, "at least 1"),
    ({"settings": {"max_unavailable": "0%"}}, "percentage"),
    ({"settings": {"max_unavailable": "many"}}, "percentage"),
    ({"settings": {"max_unavailable": True}}, "integer"),
    ({"settings": {"drain_timeout_seconds": 0}}, "greater than 0"),
    ({"pods": [observed({**pod("a"), "in_flight": -1})]}, "greater than or equal"),
    ({"pods": [pod("a")]}, "observed_at"),
    ({"pods": [{**pod("a"), "observed_at": datetime(2025, 1, 1)}]}, "timezone"),
])
def test_bad_input_gets_a_clear_error(kwargs, match):
    args = {"target": FILE, "pods": [observed(pod("a"))], "settings": {}, "state": None, "now": T0, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_step(**args)


def test_state_round_trips_as_small_camel_case_json():
    op = Operator(MOONCAKE)
    plan = op.step([pod("c-0"), pod("c-1")])
    status = plan.state.to_status()
    assert set(status) >= {"phase", "target", "targetBackend", "currentBackend", "progress", "startedAt", "pods"}
    assert set(status["pods"]["c-0"]) >= {"uid", "stage", "since", "actedAt", "previous"}
    encoded = json.dumps(status)
    assert len(encoded) < 1000
    assert SwapState.from_status(json.loads(encoded)) == plan.state
    # a record an earlier operator wrote names its stage "step": a swap in flight resumes
    earlier = json.loads(encoded)
    earlier["pods"]["c-0"]["step"] = earlier["pods"]["c-0"].pop("stage")
    assert SwapState.from_status(earlier) == plan.state


def test_apply_outcomes_records_runtime_errors_only_on_the_same_pod_instance():
    op = Operator(MOONCAKE)
    start_and_drain(op)
    state = SwapState.from_status(op.status)
    outcomes = [
        ActionOutcome(SetServingGate("c-0", "uid-c-0", True), error="conflict"),
        ActionOutcome(Detach("c-0", "uid-other"), error="stale"),
        ActionOutcome(Detach("c-9", "uid-c-9"), error="no record"),
    ]
    assert apply_outcomes(state, outcomes) == state
    failed = apply_outcomes(state, [ActionOutcome.failed(Detach("c-0", "uid-c-0"), Unauthorized("401 bad key"))])
    assert (failed.pods["c-0"].error, failed.pods["c-0"].fatal) == ("401 bad key", True)
    retry = apply_outcomes(state, [ActionOutcome.failed(Detach("c-0", "uid-c-0"), Unreachable("refused"))])
    assert retry.pods["c-0"].fatal is False
