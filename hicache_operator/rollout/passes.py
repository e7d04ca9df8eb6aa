"""One swap step as several planner passes: it follows a pod through its runtime calls (detach,
attach, verify, readmit) and, while its calls are in flight (``_hand_over``) and at its end
(``run_handover``), hands the slots of readmissions it saw finish to the next pods.

The planner asks for at most one runtime call per pod per pass and verifies each by the next
pass's GET. One pass per operator step would cost a drained pod three or four steps, each with a
status write, a work-queue round trip and the reads of every pod in flight. So when a pass's
runtime call succeeds, only that pod's runtime is read again at once and the planner runs again
on that fresh read: a drained pod is detached, attached, verified and readmitted in one step.

What keeps this as safe as one pass per step:

- Every pass is the planner's own decision on observations it trusts: a pod re-read here is
  fresh (read after its call, or a drain under a record persisted before the step, see
  ``_still_draining``); every other pod keeps its earlier read, which is stale for any pod
  acted on in an earlier pass (``observed_at`` before its ``acted_at``), so the planner only
  waits on it. A record created in this step therefore never gets a runtime call in this
  step: its pod was not re-read. The persisted-record rule of the planner holds.
- Gate patches that succeeded are applied to the observations (the API server acknowledged
  them), so a later pass neither repeats them nor mistakes an admitted pod for a new one; so are
  router changes (the router pods' lists showed them). A pod just removed from the routers under
  a record persisted before the step is read again like one whose runtime was called: requests
  routed to it before may still run.
- A failed call ends the loop: the error goes into the state (``apply_outcomes``) and the next
  step reads the pod afresh, as before.
- The operator may die between passes: what it did is what one pass per step could have done
  before a crash (a call made, its record not yet persisted), and the next step re-derives
  everything from observation.
- Endpoints are the one thing a later pass may see newer than the step's start (``_watched``):
  they come from the watch, not from a runtime, and decide only the budget and readmissions.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Awaitable, Callable, Mapping, Sequence

from .actions import Action, ActionOutcome, Attach, Detach, Event, SetRouted, SetServingGate, SwapPlan, apply_outcomes
from .observation import PodObservation, RolloutSettings
from .planner import plan_step
from .state import InvalidSwapState, PodSwap, Stage, SwapState
from hicache_operator.fleet.storage_config import StorageConfig

# detach -> attach -> verify (+ readmit): three passes carry a pod from drained to readmitted;
# one more covers a retried call. Bounded so that a runtime accepting calls but never
# converging cannot hold the step (the planner's call budget would stop it anyway).
MAX_PASSES = 4

_RUNTIME_FIELDS = ("backend", "in_flight", "queued", "runtime_error", "observed_at")

Execute = Callable[[list[Action]], Awaitable[list[ActionOutcome]]]
Reobserve = Callable[[list[str]], Awaitable[list[PodObservation]]]
EndpointReady = Callable[[], Mapping[str, "bool | None"]]  # pod name -> ready, as the watch sees it now
HANDOVER_POLL_SECONDS = 0.02


@dataclass
class Passes:
    """What one step did: ``state`` (outcomes applied) is what to persist; ``plan`` is the
    last pass's (its conditions and requeue hint are current)."""

    plan: SwapPlan
    state: SwapState
    actions: list[Action] = field(default_factory=list)
    outcomes: list[ActionOutcome] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    passes: int = 0
    observed: dict[str, PodObservation] = field(default_factory=dict)


async def run_passes(target: StorageConfig | Mapping[str, Any], observations: Sequence[PodObservation],
                   settings: RolloutSettings, state: SwapState | Mapping[str, Any] | None, *,
                   clock: Callable[[], datetime], execute: Execute, reobserve: Reobserve,
                   on_plan: Callable[[SwapPlan], None] | None = None, max_passes: int = MAX_PASSES,
                   endpoint_ready: EndpointReady | None = None,
                   poll: float = HANDOVER_POLL_SECONDS) -> Passes:
    """Plan and act, and again for the pods whose runtime call just succeeded (re-read by
    ``reobserve``), up to ``max_passes`` times. ``clock`` gives the planner's ``now`` for each
    pass; ``execute`` runs one pass's actions (at most one per pod) and never raises; ``on_plan``
    sees each pass's plan before its actions run (the fleet simulator notes its Events there: a
    pod whose rollback failed is readmitted in the pass that reports it). With
    ``endpoint_ready``, while a pass's calls are in flight the watch is looked at every
    ``poll`` seconds and the slots of readmissions it shows finished go to the next pods at once
    (``_hand_over``)."""
    seen = {o.name: o for o in observations}
    run: Passes | None = None
    prior: SwapState | Mapping[str, Any] | None = state
    persisted = _persisted_records(state)
    for _ in range(max(1, max_passes)):
        if run is not None and endpoint_ready is not None:
            seen = _watched(seen, endpoint_ready())
        plan = plan_step(target, list(seen.values()), settings, prior, clock())
        if on_plan is not None:
            on_plan(plan)
        handed = _Handed()
        if endpoint_ready is None:
            outcomes = await execute(plan.actions)
        else:
            outcomes = await _hand_over(execute(plan.actions), plan, seen, target, settings, endpoint_ready,
                                        handed, clock=clock, execute=execute, on_plan=on_plan, poll=poll)
        prior = merged = handed.merge(apply_outcomes(plan.state, outcomes))
        if run is None:
            run = Passes(plan=plan, state=prior)
        run.plan, run.state, run.passes = plan, prior, run.passes + 1
        run.actions += plan.actions + handed.actions
        run.outcomes += outcomes + handed.outcomes
        run.events += plan.events + handed.events
        for name in handed.finished:
            seen[name] = seen[name].model_copy(update={"endpoint_ready": True})
        for outcome in outcomes + handed.outcomes:
            if outcome.error is None and outcome.action.pod in seen:
                seen[outcome.action.pod] = acknowledged(seen[outcome.action.pod], outcome.action)
        # a router change is followed only under a record persisted before the step: a record the
        # step created must not meet a fresh read (its runtime is touched only in a later step)
        called = [o.action.pod for o in outcomes if o.error is None and o.action.pod in seen and (
            isinstance(o.action, (Detach, Attach)) or
            isinstance(o.action, SetRouted) and persisted.get(o.action.pod) == o.action.uid)]
        if not called:
            break
        if endpoint_ready is not None:
            seen = _watched(seen, endpoint_ready())
        for obs in await reobserve(called + _still_draining(merged, persisted, seen, called)):
            if obs.name in seen and obs.uid == seen[obs.name].uid:
                # the runtime half is new; gate and endpoint stay as the watch (and this step's
                # acknowledged patches) say
                seen[obs.name] = seen[obs.name].model_copy(update={k: getattr(obs, k) for k in _RUNTIME_FIELDS})
    assert run is not None
    run.observed = seen
    return run


def acknowledged(obs: PodObservation, action: Action) -> PodObservation:
    """The observation with a gate patch or router change that succeeded."""
    if isinstance(action, SetServingGate):
        return obs.model_copy(update={"serving_gate": action.serving})
    if isinstance(action, SetRouted):
        return obs.model_copy(update={"routed_by": obs.router_replicas if action.routed else 0})
    return obs


def _persisted_records(state: SwapState | Mapping[str, Any] | None) -> dict[str, str]:
    """Pod name -> uid of the records the step started with (persisted before it ran)."""
    try:
        parsed = SwapState.from_status(state)
    except InvalidSwapState:
        return {}
    return {name: rec.uid for name, rec in parsed.pods.items()} if parsed is not None else {}


def _still_draining(state: SwapState, persisted: Mapping[str, str], seen: Mapping[str, PodObservation],
                    called: Sequence[str]) -> list[str]:
    """Pods to read again with the ones just called: drains that waited on requests in flight.

    A pod whose endpoint just turned not ready may still run requests routed to it before; its
    drain can end while the step's other pods' calls run (0.3-0.7 s with eight pods out). Read
    again after the pass, the planner sees it idle and swaps it in this step rather than the
    next. Only records persisted before the step (a runtime is touched only under a
    persisted record), of pods out of serving whose endpoint the watch shows not ready: a read
    made now sees every request that will ever reach them."""
    return [name for name, rec in state.pods.items()
            if rec.stage is Stage.DRAINING and persisted.get(name) == rec.uid and name not in called
            and name in seen and seen[name].uid == rec.uid and seen[name].serving_gate is False
            and seen[name].endpoint_ready is not True and seen[name].unrouted
            and not (seen[name].idle and seen[name].observed_at > rec.acted_at)]


def _watched(seen: Mapping[str, PodObservation], ready: Mapping[str, bool | None]) -> dict[str, PodObservation]:
    """The pods with their endpoints as the watch shows them now.

    A pod whose endpoint was not ready when the step began (a new or restarted pod) may be ready
    by a later pass; still counted as unavailable, it could be taken out "for free", one more
    out of serving than maxUnavailable allows. The runtime half of each observation, and with
    it what may be called, is left as it was read."""
    return {name: obs.model_copy(update={"endpoint_ready": ready[name]})
            if name in ready and ready[name] is not obs.endpoint_ready else obs for name, obs in seen.items()}


@dataclass
class _Handed:
    """What ``_hand_over`` did while one pass's calls were in flight, to join to the pass."""

    finished: set[str] = field(default_factory=set)  # readmissions the watch showed done: records dropped
    taken: dict[str, PodSwap] = field(default_factory=dict)  # pods taken out: their new records
    actions: list[Action] = field(default_factory=list)
    outcomes: list[ActionOutcome] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def merge(self, state: SwapState) -> SwapState:
        pods = {name: rec for name, rec in state.pods.items()
                if not (name in self.finished and rec.stage is Stage.READMITTING)}
        pods.update(self.taken)
        return state.model_copy(update={"pods": pods})


async def _hand_over(calls: Awaitable[list[ActionOutcome]], plan: SwapPlan, seen: Mapping[str, PodObservation],
                     target: StorageConfig | Mapping[str, Any], settings: RolloutSettings,
                     endpoint_ready: EndpointReady, handed: _Handed, *, clock: Callable[[], datetime],
                     execute: Execute, on_plan: Callable[[SwapPlan], None] | None, poll: float) -> list[ActionOutcome]:
    """Run a pass's calls; meanwhile, when the watch shows a readmission of this step's state
    finished, take the next pods out under the budget, as the next pass would, without waiting
    for the pass's slowest call. Returns the pass's outcomes; what it did is in ``handed``.

    An attach on a loaded runtime, its verifying read and the gate patches of a pass take
    0.1-0.3 s, and with eight pods out at once a readmission usually finishes meanwhile; its
    slot goes to the next pod now rather than when the step ends. What keeps it safe: the planner decides, on
    the pass's own state (its planned records count against the budget; the pass's gate patches
    are taken as done), with the pods' reads as the pass had them (stale for every pod acted on,
    so it only waits on those). Of its plan only this is kept: records of readmissions the watch
    shows finished are dropped (freeing their budget), and pods with no record are taken out
    (gate False, a Draining record). Everything else it asks is the pass's own work, in flight,
    or waits for a read this view does not have. The records join the pass's state before the
    next pass plans (``_Handed.merge``)."""
    pass_calls = asyncio.ensure_future(calls)
    state = plan.state
    busy = {a.pod for a in plan.actions}  # the pass's own pods: one action per pod at a time
    view = dict(seen)
    for action in plan.actions:
        if isinstance(action, SetServingGate) and action.pod in view:
            view[action.pod] = view[action.pod].model_copy(update={"serving_gate": action.serving})
    while True:
        await asyncio.wait({pass_calls}, timeout=poll)
        if pass_calls.done():
            return pass_calls.result()
        ready = endpoint_ready()
        finished = [name for name, rec in state.pods.items()
                    if rec.stage is Stage.READMITTING and ready.get(name) is True and name not in handed.finished
                    and name in view and view[name].serving_gate is True and view[name].endpoint_ready is not True]
        if not finished:
            continue
        view = _watched(view, ready)
        hand = plan_step(target, list(view.values()), settings, state, clock())
        takeouts = [a for a in hand.actions if isinstance(a, SetServingGate) and not a.serving
                    and a.pod not in state.pods and a.pod not in busy and a.pod in hand.state.pods]
        handed.finished.update(name for name in finished if name not in hand.state.pods)
        taken = {a.pod: hand.state.pods[a.pod] for a in takeouts}
        pods = {n: r for n, r in state.pods.items() if n not in handed.finished or r.stage is not Stage.READMITTING}
        state = state.model_copy(update={"pods": {**pods, **taken}})
        if not takeouts:
            continue
        events = [e for e in hand.events if e.pod in taken]
        if on_plan is not None:
            on_plan(replace(hand, actions=takeouts, events=events, state=state))
        outcomes = await execute(takeouts)
        handed.taken.update(taken)
        handed.actions += takeouts
        handed.outcomes += outcomes
        handed.events += events
        for outcome in outcomes:
            if outcome.error is None:
                view[outcome.action.pod] = view[outcome.action.pod].model_copy(update={"serving_gate": False})


async def run_handover(run: Passes, target: StorageConfig | Mapping[str, Any], settings: RolloutSettings,
                       endpoint_ready: Mapping[str, bool | None], *, clock: Callable[[], datetime],
                       execute: Execute, on_plan: Callable[[SwapPlan], None] | None = None) -> Passes:
    """One more pass at the end of a step, for the readmissions the step saw finish while it
    ran: their slots go to the next pods now, not in the next step.

    A step lasts 0.5-1.5 s on a loaded fleet; a pod's endpoint that turned ready meanwhile would
    otherwise wait for the step's end, its status write and the next step's observation before
    the next pod leaves serving. This pass
    changes one thing in the step's view: pods with a Readmitting record whose endpoint the
    watch (``endpoint_ready``, pod name -> ready, read now) reports ready, with their gate set.
    The planner, on the step's own state, then drops those records, which frees their budget.
    The pass is kept only if it asks for nothing but gate patches (taking the next pods out,
    under the same budget rule); a runtime call, for which this view holds no fresh read, leaves
    the step as it was, for the next step to plan."""
    readmitted = [name for name, record in run.state.pods.items()
                  if record.stage is Stage.READMITTING and endpoint_ready.get(name) is True
                  and name in run.observed and run.observed[name].serving_gate is True
                  and run.observed[name].endpoint_ready is not True]
    if not readmitted:
        return run
    # the watch now: the readmitted pods' endpoints ready, and any endpoint that stopped being
    # ready while the step ran (a pod that crashed or restarted) counted as unavailable
    lost = [name for name, pod in run.observed.items()
            if pod.endpoint_ready is True and endpoint_ready.get(name) is False]
    seen = {**run.observed,
            **{n: run.observed[n].model_copy(update={"endpoint_ready": False}) for n in lost},
            **{n: run.observed[n].model_copy(update={"endpoint_ready": True}) for n in readmitted}}
    plan = plan_step(target, list(seen.values()), settings, run.state, clock())
    if any(not isinstance(a, SetServingGate) for a in plan.actions):
        return run
    if on_plan is not None:
        on_plan(plan)
    outcomes = await execute(plan.actions)
    for outcome in outcomes:
        if outcome.error is None and outcome.action.pod in seen:
            seen[outcome.action.pod] = acknowledged(seen[outcome.action.pod], outcome.action)
    return Passes(plan=plan, state=apply_outcomes(plan.state, outcomes), actions=run.actions + plan.actions,
                   outcomes=run.outcomes + outcomes, events=run.events + plan.events, passes=run.passes + 1,
                   observed=seen)


def watch_will_follow(run: Passes) -> bool:
    """Whether what this step did will be answered by a watch event that starts the next step,
    so no prompt requeue is needed (the swap poll still comes if the event does not).

    A requeue 50 ms after a step that acted would run before the EndpointSlice event the next
    step waits for (80-150 ms after a gate patch), and that empty step would hold the deployment
    while the event arrives. An event follows when every action succeeded, the follow-through
    was not cut short by ``MAX_PASSES`` (the last pass made no runtime call), and every gate
    patch changes its pod's endpoint: taken out while ready, or admitted while not ready. A gate
    set False on a pod with no ready endpoint changes nothing a watch reports."""
    if any(o.error is not None for o in run.outcomes):
        return False
    if any(isinstance(a, (Detach, Attach, SetRouted)) for a in run.plan.actions):
        return False
    for action in run.actions:
        if isinstance(action, SetServingGate):
            seen = run.observed.get(action.pod)
            ready = seen.endpoint_ready if seen is not None else None
            if (ready is True) == action.serving:
                return False
    return True
