"""The PodDisruptionBudget over the pods in serving."""

from __future__ import annotations

from typing import Any

from hicache_operator.api import labels
from hicache_operator.api.spec import HiCacheDeploymentSpec, resolve_max_unavailable
from hicache_operator.fleet import gate
from hicache_operator.fleet.names import names
from hicache_operator.plan.render.common import Owner, meta, stamp


def pdb(spec: HiCacheDeploymentSpec, owner: Owner) -> dict[str, Any]:
    return stamp({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": meta(owner, names(owner.name).pdb, "disruption-budget"),
        # Over the pods in serving, with the budget restarts and swaps use (a count: a PDB would
        # round a percentage up, they round down): a pod taken out of serving is not selected,
        # so it counts against the budget, and evictions wait while a swap uses it up.
        "spec": {"minAvailable": max(0, spec.replicas - resolve_max_unavailable(spec.rollout.max_unavailable,
                                                                                 spec.replicas)),
                 "selector": {"matchLabels": {**labels.selector_labels(owner.name), **gate.selector()}}},
    })
