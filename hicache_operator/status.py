"""HiCacheDeployment.status: its model (for the CRD) and the pure function that computes it.

The status is derived from what the operator decided (``Desired``) and what it observes (the
StatefulSet and the pods), never from memory of what it did, so a restarted operator writes the
same status. ``backendSwap`` belongs to the rollout module and is never written here; condition
types this module does not own are carried over untouched.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from hicache_operator import labels

OWN_CONDITIONS = ("ConfigValid", "Ready", "Progressing", "Degraded")


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class HiCacheDeploymentStatus(_Model):
    observed_generation: int | None = None
    replicas: int | None = Field(None, description="Pods that exist.")
    ready_replicas: int | None = Field(None, description="Pods that are Ready (containers and the serving gate).")
    ready: str | None = Field(None, description="readyReplicas/spec.replicas, for the READY column.")
    selector: str | None = Field(None, description="Pod label selector (scale subresource).")
    conditions: list[Condition] = Field(default_factory=list)
    effective_config: dict[str, Any] | None = Field(
        None, description="The configuration after normalisation, the rendered arguments, and every rule applied.")
    sizing: dict[str, Any] | None = Field(None, description="Host pool sizing arithmetic.")
    host_pool: str | None = Field(None, description="Host pool per rank, for the HOST-POOL column.")
    current_backend: str | None = Field(None, description="L3 backend most pods run now.")
    target_backend: str | None = Field(None, description="L3 backend the spec asks for.")
    swap_progress: str | None = Field(None, description="Pods on the target storage config / pods.")
    backend_swap: dict[str, Any] | None = Field(None, description="Backend swap state, owned by the rollout module.")


@dataclass(frozen=True)
class Desired:
    """What the operator rendered for the current spec."""

    replicas: int
    selector: str
    restart_hash: str
    storage_hash: str
    backend: str
    host_pool: str
    effective_config: dict[str, Any]
    sizing: dict[str, Any] | None


def pod_is_ready(pod: dict) -> bool:
    return _pod_condition(pod, "Ready") == "True"


STILL_CREATING = {"ContainerCreating", "PodInitializing"}  # waiting reasons that are no fault


def unavailable_reason(pod: dict) -> str | None:
    """Why a pod that is not Ready counts against the fleet, or None while it is starting for
    the first time (pending, startup probe not passed yet: the kubelet's ``started``, not yet
    admitted to serving, or started and not ready once since) or being readmitted (containers
    ready, gate True, Ready not yet recomputed: the end of every swap). Loading a model takes
    minutes, and that is progress, not a degraded fleet; a pod that cannot start, crashed, cannot
    be scheduled, was ready and failed, or is held out of serving is a problem."""
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    for cs in containers:
        waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
        if waiting and waiting not in STILL_CREATING:
            # ImagePullBackOff, CreateContainerConfigError, CrashLoopBackOff (with the last line
            # the crashed container wrote: the runtime's one-line reason for a bad checkpoint)
            why = _last_line(((cs.get("lastState") or {}).get("terminated") or {}).get("message"))
            return f"{waiting}: {why}" if why else waiting
    restarts = sum(cs.get("restartCount") or 0 for cs in containers)
    if restarts:  # back from a crash, or ready since and failing now
        if any(cs.get("started") is False for cs in containers) or _unready_since_start(pod, containers):
            return f"restarted {restarts} time(s)"
        return f"not ready (earlier restarts: {restarts})"
    if _pod_condition(pod, "PodScheduled") == "False":
        return "Unschedulable"
    if status.get("phase") == "Pending" or any(cs.get("started") is False for cs in containers):
        return None
    gate = _pod_condition(pod, labels.SERVING_CONDITION)
    if gate is None:
        return None  # not admitted to serving yet: the operator sets the gate on first sight
    if _pod_condition(pod, "ContainersReady") == "True":
        # its containers are ready and Ready waits on the serving gate: just readmitted (the
        # kubelet has yet to recompute Ready), or held out of serving
        return None if gate == "True" else "held out of serving (hicache.dev/serving False)"
    return None if _unready_since_start(pod, containers) else "not ready"


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


def pod_is_terminating(pod: dict) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _pod_condition(pod: dict, ctype: str) -> str | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond.get("status")
    return None


def _annotation(pod: dict, key: str) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(key)


def swap_view(pods: list[dict], target_hash: str, target_backend: str, previous_backend: str | None) -> tuple[str, str]:
    """(currentBackend, swapProgress) from the storage annotations the pods carry."""
    live = [p for p in pods if not pod_is_terminating(p)]
    behind = [p for p in live if _annotation(p, labels.STORAGE_HASH) != target_hash]
    progress = f"{len(live) - len(behind)}/{len(live)}"
    if not behind:
        return target_backend, progress
    counts = Counter(_annotation(p, labels.STORAGE_BACKEND) or previous_backend or "unknown" for p in behind)
    return counts.most_common(1)[0][0], progress


def build_status(*, generation: int, previous: dict | None, desired: Desired | None,
                 errors: list[tuple[str, str]], pods: list[dict], degraded: list[tuple[str, str]],
                 now: str) -> dict[str, Any]:
    """The status patch for one reconcile (camelCase dict, without backendSwap).

    ``desired`` is None when the spec is invalid: the conditions say so and the rest describes
    the pods still running from the last valid spec. ``degraded`` lists (reason, message) of
    problems found outside the pods (e.g. the sizing no longer fits, the admin Secret is missing).
    """
    previous = previous or {}
    live = [p for p in pods if not pod_is_terminating(p)]
    ready = sum(1 for p in live if pod_is_ready(p))
    unready = {p["metadata"]["name"]: unavailable_reason(p) for p in live if not pod_is_ready(p)}
    starting = sum(1 for why in unready.values() if why is None)
    replicas = desired.replicas if desired else int(previous.get("replicas") or len(live))
    out: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": len(live),
        "readyReplicas": ready,
        "ready": f"{ready}/{replicas}",
    }
    conds: list[dict[str, Any]] = []
    if errors:
        conds.append(_cond("ConfigValid", False, errors[0][0], "; ".join(f"{r}: {m}" for r, m in errors)))
    else:
        notes = (desired.effective_config.get("normalisations") or []) if desired else []
        msg = f"{len(notes)} normalisation(s) applied, see status.effectiveConfig" if notes else "spec is valid"
        conds.append(_cond("ConfigValid", True, "Valid", msg))

    progressing: tuple[str, str] | None = None
    if desired:
        out.update(selector=desired.selector, hostPool=desired.host_pool, targetBackend=desired.backend,
                   effectiveConfig=desired.effective_config)
        if desired.sizing is not None:
            out["sizing"] = desired.sizing
        current, progress = swap_view(live, desired.storage_hash, desired.backend, previous.get("currentBackend"))
        out.update(currentBackend=current, swapProgress=progress)
        stale = [p for p in live if _annotation(p, labels.RESTART_HASH) != desired.restart_hash]
        behind = sum(1 for p in live if _annotation(p, labels.STORAGE_HASH) != desired.storage_hash)
        terminating = len(pods) - len(live)
        if stale:
            progressing = ("RollingRestart", f"{len(stale)} of {len(live)} pod(s) run an older pod template")
        elif terminating:
            progressing = ("PodsTerminating", f"{terminating} pod(s) terminating")
        elif len(live) != desired.replicas:
            progressing = ("Scaling", f"{len(live)} pod(s), want {desired.replicas}")
        elif behind:
            progressing = ("BackendSwap", f"{progress} pod(s) on the target storage config ({desired.backend})")
        elif starting:
            progressing = ("PodsStarting", f"{starting} of {len(live)} pod(s) starting")
    conds.append(_cond("Progressing", progressing is not None, *(progressing or ("Reconciled", "pods match the spec"))))

    problem = degraded[0] if degraded else None
    settled = progressing is None or progressing[0] == "PodsStarting"
    if problem is None and settled and ready + starting < replicas:
        problem = ("ReplicasUnavailable", _unavailable_message(ready, replicas, starting, unready))
    if problem:
        message = "; ".join(m for _, m in degraded) if degraded else problem[1]
        conds.append(_cond("Degraded", True, problem[0], message))
    else:
        conds.append(_cond("Degraded", False, "AsExpected", "no problems found"))

    all_ready = ready >= replicas and len(live) == len(pods)
    conds.append(_cond("Ready", all_ready, "AllReplicasReady" if all_ready else "ReplicasNotReady",
                       f"{ready}/{replicas} pod(s) ready"))
    out["conditions"] = merge_conditions(previous.get("conditions") or [], conds, generation, now)
    return out


def _unavailable_message(ready: int, replicas: int, starting: int, unready: dict[str, str | None]) -> str:
    """E.g. "1 of 3 pod(s) ready, 1 starting; demo-2: CrashLoopBackOff": which pods to look at."""
    message = f"{ready} of {replicas} pod(s) ready" + (f", {starting} starting" if starting else "")
    why = [f"{name}: {reason}" for name, reason in sorted(unready.items()) if reason]
    if why:
        message += "; " + ", ".join(why[:3]) + (f" and {len(why) - 3} more" if len(why) > 3 else "")
    return message


def _cond(ctype: str, status: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if status else "False", "reason": reason, "message": message}


def merge_conditions(previous: list[dict], new: list[dict], generation: int, now: str) -> list[dict]:
    """New conditions in Kubernetes shape; lastTransitionTime moves only when status flips."""
    before = {c.get("type"): c for c in previous}
    merged = []
    for cond in new:
        old = before.get(cond["type"])
        changed = old is None or old.get("status") != cond["status"]
        merged.append({**cond, "observedGeneration": generation,
                       "lastTransitionTime": now if changed else old.get("lastTransitionTime", now)})
    mine = {c["type"] for c in new}
    merged += [c for c in previous if c.get("type") not in mine and c.get("type") not in OWN_CONDITIONS]
    return merged
