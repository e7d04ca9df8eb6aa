"""Host pool sizing from the nodes the pods may land on.

Placement: a pod holds tp x pp GPUs (its ranks). A node is eligible when it is schedulable,
matches nodeSelector and the required node affinity, has all its NoSchedule/NoExecute taints
tolerated, and has at least tp x pp allocatable nvidia.com/gpu. How many pods of the fleet a node
may hold (``pods_by_gpus``): with ``placement.policy`` pack, ``gpus // (tp x pp)`` (the GPU
requests bound it); with spread, or with hostNetwork (every pod binds the same port on the
node), one. The node the pools are sized for is the eligible node with the least memory per pod
it may hold, so every pod fits wherever it lands, beside as many siblings as the node's GPUs take.

Pod memory (request = limit) counts every term the pod's memory cgroup will hold: the host
pools, the processes themselves (``overheadGiB``), the memory-backed ``/dev/shm`` (``shmGiB``),
the Mooncake global segment the pod lends to the store (one per pod: the engines split it across
their ranks), each rank's Mooncake transfer buffer (registered for RDMA like the segment), the
memory requests of the containers ``podTemplate`` adds, and, for SGLang releases that check host
headroom, what that check demands. SGLang refuses a rank's pool P unless
P <= (limit - usage - 10 GiB) // ranks at the moment that rank allocates (its ranks are the pod's:
the check reads the pod's own cgroup); ranks allocate concurrently, so the last rank may already
see its r - 1 peers' pools in the usage. Its usage counts the page cache of the checkpoint the
ranks have just read in 0.5.21 (later releases count page cache as free). The limit leaves that
rank ``ADMISSION_SLACK_PER_RANK_BYTES`` beyond its pool, so processes holding somewhat more than
overheadGiB do not make it refuse its pool. The limit is

    overhead + shm + segment + buffers + 10 GiB + page cache + r x 1 GiB + (2r - 1) x P   (SGLang with the check)
    overhead + shm + segment + buffers + r x P                                             (otherwise)

(page cache: 0.5.21 only; sidecars have their own limits beside it).

fromNodeMemory: the pods on a node may take ``allocatable x fraction - reserve`` together, so
one pod's limit may take that divided by the pods the node may hold; P is what is left after the
fixed terms, divided by the pools' multiplier (2r - 1 or r), rounded down to whole pages of the
model's bytes per token and then to the whole GB that SGLang's integer ``--hicache-size`` takes
(SGLang adds one page to what the GB buys; that page is counted). Memory requests equal limits,
so the scheduler places at most ``allocatable // pod memory`` pods on a node beside the GPU
bound: with fromNodeMemory that is never below the GPU bound; with a fixed pool it may be (a
warning: GPUs stay idle there).

The result is pinned in status (with a hash of its inputs) and reused while those inputs are
unchanged, so a node joining or leaving never restarts pods by itself; ``reevaluate`` reports
when the pinned sizing no longer fits.

Nodes are plain API JSON dicts (a kopf body, or ``ApiClient().sanitize_for_serialization``).
"""

from __future__ import annotations

import hashlib
import json
import re
from decimal import Decimal
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from hicache_operator.plan.engine import features as engine
from hicache_operator.api import flags
from hicache_operator.plan.model import shapes as model_shapes
from hicache_operator.api.spec import RUNTIME_CONTAINER, HiCacheDeploymentSpec
from hicache_operator.api.status import SizingRecord

GB = 10**9
GIB = 2**30
MIB = 2**20
GPU = "nvidia.com/gpu"
# What a Mooncake client lends when global_segment_size is unset (SGLang's and the runtime's default).
DEFAULT_SEGMENT_BYTES = 4 * GIB
# Each rank's Mooncake transfer buffer: the bundled runtime's local_buffer_size default; SGLang
# ignores the key and always takes this much.
DEFAULT_LOCAL_BUFFER_BYTES = 16 * 2**20
# What SGLang's host headroom check leaves each rank beyond its pool: room for the processes to hold
# up to this much more each than overheadGiB / ranks when the last rank allocates (memory held
# beyond the terms comes out of that rank's budget, 1/ranks of it).
ADMISSION_SLACK_PER_RANK_BYTES = GIB
# Size of the checkpoints SGLang loads (their safetensors: parameters x dtype bytes), whole GiB
# rounded up, for the models model_shapes knows: the page cache the ranks leave behind.
CHECKPOINT_GIB = {
    "meta-llama/Llama-3.1-8B-Instruct": 15,
    "meta-llama/Llama-3.1-70B-Instruct": 132,
    "Qwen/Qwen2.5-7B-Instruct": 15,
    "Qwen/Qwen3-8B": 16,
    "Qwen/Qwen3-32B": 62,
    "mistralai/Mistral-7B-Instruct-v0.3": 14,
    "deepseek-ai/DeepSeek-V3": 642,
}


class SizingError(Exception):
    """The spec cannot be sized against these nodes; ``rule`` and ``params`` fill a rules.Rule."""

    def __init__(self, rule: str, **params: Any) -> None:
        super().__init__(rule)
        self.rule = rule
        self.params = params


@dataclass(frozen=True)
class NodeInfo:
    name: str
    memory: int  # allocatable bytes
    gpus: int
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict, ...] = ()
    unschedulable: bool = False


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity in base units, None when unreadable."""
    try:
        return parse_quantity(value)
    except (ValueError, TypeError, ArithmeticError):
        return None


def node_info(node: dict) -> NodeInfo:
    meta, spec = _dict(node.get("metadata")), _dict(node.get("spec"))
    alloc = _dict(_dict(node.get("status")).get("allocatable"))
    taints = spec.get("taints") if isinstance(spec.get("taints"), list) else []
    return NodeInfo(
        name=str(meta.get("name", "?")),
        memory=int(quantity(alloc.get("memory", 0)) or 0),  # unreadable: 0, so the node is ineligible
        gpus=int(quantity(alloc.get(GPU, 0)) or 0),
        labels={str(k): str(v) for k, v in _dict(meta.get("labels")).items()},
        taints=tuple(_dict(t) for t in taints),
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
    exprs = [_dict(e) for e in term.get("matchExpressions") or [] if isinstance(term.get("matchExpressions"), list)]
    fields = [_dict(f) for f in term.get("matchFields") or [] if isinstance(term.get("matchFields"), list)]
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
    required = _dict(spec.affinity).get("nodeAffinity")
    required = _dict(required).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None:
        terms = _dict(required).get("nodeSelectorTerms")
        if not any(_term_matches(_dict(t), node) for t in (terms if isinstance(terms, list) else [])):
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


def inputs_hash(spec: HiCacheDeploymentSpec) -> str:
    d = spec.dump()
    keys = ("model", "modelShape", "parallelism", "pageSize", "maxTotalTokens", "nodeSelector",
            "tolerations", "affinity", "resources", "placement", "hostNetwork")
    relevant = {k: d.get(k) for k in keys}
    relevant["hostPool"] = d["hicache"]["hostPool"]
    relevant["sidecarBytes"] = sidecar_bytes(spec)
    if spec.engine == "sglang":  # its release decides the headroom check's terms
        relevant["engineVersion"] = engine.version(spec)
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def shape_for(spec: HiCacheDeploymentSpec) -> model_shapes.Shape | None:
    override = model_shapes.Shape(**spec.model_shape.model_dump()) if spec.model_shape else None
    return model_shapes.lookup(spec.model, override)


def pool_bytes_for_tokens(tokens: int, page_size: int, bpt: int) -> tuple[int, int]:
    """(pages, bytes) SGLang allocates for a pool of ``tokens``: page_num = tokens // page + 1."""
    pages = tokens // page_size + 1
    return pages, pages * page_size * bpt


def fmt_bytes(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def memory_quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity, rounded up to whole MiB."""
    return f"{-(-n // MIB)}Mi"


def request_bytes(n: int) -> int:
    """What ``memory_quantity(n)`` requests, in bytes."""
    return -(-n // MIB) * MIB


# A size as people write it, whatever the engine reads: number, unit letter, "i" for powers of 2.
LOOSE_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt])(i?)b?", re.I)
UNIT_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def segment_bytes(value: Any, key: str = "global_segment_size") -> int:
    """A Mooncake size (``global_segment_size``, ``local_buffer_size``) as SGLang reads it
    (``mooncake_store._parse_global_segment_size``, the same in every release checked): an int as
    is, a float truncated, a string of bytes or ``"<N>gb"`` meaning N GiB, any case. What SGLang
    cannot read fails its start, and a negative size or a boolean lends nothing: SizingError."""
    if isinstance(value, bool):
        raise SizingError("mooncake-segment-size", key=key, value=value, problem="is a boolean",
                          fix="a byte count, e.g. 68719476736 or '64gb'")
    try:
        if isinstance(value, str):
            text = value.strip().lower()
            number = text[:-2].strip() if text.endswith("gb") else None
            if number == "":
                raise ValueError(value)
            size = int(number) * GIB if number is not None else int(text)
        else:
            size = int(value)
    except (TypeError, ValueError):
        raise SizingError("mooncake-segment-size", key=key, value=value,
                          problem="is not a size SGLang's Mooncake backend reads (the engine would fail to start)",
                          fix=_segment_fix(value)) from None
    if size < 0:
        raise SizingError("mooncake-segment-size", key=key, value=value, problem="is negative",
                          fix="a byte count, e.g. 68719476736 or '64gb'")
    return size


def _segment_fix(value: Any) -> str:
    """What to write for a Mooncake size SGLang cannot read, in its own spelling."""
    m = LOOSE_SIZE.fullmatch(str(value).strip())
    if not m:
        return "a byte count, e.g. 68719476736, or '<N>gb' for N GiB, e.g. '64gb'"
    size = int(Decimal(m.group(1)) * 1024 ** UNIT_POWER[m.group(2).lower()])
    exact = f"'{size // GIB}gb'" if size % GIB == 0 else str(size)
    return f"{exact} ({m.group(1)} x 2^{10 * UNIT_POWER[m.group(2).lower()]} bytes; Mooncake reads '<N>gb' as N GiB)"


def fixed_terms(spec: HiCacheDeploymentSpec) -> dict[str, int]:
    """Pod memory beside the host pools, by term (bytes)."""
    pool, st = spec.hicache.host_pool, spec.hicache.storage
    terms = {"overheadBytes": int(pool.overhead_gib * GIB), "shmBytes": int(pool.shm_gib * GIB)}
    if st.backend == "mooncake":
        size = st.extra_config.get("global_segment_size")
        terms["mooncakeSegmentBytes"] = DEFAULT_SEGMENT_BYTES if size is None else segment_bytes(size)
        buffer = st.extra_config.get("local_buffer_size") if spec.engine == "bundled" else None
        terms["mooncakeLocalBufferBytes"] = spec.ranks_per_pod * (
            DEFAULT_LOCAL_BUFFER_BYTES if buffer is None else segment_bytes(buffer, "local_buffer_size"))
    terms["engineReserveBytes"] = engine.host_reserve_bytes(spec)
    if terms["engineReserveBytes"]:
        if page_cache := page_cache_bytes(spec):
            terms["pageCacheBytes"] = page_cache
        terms["admissionSlackBytes"] = spec.ranks_per_pod * ADMISSION_SLACK_PER_RANK_BYTES
    return terms


def page_cache_bytes(spec: HiCacheDeploymentSpec) -> int | None:
    """Page cache SGLang's headroom check counts as used when the ranks allocate their pools: the
    checkpoint they just read, in releases that count the cgroup's file cache as used (0.5.21); 0
    where the release counts it free or has no check; None when counted but of unknown size."""
    if not engine.has(spec, "host_pool_headroom_check") or engine.has(spec, "host_headroom_page_cache_free"):
        return 0
    gib = CHECKPOINT_GIB.get(spec.model)
    return None if gib is None else gib * GIB


def pool_multiplier(spec: HiCacheDeploymentSpec) -> int:
    """How many pools' worth of memory the limit must hold (see the module docstring)."""
    ranks = spec.ranks_per_pod
    return 2 * ranks - 1 if engine.host_reserve_bytes(spec) else ranks


def sidecar_bytes(spec: HiCacheDeploymentSpec) -> int:
    """Memory the containers ``podTemplate`` adds request (a limit alone is also the request): its
    containers and restartable init containers, beside the operator's."""
    ps = spec.pod_template.spec
    added = [c for c in ps.get("containers") or [] if isinstance(c, dict) and c.get("name") != RUNTIME_CONTAINER]
    added += [c for c in ps.get("initContainers") or [] if isinstance(c, dict) and c.get("restartPolicy") == "Always"]
    total = 0
    for c in added:
        res = c.get("resources") if isinstance(c.get("resources"), dict) else {}
        memory = _dict(res.get("requests")).get("memory") or _dict(res.get("limits")).get("memory")
        total += int(quantity(memory) or 0) if memory is not None else 0
    return total


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


def compute(spec: HiCacheDeploymentSpec, nodes: list[dict] | None) -> SizingRecord:
    """The sizing record. Raises SizingError.

    ``nodes`` None means "not known here" (static validation): node checks are skipped, and
    fromNodeMemory cannot be sized.
    """
    pool = spec.hicache.host_pool
    ranks = spec.ranks_per_pod
    terms = fixed_terms(spec)
    fixed = sum(terms.values())
    sidecars = sidecar_bytes(spec)
    multiplier = pool_multiplier(spec)
    shape = shape_for(spec)
    bpt = model_shapes.bytes_per_token(shape, spec.parallelism.tp, spec.parallelism.pp) if shape else None
    rec: dict[str, Any] = {"inputsHash": inputs_hash(spec), "placement": spec.placement.policy, "ranksPerPod": ranks,
                           **terms, "poolMultiplier": multiplier, "pageSize": spec.page_size, "bytesPerToken": bpt}
    if sidecars:
        rec["sidecarBytes"] = sidecars
    node: NodeInfo | None = None
    smallest: NodeInfo | None = None
    slots, slots_why = 0, ""
    if nodes is not None:
        eligible, excluded = eligible_nodes(spec, nodes)
        rec["eligibleNodes"] = len(eligible)
        if eligible:
            node = sizing_node(spec, eligible)
            smallest = min(eligible, key=lambda n: (n.memory, n.name))
            slots, slots_why = pods_by_gpus(spec, node)
            rec.update(sizingNode=node.name, nodeAllocatableBytes=node.memory, podsPerNodeByGpus=slots)
        elif pool.from_node_memory is not None:
            raise SizingError("no-eligible-nodes", gpus=ranks, why=describe_exclusions(excluded, len(nodes)))
        else:
            rec["ineligible"] = describe_exclusions(excluded, len(nodes))

    per_rank: int | None = None
    if pool.from_node_memory is not None:
        if bpt is None:
            raise SizingError("unknown-model-shape", model=spec.model)
        assert node is not None
        fnm = pool.from_node_memory
        reserve = int(fnm.reserve_gib * GIB)
        pod_share = int(node_budget(spec, node) / slots) // MIB * MIB  # whole MiB: the request is rounded up to them
        budget = (pod_share - sidecars - fixed) / multiplier
        gb = int(budget // GB)
        while gb >= 1 and pool_bytes_for_tokens(gb * GB // bpt, spec.page_size, bpt)[1] > budget:
            gb -= 1
        if gb < 1:
            raise SizingError("host-pool-too-small", per_rank=fmt_bytes(max(budget, 0)), node=node.name)
        pages, per_rank = pool_bytes_for_tokens(gb * GB // bpt, spec.page_size, bpt)
        side = f" - {sidecars}" if sidecars else ""
        rec.update(mode="fromNodeMemory", fraction=fnm.fraction, reserveBytes=reserve, budgetPerRankBytes=int(budget),
                   hicacheSizeGB=gb, hostPoolPagesPerRank=pages, hostPoolTokensPerRank=pages * spec.page_size,
                   budgetFormula=(f"(({node.memory} x {fnm.fraction} - {reserve}) / {slots} pods = {pod_share} B "
                                  f"(whole MiB){side} - {fixed}) / {multiplier} = {int(budget)} B per rank -> {gb} GB "
                                  f"(--hicache-size) = {pages} pages x {spec.page_size} tokens x {bpt} B"))
    elif pool.size_gb_per_rank is not None:
        gb = pool.size_gb_per_rank
        if bpt is not None:
            pages, per_rank = pool_bytes_for_tokens(gb * GB // bpt, spec.page_size, bpt)
            rec.update(hostPoolPagesPerRank=pages, hostPoolTokensPerRank=pages * spec.page_size)
        else:
            per_rank = gb * GB
        rec.update(mode="sizeGBPerRank", hicacheSizeGB=gb)
    else:
        rec.update(mode="ratio", ratio=pool.ratio)
        device = engine.device_tokens(spec)
        if bpt is not None and device:
            pages, per_rank = pool_bytes_for_tokens(int(device * (pool.ratio or 0)), spec.page_size, bpt)
            rec.update(hostPoolPagesPerRank=pages, hostPoolTokensPerRank=pages * spec.page_size)

    if per_rank is None:
        rec["note"] = (f"model {spec.model} has no known KV shape: set spec.modelShape" if bpt is None else
                       "the host pool follows the device pool SGLang picks from GPU memory: set maxTotalTokens")
        return SizingRecord.model_validate(rec)
    total = fixed + multiplier * per_rank
    rec.update(hostPoolBytesPerRank=per_rank, podMemoryBytes=total, podMemory=memory_quantity(total),
               formula=" + ".join(f"{v} ({k.removesuffix('Bytes')})" for k, v in terms.items() if v)
               + f" + {multiplier} x {per_rank} (host pools) = {total} B")
    if reserve := terms["engineReserveBytes"]:
        limit = request_bytes(total)
        usage = fixed - reserve - terms["admissionSlackBytes"] + (ranks - 1) * per_rank
        budget = (limit - usage - reserve) // ranks
        rec.update(engineHeadroomSpareBytes=budget - per_rank, engineHeadroomCheck=(
            f"last rank to allocate: ({limit} limit - {usage} in use - {reserve} reserve) // {ranks} ranks = "
            f"{budget} B = {per_rank} B pool + {budget - per_rank} B spare (in use: every term but the reserve "
            f"and the slack, and {ranks - 1} peer pools)"))
    if smallest is not None and total + sidecars > smallest.memory:
        max_gb = max(0, (smallest.memory - sidecars - fixed) // multiplier // GB)
        fix = ("lower fraction or reserve more" if pool.from_node_memory is not None else
               f"lower hicache.hostPool.sizeGBPerRank to at most {max_gb} or use hostPool.fromNodeMemory"
               if pool.size_gb_per_rank is not None else "lower hicache.hostPool.ratio or maxTotalTokens")
        raise SizingError("host-pool-exceeds-node", ranks=multiplier, per_rank=fmt_bytes(per_rank),
                          overhead=fmt_bytes(fixed + sidecars), total=fmt_bytes(total + sidecars),
                          alloc=fmt_bytes(smallest.memory), node=smallest.name, fix=fix)
    if node is not None:
        by_memory = node.memory // (request_bytes(total) + sidecars)
        pods = min(slots, by_memory)
        rec.update(podsPerNodeByMemory=by_memory, podsPerNode=pods, ranksPerNode=pods * ranks,
                   placementFormula=(f"min({slots_why}, {node.memory} allocatable // {request_bytes(total) + sidecars} "
                                     f"per pod = {by_memory}) = {pods} pods on {node.name}"))
    return SizingRecord.model_validate(rec)


def reevaluate(record: SizingRecord, spec: HiCacheDeploymentSpec, nodes: list[dict]) -> str | None:
    """Why a pinned sizing record no longer fits the current nodes, or None when it does: an eligible
    node cannot hold one pod, or (fromNodeMemory) its memory holds fewer pods than its GPUs."""
    eligible, excluded = eligible_nodes(spec, nodes)
    if not eligible:
        return describe_exclusions(excluded, len(nodes))
    if not record.pod_memory_bytes:
        return None
    need = request_bytes(record.pod_memory_bytes) + (record.sidecar_bytes or 0)
    smallest = min(eligible, key=lambda n: (n.memory, n.name))
    if need > smallest.memory:
        return (f"pods need {fmt_bytes(need)} but eligible node {smallest.name} has {fmt_bytes(smallest.memory)} "
                "allocatable")
    if record.mode == "fromNodeMemory":
        for node in sorted(eligible, key=lambda n: n.name):
            slots = pods_by_gpus(spec, node)[0]
            if slots * need > node_budget(spec, node):
                return (f"eligible node {node.name} has GPUs for {slots} pods but its share of memory "
                        f"({fmt_bytes(max(node_budget(spec, node), 0))}) holds {int(node_budget(spec, node) // need)} "
                        f"at {fmt_bytes(need)} each")
    return None
