"""The swap state persisted in ``status.backendSwap``.

Kept small (one record per pod currently out of serving because of the swap)
and advisory: the planner re-derives every decision from observation, so a
stale copy (the operator died before persisting) only costs a repeated,
idempotent action. The one thing only the state knows is each pod's
``previous`` config — what to restore if its swap fails — which is why a
record is always persisted before its pod's runtime is touched.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, Mapping

from pydantic import AliasChoices, AwareDatetime, BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError
from pydantic.alias_generators import to_camel


class InvalidSwapState(ValueError):
    """status.backendSwap cannot be read (edited by hand, or from an incompatible version)."""


class _StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Stage(str, Enum):
    """Where one pod is in its swap (see the package README for the diagram)."""

    DRAINING = "Draining"  # serving gate False; waiting for endpoint not ready and runtime idle
    SWAPPING = "Swapping"  # drained; detach/attach until the runtime reports the target
    ROLLING_BACK = "RollingBack"  # the swap failed; detach/attach until it reports `previous`
    READMITTING = "Readmitting"  # serving gate True; waiting for the endpoint to be ready again
    RESTARTING = "Restarting"  # drained and deleted, for the new pod template; waiting for it to go


class PodSwap(_StatusModel):
    uid: str
    # read from "step" too: the field's name in records written by earlier releases of the operator
    stage: Stage = Field(validation_alias=AliasChoices("stage", "step"))
    # swap: the L3 backend changes at runtime; restart: the pod is drained, then deleted so it comes
    # back with the current pod template (image, model, engine flags)
    purpose: Literal["swap", "restart"] = "swap"
    since: AwareDatetime  # entered `stage`; the stage's timeout counts from here
    acted_at: AwareDatetime  # last action for this pod; observations not after it are stale
    previous: dict[str, Any] | None = None  # canonical config to restore; None = unknown
    toward: str | None = None  # fingerprint the runtime calls below aimed at
    calls: NonNegativeInt = 0  # detach/attach calls made toward `toward`
    last_call: Literal["detach", "attach"] | None = None
    error: str | None = None  # last runtime call's error, from apply_outcomes
    fatal: bool = False  # that error will not go away by retrying


class Failure(_StatusModel):
    pod: str
    cause: str
    message: str
    at: AwareDatetime


class Phase(str, Enum):
    IN_PROGRESS = "InProgress"
    COMPLETE = "Complete"
    FAILED = "Failed"


class SwapState(_StatusModel):
    phase: Phase
    target: str  # storage_fingerprint of the target this rollout converges to
    target_backend: str
    current_backend: str = "unknown"  # backends pods report, comma-joined
    progress: str = "0/0"  # pods on the target / fleet size
    started_at: AwareDatetime
    failure: Failure | None = None
    pods: dict[str, PodSwap] = Field(default_factory=dict)
    # The fleet's first target: pods start on it from their command line, so there is no swap to
    # report complete, unless one turns out to be needed (then this is cleared).
    initial: bool = False
    # Pods started on the target that could not attach it (pod -> the runtime's reason): they
    # serve from L1+L2 and are not swapped (see ``PodObservation.start_failure``).
    unattached: dict[str, str] = Field(default_factory=dict)

    def to_status(self) -> dict[str, Any]:
        """JSON-ready camelCase dict for ``status.backendSwap``."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | SwapState | None) -> SwapState | None:
        """Parse ``status.backendSwap``; raises InvalidSwapState on garbage."""
        if raw is None or isinstance(raw, SwapState):
            return raw
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise InvalidSwapState(f"status.backendSwap is unreadable: {exc.error_count()} problem(s), first: "
                                   f"{_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
    return f"{where}: {err.get('msg')}"
