"""Which pods to delete so they come back with the current pod template (OnDelete StatefulSet).

Only non-storage changes restart pods (the restart hash leaves the storage config out). Pods
out of serving for any reason share one budget, ``maxUnavailable``, with backend swaps: a pod
whose serving gate is False (being swapped) is never deleted and counts as unavailable.
"""

from __future__ import annotations

from hicache_operator import labels
from hicache_operator.pods import pod_is_ready, pod_is_terminating
from hicache_operator.spec import resolve_max_unavailable

from .gate import is_held


def _ordinal(pod: dict) -> int:
    name = (pod.get("metadata") or {}).get("name", "")
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _annotations(pod: dict) -> dict:
    return (pod.get("metadata") or {}).get("annotations") or {}


def restart_hash_of(pod: dict) -> str | None:
    return _annotations(pod).get(labels.RESTART_HASH)


def plan_restarts(pods: list[dict], restart_hash: str, max_unavailable: int | str, replicas: int) -> list[str]:
    """Names of pods to delete now, highest ordinal first.

    Stale pods that are already unavailable are deleted regardless of the budget (it costs
    nothing); stale Ready pods only while fewer than maxUnavailable pods are out of serving
    (missing, terminating, not Ready, or held).
    """
    budget = resolve_max_unavailable(max_unavailable, replicas)
    live = [p for p in pods if not pod_is_terminating(p)]
    unavailable = max(0, replicas - len(live)) + sum(
        1 for p in live if not pod_is_ready(p) or is_held(p))
    stale = sorted((p for p in live if restart_hash_of(p) != restart_hash and not is_held(p)),
                   key=_ordinal, reverse=True)
    out = [p["metadata"]["name"] for p in stale if not pod_is_ready(p)]
    for pod in stale:
        if pod_is_ready(pod) and unavailable < budget:
            out.append(pod["metadata"]["name"])
            unavailable += 1
    return out
