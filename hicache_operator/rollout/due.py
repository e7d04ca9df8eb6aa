"""Whether a deployment's swap step is due: read off its status, spec and pods."""

from __future__ import annotations

from hicache_operator import render
from hicache_operator.pods import restart_hash_of
from hicache_operator.spec import HiCacheDeploymentSpec

from .gate import serving_gate
from .storage_config import storage_fingerprint


def pending(status: dict | None) -> bool:
    """A swap is in flight: a step is due without any other trigger (drains end, and
    verifications come, without a Kubernetes event)."""
    swap = (status or {}).get("backendSwap") or {}
    return swap.get("phase") == "InProgress" or bool(swap.get("pods"))


def needed(status: dict | None, spec: HiCacheDeploymentSpec, pods: list[dict], restart_hash: str | None = None) -> bool:
    """Whether a step could do anything: a swap pending, a target the last step did not plan
    for, a live pod not (or no longer) in serving, or one to restart (``restart_hash``: the
    template's, once the StatefulSet carries it). Otherwise the fleet is settled and the
    observation (a GET per pod) is skipped; the periodic resync still steps regardless, so
    drift nobody reported is found within one interval."""
    swap_state = (status or {}).get("backendSwap")
    if not swap_state or pending(status):
        return True
    if swap_state.get("target") != storage_fingerprint(render.storage_config(spec)):
        return True
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    return any(serving_gate(p) is not True or restart_hash is not None and restart_hash_of(p) != restart_hash
               for p in live)
