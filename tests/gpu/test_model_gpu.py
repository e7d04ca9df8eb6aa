"""The runtime's GPU path on real architectures: L1 on the device, L1<->L2 through the CUDA
kernels (pinned host pool), attention over the paged device pool; outputs as transformers' on
the CPU, and a prefix from L1, L2 and L3 as a cold prefill. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from testbed.checkpoints import build_oracle_checkpoint
from tests.unit.runtime.conftest import engines, generate, on_engine, settle  # noqa: F401  (fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
KINDS = ["llama-gqa", "qwen3", "deepseek-v3"]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-oracles")
    return {kind: build_oracle_checkpoint(kind, root) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout,io", [("layer_first", "kernel"), ("page_first", "kernel"),
                                       ("page_first_direct", "direct")])
def test_gpu_engine_matches_transformers_through_every_tier(engines, oracle, tmp_path, kind, layout, io):
    path, ref = oracle[kind]
    engine = engines(model_path=str(path), device="cuda", dtype="float32", page_size=4, max_total_tokens=1024,
                     enable_hierarchical_cache=True, hicache_mem_layout=layout, hicache_io_backend=io,
                     hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                     extra_config={"file_storage_path": str(tmp_path), "prefetch_threshold": 8})
    assert engine.device.type == "cuda" and engine.cache.host.pinned
    ids = [(7 * i + 3) % 1000 + 3 for i in range(121)]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, max_new_tokens=16, min_new_tokens=16)[0, len(ids):].tolist()
    cold = generate(engine, ids, n=16, ignore_eos=True)
    assert cold.output_ids == want
    settle(engine)
    on_engine(engine, lambda: engine.cache.evict(10**9))
    l2 = generate(engine, ids, n=16, ignore_eos=True)
    assert l2.meta["cached_tokens_details"]["host"] == 120 and l2.output_ids == want
    settle(engine)
    assert on_engine(engine, engine.flush)
    l3 = generate(engine, ids, n=16, ignore_eos=True)
    assert l3.meta["cached_tokens_details"]["storage"] == 120 and l3.output_ids == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_tensor_parallel_matches_one_rank(engines, oracle, tmp_path):
    path, _ = oracle["llama-gqa"]
    ids = [(5 * i + 1) % 1000 + 3 for i in range(61)]
    outs = []
    for tp in (1, 2):
        engine = engines(model_path=str(path), device="cuda", dtype="float32", tp_size=tp, page_size=4,
                         max_total_tokens=512, enable_hierarchical_cache=True)
        outs.append(generate(engine, ids, n=16, ignore_eos=True).output_ids)
    assert outs[0] == outs[1]
