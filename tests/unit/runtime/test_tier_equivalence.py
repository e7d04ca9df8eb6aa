"""A prefix served from L1, L2 or L3 must give the same tokens and logits as a cold prefill."""

from __future__ import annotations

import pytest

from testbed.mooncake import mooncake_env, mooncake_master  # noqa: F401  (pytest fixtures)
from tests.unit.runtime.conftest import generate, on_engine, prompt, settle

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def _same(cold, warm, tol):
    assert warm.output_ids == cold.output_ids
    assert max(abs(a - b) for a, b in zip(cold.logprobs, warm.logprobs)) < tol


@pytest.mark.parametrize("layout,dtype,tol", [(layout, "float32", 1e-4) for layout in LAYOUTS]
                         + [("page_first", "bfloat16", 5e-2)])
def test_every_tier_matches_cold_prefill(engines, tmp_path, layout, dtype, tol):
    engine = engines(
        enable_hierarchical_cache=True, page_size=4, max_total_tokens=1024, hicache_mem_layout=layout,
        kv_cache_dtype=dtype, hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
        extra_config={"file_storage_path": str(tmp_path), "prefetch_threshold": 8},
    )
    ids = prompt(1, 301)
    cold = generate(engine, ids, n=8)
    assert cold.meta["cached_tokens"] == 0

    l1 = generate(engine, ids, n=8)
    assert l1.meta["cached_tokens_details"] == {"device": 300, "host": 0, "storage": 0}
    _same(cold, l1, tol)

    settle(engine)
    on_engine(engine, lambda: engine.cache.evict(10**9))
    l2 = generate(engine, ids, n=8)
    assert l2.meta["cached_tokens_details"]["host"] == 300
    assert l2.meta["cached_tokens_details"]["device"] == 0
    _same(cold, l2, tol)

    settle(engine)
    assert on_engine(engine, engine.flush)
    l3 = generate(engine, ids, n=8)
    assert l3.meta["cached_tokens_details"]["storage"] == 300
    _same(cold, l3, tol)
    assert engine.cache.counters.prefetched_tokens >= 300


def test_partial_prefix_hit_matches_cold(engines):
    """A shared prefix followed by a new suffix: only the prefix is reused, output equals a fresh engine."""
    warm = engines(enable_hierarchical_cache=True, page_size=2, max_total_tokens=2048)
    cold = engines(disable_radix_cache=True, max_total_tokens=2048)
    base = prompt(3, 200)
    generate(warm, base + prompt(4, 50))
    ids = base + prompt(5, 77)
    hit = generate(warm, ids, n=10)
    ref = generate(cold, ids, n=10)
    assert hit.meta["cached_tokens"] >= 200
    assert ref.meta["cached_tokens"] == 0
    _same(ref, hit, 1e-4)


REAL = [(kind, "file", layout) for kind in ("llama-gqa", "deepseek-v3") for layout in LAYOUTS] + [
    (kind, "mooncake", layout) for kind in ("llama-gqa", "deepseek-v3") for layout in ("page_first",
                                                                                         "page_first_direct")]


@pytest.mark.parametrize("kind,backend,layout", REAL)
def test_real_checkpoint_prefix_from_every_tier_matches_cold(request, engines, oracles, tmp_path, kind, backend,
                                                             layout):
    """A real architecture's KV (GQA, and MLA's latent rows) through L1, L2 and L3, file and Mooncake."""
    path, _ = oracles(kind)
    if backend == "mooncake":
        extra = request.getfixturevalue("mooncake_master").extra_config()
    else:
        extra = {"file_storage_path": str(tmp_path)}
    engine = engines(model_path=str(path), dtype="float32", enable_hierarchical_cache=True, page_size=4,
                     max_total_tokens=1024, hicache_mem_layout=layout, hicache_storage_backend=backend,
                     hicache_storage_prefetch_policy="wait_complete", extra_config={**extra, "prefetch_threshold": 8})
    ids = [(7 * i + 3) % 1000 + 3 for i in range(121)]
    cold = generate(engine, ids, n=8, ignore_eos=True)
    l1 = generate(engine, ids, n=8, ignore_eos=True)
    assert l1.meta["cached_tokens_details"]["device"] == 120
    _same(cold, l1, 1e-4)
    settle(engine)
    on_engine(engine, lambda: engine.cache.evict(10**9))
    l2 = generate(engine, ids, n=8, ignore_eos=True)
    assert l2.meta["cached_tokens_details"]["host"] == 120
    _same(cold, l2, 1e-4)
    settle(engine)
    assert on_engine(engine, engine.flush)
    l3 = generate(engine, ids, n=8, ignore_eos=True)
    assert l3.meta["cached_tokens_details"]["storage"] == 120
    _same(cold, l3, 1e-4)
