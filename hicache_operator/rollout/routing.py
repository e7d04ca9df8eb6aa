"""Router membership: which of a fleet's pods its router sends requests to, read off each router
pod's worker list.

sglang-router 0.3.2 discovers workers by watching every pod of the namespace and filtering on its
``--selector`` itself (``sgl-model-gateway/src/service_discovery.rs``): it adds a pod that
matches and is Ready and Running, and removes one only when the pod gets a deletion timestamp
while it still matches. A pod whose serving label turns ``false`` no longer matches, so its
events are dropped and it stays a worker; one that turns not Ready stays a worker too (the
router's own health checks take minutes). So the operator keeps each router's workers equal
to the pods in serving through the router's worker API (``act/router_client``): a pod leaves
the routers before its runtime is touched or it is deleted, and joins them again when it is
back in serving (``planner``).

A router pod whose list could not be read counts as "maybe routing" only while it is Ready (the
kubelet reaches it): one that is starting or crashed has or will have only the pods its own
discovery finds, which are the pods in serving.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_operator.api.flags import RUNTIME_PORT


def worker_url(ip: str) -> str:
    """A pod's URL as the router's discovery writes it (``--service-discovery-port``)."""
    return f"http://{ip}:{RUNTIME_PORT}"


@dataclass(frozen=True)
class RouterRead:
    """One router pod's worker list: ``listed`` the worker URLs (None: the read failed),
    ``ready`` whether the router pod was Ready."""

    router: str
    listed: frozenset[str] | None
    ready: bool

    @property
    def counts(self) -> bool:
        """Whether this router pod may route: its list was read, or it is Ready."""
        return self.listed is not None or self.ready


def membership(ip: str | None, reads: list[RouterRead]) -> tuple[int, int | None]:
    """(router pods that may route, how many of them list the pod; None when one of them could
    not be read). A pod without an IP is in no list."""
    counted = [r for r in reads if r.counts]
    if ip is None:
        return len(counted), 0
    url = worker_url(ip)
    if any(r.listed is None for r in counted):
        return len(counted), None
    return len(counted), sum(1 for r in counted if url in (r.listed or ()))
