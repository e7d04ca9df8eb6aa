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
The terms are ``memory``'s, the node readings ``nodes``'.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.api.status import SizingRecord
from hicache_operator.plan.engine import features as engine
from hicache_operator.plan.model import shapes as model_shapes
from hicache_operator.plan.sizing.memory import (GB, GIB, MIB, SizingError, fixed_terms, fmt_bytes, memory_quantity,
                                                 page_cache_bytes, pool_bytes_for_tokens, pool_multiplier,
                                                 quantity, request_bytes, segment_bytes, shape_for, sidecar_bytes)
from hicache_operator.plan.sizing.nodes import (NodeInfo, Nodes, describe_exclusions, eligible_nodes, node_budget,
                                                node_info, pods_by_gpus, sizing_node, tolerates)

__all__ = ["NodeInfo", "Nodes", "SizingError", "compute", "eligible_nodes", "fmt_bytes", "inputs_hash",
           "memory_quantity", "node_info", "page_cache_bytes", "quantity", "reevaluate", "request_bytes",
           "segment_bytes", "tolerates"]


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
