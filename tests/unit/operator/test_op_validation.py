"""Each validation rule and normalisation, through validation.validate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_operator.api import rules
from hicache_operator.plan.validation import validate

from op_helpers import gpu_node

TOL = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def run(nodes=None, name="demo", **spec):
    return validate({"image": "img", **spec}, name=name, nodes=nodes)


def names(outcome, severity=None):
    return [f.rule for f in outcome.findings if severity is None or f.severity == severity]


def test_defaults_are_valid_and_unchanged():
    out = run()
    assert out.ok and out.findings == []
    assert out.spec.hicache.host_pool.ratio == 2.0
    assert out.spec.hicache.mem_layout == "layer_first"


@pytest.mark.parametrize("ratio,ok", [(1.0, False), (0.5, False), (1.01, True), (4, True)])
def test_host_ratio_must_exceed_one(ratio, ok):
    out = run(hicache={"hostPool": {"ratio": ratio}})
    assert out.ok is ok
    if not ok:
        assert out.errors[0].message == rules.rule("host-ratio").message


@pytest.mark.parametrize("pool", [{}, {"ratio": 3, "sizeGBPerRank": 4},
                                  {"sizeGBPerRank": 4, "fromNodeMemory": {"fraction": 0.5}}])
def test_exactly_one_host_pool_mode(pool):
    assert "host-pool-mode" in names(run(hicache={"hostPool": pool}), "error")


def test_write_back_needs_the_opt_in_and_then_warns():
    refused = run(hicache={"writePolicy": "write_back"})
    assert names(refused, "error") == ["write-back-not-allowed"]
    assert "allowWriteBack" in refused.errors[0].message
    allowed = run(hicache={"writePolicy": "write_back", "allowWriteBack": True})
    assert allowed.ok and names(allowed) == ["write-back-allowed"]


SG = {"engine": "sglang", "model": "Qwen/Qwen3-8B", "engineVersion": "0.5.23"}


def test_pp_with_l3_is_refused_but_pp_alone_is_fine():
    assert names(run(**SG, parallelism={"tp": 1, "pp": 2}, hicache={"storage": {"backend": "file"}}), "error") == [
        "pp-with-storage"]
    assert run(**SG, parallelism={"pp": 2}).ok


def test_dp_must_divide_tp():
    assert names(run(**SG, parallelism={"tp": 4, "dp": 3}), "error") == ["dp-divides-tp"]
    assert run(**SG, parallelism={"tp": 4, "dp": 2}).ok


def test_bundled_engine_needs_a_local_checkpoint_and_no_dp_pp():
    assert names(run(model="meta-llama/Llama-3.1-8B-Instruct"), "error") == ["bundled-model-source"]
    assert names(run(model="builtin:huge"), "error") == ["bundled-model-source"]
    assert names(run(model="/models/llama", modelShape={"numLayers": 32, "numKvHeads": 8, "headDim": 128}),
                 "error") == []
    assert names(run(parallelism={"tp": 2, "dp": 2}), "error") == ["bundled-parallelism"]
    assert names(run(parallelism={"pp": 2}), "error") == ["bundled-parallelism"]
    assert "set parallelism.pp and parallelism.dp to 1" in run(parallelism={"pp": 2}).findings[0].message


def test_builtin_model_needs_the_bundled_engine():
    assert names(run(engine="sglang", engineVersion="0.5.23"), "error") == ["builtin-model-needs-bundled"]
    assert run(**SG).ok


def test_name_length():
    assert names(run(name="x" * 53), "error") == ["name-too-long"]
    assert run(name="x" * 52).ok


def test_max_unavailable_count_or_percent():
    assert run(rollout={"maxUnavailable": "25%"}).ok
    assert names(run(rollout={"maxUnavailable": "half"}), "error") == ["max-unavailable"]


@pytest.mark.parametrize("io,layout", [("kernel", "page_first"), ("direct", "page_first_direct")])
def test_mooncake_layer_first_is_normalised_by_io_backend(io, layout):
    out = run(hicache={"ioBackend": io, "storage": {"backend": "mooncake", "mooncake": {"masterAddress": "m:50051"}}})
    assert out.ok
    assert out.spec.hicache.mem_layout == layout
    note = [f for f in out.findings if f.rule == "mooncake-layer-first"][0]
    assert note.severity == "normalised" and layout in note.message and io in note.message


def test_page_first_direct_with_kernel_io_switches_io():
    out = run(hicache={"memLayout": "page_first_direct", "ioBackend": "kernel"})
    assert (out.spec.hicache.mem_layout, out.spec.hicache.io_backend) == ("page_first_direct", "direct")
    assert names(out) == ["page-first-direct-kernel-io"]


def test_page_first_with_direct_io_becomes_page_first_direct():
    out = run(hicache={"memLayout": "page_first", "ioBackend": "direct"})
    assert (out.spec.hicache.mem_layout, out.spec.hicache.io_backend) == ("page_first_direct", "direct")
    assert names(out) == ["page-first-direct-io"]


def test_compatible_layouts_are_left_alone():
    out = run(hicache={"memLayout": "page_first", "storage": {"backend": "mooncake",
                                                               "mooncake": {"masterAddress": "m:1"}}})
    assert out.spec.hicache.mem_layout == "page_first" and "normalised" not in {f.severity for f in out.findings}


def test_unknown_extra_config_keys_warn_per_backend_and_prefetch_knobs_are_known():
    out = run(hicache={"storage": {"backend": "file", "extraConfig": {
        "file_storage_path": "/d", "prefetch_threshold": 64, "master_server_address": "x", "bogus": 1}}})
    assert out.ok
    warned = sorted(f.message.split(" ")[0] for f in out.findings if f.rule == "extra-config-unknown-key")
    assert warned == ["hicache.storage.extraConfig.bogus", "hicache.storage.extraConfig.master_server_address"]


def test_local_hostname_is_stripped_from_shared_config():
    out = run(hicache={"storage": {"backend": "mooncake", "extraConfig": {
        "local_hostname": "10.0.0.1", "master_server_address": "m:50051"}}})
    assert out.ok and "local_hostname" not in out.spec.hicache.storage.extra_config
    assert "extra-config-local-hostname" in names(out, "normalised")


def test_mooncake_settings_flow_into_extra_config_with_defaults():
    out = run(hicache={"storage": {"backend": "mooncake", "mooncake": {
        "masterAddress": "m:50051", "globalSegmentSize": "4gb"}}})
    assert out.spec.hicache.storage.extra_config == {
        "master_server_address": "m:50051", "global_segment_size": "4gb", "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE"}


def test_mooncake_needs_a_master_and_refuses_conflicts():
    assert "mooncake-master-required" in names(run(hicache={"storage": {"backend": "mooncake"}}), "error")
    assert run(hicache={"storage": {"backend": "mooncake", "extraConfig": {"master_server_address": "m:1"}}}).ok
    clash = run(hicache={"storage": {"backend": "mooncake", "mooncake": {"masterAddress": "a:1"},
                                     "extraConfig": {"master_server_address": "b:1"}}})
    assert names(clash, "error") == ["mooncake-config-conflict"]


def test_dynamic_backend_lists_missing_keys():
    out = run(hicache={"storage": {"backend": "dynamic", "extraConfig": {"backend_name": "x"}}})
    assert out.errors[0].rule == "dynamic-backend-config"
    assert out.errors[0].message.endswith("missing: module_path, class_name")


def test_schema_errors_name_the_field():
    out = validate({"image": "img", "hicache": {"memLayout": "page_head"}})
    assert out.spec is None and out.errors[0].rule == "schema"
    assert out.errors[0].message.startswith("spec.hicache.memLayout:")
    assert validate({}).errors[0].message.startswith("spec.image:")
    assert validate({"image": "i", "replicaz": 2}).errors[0].message.startswith("spec.replicaz:")


def test_per_rank_size_times_ranks_must_fit_the_smallest_eligible_node():
    nodes = [gpu_node("big", "2Ti"), gpu_node("small", "256Gi")]
    out = run(nodes, parallelism={"tp": 8}, hicache={"hostPool": {"sizeGBPerRank": 40}})
    assert names(out, "error") == ["host-pool-exceeds-node"]
    msg = out.errors[0].message
    assert "node small" in msg and "at most 33" in msg  # (256 GiB - 10 GiB overhead) / 8 ranks = 33.02 GB
    fits = run(nodes, parallelism={"tp": 8}, hicache={"hostPool": {"sizeGBPerRank": 33}})
    assert fits.ok and fits.sizing.pod_memory_bytes <= 256 * 2**30
    assert not run(nodes, parallelism={"tp": 8}, hicache={"hostPool": {"sizeGBPerRank": 34}}).ok


def test_memory_request_below_the_pools_is_refused():
    nodes = [gpu_node("n", "1Ti")]
    out = run(nodes, parallelism={"tp": 2}, hicache={"hostPool": {"sizeGBPerRank": 20}},
              resources={"requests": {"memory": "30Gi"}})
    assert names(out, "error") == ["memory-request-too-small"]
    assert run(nodes, parallelism={"tp": 2}, hicache={"hostPool": {"sizeGBPerRank": 20}},
               resources={"requests": {"memory": "64Gi"}}).ok


def test_no_eligible_node_is_an_error_only_when_sizing_needs_one():
    nodes = [gpu_node("n", gpus=4)]
    sized = run(nodes, parallelism={"tp": 8}, hicache={"hostPool": {"fromNodeMemory": {"fraction": 0.5}}})
    assert names(sized, "error") == ["no-eligible-nodes"] and "n: 4 nvidia.com/gpu allocatable" in sized.errors[0].message
    ratio = run(nodes, parallelism={"tp": 8})
    assert ratio.ok and names(ratio) == ["no-eligible-nodes-yet"]


json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=3), max_leaves=12)
affinities = st.fixed_dictionaries({"nodeAffinity": st.fixed_dictionaries({
    "requiredDuringSchedulingIgnoredDuringExecution": st.fixed_dictionaries({
        "nodeSelectorTerms": st.lists(st.fixed_dictionaries({"matchExpressions": json_values}) | json_values,
                                      max_size=2)}) | json_values}) | json_values})
spec_keys = st.sampled_from(["engine", "image", "model", "replicas", "parallelism", "pageSize", "hicache",
                             "rollout", "resources", "nodeSelector", "tolerations", "affinity",
                             "adminKeySecretRef", "maxTotalTokens", "modelShape"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(spec_keys, json_values, max_size=6), st.lists(json_values, max_size=3), affinities)
def test_fuzzed_specs_and_nodes_never_crash(raw, junk_nodes, affinity):
    if "affinity" in raw:
        raw["affinity"] = affinity
    nodes = [n for n in junk_nodes if isinstance(n, dict)] + [gpu_node("n")]
    out = validate(raw, name="fuzz", nodes=nodes)
    assert out.ok or out.errors


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["metadata", "spec", "status"]),
                       st.dictionaries(st.sampled_from(["name", "labels", "taints", "allocatable", "unschedulable"]),
                                       json_values, max_size=4), max_size=3))
def test_malformed_nodes_are_ineligible_not_fatal(node):
    out = validate({"image": "i", "hicache": {"hostPool": {"fromNodeMemory": {}}}}, nodes=[node, gpu_node("good")])
    assert out.ok or [f.rule for f in out.errors] in (["host-pool-too-small"], ["host-pool-exceeds-node"])
