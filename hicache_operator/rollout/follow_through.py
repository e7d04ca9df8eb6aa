"""One swap step that follows a pod through its runtime calls: detach, attach, verify, readmit;
and, at its end, hands the slots of readmissions it saw finish to the next pods (``run_handover``).

Why: the planner asks for at most one runtime call per pod per pass, and verifies each by the
next pass's GET. Run as one pass per operator step, a drained pod needed three or four steps
(detach, attach, verify + readmit), each paying a status write, a work-queue round trip and
the runtime reads of every pod in flight; with eight pods out at once, those steps queued
behind one another and were most of a swap's wall time. Here, when a pass's runtime call
succeeds, only that pod's runtime is read again at once and the planner runs again on that
fresh read, so a drained pod is detached, attached, verified and readmitted in one step.

What keeps this as safe as one pass per step:

- Every pass is the planner's own decision on observations it trusts: a pod re-read here is
  fresh (read after its call); every other pod keeps its earlier read, which is stale for any
  pod acted on in an earlier pass (``observed_at`` before its ``acted_at``), so the planner
  only waits on it. A record created in this step therefore never gets a runtime call in this
  step: its pod was not re-read. The persisted-record rule of the planner holds.
- Gate patches that succeeded are applied to the observations (the API server acknowledged
  them), so a later pass neither repeats them nor mistakes an admitted pod for a new one.
- A failed call ends the loop: the error goes into the state (``apply_outcomes``) and the next
  step reads the pod afresh, as before.
- The operator may die between passes: what it did is what one pass per step could have done
  before a crash (a call made, its record not yet persisted), and the next step re-derives
  everything from observation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Awaitable, Callable, Mapping, Sequence

from .actions import Action, ActionOutcome, Attach, Detach, Event, Plan, SetServingGate, apply_outcomes
from .observation import PodObservation, RolloutSettings
from .planner import plan_step
from .state import Step, SwapState
from .storage_config import StorageConfig

# detach -> attach -> verify (+ readmit): three passes carry a pod from drained to readmitted;
# one more covers a retried call. Bounded so that a runtime accepting calls but never
# converging cannot hold the step (the planner's call budget would stop it anyway).
MAX_PASSES = 4

_RUNTIME_FIELDS = ("backend", "in_flight", "queued", "runtime_error", "observed_at")

Execute = Callable[[list[Action]], Awaitable[list[ActionOutcome]]]
Reobserve = Callable[[list[str]], Awaitable[list[PodObservation]]]


@dataclass
class StepRun:
    """What one step did: ``state`` (outcomes applied) is what to persist; ``plan`` is the
    last pass's (its conditions and requeue hint are current)."""

    plan: Plan
    state: SwapState
    actions: list[Action] = field(default_factory=list)
    outcomes: list[ActionOutcome] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    passes: int = 0
    observed: dict[str, PodObservation] = field(default_factory=dict)


async def run_step(target: StorageConfig | Mapping[str, Any], observations: Sequence[PodObservation],
                   settings: RolloutSettings, state: SwapState | Mapping[str, Any] | None, *,
                   clock: Callable[[], datetime], execute: Execute, reobserve: Reobserve,
                   on_plan: Callable[[Plan], None] | None = None, max_passes: int = MAX_PASSES) -> StepRun:
    """Plan and act, and again for the pods whose runtime call just succeeded (re-read by
    ``reobserve``), up to ``max_passes`` times. ``clock`` gives the planner's ``now`` for each
    pass; ``execute`` runs one pass's actions (at most one per pod) and never raises; ``on_plan``
    sees each pass's plan before its actions run (the fleet simulator notes its Events there: a
    pod whose rollback failed is readmitted in the pass that reports it)."""
    seen = {o.name: o for o in observations}
    run: StepRun | None = None
    prior: SwapState | Mapping[str, Any] | None = state
    for _ in range(max(1, max_passes)):
        plan = plan_step(target, list(seen.values()), settings, prior, clock())
        if on_plan is not None:
            on_plan(plan)
        outcomes = await execute(plan.actions)
        prior = apply_outcomes(plan.state, outcomes)
        if run is None:
            run = StepRun(plan=plan, state=prior)
        run.plan, run.state, run.passes = plan, prior, run.passes + 1
        run.actions += plan.actions
        run.outcomes += outcomes
        run.events += plan.events
        for outcome in outcomes:
            action = outcome.action
            if outcome.error is None and isinstance(action, SetServingGate) and action.pod in seen:
                seen[action.pod] = seen[action.pod].model_copy(update={"serving_gate": action.serving})
        called = [o.action.pod for o in outcomes
                  if o.error is None and isinstance(o.action, (Detach, Attach)) and o.action.pod in seen]
        if not called:
            break
        for obs in await reobserve(called):
            if obs.name in seen and obs.uid == seen[obs.name].uid:
                # the runtime half is new; gate and endpoint stay as the watch (and this step's
                # acknowledged patches) say
                seen[obs.name] = seen[obs.name].model_copy(update={k: getattr(obs, k) for k in _RUNTIME_FIELDS})
    assert run is not None
    run.observed = seen
    return run


async def run_handover(run: StepRun, target: StorageConfig | Mapping[str, Any], settings: RolloutSettings,
                       endpoint_ready: Mapping[str, bool | None], *, clock: Callable[[], datetime],
                       execute: Execute, on_plan: Callable[[Plan], None] | None = None) -> StepRun:
    """One more pass at the end of a step, for the readmissions the step saw finish while it
    ran: their slots go to the next pods now, not in the next step.

    Why: a step lasts 0.5-1.5 s on a loaded fleet, and a pod's endpoint turning ready while it
    ran waited for it to end, for its status write, and for the next step's observation before
    the next pod left serving; with eight pods out at once most steps see some. This pass
    changes one thing in the step's view: pods with a Readmitting record whose endpoint the
    watch (``endpoint_ready``, pod name -> ready, read now) reports ready, with their gate set.
    The planner, on the step's own state, then drops those records, which frees their budget.
    The pass is kept only if it asks for nothing but gate patches (taking the next pods out,
    under the same budget rule); a runtime call, for which this view holds no fresh read, leaves
    the step as it was, for the next step to plan."""
    readmitted = [name for name, record in run.state.pods.items()
                  if record.step is Step.READMITTING and endpoint_ready.get(name) is True
                  and name in run.observed and run.observed[name].serving_gate is True
                  and run.observed[name].endpoint_ready is not True]
    if not readmitted:
        return run
    seen = {**run.observed, **{n: run.observed[n].model_copy(update={"endpoint_ready": True}) for n in readmitted}}
    plan = plan_step(target, list(seen.values()), settings, run.state, clock())
    if any(not isinstance(a, SetServingGate) for a in plan.actions):
        return run
    if on_plan is not None:
        on_plan(plan)
    outcomes = await execute(plan.actions)
    for outcome in outcomes:
        action = outcome.action
        if outcome.error is None and action.pod in seen:
            seen[action.pod] = seen[action.pod].model_copy(update={"serving_gate": action.serving})
    return StepRun(plan=plan, state=apply_outcomes(plan.state, outcomes), actions=run.actions + plan.actions,
                   outcomes=run.outcomes + outcomes, events=run.events + plan.events, passes=run.passes + 1,
                   observed=seen)


def watch_will_follow(run: StepRun) -> bool:
    """Whether what this step did will be answered by a watch event that starts the next step,
    so no prompt requeue is needed (the swap poll still comes if the event does not).

    Why: a requeue 50 ms after every step that acted ran before the EndpointSlice event the
    next step waits for (80-150 ms after a gate patch); that empty step then held the
    deployment while the event arrived, and the wait it added sat between one pod's readmission
    and the next pod's drain. An event follows when every action succeeded, the follow-through
    was not cut short by ``MAX_PASSES`` (the last pass made no runtime call), and every gate
    patch changes its pod's endpoint: taken out while ready, or admitted while not ready. A gate
    set False on a pod with no ready endpoint changes nothing a watch reports."""
    if any(o.error is not None for o in run.outcomes):
        return False
    if any(isinstance(a, (Detach, Attach)) for a in run.plan.actions):
        return False
    for action in run.actions:
        if isinstance(action, SetServingGate):
            seen = run.observed.get(action.pod)
            ready = seen.endpoint_ready if seen is not None else None
            if (ready is True) == action.serving:
                return False
    return True
