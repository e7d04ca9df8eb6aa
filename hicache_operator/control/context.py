"""What a reconcile is given: the ``Context`` every reconcile shares and the ``Observation`` of
one deployment, taken when its key is taken."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

import kopf

from hicache_operator.api.conditions import now
from hicache_operator.control.informers import Informers, Key
from hicache_operator.io.kube import Kube
from hicache_operator.rollout import act


def post_event(body: dict, type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message)


@dataclass(frozen=True)
class Context:
    """What every reconcile shares: the API client, the watches' caches (read, and refreshed by
    the status write), the swap executor (None: no swap step), the clock, the Event poster."""

    kube: Kube
    informers: Informers = field(default_factory=Informers)
    swapper: act.Swapper | None = None
    clock: Callable[[], str] = now
    process_backed: bool = False  # every fleet's pods run as processes (the local test cluster)
    new_key: Callable[[], str] = lambda: secrets.token_urlsafe(32)
    post: Callable[[dict, str, str, str], None] = post_event


@dataclass(frozen=True)
class Observation:
    """One deployment as the watches show it when its key is taken. ``pods``: None to list
    them; ``master``: the managed master's Deployment (``informers.master_essence``), None when
    there is none; ``failing``: the last reconcile of this generation failed; ``waited``: how
    long the request queued."""

    key: Key
    body: dict[str, Any]
    trigger: str = "resync"
    apply: bool = True
    nodes: list[dict] | None = None
    pods: list[dict] | None = None
    master: dict[str, Any] | None = None
    router_pods: list[dict] = field(default_factory=list)
    failing: bool = False
    waited: float = 0.0

    @property
    def previous(self) -> dict[str, Any]:
        return self.body.get("status") or {}

    @property
    def generation(self) -> int:
        return int(self.body["metadata"].get("generation") or 0)

    @property
    def post_findings(self) -> bool:
        """The generation is new to the status: its validation findings are posted."""
        return self.previous.get("observedGeneration") != self.body["metadata"].get("generation")

    @property
    def why(self) -> str:
        return f"{self.trigger} waited={self.waited:.3f}"
