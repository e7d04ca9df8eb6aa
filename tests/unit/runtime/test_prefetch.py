"""L3 prefetch policies and degradation, against the real file backend."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from cache_runtime.engine.requests import Request
from cache_runtime.policies import PrefetchConfig
from cache_runtime.storage_io import RankedStorage
from cache_runtime.sampling import SamplingParams
from cache_runtime.storage.base import HiCacheStorageConfig, StorageUnavailable
from cache_runtime.storage.file_backend import HiCacheFile
from tests.unit.runtime.conftest import accounting_ok as _accounting_ok, generate, on_engine, prompt, settle


def test_timeout_formula_is_sglangs_with_our_cap():
    cfg = PrefetchConfig(policy="timeout")
    assert cfg.timeout_for(0) == pytest.approx(2.0)
    assert cfg.timeout_for(2048) == pytest.approx(2.0 + 0.1 * 2)
    assert cfg.timeout_for(10**7) == pytest.approx(30.0)


def test_extra_config_knobs_are_popped_and_checked():
    cfg, rest = PrefetchConfig.from_extra_config("timeout", {
        "prefetch_threshold": 64, "prefetch_timeout_base": 0.5, "prefetch_timeout_per_ki_token": 1,
        "prefetch_timeout_max": 3, "hicache_storage_pass_prefix_keys": True, "file_storage_path": "/x"})
    assert rest == {"file_storage_path": "/x"}
    assert (cfg.threshold, cfg.timeout_base, cfg.timeout_per_ki_token, cfg.timeout_max) == (64, 0.5, 1.0, 3.0)
    assert cfg.pass_prefix_keys is True
    with pytest.raises(ValueError, match="prefetch_threshold must be a int"):
        PrefetchConfig.from_extra_config("timeout", {"prefetch_threshold": "lots"})
    with pytest.raises(ValueError, match=">= 0"):
        PrefetchConfig.from_extra_config("timeout", {"prefetch_timeout_max": -1})
    with pytest.raises(ValueError, match="invalid hicache_storage_prefetch_policy"):
        PrefetchConfig.from_extra_config("eventually", {})


class GatedFile(HiCacheFile):
    """The real file backend whose reads wait until the test opens the gate (a slow L3, made deterministic)."""

    def __init__(self, config, gate: threading.Event) -> None:
        super().__init__(config)
        self.gate = gate

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        self.gate.wait(30)
        return super().batch_get(keys, target_locations, target_sizes)


class BrokenStore(HiCacheFile):
    def batch_exists(self, keys, extra_info=None):
        raise StorageUnavailable("store master unreachable")

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        raise StorageUnavailable("store master unreachable")


def _seeded_engine(engines, tmp_path, policy, ids):
    """An engine whose L3 (file, tmp_path) holds ``ids``' pages while L1 and L2 are empty."""
    engine = engines(enable_hierarchical_cache=True, page_size=4, max_total_tokens=1024,
                     hicache_storage_backend="file", hicache_storage_prefetch_policy=policy,
                     extra_config={"file_storage_path": str(tmp_path), "prefetch_threshold": 8,
                                   "prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0.0})
    cold = generate(engine, ids, n=6)
    settle(engine)
    assert engine.cache.counters.backuped_tokens >= 300
    assert on_engine(engine, engine.flush)
    return engine, cold


def _swap_backend(engine, backend, policy):
    def swap():
        engine.cache.detach_storage()
        engine.cache.attach_storage("file", RankedStorage([backend], engine.runner.host_pools), PrefetchConfig(policy=policy, threshold=8, timeout_base=0.05,
                                                                     timeout_per_ki_token=0.0), {})
    on_engine(engine, swap)


def _config(tmp_path):
    return HiCacheStorageConfig(model_name="builtin:tiny", extra_config={"file_storage_path": str(tmp_path)})


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_non_waiting_policies_never_block_on_a_slow_l3(engines, tmp_path, policy):
    ids = prompt(7, 301)
    engine, cold = _seeded_engine(engines, tmp_path, policy, ids)
    gate = threading.Event()
    _swap_backend(engine, GatedFile(_config(tmp_path), gate), policy)
    try:
        out = generate(engine, ids, n=6)  # finishes while every L3 read is still blocked
        assert out.meta["cached_tokens_details"]["storage"] == 0
        assert out.output_ids == cold.output_ids
    finally:
        gate.set()
    settle(engine)
    on_engine(engine, lambda: _accounting_ok(engine.cache))  # the abandoned prefetch gave its L2 pages back


def test_wait_complete_waits_for_l3_and_uses_every_page(engines, tmp_path):
    ids = prompt(8, 301)
    engine, cold = _seeded_engine(engines, tmp_path, "wait_complete", ids)
    gate = threading.Event()
    _swap_backend(engine, GatedFile(_config(tmp_path), gate), "wait_complete")
    q: queue.Queue = queue.Queue()
    engine.submit(Request(ids, SamplingParams(max_new_tokens=6), q.put))
    time.sleep(0.3)
    assert q.empty() and engine.num_queued == 1  # held in the waiting queue by the prefetch
    gate.set()
    while not (out := q.get(timeout=60)).finished:
        pass
    assert out.meta["cached_tokens_details"]["storage"] == 300
    assert out.output_ids == cold.output_ids
    settle(engine)
    on_engine(engine, lambda: _accounting_ok(engine.cache))


def test_unreachable_l3_degrades_to_l1_l2(engines, tmp_path):
    ids = prompt(9, 301)
    engine, cold = _seeded_engine(engines, tmp_path, "wait_complete", ids)
    _swap_backend(engine, BrokenStore(_config(tmp_path)), "wait_complete")
    out = generate(engine, ids, n=6)
    assert out.output_ids == cold.output_ids
    assert engine.cache.storage.degraded.startswith("StorageUnavailable")
    # with L3 degraded, L1 and L2 keep working
    again = generate(engine, ids, n=6)
    assert again.meta["cached_tokens_details"]["device"] == 300
    settle(engine)
    on_engine(engine, lambda: engine.cache.evict(10**9))
    assert generate(engine, ids, n=6).meta["cached_tokens_details"]["host"] == 300


def test_unreachable_l3_at_boot_is_reported_not_fatal(engines, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    engine = engines(enable_hierarchical_cache=True, hicache_storage_backend="file",
                     extra_config={"file_storage_path": str(blocker / "sub")})
    assert engine.cache.storage is None and "StorageUnavailable" in engine.storage_admin.unavailable
    assert generate(engine, prompt(1, 40)).output_ids
