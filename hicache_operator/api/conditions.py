"""Status conditions in the Kubernetes shape, and the one function that sets them.

Every writer of ``status.conditions`` (the derived status, a failed reconcile, a child the API
server refused, the swap planner's two conditions) goes through ``set_conditions``, so
``lastTransitionTime`` and ``observedGeneration`` follow one rule: the time moves only when a
condition's status flips, as apimachinery's ``meta.SetStatusCondition`` does.
"""

from __future__ import annotations

import datetime
from typing import Any, Collection, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Status = Literal["True", "False", "Unknown"]

# The swap planner's two conditions (``rollout.planner``), which the status carries as they are.
SWAP_IN_PROGRESS, SWAP_FAILED = "BackendSwapInProgress", "BackendSwapFailed"


class Condition(BaseModel):
    """A status condition in the Kubernetes shape."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)

    type: str = Field(description="The condition's type, e.g. Ready, Progressing, Degraded.")
    status: Status = Field(description="True, False or Unknown.")
    reason: str = Field(description="Why, in one CamelCase word (docs/operations.md lists each type's reasons).")
    message: str = Field("", description="What is wrong or going on, naming the pods or fields to look at.")
    last_transition_time: str | None = Field(None, description="When the status last flipped (RFC 3339).")
    observed_generation: int | None = Field(None, description="The metadata.generation it was set for.")

    def brief(self) -> dict[str, Any]:
        """{type, status, reason, message}: what decides it, without when it was set."""
        return {"type": self.type, "status": self.status, "reason": self.reason, "message": self.message}


def now() -> str:
    """The time as conditions carry it (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(ctype: str, status: bool | Status, reason: str, message: str = "") -> Condition:
    """A condition; ``status`` True/False or "True"/"False"/"Unknown"."""
    text: Status = ("True" if status else "False") if isinstance(status, bool) else status
    return Condition(type=ctype, status=text, reason=reason, message=message)


def set_conditions(previous: Iterable[dict[str, Any]], new: Iterable[Condition | dict[str, Any]], generation: int,
                   now: str, *, drop: Collection[str] = ()) -> list[dict[str, Any]]:
    """``previous`` with each of ``new`` set in place (a new type is appended): each gets
    ``observedGeneration``, and keeps its ``lastTransitionTime`` unless its status flipped.
    Conditions of a type in ``drop`` that ``new`` does not set are removed (a writer that
    derives all of its conditions names them here); every other condition is kept as it was."""
    wanted = {c.type: c.brief() if isinstance(c, Condition) else dict(c) for c in new}
    out: list[dict[str, Any]] = []
    for old in previous:
        ctype = old.get("type")
        if ctype in wanted:
            out.append(_set(old, wanted.pop(ctype), generation, now))
        elif ctype not in drop:
            out.append(dict(old))
    out += [_set(None, cond, generation, now) for cond in wanted.values()]
    return out


def _set(old: dict[str, Any] | None, cond: dict[str, Any], generation: int, now: str) -> dict[str, Any]:
    flipped = old is None or old.get("status") != cond["status"]
    return {**cond, "observedGeneration": generation,
            "lastTransitionTime": now if flipped else old.get("lastTransitionTime") or now}
