"""What the status reads from one pod: Ready, running, terminating, why it is unavailable.

Pure functions of a pod as the watch shows it (``handlers.pod_essence``), shared by the status
(``status.derive``) and the restart planner.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hicache_operator.api import labels
from hicache_operator.fleet import gate


def pod_is_ready(pod: dict) -> bool:
    return _pod_condition(pod, "Ready") == "True"


def pod_serves(pod: dict) -> bool:
    """Ready and in serving (not taken out by the swap planner): the client Service routes to it."""
    return pod_is_ready(pod) and not gate.is_held(pod)


def pod_runs(pod: dict) -> bool:
    """The pod's runtime is up (Running, every container started: its startup probe passed), so
    it runs a storage config; a Pending or still-starting pod runs none yet."""
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    return status.get("phase") == "Running" and bool(containers) and all(cs.get("started") is True for cs in containers)


STILL_CREATING = {"ContainerCreating", "PodInitializing"}  # waiting reasons that are no fault


def unavailable_reason(pod: dict) -> str | None:
    """Why a pod that does not serve counts against the fleet, or None while it is starting for
    the first time (pending, startup probe not passed yet: the kubelet's ``started``, not yet
    admitted to serving, or started and not ready once since). Loading a model takes minutes,
    and that is progress, not a degraded fleet; a pod that cannot start, crashed, cannot be
    scheduled, was ready and failed, or is held out of serving is a problem."""
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    for prefix, statuses in (("Init:", status.get("initContainerStatuses") or []), ("", containers)):
        for cs in statuses:
            waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
            if waiting and waiting not in STILL_CREATING:
                # ImagePullBackOff, CreateContainerConfigError, CrashLoopBackOff (with the last line
                # the crashed container wrote: the runtime's one-line reason for a bad checkpoint,
                # the model download's for a repo it cannot fetch)
                why = _last_line(((cs.get("lastState") or {}).get("terminated") or {}).get("message"))
                return f"{prefix}{waiting}: {why}" if why else f"{prefix}{waiting}"
    restarts = sum(cs.get("restartCount") or 0 for cs in containers)
    if restarts:  # back from a crash, or ready since and failing now
        if any(cs.get("started") is False for cs in containers) or _unready_since_start(pod, containers):
            return f"restarted {restarts} time(s)"
        return f"not ready (earlier restarts: {restarts})"
    if _pod_condition(pod, "PodScheduled") == "False":
        return "Unschedulable"
    if status.get("phase") == "Pending" or any(cs.get("started") is False for cs in containers):
        return None
    if gate.is_held(pod):
        return f"held out of serving ({gate.LABEL}=false)"
    if gate.serving_gate(pod) is None:
        return None  # not admitted to serving yet: the operator sets the label on first sight
    return None if pod_is_ready(pod) or _unready_since_start(pod, containers) else "not ready"


def _last_line(text: Any, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


def _unready_since_start(pod: dict, containers: list[dict]) -> bool:
    """Started, and not ready once since: its first readiness probes are still to come. The
    kubelet moves ContainersReady's lastTransitionTime only when it flips, so a False dating from
    before the containers started has not been True since (one that failed later is newer)."""
    cond = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "ContainersReady"),
                None)
    started = [((cs.get("state") or {}).get("running") or {}).get("startedAt") for cs in containers]
    if cond is None or cond.get("status") != "False" or not cond.get("lastTransitionTime") \
            or not started or None in started:
        return False
    return _when(cond["lastTransitionTime"]) <= min(_when(t) for t in started)


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def init_running(pod: dict, container: str) -> bool:
    """The pod's init container ``container`` runs now (e.g. the model download)."""
    return any(cs.get("name") == container and (cs.get("state") or {}).get("running") is not None
               for cs in (pod.get("status") or {}).get("initContainerStatuses") or [])


def pod_is_terminating(pod: dict) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _pod_condition(pod: dict, ctype: str) -> str | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond.get("status")
    return None


def annotation(pod: dict, key: str) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(key)


def restart_hash_of(pod: dict) -> str | None:
    """The hash of the pod template the pod was created from (everything but storage)."""
    return annotation(pod, labels.RESTART_HASH)
