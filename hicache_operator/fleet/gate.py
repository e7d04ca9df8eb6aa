"""Serving membership: the pod label ``hicache.dev/serving``, read and written here only.

The client Service (and a router, which discovers workers by the same labels) selects pods
whose label is ``"true"``; the pod template carries ``"true"``, so a new or restarted pod joins
serving as soon as its readiness probe passes, with or without the operator. The swap planner
takes a pod out of serving by setting the label to ``"false"``: the EndpointSlice controller
drops its endpoint, so clients stop routing to it, for both engines alike (SGLang has no drain
switch). Readmission sets ``"true"`` again and, in the same patch, the pod's storage annotations
of the config its runtime was seen running, so they never disagree with its membership.

A pod without the label (from an older template) is not selected; the planner admits it.
"""

from __future__ import annotations

import copy
from typing import Any

from hicache_operator.api import labels

from hicache_operator.fleet.storage_config import storage_fingerprint

LABEL = f"{labels.PREFIX}/serving"


def template_labels() -> dict[str, str]:
    """What the pod template carries: every new pod starts in serving."""
    return {LABEL: "true"}


def selector() -> dict[str, str]:
    """What the client Service (and the disruption budget) select on, beside the fleet's labels."""
    return {LABEL: "true"}


def serving_gate(pod: dict) -> bool | None:
    """The pod's membership: True, False, or None when it has no label (not admitted)."""
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL)
    return None if value is None else value == "true"


def is_held(pod: dict) -> bool:
    """Taken out of serving (by the swap planner: only it writes ``"false"``)."""
    return serving_gate(pod) is False


def with_gate(pod: dict, serving: bool) -> dict:
    """A copy of ``pod`` showing the membership ``serving`` (a patch the API server
    acknowledged before the watch delivered it)."""
    pod = copy.deepcopy(pod)
    pod.setdefault("metadata", {}).setdefault("labels", {})[LABEL] = "true" if serving else "false"
    return pod


def patch(uid: str, serving: bool, runs: dict[str, Any] | None, target_fingerprint: str,
          target_backend: str) -> dict[str, Any]:
    """The pod patch that sets the membership ``serving``: the label, guarded by the pod's ``uid``
    (a precondition: never a replacement pod of the same name), and with a readmission the storage
    annotations of the config its runtime was seen running (``runs``)."""
    meta: dict[str, Any] = {"uid": uid, "labels": {LABEL: "true" if serving else "false"}}
    if serving and runs is not None:
        fingerprint = storage_fingerprint(runs)
        on_target = fingerprint == target_fingerprint
        meta["annotations"] = {
            labels.STORAGE_HASH: fingerprint,
            labels.STORAGE_BACKEND: target_backend if on_target else (runs.get("backend") or "none")}
    return {"metadata": meta}
