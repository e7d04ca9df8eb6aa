"""One operator step follows a drained pod through its runtime calls (``rollout.follow_through``),
on the simulated fleet, which checks as it goes that no runtime is called while its pod is
routable or before the pod's swap record (its rollback target) was persisted."""

from __future__ import annotations

import asyncio

from hicache_operator.rollout import Attach, Detach, RolloutSettings, SetServingGate
from hicache_operator.rollout.follow_through import run_step, watch_will_follow

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
    fleet = Fleet(1, "file", follow_through=True, seed=3)
    fleet.set_target("mooncake")
    _until(fleet, lambda: _calls(fleet.last_actions))

    assert [(type(a).__name__, getattr(a, "serving", None)) for a in fleet.last_actions] == [
        ("Detach", None), ("Attach", None), ("SetServingGate", True)]
    assert fleet.last_run.passes == 3
    pod = fleet.pods["cache-0"]
    assert pod.runtime.backend == "mooncake" and pod.gate is True
    assert fleet.persisted["pods"]["cache-0"]["step"] == "Readmitting"
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
    fleet = Fleet(2, "file", follow_through=True, seed=1)
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
    assert fleet.persisted["pods"]["cache-1"]["step"] == "Draining"
    assert b.runtime.backend == "file"
    fleet.step()  # the next step may call it: the record is persisted now
    assert ("Detach", "cache-1") in _calls(fleet.last_actions)


def test_a_failed_call_ends_the_step_with_the_error_recorded():
    fleet = Fleet(1, "file", follow_through=True, seed=3)
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
    fleet = Fleet(2, "file", follow_through=True, seed=1)
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
    fleet = Fleet(1, "file", follow_through=True, seed=3)
    fleet.set_target("mooncake")
    fleet.tick()
    fleet.step()
    assert [(type(a).__name__, a.serving) for a in fleet.last_actions] == [("SetServingGate", False)]
    assert watch_will_follow(fleet.last_run)  # its endpoint was ready
    _until(fleet, lambda: _calls(fleet.last_actions))
    assert isinstance(fleet.last_actions[-1], SetServingGate) and fleet.last_actions[-1].serving
    assert watch_will_follow(fleet.last_run)  # its endpoint was not ready


def test_no_watch_event_answers_a_failed_call_a_cut_short_follow_through_or_a_gate_that_moves_no_endpoint():
    fleet = Fleet(1, "file", follow_through=True, seed=3)
    fleet.set_target("refused")
    _until(fleet, lambda: ("Attach", "cache-0") in _calls(fleet.last_actions))
    assert not watch_will_follow(fleet.last_run)  # the attach failed

    cut = Fleet(1, "file", follow_through=True, seed=3)
    cut.set_target("mooncake")
    cut.tick()
    cut.step()  # taken out
    for _ in range(6):  # drained, the operator idle
        cut.tick()
    assert cut.pods["cache-0"].endpoint_ready is False and not cut.pods["cache-0"].busy()
    run = asyncio.run(run_step(cut.target, cut.observe(), cut.settings, cut.persisted,
                               clock=lambda: cut.clock, execute=_run_on(cut), reobserve=_reread(cut),
                               max_passes=1))
    assert _calls(run.actions) == [("Detach", "cache-0")]
    assert not watch_will_follow(run)  # the follow-through stopped after a runtime call

    idle = Fleet(2, "file", follow_through=True, seed=1, max_unavailable=2)
    idle.pods["cache-1"].endpoint_ready = False  # not routable already: taking it out changes no endpoint
    idle.set_target("mooncake")
    idle.step()
    assert {(a.pod, a.serving) for a in idle.last_actions} == {("cache-0", False), ("cache-1", False)}
    assert not watch_will_follow(idle.last_run)


def _run_on(fleet: Fleet):
    async def execute(actions):
        return [fleet.execute(a) for a in actions]
    return execute


def _reread(fleet: Fleet):
    async def reobserve(names):
        return fleet.observe(names)
    return reobserve
