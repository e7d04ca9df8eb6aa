"""The nodes a fleet's pods may land on: node readings, eligibility (schedulable, nodeSelector,
required node affinity, tolerated taints, enough GPUs), and how many pods of the fleet each may hold."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hicache_operator.api import flags
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.plan.sizing.memory import GIB, as_dict, quantity

GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    memory: int  # allocatable bytes
    gpus: int
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict, ...] = ()
    unschedulable: bool = False


def node_info(node: dict) -> NodeInfo:
    meta, spec = as_dict(node.get("metadata")), as_dict(node.get("spec"))
    alloc = as_dict(as_dict(node.get("status")).get("allocatable"))
    taints = spec.get("taints") if isinstance(spec.get("taints"), list) else []
    return NodeInfo(
        name=str(meta.get("name", "?")),
        memory=int(quantity(alloc.get("memory", 0)) or 0),  # unreadable: 0, so the node is ineligible
        gpus=int(quantity(alloc.get(GPU, 0)) or 0),
        labels={str(k): str(v) for k, v in as_dict(meta.get("labels")).items()},
        taints=tuple(as_dict(t) for t in taints),
        unschedulable=bool(spec.get("unschedulable")),
    )


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol.get("effect") != taint.get("effect"):
            continue
        if (tol.get("operator") or "Equal") == "Exists":
            if not tol.get("key") or tol.get("key") == taint.get("key"):
                return True
        elif tol.get("key") == taint.get("key") and (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _expression_matches(expr: dict, value: str | None) -> bool:
    op, values = expr.get("operator"), expr.get("values") if isinstance(expr.get("values"), list) else []
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            lhs, rhs = int(value), int(values[0])
        except (ValueError, TypeError):
            return False
        return lhs > rhs if op == "Gt" else lhs < rhs
    return False


def _term_matches(term: dict, node: NodeInfo) -> bool:
    exprs = [as_dict(e) for e in term.get("matchExpressions") or [] if isinstance(term.get("matchExpressions"), list)]
    fields = [as_dict(f) for f in term.get("matchFields") or [] if isinstance(term.get("matchFields"), list)]
    if not exprs and not fields:
        return False  # an empty term selects nothing (Kubernetes semantics)
    return all(_expression_matches(e, node.labels.get(e.get("key"))) for e in exprs) and all(
        _expression_matches(f, node.name if f.get("key") == "metadata.name" else None) for f in fields)


def why_ineligible(spec: HiCacheDeploymentSpec, node: NodeInfo) -> str | None:
    """None when a pod of ``spec`` may run on ``node``, else the first reason it may not."""
    if node.unschedulable:
        return "unschedulable"
    for key, value in spec.node_selector.items():
        if node.labels.get(key) != value:
            return f"nodeSelector {key}={value} not matched"
    required = as_dict(spec.affinity).get("nodeAffinity")
    required = as_dict(required).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None:
        terms = as_dict(required).get("nodeSelectorTerms")
        if not any(_term_matches(as_dict(t), node) for t in (terms if isinstance(terms, list) else [])):
            return "required node affinity not matched"
    for taint in node.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(spec.tolerations, taint):
            return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} not tolerated"
    if node.memory <= 0:
        return "no readable allocatable memory"
    if node.gpus < spec.ranks_per_pod:
        return f"{node.gpus} {GPU} allocatable, needs {spec.ranks_per_pod}"
    return None


class Nodes(list):
    """A node list with a version: lists of equal version hold equal nodes, so eligibility,
    which a fleet-sized operator would otherwise recompute over thousands of nodes on every
    reconcile, is remembered per version and placement (``eligible_nodes``)."""

    def __init__(self, items: list[dict], version: Any) -> None:
        super().__init__(items)
        self.version = version


_ELIGIBLE_MEMO: dict[tuple, tuple[list[NodeInfo], dict[str, str]]] = {}
_ELIGIBLE_MEMO_SIZE = 256


def eligible_nodes(spec: HiCacheDeploymentSpec, nodes: list[dict]) -> tuple[list[NodeInfo], dict[str, str]]:
    """The nodes a pod of ``spec`` may land on, and why each other one may not (callers must not
    mutate the result: it may be shared)."""
    version = getattr(nodes, "version", None)
    if version is None:
        return _eligible_nodes(spec, nodes)
    key = (version, json.dumps([spec.node_selector, spec.affinity, spec.tolerations, spec.ranks_per_pod],
                               sort_keys=True, default=str))
    if key not in _ELIGIBLE_MEMO:
        if len(_ELIGIBLE_MEMO) >= _ELIGIBLE_MEMO_SIZE:
            _ELIGIBLE_MEMO.clear()
        _ELIGIBLE_MEMO[key] = _eligible_nodes(spec, nodes)
    return _ELIGIBLE_MEMO[key]


def _eligible_nodes(spec: HiCacheDeploymentSpec, nodes: list[dict]) -> tuple[list[NodeInfo], dict[str, str]]:
    eligible, excluded = [], {}
    for raw in nodes:
        info = node_info(raw)
        reason = why_ineligible(spec, info)
        if reason is None:
            eligible.append(info)
        else:
            excluded[info.name] = reason
    return eligible, excluded


def describe_exclusions(excluded: dict[str, str], total: int) -> str:
    if not total:
        return "the cluster has no nodes"
    shown = "; ".join(f"{n}: {r}" for n, r in sorted(excluded.items())[:5])
    more = f" (and {len(excluded) - 5} more)" if len(excluded) > 5 else ""
    return f"0 of {total} node(s) eligible: {shown}{more}"


def pods_by_gpus(spec: HiCacheDeploymentSpec, node: NodeInfo) -> tuple[int, str]:
    """Pods of the fleet ``node`` may hold by its GPUs and the placement, and why."""
    if spec.placement.policy == "spread":
        return 1, "spread: one pod per node"
    if spec.host_network:
        return 1, f"hostNetwork: one pod per node (each binds port {flags.RUNTIME_PORT} on it)"
    ranks = spec.ranks_per_pod
    return node.gpus // ranks, f"pack: {node.gpus} {GPU} // {ranks} per pod = {node.gpus // ranks}"


def node_budget(spec: HiCacheDeploymentSpec, node: NodeInfo) -> float:
    """Memory the fleet's pods on ``node`` may take together: fromNodeMemory's share, else all of it."""
    fnm = spec.hicache.host_pool.from_node_memory
    return node.memory * fnm.fraction - fnm.reserve_gib * GIB if fnm is not None else node.memory


def sizing_node(spec: HiCacheDeploymentSpec, eligible: list[NodeInfo]) -> NodeInfo:
    """The eligible node with the least memory per pod it may hold."""
    return min(eligible, key=lambda n: (node_budget(spec, n) / pods_by_gpus(spec, n)[0], n.name))

