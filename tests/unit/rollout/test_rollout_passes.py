"""One operator step follows a drained pod through its runtime calls (``rollout.passes``),
on the simulated fleet, which checks as it goes that no runtime is called while its pod is
routable or before the pod's swap record (its rollback target) was persisted."""

from __future__ import annotations

import asyncio

from datetime import timedelta

from hicache_operator.rollout import Attach, Detach, PodObservation, RolloutSettings, SetServingGate, Stage, SwapState, plan_step
from hicache_operator.rollout.passes import Passes, run_handover, run_passes, watch_will_follow

from .rollout_fleet_sim import CONFIGS, Fleet, SimRuntime


def _until(fleet: Fleet, done, limit: int = 60) -> None:
    for _ in range(limit):
        fleet.tick()
        fleet.step()
        if done():
            return
    raise AssertionError(f"not reached in {limit} steps: {fleet.persisted}")


def _calls(actions) -> list[tuple[str, str]]:
    return [(type(a).__name__, a.pod) for a in actions if isinstance(a, (Detach, Attach))]


def test_a_drained_pod_is_detached_attached_verified_and_readmitted_in_one_step():
    fleet = Fleet(1, "file", passes=True, seed=3)
    fleet.set_target("mooncake")
    _until(fleet, lambda: _calls(fleet.last_actions))

    assert [(type(a).__name__, getattr(a, "serving", None)) for a in fleet.last_actions] == [
        ("Detach", None), ("Attach", None), ("SetServingGate", True)]
    assert fleet.last_run.passes == 3
    pod = fleet.pods["cache-0"]
    assert pod.runtime.backend == "mooncake" and pod.gate is True
    assert fleet.persisted["pods"]["cache-0"]["stage"] == "Readmitting"
    plan = fleet.run_until_quiet()
    assert plan.state.phase.value == "Complete"


def test_one_pass_per_step_needs_a_step_per_call():
    """The same history without follow-through: what the operator did before."""
    fleet = Fleet(1, "file", seed=3)
    fleet.set_target("mooncake")
    _until(fleet, lambda: _calls(fleet.last_actions))
    assert _calls(fleet.last_actions) == [("Detach", "cache-0")]
    assert fleet.pods["cache-0"].gate is False


def test_a_pod_taken_out_in_this_step_gets_no_runtime_call_in_it():
    """cache-0 is drained and swapped; cache-1, idle and already not routable, is taken out in
    the same step. Its fresh-looking state must not lead to a call before its record (holding
    its rollback target) is persisted: it was not re-read, so the planner waits on it."""
    fleet = Fleet(2, "file", passes=True, seed=1)
    fleet.set_target("mooncake")
    fleet.tick()
    fleet.step()  # cache-0 taken out (maxUnavailable 1)
    a, b = fleet.pods["cache-0"], fleet.pods["cache-1"]
    assert a.gate is False and b.gate is True
    for _ in range(6):  # the world moves, the operator does not
        fleet.tick()
    a.endpoint_ready, a.in_flight, a.queued = False, 0, 0
    b.unhealthy, b.endpoint_ready, b.in_flight, b.queued = 5, False, 0, 0
    fleet.settings = RolloutSettings(max_unavailable=2, drain_timeout_seconds=8.0, desired_replicas=2,
                                     poll_seconds=1.0)

    fleet.step()

    assert _calls(fleet.last_actions) == [("Detach", "cache-0"), ("Attach", "cache-0")]
    assert any(isinstance(x, SetServingGate) and x.pod == "cache-1" and not x.serving for x in fleet.last_actions)
    assert fleet.persisted["pods"]["cache-1"]["stage"] == "Draining"
    assert b.runtime.backend == "file"
    fleet.step()  # the next step may call it: the record is persisted now
    assert ("Detach", "cache-1") in _calls(fleet.last_actions)


def test_a_failed_call_ends_the_step_with_the_error_recorded():
    fleet = Fleet(1, "file", passes=True, seed=3)
    fleet.set_target("refused")
    _until(fleet, lambda: ("Attach", "cache-0") in _calls(fleet.last_actions))

    assert _calls(fleet.last_actions) == [("Detach", "cache-0"), ("Attach", "cache-0")]
    assert fleet.last_run.passes == 2
    record = fleet.persisted["pods"]["cache-0"]
    assert "sim refuses" in record["error"] and record["fatal"] is True
    plan = fleet.run_until_quiet()
    fleet.check_quiet(plan)
    assert plan.state.phase.value == "Failed" and fleet.pods["cache-0"].runtime.backend == "file"


def test_a_new_pod_is_admitted_once_while_another_is_swapped():
    fleet = Fleet(2, "file", passes=True, seed=1)
    fleet.set_target("mooncake")
    fleet.tick()
    fleet.step()
    a, b = fleet.pods["cache-0"], fleet.pods["cache-1"]
    for _ in range(6):
        fleet.tick()
    a.endpoint_ready, a.in_flight, a.queued = False, 0, 0
    # as if just recreated from the template, which carries the target: no serving condition yet
    b.boot_config, b.runtime = CONFIGS["mooncake"], SimRuntime.booted_with(CONFIGS["mooncake"])
    b.gate, b.endpoint_ready = None, None

    fleet.step()

    assert _calls(fleet.last_actions) == [("Detach", "cache-0"), ("Attach", "cache-0")]
    admissions = [x for x in fleet.last_actions if isinstance(x, SetServingGate) and x.pod == "cache-1"]
    assert len(admissions) == 1 and admissions[0].serving is True


def test_a_watch_event_answers_taking_out_a_routable_pod_and_readmitting_a_swapped_one():
    """No prompt requeue after these steps: the EndpointSlice change they cause starts the next."""
    fleet = Fleet(1, "file", passes=True, seed=3)
    fleet.set_target("mooncake")
    fleet.tick()
    fleet.step()
    assert [(type(a).__name__, a.serving) for a in fleet.last_actions] == [("SetServingGate", False)]
    assert watch_will_follow(fleet.last_run)  # its endpoint was ready
    _until(fleet, lambda: _calls(fleet.last_actions))
    assert isinstance(fleet.last_actions[-1], SetServingGate) and fleet.last_actions[-1].serving
    assert watch_will_follow(fleet.last_run)  # its endpoint was not ready


def test_no_watch_event_answers_a_failed_call_a_cut_short_follow_through_or_a_gate_that_moves_no_endpoint():
    fleet = Fleet(1, "file", passes=True, seed=3)
    fleet.set_target("refused")
    _until(fleet, lambda: ("Attach", "cache-0") in _calls(fleet.last_actions))
    assert not watch_will_follow(fleet.last_run)  # the attach failed

    cut = Fleet(1, "file", passes=True, seed=3)
    cut.set_target("mooncake")
    cut.tick()
    cut.step()  # taken out
    for _ in range(6):  # drained, the operator idle
        cut.tick()
    assert cut.pods["cache-0"].endpoint_ready is False and not cut.pods["cache-0"].busy()
    run = asyncio.run(run_passes(cut.target, cut.observe(), cut.settings, cut.persisted,
                               clock=lambda: cut.clock, execute=_run_on(cut), reobserve=_reread(cut),
                               max_passes=1))
    assert _calls(run.actions) == [("Detach", "cache-0")]
    assert not watch_will_follow(run)  # the follow-through stopped after a runtime call

    idle = Fleet(2, "file", passes=True, seed=1, max_unavailable=2)
    idle.pods["cache-1"].endpoint_ready = False  # not routable already: taking it out changes no endpoint
    idle.set_target("mooncake")
    idle.step()
    assert {(a.pod, a.serving) for a in idle.last_actions} == {("cache-0", False), ("cache-1", False)}
    assert not watch_will_follow(idle.last_run)


def test_a_readmission_seen_finished_hands_its_slot_to_the_next_pod_in_the_same_step():
    """maxUnavailable 1: cache-0 is swapped and readmitted; the watch shows its endpoint ready
    before the step ends, so the same step takes cache-1 out (the fleet checks the budget)."""
    fleet = Fleet(2, "file", passes=True, seed=3, watch_moves=1.0)
    fleet.set_target("mooncake")
    _until(fleet, lambda: _calls(fleet.last_actions))

    assert _calls(fleet.last_actions) == [("Detach", "cache-0"), ("Attach", "cache-0")]
    gates = [(a.pod, a.serving) for a in fleet.last_actions if isinstance(a, SetServingGate)]
    assert gates == [("cache-0", True), ("cache-1", False)]
    assert fleet.last_run.passes == 4  # detach, attach, verify + readmit, handover
    assert set(fleet.persisted["pods"]) == {"cache-1"} and fleet.persisted["pods"]["cache-1"]["stage"] == "Draining"
    plan = fleet.run_until_quiet()
    fleet.check_quiet(plan)
    assert plan.state.phase.value == "Complete"


def test_a_handover_pass_that_would_call_a_runtime_is_left_to_the_next_step():
    """The handover view holds no runtime read newer than the step's: a pass asking for a call
    is dropped. Here cache-0 was readmitted by the step and its endpoint is now ready; cache-1,
    drained, has a read newer than its last action that nothing in the step answered."""
    fleet = Fleet(2, "file", passes=True, seed=3, max_unavailable=2)
    fleet.set_target("mooncake")
    fleet.tick()
    fleet.step()  # both taken out, records persisted
    now = fleet.clock + timedelta(seconds=5)
    state = SwapState.from_status(fleet.persisted)
    readmitting = state.pods["cache-0"].model_copy(update={"stage": Stage.READMITTING, "acted_at": now})
    state = state.model_copy(update={"pods": {**state.pods, "cache-0": readmitting}})
    a, b = fleet.observe()
    gated = a.model_copy(update={"serving_gate": True, "endpoint_ready": False, "observed_at": now,
                                 "backend": SimRuntime.booted_with(CONFIGS["mooncake"]).report()})
    drained = b.model_copy(update={"serving_gate": False, "endpoint_ready": False, "in_flight": 0, "queued": 0,
                                   "observed_at": now})
    plan = plan_step(fleet.target, [gated], fleet.settings, None, now)  # any plan: replaced or kept whole
    executed: list = []

    async def execute(actions):
        executed.extend(actions)
        return [fleet.execute(x) for x in actions]

    def handover(cache_1: PodObservation) -> Passes:
        run = Passes(plan=plan, state=state, passes=1, observed={"cache-0": gated, "cache-1": cache_1})
        after = asyncio.run(run_handover(run, fleet.target, fleet.settings, {"cache-0": True, "cache-1": False},
                                         clock=lambda: now + timedelta(milliseconds=5), execute=execute))
        return run, after

    run, after = handover(drained)
    assert after is run and executed == []
    # with cache-1's read older than its last action the planner only waits on it: kept
    run, after = handover(drained.model_copy(update={"observed_at": now - timedelta(seconds=10)}))
    assert after.passes == 2 and executed == [] and set(after.state.pods) == {"cache-1"}


def _run_on(fleet: Fleet):
    async def execute(actions):
        return [fleet.execute(a) for a in actions]
    return execute


def _reread(fleet: Fleet):
    async def reobserve(names):
        return fleet.observe(names)
    return reobserve


def _mid_rollout(ready_cache_0: bool):
    """maxUnavailable 2: cache-0 readmitted (endpoint not yet ready as the step began), cache-1
    drained (its record persisted: the step calls its runtime), cache-2 still to do. The runtime
    call blocks until the step takes cache-2 out, or until the watch was looked at ten times."""
    fleet = Fleet(3, "file", passes=True, seed=3, max_unavailable=2)
    fleet.set_target("mooncake")
    fleet.tick()
    fleet.step()  # cache-0 and cache-1 taken out, records persisted
    back, drained = fleet.pods["cache-0"], fleet.pods["cache-1"]  # the fleet as the observations below say
    back.gate, back.endpoint_ready, back.runtime = True, ready_cache_0, SimRuntime.booted_with(CONFIGS["mooncake"])
    drained.endpoint_ready, drained.in_flight, drained.queued = False, 0, 0
    now = fleet.clock + timedelta(seconds=5)
    state = SwapState.from_status(fleet.persisted)
    readmitting = state.pods["cache-0"].model_copy(update={"stage": Stage.READMITTING, "acted_at": now})
    state = state.model_copy(update={"pods": {**state.pods, "cache-0": readmitting}})
    a, b, c = fleet.observe()
    later = now + timedelta(milliseconds=1)
    observed = [a.model_copy(update={"serving_gate": True, "endpoint_ready": False, "observed_at": later,
                                     "backend": SimRuntime.booted_with(CONFIGS["mooncake"]).report()}),
                b.model_copy(update={"serving_gate": False, "endpoint_ready": False, "in_flight": 0, "queued": 0,
                                     "observed_at": later}),
                c]
    executed: list = []
    looks = 0

    async def execute(actions):
        if any(isinstance(x, (Detach, Attach)) for x in actions):
            for _ in range(200):
                if any(isinstance(x, SetServingGate) and x.pod == "cache-2" for x in executed) or looks >= 10:
                    break
                await asyncio.sleep(0.001)
        executed.extend(actions)
        return [fleet.execute(x) for x in actions]

    async def reobserve(names):
        return []

    def endpoint_ready():
        nonlocal looks
        looks += 1
        return {"cache-0": ready_cache_0, "cache-1": False, "cache-2": True}

    clock = iter(now + timedelta(milliseconds=2 + i) for i in range(100))
    run = asyncio.run(run_passes(fleet.target, observed, fleet.settings, state, clock=lambda: next(clock),
                               execute=execute, reobserve=reobserve, max_passes=1,
                               endpoint_ready=endpoint_ready, poll=0.001))
    return run, executed


def test_a_readmission_that_finishes_during_a_call_hands_its_slot_over_before_the_call_returns():
    run, executed = _mid_rollout(ready_cache_0=True)
    kinds = [(type(x).__name__, x.pod) for x in executed]
    assert kinds.index(("SetServingGate", "cache-2")) < kinds.index(("Detach", "cache-1"))
    assert [x.serving for x in executed if x.pod == "cache-2"] == [False]
    assert set(run.state.pods) == {"cache-1", "cache-2"}  # cache-0 done: its slot went to cache-2
    assert run.state.pods["cache-2"].stage is Stage.DRAINING and run.state.pods["cache-2"].previous is not None
    assert any(e.reason == "PodDraining" and e.pod == "cache-2" for e in run.events)
    assert run.observed["cache-2"].serving_gate is False and run.observed["cache-0"].endpoint_ready is True


def test_no_slot_is_handed_over_while_the_readmission_has_not_finished():
    run, executed = _mid_rollout(ready_cache_0=False)
    assert [x.pod for x in executed] == ["cache-1"]  # the call, after ten looks at the watch
    assert set(run.state.pods) == {"cache-0", "cache-1"}


class _RequestsEndDuringCalls(Fleet):
    """The runtimes' requests finish while the step's calls to another pod are in flight."""

    def __init__(self, *args, finishing: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.finishing = finishing

    def _runtime_call(self, pod, call, payload) -> None:
        super()._runtime_call(pod, call, payload)
        self.pods[self.finishing].in_flight = 0


def _two_out(fleet: Fleet) -> tuple:
    """Both pods taken out under maxUnavailable 2 (records persisted), endpoints not ready;
    cache-0 idle, cache-1 still running requests routed to it before."""
    fleet.set_target("mooncake")
    fleet.tick()
    fleet.step()
    a, b = fleet.pods["cache-0"], fleet.pods["cache-1"]
    assert a.gate is False and b.gate is False
    assert set(fleet.persisted["pods"]) == {"cache-0", "cache-1"}
    for _ in range(3):  # the world moves, the operator does not
        fleet.tick()
    for pod in (a, b):
        pod.endpoint_ready, pod.lag, pod.queued = False, 0, 0
    a.in_flight, b.in_flight = 0, 2
    return a, b


def test_a_drain_that_ends_while_other_calls_run_is_swapped_in_the_same_step():
    fleet = _RequestsEndDuringCalls(2, "file", max_unavailable=2, passes=True, seed=5, finishing="cache-1")
    a, b = _two_out(fleet)

    fleet.step()

    assert ("Detach", "cache-0") in _calls(fleet.last_actions)
    assert ("Detach", "cache-1") in _calls(fleet.last_actions)  # re-read after cache-0's call: idle now
    plan = fleet.run_until_quiet()
    fleet.check_quiet(plan)
    assert plan.state.phase.value == "Complete"


def test_a_drain_still_busy_after_the_calls_waits_for_the_next_step():
    fleet = Fleet(2, "file", max_unavailable=2, passes=True, seed=5)
    a, b = _two_out(fleet)

    fleet.step()

    assert ("Detach", "cache-0") in _calls(fleet.last_actions)
    assert not [c for c in _calls(fleet.last_actions) if c[1] == "cache-1"]
    assert fleet.persisted["pods"]["cache-1"]["stage"] == "Draining"
