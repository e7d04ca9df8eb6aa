"""Property tests: the planner driven through random histories of a
simulated fleet (target changes and reverts, new pod templates, deleted and
restarted pods, stuck requests, readiness blips, failed observations, flaky
runtime calls), with or without a router in front of the fleet,
by an operator that crashes at random points. The fleet checks as it goes
that the budget is never exceeded, no runtime is touched while serving or a
router worker, no pod is restarted while routable or (before its drain times
out) busy, none joins the router out of serving or mid-swap, no
pod returns to serving in an intermediate state and no payload carries a
hostname; at the end, that the fleet settles with every pod serving on the
current template, and that a good target always completes. Each history runs with the operator's
step as one planner pass, or following a pod through its runtime calls
(``rollout.passes``), as the operator does."""

from __future__ import annotations

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from .rollout_fleet_sim import CONFIGS, GOOD, Fleet

WORLD = ["calm"] * 8 + ["target", "target", "revert", "template", "delete", "restart", "stuck", "stall", "outage",
                        "blip", "glitch"]
OPERATOR = ["ok"] * 6 + ["drop", "prefix", "reorder"]


@st.composite
def history_step(draw):
    return (
        draw(st.sampled_from(WORLD)),
        draw(st.sampled_from(sorted(CONFIGS))),
        draw(st.integers(0, 4)),
        draw(st.sampled_from(OPERATOR)),
        draw(st.integers(0, 3)),
    )


def apply_world(fleet: Fleet, kind: str, config: str, index: int) -> None:
    # "stall" and "outage" aim at a pod mid-swap when there is one.
    swapping = sorted(name for name in (fleet.persisted or {}).get("pods", {}) if name in fleet.pods)
    names = swapping if kind in ("stall", "outage") and swapping else sorted(fleet.pods)
    name = names[index % len(names)] if names else None
    if kind == "target":
        fleet.set_target(config)
    elif kind == "revert":
        fleet.revert()
    elif kind == "template":
        fleet.new_template()
    elif name is None:
        return
    elif kind == "delete":
        fleet.delete(name)
    elif kind == "restart":
        fleet.restart_container(name)
    elif kind in ("stuck", "stall"):
        fleet.pods[name].stuck = True
    elif kind == "outage":
        fleet.restart_container(name, down=12)  # longer than the drain timeout
    elif kind == "blip":
        fleet.pods[name].unhealthy = 3
    elif kind == "glitch":
        fleet.pods[name].glitch = True


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 5),
    max_unavailable=st.sampled_from([1, 2, 3, "50%"]),
    initial=st.sampled_from(GOOD),
    first_target=st.sampled_from(sorted(CONFIGS)),
    seed=st.integers(0, 2**16),
    flaky=st.sampled_from([0.0, 0.3]),
    history=st.lists(history_step(), min_size=1, max_size=60),
    follow=st.booleans(),
    watch_moves=st.sampled_from([0.0, 0.5]),
    router=st.booleans(),
)
# A pod whose rollback failed (back to a config its runtime refuses, its
# attach of the new target mangled) is readmitted detached in the pass that reports
# RollbackFailed; the fleet only allowed it once it had seen that Event, after the step.
@example(n=1, max_unavailable=1, initial="file", first_target="file", seed=0, flaky=0.0, follow=True, watch_moves=0.0,
         router=False,
         history=[("calm", "file", 0, "ok", 0)] * 8 + [
             ("target", "refused", 0, "ok", 0), ("target", "file", 0, "ok", 0), ("revert", "file", 0, "ok", 0),
             ("delete", "file", 0, "ok", 0), ("calm", "file", 0, "ok", 0), ("calm", "file", 0, "ok", 0),
             ("target", "mangled", 0, "ok", 0)])
# A step whose state was lost had swapped the pod to the target; taken out
# again on it, its drain timed out in an outage, and it was restored to its record's `previous`,
# which it ran at an earlier takeout (the fleet only allowed the config of the last one).
@example(n=1, max_unavailable=1, initial="file", first_target="file", seed=0, flaky=0.0, follow=True, watch_moves=0.0,
         router=False,
         history=[("calm", "file", 0, "ok", 0)] * 2 + [("target", "mangled", 0, "ok", 0)] + [
             ("calm", "file", 0, "ok", 0)] * 3 + [("target", "file-selective", 0, "ok", 0)] + [
             ("calm", "file", 0, "ok", 0)] * 2 + [("target", "file", 0, "ok", 0), ("calm", "file", 0, "drop", 0),
                                                  ("outage", "file", 0, "ok", 0)])
# The step's watch saw the restarted pod come back only after the planner had planned (no budget
# for the next restart then): the fleet is quiet only once the planner itself saw it settled.
@example(n=2, max_unavailable=1, initial="file", first_target="file", seed=0, flaky=0.0, follow=True, watch_moves=0.5,
         router=False, history=[("calm", "file", 0, "ok", 0)] * 6 + [("template", "file", 0, "ok", 0)])
# A read of the draining pod's runtime failed once: that is no proof it is idle, so no restart yet.
@example(n=1, max_unavailable=1, initial="file", first_target="file", seed=2, flaky=0.0, follow=False, watch_moves=0.0,
         router=False, history=[("calm", "file", 0, "ok", 0)] * 6 + [("template", "file", 0, "ok", 0), ("calm", "file", 0, "ok", 0),
                                                      ("glitch", "file", 0, "ok", 0)])
# A pod restarted while a step ran: the step's handover pass, freeing the slot of a readmission
# the watch saw finish, must count the restarted pod's endpoint as lost, not as the step saw it.
@example(n=3, max_unavailable=1, initial="file-selective", first_target="file", seed=194, flaky=0.0, follow=True,
         watch_moves=0.5, router=False, history=[("calm", "file", 0, "ok", 0)] * 3 + [("restart", "file", 1, "ok", 0)])
def test_fleet_invariants_under_chaos(n, max_unavailable, initial, first_target, seed, flaky, history, follow,
                                     watch_moves, router):
    fleet = Fleet(n, initial, max_unavailable=max_unavailable, seed=seed, flaky=flaky, passes=follow,
                  watch_moves=watch_moves, router=router)
    fleet.set_target(first_target)
    for kind, config, index, crash, prefix in history:
        apply_world(fleet, kind, config, index)
        fleet.tick()
        fleet.step(crash, prefix)

    plan = fleet.run_until_quiet()
    fleet.check_quiet(plan)
    for reason in sorted(fleet.reasons):
        event(reason)

    fresh = next(name for name in GOOD if name != fleet.target_name)
    fleet.set_target(fresh)
    plan = fleet.run_until_quiet()
    fleet.check_quiet(plan)
    assert plan.state.phase.value == "Complete", plan.state.to_status()
    assert plan.state.progress == f"{n}/{n}"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 5),
    max_unavailable=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
    revert_after=st.integers(1, 25),
    follow=st.booleans(),
)
def test_revert_mid_rollout_returns_every_pod_to_the_original(n, max_unavailable, seed, revert_after, follow):
    fleet = Fleet(n, "file", max_unavailable=max_unavailable, seed=seed, passes=follow,
                  watch_moves=0.5 if follow else 0.0)
    fleet.set_target("mooncake")
    for _ in range(revert_after):
        fleet.tick()
        fleet.step()
    fleet.revert()
    plan = fleet.run_until_quiet()
    fleet.check_quiet(plan)
    assert plan.state.phase.value == "Complete"
    assert {p.runtime.backend for p in fleet.pods.values()} == {"file"}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 4), seed=st.integers(0, 2**16), bad=st.sampled_from(["refused", "mangled"]),
       follow=st.booleans())
def test_bad_target_fails_once_and_restores_the_pod(n, seed, bad, follow):
    fleet = Fleet(n, "file", max_unavailable=1, seed=seed, passes=follow, watch_moves=0.5 if follow else 0.0)
    fleet.set_target(bad)
    plan = fleet.run_until_quiet()
    fleet.check_quiet(plan)
    assert plan.state.phase.value == "Failed"
    failed_pods = {p.name for p in fleet.pods.values() if p.taken_out_config is not None}
    assert failed_pods == {plan.state.failure.pod}, "the rollout must stop at the first failure"
    assert plan.state.failure.cause == ("AttachFailed" if bad == "refused" else "VerifyMismatch")
    assert {p.runtime.fingerprint() for p in fleet.pods.values()} == {fleet.pods[plan.state.failure.pod].boot_fp}


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5),
    max_unavailable=st.sampled_from([1, 2, "50%"]),
    seed=st.integers(0, 2**16),
    swap_too=st.booleans(),
    stuck=st.integers(0, 4),
    follow=st.booleans(),
    router=st.booleans(),
)
def test_a_new_template_rolls_through_every_pod_drained_within_the_budget(n, max_unavailable, seed, swap_too, stuck,
                                                                        follow, router):
    fleet = Fleet(n, "file", max_unavailable=max_unavailable, seed=seed, passes=follow, router=router)
    fleet.new_template()
    if swap_too:
        fleet.set_target("mooncake")
    if stuck < n:
        fleet.pods[f"cache-{stuck}"].stuck = True  # its drain must time out; the restart goes on
    for _ in range(40):
        fleet.tick()
        fleet.step()
    plan = fleet.run_until_quiet()
    fleet.check_quiet(plan)
    assert all(pod.template == fleet.template for pod in fleet.pods.values())
    if swap_too:
        assert plan.state.phase.value == "Complete", plan.state.to_status()
