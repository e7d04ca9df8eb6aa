"""Node eligibility and host-pool sizing arithmetic."""

from __future__ import annotations

import pytest
from op_helpers import gpu_node

from hicache_operator.plan.model import shapes as model_shapes
from hicache_operator.plan import sizing
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.plan.validation import validate

TOL = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]


def spec(**kw) -> HiCacheDeploymentSpec:
    return HiCacheDeploymentSpec.model_validate({"image": "i", **kw})


def test_bytes_per_token_mha_splits_heads_over_tp_and_layers_over_pp():
    llama = model_shapes.KNOWN["meta-llama/Llama-3.1-8B-Instruct"]
    assert model_shapes.bytes_per_token(llama, 1, 1) == 128 * 8 * 32 * 2 * 2
    assert model_shapes.bytes_per_token(llama, 8, 1) == 128 * 1 * 32 * 2 * 2
    assert model_shapes.bytes_per_token(llama, 16, 1) == 128 * 1 * 32 * 2 * 2  # heads replicated
    assert model_shapes.bytes_per_token(llama, 1, 2) == 128 * 8 * 16 * 2 * 2


def test_bytes_per_token_mla_is_not_split_over_tp():
    ds = model_shapes.KNOWN["deepseek-ai/DeepSeek-V3"]
    assert model_shapes.bytes_per_token(ds, 8, 1) == (512 + 64) * 2 * 61


def test_eligibility_selector_affinity_taints_gpus_and_cordon():
    s = spec(parallelism={"tp": 4}, nodeSelector={"pool": "a"}, tolerations=TOL,
             affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                 {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1", "z2"]}]}]}}})
    good = {"pool": "a", "zone": "z1"}
    nodes = [
        gpu_node("ok", labels=good, taints=[{"key": "gpu", "value": "x", "effect": "NoSchedule"}]),
        gpu_node("wrong-pool", labels={"pool": "b", "zone": "z1"}),
        gpu_node("wrong-zone", labels={"pool": "a", "zone": "z9"}),
        gpu_node("tainted", labels=good, taints=[{"key": "other", "effect": "NoExecute"}]),
        gpu_node("soft-taint", labels=good, taints=[{"key": "other", "effect": "PreferNoSchedule"}]),
        gpu_node("few-gpus", labels=good, gpus=2),
        gpu_node("cordoned", labels=good, unschedulable=True),
    ]
    eligible, excluded = sizing.eligible_nodes(s, nodes)
    assert sorted(n.name for n in eligible) == ["ok", "soft-taint"]
    assert excluded["wrong-pool"].startswith("nodeSelector pool=a")
    assert excluded["wrong-zone"] == "required node affinity not matched"
    assert excluded["tainted"].startswith("taint other=")
    assert excluded["few-gpus"] == "2 nvidia.com/gpu allocatable, needs 4"
    assert excluded["cordoned"] == "unschedulable"


def test_toleration_operators():
    taint = {"key": "k", "value": "v", "effect": "NoSchedule"}
    assert sizing.tolerates([{"key": "k", "operator": "Equal", "value": "v"}], taint)
    assert not sizing.tolerates([{"key": "k", "operator": "Equal", "value": "w"}], taint)
    assert sizing.tolerates([{"operator": "Exists"}], taint)
    assert not sizing.tolerates([{"key": "k", "operator": "Exists", "effect": "NoExecute"}], taint)


def test_from_node_memory_arithmetic_uses_the_node_with_least_memory_per_pod_and_whole_pages():
    s = spec(model="Qwen/Qwen3-8B", pageSize=64, parallelism={"tp": 8},
             hicache={"hostPool": {"fromNodeMemory": {"fraction": 0.5, "reserveGiB": 8}, "overheadGiB": 4}})
    rec = sizing.compute(s, [gpu_node("a", "1Ti"), gpu_node("b", "768Gi")]).dump()
    alloc = 768 * 2**30
    fixed = 4 * 2**30 + 2 * 2**30  # overheadGiB + the default shmGiB; the bundled engine keeps no reserve
    budget = (alloc * 0.5 - 8 * 2**30 - fixed) / 8
    bpt = 128 * 1 * 36 * 2 * 2
    assert rec["sizingNode"] == "b" and rec["bytesPerToken"] == bpt
    assert rec["hicacheSizeGB"] == int(budget // 1e9)
    pages = rec["hicacheSizeGB"] * 10**9 // bpt // 64 + 1
    assert rec["hostPoolPagesPerRank"] == pages
    assert rec["hostPoolBytesPerRank"] == pages * 64 * bpt <= budget
    assert rec["podMemoryBytes"] == 8 * rec["hostPoolBytesPerRank"] + fixed <= alloc * 0.5 - 8 * 2**30
    assert rec["podMemory"] == f"{-(-rec['podMemoryBytes'] // 2**20)}Mi"


def test_sglang_limit_passes_its_headroom_check_for_every_rank():
    """SGLang refuses a pool larger than (limit - usage - 10 GiB) / ranks, and a rank may check after
    its peers allocated theirs: the limit holds 2r - 1 pools, the reserve, the Mooncake segment
    (one per pod), the ranks' Mooncake transfer buffers, /dev/shm and 1 GiB of slack per rank
    (test_op_host_admission.py runs SGLang's own check on it)."""
    s = spec(engine="sglang", engineVersion="0.5.23", model="Qwen/Qwen3-8B", parallelism={"tp": 4},
             hicache={"hostPool": {"sizeGBPerRank": 20, "overheadGiB": 6, "shmGiB": 3}, "memLayout": "page_first",
                      "storage": {"backend": "mooncake", "extraConfig": {"global_segment_size": "16gb"}}})
    rec = sizing.compute(s, [gpu_node("a", "2Ti")]).dump()
    pool = rec["hostPoolBytesPerRank"]
    assert (rec["poolMultiplier"], rec["engineReserveBytes"], rec["mooncakeSegmentBytes"]) == (7, 10 * 2**30, 16 * 2**30)
    buffers = rec["mooncakeLocalBufferBytes"]
    assert buffers == 4 * 16 * 2**20  # SGLang's fixed transfer buffer, one per rank
    usage_last = (6 + 3 + 16) * 2**30 + buffers + 3 * pool
    assert rec["admissionSlackBytes"] == 4 * 2**30 and "pageCacheBytes" not in rec  # 0.5.23 counts it free
    assert (rec["podMemoryBytes"] - usage_last - 10 * 2**30) // 4 == pool + 2**30
    older = spec(**{**s.dump(), "engineVersion": "0.5.20"})
    assert sizing.compute(older, [gpu_node("a", "2Ti")]).pod_memory_bytes == (6 + 3 + 16) * 2**30 + buffers + 4 * pool


def test_from_node_memory_needs_nodes_and_a_shape():
    s = spec(model="org/unknown", hicache={"hostPool": {"fromNodeMemory": {}}})
    try:
        sizing.compute(s, [gpu_node("a")])
    except sizing.SizingError as exc:
        assert exc.rule == "unknown-model-shape"
    else:
        raise AssertionError("sized a model without a shape")
    shaped = spec(model="org/unknown", modelShape={"numLayers": 10, "numKvHeads": 2, "headDim": 64},
                  hicache={"hostPool": {"fromNodeMemory": {}}})
    assert sizing.compute(shaped, [gpu_node("a")]).bytes_per_token == 64 * 2 * 10 * 2 * 2


def test_pinned_sizing_survives_node_changes_and_reports_no_longer_fits():
    s = spec(parallelism={"tp": 8}, hicache={"hostPool": {"fromNodeMemory": {"fraction": 0.9, "reserveGiB": 0}}})
    rec = sizing.compute(s, [gpu_node("a", "1Ti")])
    assert sizing.reevaluate(rec, s, [gpu_node("a", "1Ti"), gpu_node("b", "2Ti")]) is None
    why = sizing.reevaluate(rec, s, [gpu_node("a", "1Ti"), gpu_node("small", "256Gi")])
    assert why and "small" in why
    assert "0 of 1 node(s) eligible" in sizing.reevaluate(rec, s, [gpu_node("a", gpus=1)])
    assert sizing.inputs_hash(s) == rec.inputs_hash
    resized = spec(parallelism={"tp": 4}, hicache={"hostPool": {"fromNodeMemory": {"fraction": 0.9, "reserveGiB": 0}}})
    assert sizing.inputs_hash(resized) != rec.inputs_hash


def test_storage_changes_do_not_change_the_sizing_inputs():
    a = spec(hicache={"storage": {"backend": "file"}})
    b = spec(hicache={"storage": {"backend": "none"}})
    assert sizing.inputs_hash(a) == sizing.inputs_hash(b)


def test_eligibility_is_remembered_per_node_version_and_placement():
    nodes = [gpu_node("big", "2Ti"), gpu_node("small", "512Gi"), gpu_node("cpu", gpus=0)]
    plain = HiCacheDeploymentSpec.model_validate({"image": "i"})
    pinned = HiCacheDeploymentSpec.model_validate({"image": "i", "nodeSelector": {"kubernetes.io/hostname": "big"}})
    v1 = sizing.Nodes(nodes, version="v1")
    assert sizing.eligible_nodes(plain, v1) == sizing.eligible_nodes(plain, nodes)
    assert sizing.eligible_nodes(plain, v1) is sizing.eligible_nodes(plain, sizing.Nodes(nodes, version="v1"))
    assert [n.name for n in sizing.eligible_nodes(pinned, v1)[0]] == ["big"]  # placement is part of the key
    # a new version is recomputed: "small" shrank, so the smallest eligible node changes
    v2 = sizing.Nodes([gpu_node("big", "2Ti"), gpu_node("small", "256Gi"), gpu_node("cpu", gpus=0)], version="v2")
    assert min(n.memory for n in sizing.eligible_nodes(plain, v2)[0]) == 256 * 2**30


DRAM_TP4 = {"model": "Qwen/Qwen3-8B", "pageSize": 64, "parallelism": {"tp": 4},
            "hicache": {"hostPool": {"fromNodeMemory": {"fraction": 0.75, "reserveGiB": 16}, "overheadGiB": 4}}}


def test_pack_divides_the_node_share_among_the_pods_its_gpus_hold():
    node = gpu_node("a", "1Ti", gpus=8)
    share = 2**40 * 0.75 - 16 * 2**30
    fixed = (4 + 2) * 2**30
    packed = sizing.compute(spec(**DRAM_TP4), [node])
    assert (packed.placement, packed.pods_per_node_by_gpus, packed.pods_per_node, packed.ranks_per_node) == \
        ("pack", 2, 2, 8)
    assert packed.budget_per_rank_bytes == int((share / 2 - fixed) / 4)
    assert 2 * packed.pod_memory_bytes <= share  # both pods fit the node's share together
    assert packed.pods_per_node_by_memory == 2**40 // sizing.request_bytes(packed.pod_memory_bytes) >= 2
    assert packed.placement_formula.endswith("= 2 pods on a") and "8 nvidia.com/gpu // 4 per pod = 2" in \
        packed.placement_formula
    spread = sizing.compute(spec(**DRAM_TP4, placement={"policy": "spread"}), [node])
    assert (spread.pods_per_node_by_gpus, spread.pods_per_node, spread.ranks_per_node) == (1, 1, 4)
    assert spread.budget_per_rank_bytes == int((share - fixed) / 4)
    assert spread.inputs_hash != packed.inputs_hash


def test_host_network_holds_one_pod_per_node_whatever_the_gpus():
    rec = sizing.compute(spec(**DRAM_TP4, hostNetwork=True), [gpu_node("a", "1Ti", gpus=8)])
    assert rec.pods_per_node_by_gpus == 1 and "hostNetwork" in rec.placement_formula


def test_the_pools_are_sized_for_the_node_with_least_memory_per_pod():
    """A big node whose GPUs take many pods can leave each less memory than a small node with one."""
    s = spec(**{**DRAM_TP4, "parallelism": {"tp": 2}})
    big, small = gpu_node("big", "2Ti", gpus=8), gpu_node("small", "768Gi", gpus=2)
    rec = sizing.compute(s, [big, small])
    assert rec.sizing_node == "big" and rec.pods_per_node_by_gpus == 4
    for node, slots in ((big, 4), (small, 1)):  # every node holds the pods its GPUs take, within its share
        alloc = sizing.node_info(node).memory
        assert slots * rec.pod_memory_bytes <= alloc * 0.75 - 16 * 2**30


@pytest.mark.parametrize("memory,gpus,tp,fnm", [
    ("256Gi", 8, 1, {}), ("1Ti", 8, 2, {}), ("3Ti", 16, 4, {}), ("300Gi", 8, 8, {}),
    ("1000000000000", 8, 3, {"fraction": 1.0, "reserveGiB": 0}),  # the node's whole memory, in no whole MiB
])
def test_from_node_memory_never_strands_gpus(memory, gpus, tp, fnm):
    pool = {"hostPool": {"fromNodeMemory": fnm or DRAM_TP4["hicache"]["hostPool"]["fromNodeMemory"]}}
    rec = sizing.compute(spec(**{**DRAM_TP4, "parallelism": {"tp": tp}, "hicache": pool}),
                         [gpu_node("n", memory, gpus=gpus)])
    assert rec.pods_per_node == rec.pods_per_node_by_gpus == gpus // tp <= rec.pods_per_node_by_memory
    assert rec.pods_per_node_by_gpus * sizing.request_bytes(rec.pod_memory_bytes) <= sizing.quantity(memory)


def test_a_fixed_pool_the_memory_cannot_hold_beside_every_gpu_is_bound_by_memory_and_warned():
    raw = {"image": "lmsysorg/sglang:v0.5.23", "engine": "sglang", "model": "Qwen/Qwen3-8B", "parallelism": {"tp": 1},
           "hicache": {"hostPool": {"sizeGBPerRank": 100}}}
    out = validate(raw, name="f", nodes=[gpu_node("n", "512Gi", gpus=8)])
    rec = out.sizing
    assert rec.pods_per_node_by_gpus == 8
    assert rec.pods_per_node_by_memory == 512 * 2**30 // sizing.request_bytes(rec.pod_memory_bytes) == \
        rec.pods_per_node < 8
    warning = next(f for f in out.findings if f.rule == "pods-per-node-memory-bound")
    assert f"GPUs for 8 pods of this deployment but allocatable memory for {rec.pods_per_node}" in warning.message
    assert f"{8 - rec.pods_per_node} GPUs stay idle" in warning.message
    assert out.ok  # a warning: the scheduler's memory requests keep the node from overcommitting


def test_containers_the_pod_template_adds_come_out_of_the_pods_share():
    sidecar = {"podTemplate": {"spec": {
        "containers": [{"name": "log-shipper", "image": "x", "resources": {"requests": {"memory": "8Gi"}}}],
        "initContainers": [{"name": "proxy", "image": "y", "restartPolicy": "Always",
                            "resources": {"limits": {"memory": "2Gi"}}},
                           {"name": "once", "image": "z", "resources": {"requests": {"memory": "64Gi"}}}]}}}
    node = [gpu_node("a", "1Ti", gpus=8)]
    plain, with_sidecars = sizing.compute(spec(**DRAM_TP4), node), sizing.compute(spec(**DRAM_TP4, **sidecar), node)
    assert with_sidecars.sidecar_bytes == 10 * 2**30
    assert with_sidecars.budget_per_rank_bytes == int(plain.budget_per_rank_bytes - 10 * 2**30 / 4)
    assert 2 * (with_sidecars.pod_memory_bytes + with_sidecars.sidecar_bytes) <= 2**40 * 0.75 - 16 * 2**30
    assert with_sidecars.inputs_hash != plain.inputs_hash


def test_a_node_whose_memory_holds_fewer_pods_than_its_gpus_no_longer_fits_a_pinned_sizing():
    s = spec(**DRAM_TP4)
    rec = sizing.compute(s, [gpu_node("a", "1Ti", gpus=8)])
    assert sizing.reevaluate(rec, s, [gpu_node("a", "1Ti", gpus=8), gpu_node("b", "2Ti", gpus=8)]) is None
    why = sizing.reevaluate(rec, s, [gpu_node("a", "1Ti", gpus=8), gpu_node("dense", "1Ti", gpus=16)])
    assert why and "dense has GPUs for 4 pods" in why
