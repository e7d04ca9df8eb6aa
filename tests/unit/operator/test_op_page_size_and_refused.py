"""The page size SGLang really serves, per GPU kind, and extraArgs/env SGLang's resolution refuses:
validation refuses what SGLang would rewrite or crash on (tests/unit/sglang/test_refused_args.py
checks the tables against SGLang itself)."""

from __future__ import annotations

import pytest
from op_helpers import gpu_node

from hicache_operator.plan.engine import features as engine
from hicache_operator.plan.validation import validate

B200 = {"nvidia.com/gpu.product": "NVIDIA-B200"}
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def spec(**over) -> dict:
    return {"engine": "sglang", "image": "lmsysorg/sglang:v0.5.23-cu129", "model": "Qwen/Qwen3-8B",
            "maxTotalTokens": 200_000, "hicache": {"hostPool": {"ratio": 2.0}}, "router": {"enabled": True}, **over}


def rules(s: dict, nodes, severity: str) -> list[str]:
    return [f.rule for f in validate(s, name="f", nodes=nodes).findings if f.severity == severity]


@pytest.mark.parametrize("labels,kind", [(B200, 10), ({"nvidia.com/gpu.product": "NVIDIA-GB200"}, 10), (H100, 9),
                                         ({"nvidia.com/gpu.compute.major": "10"}, 10),
                                         ({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, 8), ({}, None)])
def test_gpu_kind_from_feature_discovery_labels(labels, kind):
    assert engine.gpu_kind(labels) == kind


def test_mha_page_size_1_on_sm100_is_refused_naming_the_size_sglang_uses():
    out = validate(spec(), name="f", nodes=[gpu_node("b", labels=B200)])
    [err] = out.errors
    assert err.rule == "page-size-rewritten" and "set pageSize to 64" in err.message and "node b" in err.message
    assert rules(spec(pageSize=64), [gpu_node("b", labels=B200)], "error") == []
    assert rules(spec(pageSize=128), [gpu_node("b", labels=B200)], "error") == []  # trtllm_mha keeps 128 from 0.5.21
    assert rules(spec(pageSize=128, image="lmsysorg/sglang:v0.5.9-cu129"), [gpu_node("b", labels=B200)],
                 "error") == ["page-size-rewritten"]


def test_hopper_keeps_page_size_1_and_unknown_gpus_warn():
    assert rules(spec(), [gpu_node("h", labels=H100)], "warning") == []
    assert rules(spec(), [gpu_node("x")], "warning") == ["page-size-may-be-rewritten"]
    assert rules(spec(pageSize=64), [gpu_node("x")], "warning") == []
    assert rules(spec(), None, "warning") == []  # nodes not read: node-dependent rules wait
    bundled = spec(engine="bundled", image="hicache-runtime:0.1.0", model="builtin:tiny")
    assert rules(bundled, [gpu_node("b", labels=B200)], "error") == []


def test_flashmla_forces_64_on_any_gpu():
    s = spec(extraArgs=["--attention-backend", "flashmla"], pageSize=16)
    assert rules(s, None, "error") == ["page-size-rewritten"]
    assert rules({**s, "pageSize": 64}, None, "error") == []


@pytest.mark.parametrize("args", [["--disable-radix-cache"], ["--enable-lmcache"],
                                  ["--enable-unified-cache-external-linker"], ["--dcp-size", "2"], ["--dcp-size=2"],
                                  ["--nnodes", "2"], ["--node-rank", "1"], ["--dist-init-addr", "10.0.0.1:5000"],
                                  ["--base-gpu-id", "1"], ["--gpu-id-step", "2"], ["--nnode", "2"]])
def test_extra_args_sglang_refuses_or_that_move_the_ranks_are_refused(args):
    assert rules(spec(extraArgs=args), None, "error") == ["extra-args-refused"]


@pytest.mark.parametrize("args", [["--dcp-size", "1"], ["--nnodes", "1"], ["--base-gpu-id", "0"],
                                  ["--mem-fraction-static", "0.8"]])
def test_their_harmless_values_pass(args):
    assert rules(spec(extraArgs=args), None, "error") == []


def test_env_that_moves_the_file_directory_is_refused():
    s = spec(env=[{"name": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "value": "/tmp/x"}])
    assert rules(s, None, "error") == ["env-engine-override"]
    assert rules(spec(env=[{"name": "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "value": "10G"}]), None, "error") == []
