"""The serving gate: the pod readiness gate ``hicache.dev/serving``, read and written here only.

Every pod template carries the gate (``readiness_gates``), so a pod is Ready only when its
containers are ready and the gate is True; the EndpointSlice controller then publishes its
endpoint as ready and clients route to it. The swap planner is the gate's only writer: it
admits a new pod (True) and takes a pod out of serving to swap its backend (False). Holding
the gate False drains a pod for both engines alike (SGLang has no drain switch) and is what a
kubelet honours. A readmission also rewrites the pod's storage annotations in the same patch
(the pods/status subresource takes metadata changes), so they never disagree with the gate.
"""

from __future__ import annotations

import copy
from typing import Any

from hicache_operator import labels

from .actions import SetServingGate
from .storage_config import storage_fingerprint

CONDITION = f"{labels.PREFIX}/serving"


def readiness_gates() -> list[dict[str, str]]:
    """The pod template's ``readinessGates``."""
    return [{"conditionType": CONDITION}]


def serving_gate(pod: dict) -> bool | None:
    """The pod's gate: True, False, or None when it has none yet (not admitted)."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == CONDITION:
            return cond.get("status") == "True"
    return None


def with_gate(pod: dict, serving: bool) -> dict:
    """A copy of ``pod`` showing the gate as ``serving`` (a patch the API server acknowledged
    before the watch delivered it)."""
    pod = copy.deepcopy(pod)
    conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != CONDITION]
    conditions.append({"type": CONDITION, "status": str(serving)})
    pod.setdefault("status", {})["conditions"] = conditions
    return pod


def patch(action: SetServingGate, target_fingerprint: str, target_backend: str, now: str) -> dict[str, Any]:
    """The pods/status patch for ``action``: the gate, guarded by the pod's uid (a precondition:
    never a replacement pod of the same name), and with a readmission the storage annotations
    of the config its runtime was seen running (``action.runs``)."""
    meta: dict[str, Any] = {"uid": action.uid}
    if action.serving and action.runs is not None:
        runs = storage_fingerprint(action.runs)
        on_target = runs == target_fingerprint
        meta["annotations"] = {
            labels.STORAGE_HASH: runs,
            labels.STORAGE_BACKEND: target_backend if on_target else (action.runs.get("backend") or "none")}
    reason, message = ("Serving", "admitted by the operator") if action.serving else \
        ("BackendSwap", "taken out of serving to swap the L3 storage backend")
    return {"metadata": meta,
            "status": {"conditions": [{"type": CONDITION, "status": "True" if action.serving else "False",
                                       "reason": reason, "message": message, "lastTransitionTime": now}]}}
