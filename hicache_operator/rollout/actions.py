"""What one planning step asks the operator to do, and how the results flow
back into the state before it is persisted.

Every action names the pod's uid: the executor must act only if the pod with
that name still has that uid (a StatefulSet reuses names), e.g. with a
``metadata.uid`` precondition on the status patch. A step holds at most one
action per pod, so actions may run in any order or concurrently. Every action
is idempotent (setting a condition to what it is, attaching the backend that
is attached — SGLang answers "policies updated" — detaching when detached).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, Union

from hicache_operator.api.conditions import Condition

from .state import SwapState
from hicache_operator.fleet.storage_config import clip_message

@dataclass(frozen=True)
class SetServingGate:
    """Set the pod's ``hicache.dev/serving`` label (``gate``): in serving or out.

    ``runs``: on a readmission, the storage config (canonical dict) the
    runtime was just seen running, for the pod's storage annotations; None
    when not known or unchanged by the rollout (a new pod keeps its
    template's)."""

    pod: str
    uid: str
    serving: bool
    runs: dict[str, Any] | None = None


@dataclass(frozen=True)
class SetRouted:
    """Add the pod to (``routed``) or remove it from every router pod's workers, and return once
    their lists show it (``routing``)."""

    pod: str
    uid: str
    routed: bool


@dataclass(frozen=True)
class Detach:
    """``DELETE /hicache/storage-backend`` on the pod's runtime."""

    pod: str
    uid: str


@dataclass(frozen=True)
class Attach:
    """``PUT /hicache/storage-backend`` with ``payload`` (never has a hostname)."""

    pod: str
    uid: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class DeletePod:
    """Delete the pod (uid precondition), so its StatefulSet creates it again from the current
    template: a restart, made only once the pod is drained."""

    pod: str
    uid: str


Action = Union[SetServingGate, SetRouted, Detach, Attach, DeletePod]


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    pod: str | None = None


@dataclass
class SwapPlan:
    """One step: persist ``state`` (after ``apply_outcomes``), run
    ``actions``, post ``events``, set ``conditions``, and plan again after
    ``requeue_after`` seconds (None: nothing is pending)."""

    state: SwapState
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    requeue_after: float | None = None


@dataclass(frozen=True)
class ActionOutcome:
    """How one action went. ``retryable=False`` marks an error that another
    try will not fix (the runtime refused the config, bad credentials)."""

    action: Action
    error: str | None = None
    retryable: bool = True

    @classmethod
    def failed(cls, action: Action, exc: BaseException) -> ActionOutcome:
        """From an exception; runtime_client errors carry ``retryable``."""
        return cls(action, error=str(exc) or type(exc).__name__, retryable=getattr(exc, "retryable", True))


def apply_outcomes(state: SwapState, outcomes: Sequence[ActionOutcome]) -> SwapState:
    """Record runtime-call errors on their pods' records so the next step can
    name the cause (and give up at once on a fatal one). Gate and router
    failures need no record: the next observation still shows the old gate or
    worker list and the step is planned again. Losing this (a crash before persisting) only delays the
    diagnosis; the planner retries and learns the error anew."""
    pods = dict(state.pods)
    for outcome in outcomes:
        action = outcome.action
        record = pods.get(action.pod)
        if outcome.error is None or isinstance(action, (SetServingGate, SetRouted)) or record is None \
                or record.uid != action.uid:
            continue
        pods[action.pod] = record.model_copy(
            update={"error": clip_message(outcome.error), "fatal": not outcome.retryable}
        )
    return state.model_copy(update={"pods": pods})
