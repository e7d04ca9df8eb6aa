"""The apply phase's writes: a deployment's children in the order their pods need them, the
router's children removed once the router is off, and a managed Mooncake master the spec no
longer asks for deleted.

Why not all at once: a ClusterIP Service's create allocates an IP, which on a busy API server
took ~10x any other apply; nothing waits for it but the end of the reconcile.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Any, Callable

from hicache_operator.fleet.names import names
from hicache_operator.io.kube import Kube
from hicache_operator.plan import render

FIRST = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding")  # what pods read or need at start
WORKLOADS = ("Deployment", "StatefulSet")  # what starts pods


def first_calls(kube: Kube, children: list[dict[str, Any]]) -> list[Callable[[], Any]]:
    """The applies of ``FIRST``, each an independent call but a RoleBinding, which runs after the
    Role in the same call: the API server checks a binding against the rules of the Role it
    references (the operator may grant only what it holds itself), and refuses one whose Role does
    not exist yet with 404."""
    ordered = ("Role", "RoleBinding")
    rbac = sorted((c for c in children if c["kind"] in ordered), key=lambda c: ordered.index(c["kind"]))
    calls: list[Callable[[], Any]] = [lambda child=child: kube.apply(child) for child in children
                                      if child["kind"] in FIRST and child["kind"] not in ordered]
    if rbac:
        calls.append(lambda: [kube.apply(child) for child in rbac])
    return calls


class Workload:
    """The rest of a started apply: the StatefulSet (after what its pods read, so they never
    start without it; not at all when held) and the wait for the Services and the PDB."""

    def __init__(self, kube: Kube, sts: dict[str, Any], beside: list[Future], hold: bool) -> None:
        self.kube, self.sts, self.beside, self.hold = kube, sts, beside, hold

    def finish(self) -> None:
        try:
            if not self.hold:
                self.kube.apply(self.sts)
        finally:
            wait(self.beside)  # never leave an apply of this reconcile in flight after it
        for f in self.beside:
            f.result()


def start(kube: Kube, children: list[dict[str, Any]], secrets: list[dict[str, Any]], *,
          hold_workload: bool = False) -> tuple[list[str], Workload]:
    """Apply what the pods read or need at start (the ConfigMap, the key ``secrets``, the
    router's ServiceAccount and RBAC: a router that starts without them waits a minute before it
    looks again) while the Services and the PodDisruptionBudget are started beside them, then
    start the Deployments (the router, a managed Mooncake master); returns (the Secrets this
    call created, the ``Workload`` left to finish). ``children``: in render order, the
    StatefulSet last."""
    *others, sts = children
    assert sts["kind"] == "StatefulSet", "render puts the workload last"
    first = first_calls(kube, others)
    beside = [kube.submit(lambda child=child: kube.apply(child)) for child in others
              if child["kind"] not in FIRST + WORKLOADS]
    created: list[str] = []
    for secret in secrets:
        first.append(lambda secret=secret: created.append(secret["metadata"]["name"])
                     if kube.ensure_secret(secret) else None)
    try:
        kube.concurrently(*first)
    except BaseException:
        wait(beside)
        raise
    beside += [kube.submit(lambda child=child: kube.apply(child)) for child in others if child["kind"] in WORKLOADS]
    return created, Workload(kube, sts, beside, hold_workload)


def remove_router(kube: Kube, owner: render.Owner) -> bool:
    """Delete the router's children; whether any was there."""
    return any(kube.concurrently(*(lambda kind=kind, child=child: kube.delete(kind, owner.namespace, child)
                                   for _, kind, child in render.router_children(owner))))


def remove_master(kube: Kube, owner: render.Owner) -> None:
    """Delete the managed Mooncake master's Deployment and Service."""
    n = names(owner.name).mooncake_master
    kube.concurrently(lambda: kube.delete("Deployment", owner.namespace, n),
                      lambda: kube.delete("Service", owner.namespace, n))
