"""The ``hicache.dev/serving`` pod readiness gate.

Every pod carries the gate, so it is Ready (and in the client Service's endpoints) only while
this condition is True. The operator sets it True on every pod unless something holds it:

- the pod annotation ``hicache.dev/serving-hold`` (its value says why). This is the hook for the
  rollout module: it survives operator restarts, so a pod held for a swap stays out of serving;
  ``hold``/``release`` set the annotation and flip the condition at once;
- any predicate registered with ``register_hold`` (pod dict -> reason or None), for holds that
  are derived from state rather than stored on the pod.
"""

from __future__ import annotations

from typing import Callable

from kubernetes import client

from hicache_operator import labels

HoldPredicate = Callable[[dict], "str | None"]
_HOLDS: list[HoldPredicate] = []


def register_hold(predicate: HoldPredicate) -> None:
    _HOLDS.append(predicate)


def decide(pod: dict) -> tuple[bool, str, str]:
    """(serving, reason, message) for one pod."""
    hold = ((pod.get("metadata") or {}).get("annotations") or {}).get(labels.SERVING_HOLD)
    if hold is not None:
        return False, "Held", hold or "held by annotation"
    for predicate in _HOLDS:
        reason = predicate(pod)
        if reason:
            return False, "Held", reason
    return True, "Serving", "pod is in service"


def current(pod: dict) -> str | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == labels.SERVING_CONDITION:
            return cond.get("status")
    return None


def condition_patch(serving: bool, reason: str, message: str, now: str) -> dict:
    """Strategic-merge patch for the pod status: conditions merge by type, others stay."""
    return {"status": {"conditions": [{"type": labels.SERVING_CONDITION, "status": "True" if serving else "False",
                                       "reason": reason, "message": message, "lastTransitionTime": now}]}}


def set_condition(core: client.CoreV1Api, namespace: str, name: str, serving: bool, reason: str,
                  message: str, now: str) -> None:
    core.patch_namespaced_pod_status(name, namespace, condition_patch(serving, reason, message, now))


def hold(core: client.CoreV1Api, namespace: str, name: str, reason: str, now: str) -> None:
    """Take a pod out of serving and keep it out (until ``release``), across operator restarts."""
    core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {labels.SERVING_HOLD: reason}}})
    set_condition(core, namespace, name, False, "Held", reason, now)


def release(core: client.CoreV1Api, namespace: str, name: str, now: str) -> None:
    """Drop the hold annotation and set the gate to what ``decide`` now says (another hold may remain)."""
    pod = core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {labels.SERVING_HOLD: None}}})
    serving, reason, message = decide(client.ApiClient().sanitize_for_serialization(pod))
    set_condition(core, namespace, name, serving, reason, message, now)
