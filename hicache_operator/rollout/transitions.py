"""What happens to a pod that has a swap record: one method per stage of the diagram in
``planner`` (Draining, Swapping, RollingBack, Readmitting, Restarting), and the record helpers
they and the planner share. ``RecordTransitions`` is the half of the planner that moves one
record; ``planner._Planner`` adds the fleet (new pods, the budget, the summary).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping

from hicache_operator.fleet.storage_config import (StorageConfig, attach_payload, clip_message, config_matches,
                                                   storage_fingerprint, updatable_in_place)

from .actions import Action, Attach, DeletePod, Detach, Event, SetRouted, SetServingGate
from .observation import PodObservation, RolloutSettings
from .state import Failure, Phase, PodSwap, Stage, SwapState

_MAX_TRANSITIONS = 5  # longest chain in one step: Draining->Swapping->RollingBack->Readmitting


@dataclass(frozen=True)
class _Fail:
    cause: str
    message: str


_DONE, _WAIT, _ACTED = "done", "wait", "acted"


class RecordTransitions:
    """One step's moves of the records (``_advance``); the planner sets the state below."""

    now: datetime
    target: StorageConfig
    target_fp: str
    settings: RolloutSettings
    pods: dict[str, PodObservation]
    state: SwapState
    records: dict[str, PodSwap]
    actions: list[Action]
    events: list[Event]
    acted: set[str]

    @property
    def failed(self) -> bool:
        return self.state.phase is Phase.FAILED

    def _advance(self, name: str) -> None:
        rec = self.records[name]
        obs = self.pods.get(name)
        if obs is None or not obs.live or obs.uid != rec.uid:
            del self.records[name]
            if rec.stage is Stage.RESTARTING:
                self._event("Normal", "PodRestarted", f"pod {name} was deleted to run the new pod template; "
                            "the StatefulSet creates it again", name)
                return
            why = "disappeared" if obs is None else "is terminating" if not obs.live else "was replaced (new uid)"
            what = "restart" if rec.purpose == "restart" else "backend swap"
            self._event("Normal", "PodLeftSwap", f"pod {name} {why} during its {what} ({rec.stage.value}); "
                        "a replacement is judged afresh", name)
            return
        if rec.stage is not Stage.READMITTING and self._fresh(obs, rec) and obs.available:
            # Serving, so settled: the record predates a readmission whose
            # state was never persisted. Taking the pod out again must
            # compete for the budget like any other pod, so forget it.
            del self.records[name]
            return
        handlers = {
            Stage.DRAINING: self._draining,
            Stage.SWAPPING: self._swapping,
            Stage.ROLLING_BACK: self._rolling_back,
            Stage.READMITTING: self._readmitting,
            Stage.RESTARTING: self._restarting,
        }
        for _ in range(_MAX_TRANSITIONS):
            rec = self.records.get(name)
            if rec is None or not handlers[rec.stage](name, rec, obs):
                return

    def _draining(self, name: str, rec: PodSwap, obs: PodObservation) -> bool:
        fresh = self._fresh(obs, rec)
        if rec.purpose == "restart":
            return self._draining_for_restart(name, rec, obs, fresh)
        if self.failed:
            self._event("Normal", "PodSwapAborted", f"rollout stopped; returning pod {name} to serving", name)
            self._set(name, self._moved(rec, Stage.ROLLING_BACK))
            return True
        if fresh and obs.reachable and config_matches(obs.backend, self.target):
            self._set(name, self._moved(rec, Stage.READMITTING))
            return True
        if fresh and obs.serving_gate is False and obs.endpoint_ready is not True and obs.unrouted and obs.reachable \
                and obs.idle:
            self._set(name, self._moved(rec, Stage.SWAPPING))
            return True
        if self._timed_out(rec):
            self._fail(name, "DrainTimeout", f"not drained after {self._elapsed(rec):.0f}s: {self._blockers(obs, fresh)}")
            return True
        self._take_out(name, rec, obs, fresh)
        return False

    def _take_out(self, name: str, rec: PodSwap, obs: PodObservation, fresh: bool) -> None:
        """Out of serving: the label first, then off the routers."""
        if fresh and obs.serving_gate is not False:
            self._act(name, rec, SetServingGate(name, rec.uid, False))
        elif obs.serving_gate is False and not obs.unrouted:
            self._act(name, rec, SetRouted(name, rec.uid, False))

    def _draining_for_restart(self, name: str, rec: PodSwap, obs: PodObservation, fresh: bool) -> bool:
        """Delete the pod once drained (out of serving, off every router, idle), or when the drain
        times out. A runtime that does not answer is not taken as drained: a read that timed out
        may hide requests still running."""
        out = obs.serving_gate is False and obs.endpoint_ready is not True and obs.unrouted
        if fresh and out and obs.reachable and obs.idle:
            self._delete(name, rec)
            return False
        if self._timed_out(rec):
            self._event("Warning", "DrainTimeout", f"pod {name} not drained after {self._elapsed(rec):.0f}s "
                        f"({self._blockers(obs, fresh)}); restarting it anyway", name)
            self._delete(name, rec)
            return False
        self._take_out(name, rec, obs, fresh)
        return False

    def _restarting(self, name: str, rec: PodSwap, obs: PodObservation) -> bool:
        """Deleted, yet seen alive after the deletion (the call failed): delete it again."""
        if self._fresh(obs, rec):
            self._act(name, rec, DeletePod(name, rec.uid))
        return False

    def _delete(self, name: str, rec: PodSwap) -> None:
        self._act(name, self._moved(rec, Stage.RESTARTING), DeletePod(name, rec.uid))

    def _swapping(self, name: str, rec: PodSwap, obs: PodObservation) -> bool:
        result = self._converge(name, obs, self.target, self.target_fp)
        if result == _DONE:
            self._event("Normal", "PodSwapped", f"pod {name} now runs {self.target.describe()}; readmitting it", name)
            self._set(name, self._moved(self.records[name], Stage.READMITTING))
            return True
        if isinstance(result, _Fail):
            self._fail(name, result.cause, result.message)
            return True
        return False

    def _rolling_back(self, name: str, rec: PodSwap, obs: PodObservation) -> bool:
        previous = config_or_none(rec.previous)
        if previous is None:
            self._event("Warning", "RollbackSkipped", f"previous storage config of pod {name} is unknown; "
                        "readmitting it as it is", name)
            self._set(name, self._moved(rec, Stage.READMITTING))
            return True
        result = self._converge(name, obs, previous, storage_fingerprint(previous))
        if result == _DONE:
            self._event("Normal", "PodRolledBack", f"pod {name} runs {previous.describe()} again; readmitting it", name)
        elif isinstance(result, _Fail):
            reported = obs.backend.describe() if obs.reachable else "unknown (runtime unreachable)"
            message = clip_message(f"could not restore {previous.describe()} on pod {name} ({result.cause}: "
                                   f"{result.message}); readmitting it with {reported}")
            self._event("Warning", "RollbackFailed", message, name)
            if self.state.failure is not None and self.state.failure.pod == name:
                failure = self.state.failure.model_copy(
                    update={"message": clip_message(f"{self.state.failure.message}; rollback failed: {result.message}")})
                self.state = self.state.model_copy(update={"failure": failure})
        else:
            return False
        self._set(name, self._moved(self.records[name], Stage.READMITTING))
        return True

    def _readmitting(self, name: str, rec: PodSwap, obs: PodObservation) -> bool:
        if obs.serving_gate is True and obs.endpoint_ready is True and obs.ready is not False:
            if obs.fully_routed:
                # Back in serving. All of it comes from the watches and the routers, not the
                # runtime, so this needs no runtime read newer than the readmission (the operator
                # reuses the verify step's).
                del self.records[name]
            elif self._timed_out(rec):
                del self.records[name]
                self._event("Warning", "PodNotRouted", f"pod {name} is back in serving but not a worker of every "
                            f"router pod after {self._elapsed(rec):.0f}s ({self._blockers(obs, True)})", name)
            else:  # the routers follow the Service: the pod joins them once its endpoint is ready
                self._act(name, rec, SetRouted(name, rec.uid, True))
            return False
        if not self._fresh(obs, rec):
            return False
        if obs.serving_gate is not True:
            self._act(name, rec, SetServingGate(name, rec.uid, True, runs=runs_of(obs)))
        elif self._timed_out(rec):
            del self.records[name]
            self._event("Warning", "PodNotReady", f"pod {name} is back in serving but its endpoint is still not "
                        f"ready after {self._elapsed(rec):.0f}s; it counts as unavailable until it is", name)
        return False

    def _converge(self, name: str, obs: PodObservation, want: StorageConfig, want_fp: str):
        """One runtime call toward ``want``, or a verdict. Returns _DONE,
        _WAIT, _ACTED or a _Fail."""
        rec = self.records[name]
        if rec.toward != want_fp:
            rec = rec.model_copy(update={"toward": want_fp, "calls": 0, "last_call": None, "error": None,
                                         "fatal": False, "since": self.now})
            self._set(name, rec)
        if not self._fresh(obs, rec):
            return _Fail("StepTimeout", "no fresh observation of the pod") if self._timed_out(rec) else _WAIT
        if not obs.reachable:
            if self._timed_out(rec):
                return _Fail("RuntimeUnreachable", f"runtime unreachable for {self._elapsed(rec):.0f}s: "
                             f"{obs.runtime_error or 'no answer'}")
            return _WAIT
        reported = obs.backend
        if config_matches(reported, want):
            return _DONE
        cause = "AttachFailed" if rec.last_call == "attach" else "DetachFailed"
        if rec.fatal:
            return _Fail(cause, rec.error or "refused")
        if rec.last_call == "attach" and rec.error is None and reported.backend is not None:
            return _Fail("VerifyMismatch", f"after attach the runtime reports {reported.describe()}, "
                         f"expected {want.describe()}")
        # Never touch a runtime that is routable or busy (a stale record may
        # meet a pod that went back into serving).
        if obs.serving_gate is not False or obs.endpoint_ready is True or not obs.unrouted or not obs.idle:
            if self._timed_out(rec):
                return _Fail("DrainTimeout", f"not drained after {self._elapsed(rec):.0f}s: "
                             f"{self._blockers(obs, True)}")
            if obs.serving_gate is not False or not obs.unrouted:
                self._take_out(name, rec, obs, True)
                return _ACTED
            return _WAIT
        if rec.calls >= self.settings.max_runtime_calls:
            detail = f": {rec.error}" if rec.error else ""
            return _Fail(cause, f"runtime still reports {reported.describe()} after {rec.calls} calls{detail}")
        if reported.backend is not None and not updatable_in_place(reported, want):
            action: Action = Detach(name, rec.uid)
            call = "detach"
        else:
            action = Attach(name, rec.uid, attach_payload(want))
            call = "attach"
        self._act(name, rec, action, calls=rec.calls + 1, last_call=call, error=None, fatal=False)
        return _ACTED

    def _fail(self, name: str, cause: str, message: str) -> None:
        rec = self.records[name]
        previous = config_or_none(rec.previous)
        back_to = previous.describe() if previous is not None else "its previous config (unknown)"
        if self.failed:
            self._event("Warning", "PodSwapFailed", clip_message(f"pod {name}: {cause}: {message}"), name)
        else:
            self.state = self.state.model_copy(update={
                "phase": Phase.FAILED,
                "failure": Failure(pod=name, cause=cause, message=clip_message(message), at=self.now),
            })
            self._event("Warning", "BackendSwapFailed", clip_message(
                f"pod {name}: {cause}: {message}; restoring {back_to}. The rollout stops until the storage target "
                "changes"), name)
        self._set(name, self._moved(rec, Stage.ROLLING_BACK))

    def _fresh(self, obs: PodObservation, rec: PodSwap) -> bool:
        return obs.observed_at > rec.acted_at

    def _elapsed(self, rec: PodSwap) -> float:
        return (self.now - rec.since).total_seconds()

    def _timed_out(self, rec: PodSwap) -> bool:
        return self._elapsed(rec) > self.settings.drain_timeout_seconds

    def _moved(self, rec: PodSwap, stage: Stage) -> PodSwap:
        return rec.model_copy(update={"stage": stage, "since": self.now, "toward": None, "calls": 0,
                                      "last_call": None, "error": None, "fatal": False})

    def _set(self, name: str, rec: PodSwap) -> None:
        self.records[name] = rec

    def _act(self, name: str, rec: PodSwap, action: Action, **updates: Any) -> None:
        self.records[name] = rec.model_copy(update={"acted_at": self.now, **updates})
        self.actions.append(action)
        self.acted.add(name)

    def _event(self, type_: str, reason: str, message: str, pod: str | None = None) -> None:
        self.events.append(Event(type_, reason, message, pod))

    def _blockers(self, obs: PodObservation, fresh: bool) -> str:
        # Gate and endpoint come from the watches and are current either way; the operator
        # does not read the runtime of a pod whose endpoint is still ready (nothing could be
        # decided from it), so a stale runtime read is common and not the cause.
        why = []
        if obs.serving_gate is not False:
            why.append("serving gate not yet False")
        if obs.endpoint_ready is True:
            why.append("endpoint still ready")
        if not obs.unrouted:
            why.append("router workers unknown" if obs.routed_by is None else
                       f"still a worker of {obs.routed_by} router pod(s)")
        if not fresh:
            if not why:
                why.append("no fresh observation of the pod")
        elif not obs.reachable:
            why.append(f"runtime unreachable ({obs.runtime_error or 'no answer'})")
        elif not obs.idle:
            running = "?" if obs.in_flight is None else obs.in_flight
            queued = "?" if obs.queued is None else obs.queued
            why.append(f"{running} running, {queued} queued")
        return ", ".join(why)


def config_or_none(raw: Mapping[str, Any] | None) -> StorageConfig | None:
    if raw is None:
        return None
    try:
        return StorageConfig.model_validate(raw)
    except ValueError:
        return None


def runs_of(obs: PodObservation) -> dict[str, Any] | None:
    config = obs.backend.to_config() if obs.reachable else None
    return config.canonical() if config is not None else None
