"""Drain-aware rolling swap of the L3 storage backend: the pure planner.

(The transitions of a pod's record, one method per stage of the diagram below, are in
``transitions``; this module holds the fleet: new pods, the budget, the summary.)

``plan_step`` looks at the fleet once and returns the NEXT step — new state
to persist in ``status.backendSwap``, at most one action per pod, Events,
conditions and a requeue hint. It never sleeps and never assumes an action
happened: the operator may die after any action and before persisting, so
every decision is re-derived from what the pods, their EndpointSlices and
their runtimes report now, and every action is idempotent.

Per pod (only pods whose runtime reports something other than the target)::

    serving, wrong backend
        |  start (within maxUnavailable; a pod already out of serving is free)
        v                                  gate False, record persisted with `previous`
    Draining --- runtime reports target already -----------------------------+
        |  gate False seen, endpoint not ready, 0 running + 0 queued          |
        |  (timeout: DrainTimeout) -------------------------+                 |
        v                                                   |                 |
    Swapping  one runtime call per step, then look again:   |                 |
        |  other backend/extra attached -> Detach           |                 |
        |  nothing attached (or same backend) -> Attach     |                 |
        |  GET matches target ----------------------------- | --------------> +
        |  attach refused / GET mismatch after attach /     |                 |
        |  calls used up / runtime gone too long  ----------+                 |
        |                                                   v                 |
        |                                    RollingBack: same loop toward    |
        |                                    `previous`; matches or gives up  |
        |                                                   |                 |
        v                                                   v                 v
    Readmitting  gate True; done when the endpoint is ready again (timeout: Warning, record dropped)

The first failure stops the rollout (phase Failed, condition
BackendSwapFailed=True naming the pod and cause): pods still Draining go back
unchanged, pods already Swapping finish (or fail and roll back), no new pod
starts, until the target changes. A changed target (a revert included) starts
a new rollout under the same budget: records carry over, so a pod mid-swap
converges to the newest target; pods already on an older target are swapped
again like any other.

Verification is the next pass's GET, not an action: it then holds whether or
not the operator survived the attach. No runtime call is made while the pod
is routable or busy, even by a stale record.

With a router in front of the fleet (``routing``), "routable" includes its
worker lists: a pod taken out of serving is also removed from every router
pod (``SetRouted``), and drained only once none lists it; a readmitted pod
joins every router pod once its endpoint is ready again, and its record ends
only when every router pod lists it. Pods without a record follow their
endpoint: a pod in serving with a ready endpoint that a router lacks is added,
one whose endpoint is not ready (or that is terminating) is removed.

Crash safety: a runtime call is only made for a pod whose record (holding
``previous``) came from the persisted state, never in the step that creates
it. A record whose pod is seen serving again (its readmission was never
persisted) is forgotten, so taking the pod out again spends budget. A pod
found out of serving with no record (the operator died after the gate
action) is adopted: continued if it still needs a swap, else readmitted.
A record whose pod is gone or has a new uid is dropped; the new pod is judged
afresh (a pod created from a template carrying the target needs nothing but
its gate set True). Observations not newer than a pod's last action are
treated as stale.

A pod started on the target whose runtime could not attach it (an unreachable
Mooncake master at start: it serves from L1+L2) is not swapped: a new fleet on
its target is no swap, and the attach already failed once. It is listed in
``unattached`` (the operator reports it as Degraded) until it runs the target.

Restarts share the budget and the drain. A pod that runs an older pod template
than its StatefulSet now carries (``stale_template``: a new image, model or
engine flag) gets a record with purpose ``restart``: taken out of serving,
drained like a swap (a runtime that does not answer counts as busy), then deleted (``DeletePod``, stage Restarting) so the
StatefulSet creates it again from the new template; the record ends when the
pod is gone. Highest ordinal first, before any swap (a restarted pod starts on
the target storage config). A stale pod that is not serving anyway is deleted
at once, at no cost to the budget. A drain that times out restarts the pod
anyway (a Warning says so): a restart must not wait forever on a stuck
request. A failed swap does not stop restarts.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Mapping, Sequence

from hicache_operator.api.conditions import SWAP_FAILED, SWAP_IN_PROGRESS, Condition, condition
from hicache_operator.fleet.storage_config import (StorageConfig, as_target, clip_message, config_matches,
                                                   storage_fingerprint)

from .actions import Action, DeletePod, Event, SetRouted, SetServingGate, SwapPlan
from .observation import PodObservation, RolloutSettings
from .state import Failure, InvalidSwapState, Phase, PodSwap, Stage, SwapState
from .transitions import RecordTransitions, runs_of


def plan_step(
    target: StorageConfig | Mapping[str, Any],
    pods: Sequence[PodObservation | Mapping[str, Any]],
    settings: RolloutSettings | Mapping[str, Any],
    state: SwapState | Mapping[str, Any] | None,
    now: datetime,
) -> SwapPlan:
    """Next step of the swap toward ``target``; see the module docstring.

    ``state`` is ``status.backendSwap`` as persisted (None at first; an
    unreadable one is discarded with a Warning — observation is enough to
    resume, only rollback targets of pods mid-swap are lost). Raises
    ValueError on bad input (an invalid or hostname-carrying target, naive
    datetimes, duplicate pod names)."""
    return _Planner(target, pods, settings, state, now).plan()


def natural_key(name: str) -> list[Any]:
    """``pod-2`` before ``pod-10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class _Planner(RecordTransitions):
    def __init__(self, target, pods, settings, state, now: datetime) -> None:
        if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
            raise ValueError("now must be a timezone-aware datetime")
        self.now = now
        self.target = as_target(target)
        self.target_fp = storage_fingerprint(self.target)
        self.settings = settings if isinstance(settings, RolloutSettings) else RolloutSettings.model_validate(settings)
        self.pods: dict[str, PodObservation] = {}
        for raw in pods:
            obs = raw if isinstance(raw, PodObservation) else PodObservation.model_validate(raw)
            if obs.name in self.pods:
                raise ValueError(f"pod {obs.name!r} observed twice")
            self.pods[obs.name] = obs
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.acted: set[str] = set()
        discarded = False
        try:
            prior = SwapState.from_status(state)
        except InvalidSwapState as exc:
            self._event("Warning", "SwapStateDiscarded", f"{exc}; resuming from observation")
            prior, discarded = None, True
        self.prior = prior
        self.state = self._begin(prior, initial=prior is None and not discarded)
        self.records: dict[str, PodSwap] = dict(self.state.pods)

    def _begin(self, prior: SwapState | None, initial: bool) -> SwapState:
        if prior is not None and prior.target == self.target_fp:
            return prior
        records: dict[str, PodSwap] = {}
        if prior is not None:
            for name, rec in prior.pods.items():
                # A pod rolling back re-checks its drain before heading for the new target.
                records[name] = self._moved(rec, Stage.DRAINING) if rec.stage is Stage.ROLLING_BACK else rec
            self._event(
                "Normal",
                "BackendSwapStarted",
                f"storage target is now {self.target.describe()}; pods are swapped at most "
                f"{self.settings.max_unavailable} out of serving at a time",
            )
        return SwapState(
            phase=Phase.IN_PROGRESS,
            target=self.target_fp,
            target_backend=self.target.backend,
            started_at=self.now,
            pods=records,
            initial=initial,
        )

    def plan(self) -> SwapPlan:
        for name in sorted(self.records, key=natural_key):
            self._advance(name)
        live = sorted((o for o in self.pods.values() if o.live), key=lambda o: natural_key(o.name))
        self._adopt_orphans(live)
        self._start_and_admit(live)
        return self._finish(live)

    # ---------------------------------------------------------------- pods without records

    def _adopt_orphans(self, live: list[PodObservation]) -> None:
        for obs in live:
            if obs.name in self.records or obs.name in self.acted or obs.serving_gate is not False:
                continue
            if obs.stale_template:  # out of serving already: its restart drains it from here
                self._set(obs.name, PodSwap(uid=obs.uid, stage=Stage.DRAINING, since=self.now,
                                            acted_at=self.now, purpose="restart"))
                continue
            previous = obs.backend.to_config() if obs.reachable else None
            needs_swap = obs.reachable and not config_matches(obs.backend, self.target) and not obs.start_failure
            rec = PodSwap(uid=obs.uid, stage=Stage.DRAINING, since=self.now, acted_at=self.now,
                          previous=previous.canonical() if previous is not None else None)
            if needs_swap and not self.failed:
                self._in_progress()
                self._set(obs.name, rec)
                self._event("Normal", "PodAdopted", f"pod {obs.name} is out of serving with no swap record "
                            "(operator restarted mid-step?); continuing its swap", obs.name)
            else:
                rec = self._moved(rec, Stage.READMITTING)
                self._act(obs.name, rec, SetServingGate(obs.name, obs.uid, True, runs=runs_of(obs)))

    def _start_and_admit(self, live: list[PodObservation]) -> None:
        unavailable = {o.name for o in live if not o.available} | set(self.records)
        # pods leaving the routers in this pass (not Ready) are not taken out for free, but no
        # longer count as serving
        counted = unavailable | {o.name for o in live if self._leaves_routers(o)}
        budget = self.settings.budget(self._fleet_size(live))
        absent = self._absent(live)
        stale = sorted((o for o in live if o.stale_template and o.name not in self.records
                        and o.name not in self.acted), key=lambda o: natural_key(o.name), reverse=True)
        for obs in stale:
            if obs.name in unavailable:  # not serving anyway: no cost to the budget
                if obs.endpoint_ready is not True and obs.unrouted:
                    self._restart_now(obs)  # and unreachable for clients: no drain
                else:
                    self._start_restart(obs)
            elif len(counted) + absent < budget:
                unavailable.add(obs.name)
                counted.add(obs.name)
                self._start_restart(obs)
        candidates = [
            o for o in live
            if o.name not in self.records and o.name not in self.acted and o.phase == "Running"
            and o.serving_gate is not False and o.reachable and not config_matches(o.backend, self.target)
            and not o.start_failure and not o.stale_template
        ]
        if not self.failed:
            candidates.sort(key=lambda o: (o.name not in unavailable, natural_key(o.name)))
            for obs in candidates:
                if obs.name in unavailable or len(counted) + absent < budget:
                    unavailable.add(obs.name)
                    counted.add(obs.name)
                    self._start(obs)
        for obs in live:
            if obs.serving_gate is None and obs.name not in self.records and obs.name not in self.acted:
                self._admit(obs)
        self._follow_endpoints()

    def _follow_endpoints(self) -> None:
        """Routers of pods without a record: a pod in serving whose endpoint is ready joins every
        router pod, one that is not Ready (its runtime failing or restarting) or terminating
        leaves them (the router's own health checks take minutes)."""
        for obs in sorted(self.pods.values(), key=lambda o: natural_key(o.name)):
            if obs.name in self.records or obs.name in self.acted or not obs.router_replicas:
                continue
            serving = obs.live and obs.serving_gate is True and obs.endpoint_ready is True and obs.ready is not False
            if serving and not obs.fully_routed:
                self.actions.append(SetRouted(obs.name, obs.uid, True))
                self.acted.add(obs.name)
            elif self._leaves_routers(obs):
                self.actions.append(SetRouted(obs.name, obs.uid, False))
                self.acted.add(obs.name)

    def _leaves_routers(self, obs: PodObservation) -> bool:
        """A pod without a record that a router lists though it is not Ready or is terminating."""
        return bool(obs.router_replicas) and obs.name not in self.records and obs.name not in self.acted \
            and not obs.unrouted and (not obs.live or obs.ready is False)

    def _start(self, obs: PodObservation) -> None:
        self._in_progress()
        previous = obs.backend.to_config()
        rec = PodSwap(uid=obs.uid, stage=Stage.DRAINING, since=self.now, acted_at=self.now,
                      previous=previous.canonical() if previous is not None else None)
        self._act(obs.name, rec, SetServingGate(obs.name, obs.uid, False))
        self._event("Normal", "PodDraining", f"taking pod {obs.name} out of serving to swap its storage backend "
                    f"from {obs.backend.describe()} to {self.target.describe()}", obs.name)

    def _start_restart(self, obs: PodObservation) -> None:
        rec = PodSwap(uid=obs.uid, stage=Stage.DRAINING, since=self.now, acted_at=self.now, purpose="restart")
        self._act(obs.name, rec, SetServingGate(obs.name, obs.uid, False))
        self._event("Normal", "PodDraining", f"taking pod {obs.name} out of serving to restart it with the new "
                    "pod template", obs.name)

    def _restart_now(self, obs: PodObservation) -> None:
        rec = PodSwap(uid=obs.uid, stage=Stage.RESTARTING, since=self.now, acted_at=self.now, purpose="restart")
        self._act(obs.name, rec, DeletePod(obs.name, obs.uid))
        self._event("Normal", "RestartingPod", f"deleting pod {obs.name}, which does not serve, to run the new pod "
                    "template", obs.name)

    def _admit(self, obs: PodObservation) -> None:
        self.actions.append(SetServingGate(obs.name, obs.uid, True))
        self.acted.add(obs.name)

    # ---------------------------------------------------------------- summary

    def _finish(self, live: list[PodObservation]) -> SwapPlan:
        matching = [o for o in live if o.reachable and config_matches(o.backend, self.target)]
        unattached = {o.name: o.start_failure for o in live if o.start_failure and o not in matching
                      and o.name not in self.records}
        mismatched = [o for o in live if o.reachable and not config_matches(o.backend, self.target)
                      and o.name not in unattached]
        unknown = [o for o in live if not o.reachable]
        fleet = self._fleet_size(live)
        swapping = {n for n, r in self.records.items() if r.purpose == "swap"}  # restarts are no swap
        done = sum(1 for o in matching if o.name not in swapping)
        if not self.failed:
            if swapping or mismatched:
                self._in_progress()
            elif not unknown and not self._absent(live) and all(o.available for o in live):
                if self.state.phase is not Phase.COMPLETE and self.prior is not None and not self.state.initial:
                    runs = f"all {len(live)} pods run" if not unattached else \
                        f"{len(live) - len(unattached)} of {len(live)} pods run"
                    self._event("Normal", "BackendSwapComplete", f"{runs} {self.target.describe()}")
                self.state = self.state.model_copy(update={"phase": Phase.COMPLETE})
        backends = sorted({o.backend.backend or "none" for o in live if o.reachable})
        self.state = self.state.model_copy(update={
            "pods": dict(sorted(self.records.items(), key=lambda kv: natural_key(kv[0]))),
            "progress": f"{done}/{fleet}",
            "current_backend": ",".join(backends) or "unknown",
            "unattached": dict(sorted(unattached.items(), key=lambda kv: natural_key(kv[0]))),
        })
        pending = bool(self.records or self.actions or (not self.failed and (mismatched or unknown)))
        return SwapPlan(
            state=self.state,
            actions=self.actions,
            events=self.events,
            conditions=self._conditions(mismatched, unknown, live),
            requeue_after=self.settings.poll_seconds if pending else None,
        )

    def _conditions(self, mismatched, unknown, live) -> list[Condition]:
        state = self.state
        no_failure = condition(SWAP_FAILED, "False", "NoFailure", "")
        if state.phase is Phase.FAILED:
            failure = state.failure or Failure(pod="?", cause="Unknown", message="no failure recorded", at=self.now)
            return [
                condition(SWAP_IN_PROGRESS, "False", "Failed", f"stopped by pod {failure.pod} ({failure.cause})"),
                condition(SWAP_FAILED, "True", failure.cause, f"pod {failure.pod}: {failure.message}"),
            ]
        if state.phase is Phase.COMPLETE and state.unattached:
            return [condition(SWAP_IN_PROGRESS, "False", "StorageUnavailable", clip_message(
                f"not swapped: {', '.join(state.unattached)} could not attach {self.target.backend} when started "
                "and serve from L1+L2")), no_failure]
        if state.phase is Phase.COMPLETE:
            return [condition(SWAP_IN_PROGRESS, "False", "Complete",
                              f"all pods run {self.target.describe()}"), no_failure]
        summary = f"{state.progress} pods run {self.target.backend}"
        if self.records or mismatched:
            busy = ", ".join(f"{n} ({r.stage.value})" for n, r in state.pods.items()) or "none yet"
            return [condition(SWAP_IN_PROGRESS, "True", "Swapping", f"{summary}; in progress: {busy}"), no_failure]
        waiting = [f"{o.name} (runtime: {o.runtime_error or 'no answer'})" for o in unknown]
        waiting += [f"{o.name} (not serving)" for o in live if o.reachable and not o.available]
        absent = self._absent(live)
        if absent:
            waiting.append(f"{absent} absent pod(s)")
        return [condition(SWAP_IN_PROGRESS, "Unknown", "WaitingForPods",
                          clip_message(f"{summary}; waiting for {', '.join(waiting)}")), no_failure]

    # ---------------------------------------------------------------- helpers

    def _fleet_size(self, live: list[PodObservation]) -> int:
        desired = self.settings.desired_replicas
        return desired if desired is not None else len(live)

    def _absent(self, live: list[PodObservation]) -> int:
        """Pods out of serving that no live observation stands for."""
        desired = self.settings.desired_replicas
        if desired is None:
            return len(self.pods) - len(live)
        return max(0, desired - len(live))

    def _in_progress(self) -> None:
        """Swap work found: a first target that needs it is a swap like any other."""
        if self.state.phase is Phase.COMPLETE or self.state.initial:
            self.state = self.state.model_copy(update={"phase": Phase.IN_PROGRESS, "initial": False})
