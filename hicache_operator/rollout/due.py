"""Whether a deployment's swap step is due: read off its status, spec and pods."""

from __future__ import annotations

from typing import Mapping

from hicache_operator.fleet.gate import serving_gate
from hicache_operator.fleet.pods import pod_is_terminating, pod_serves, restart_hash_of


def pending(status: dict | None) -> bool:
    """A swap is in flight: a step is due without any other trigger (drains end, and
    verifications come, without a Kubernetes event)."""
    swap = (status or {}).get("backendSwap") or {}
    return swap.get("phase") == "InProgress" or bool(swap.get("pods"))


def needed(status: dict | None, target_fp: str, router_on: bool, pods: list[dict], restart_hash: str | None = None,
           routes: Mapping[str, tuple[int, int | None]] | None = None) -> bool:
    """Whether a step could do anything: a swap pending, a target (``target_fp``: the storage
    config's fingerprint) the last step did not plan for, a live pod not (or no longer) in
    serving, one to restart (``restart_hash``: the template's, once the StatefulSet carries
    it), or with the router on (``router_on``), a pod whose router
    membership (``routes``: pod IP -> ``routing.membership`` as the last step read it, None
    before the first) may not follow its serving. Otherwise the fleet is settled and the
    observation (a GET per pod) is skipped; the periodic resync still steps regardless, so
    drift nobody reported is found within one interval."""
    swap_state = (status or {}).get("backendSwap")
    if not swap_state or pending(status):
        return True
    if swap_state.get("target") != target_fp:
        return True
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    if any(serving_gate(p) is not True or restart_hash is not None and restart_hash_of(p) != restart_hash
           for p in live):
        return True
    return router_on and not follows(pods, routes)


def follows(pods: list[dict], routes: Mapping[str, tuple[int, int | None]] | None) -> bool:
    """Whether the routers' workers, as last read, are the pods in serving (Ready, label true)."""
    if routes is None:
        return False
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        replicas, routed = routes.get(ip, (0, 0))
        if pod_serves(pod) and not pod_is_terminating(pod):
            if ip not in routes or routed is None or routed < replicas:
                return False
        elif routed != 0:
            return False
    return True
