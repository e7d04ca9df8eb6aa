"""L2<->L3 traffic in /metrics: prefetch and backup latency histograms, bytes moved, L2 bytes."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cache_runtime.metrics import Metrics
from tests.unit.runtime.conftest import generate, on_engine, prompt, settle


def samples(engine) -> dict[str, float]:
    text = generate_latest(Metrics(engine).registry).decode()
    return {s.name + (str(sorted(s.labels.items())) if s.labels else ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_storage_traffic_is_measured(engines, tmp_path):
    engine = engines(enable_hierarchical_cache=True, page_size=4, max_total_tokens=1024,
                     hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                     extra_config={"file_storage_path": str(tmp_path), "prefetch_threshold": 8})
    ids = prompt(11, 301)
    generate(engine, ids)
    settle(engine)
    assert on_engine(engine, engine.flush)  # L1 and L2 emptied: the next request reads L3
    out = generate(engine, ids)
    settle(engine)
    assert out.meta["cached_tokens_details"]["storage"] == 300
    got = samples(engine)
    host, counters = engine.cache.host, engine.cache.counters
    token_bytes = host.page_bytes // host.page_size
    assert got["hicache_storage_written_bytes_total"] == counters.backuped_tokens * token_bytes > 0
    assert got["hicache_storage_read_bytes_total"] == counters.prefetched_tokens * token_bytes > 0
    assert got["hicache_prefetch_duration_seconds_count"] == 1 and got["hicache_prefetch_duration_seconds_sum"] > 0
    assert got["hicache_backup_duration_seconds_count"] >= 1
    assert got["hicache_prefetch_duration_seconds_bucket[('le', '+Inf')]"] == 1
    assert got["hicache_host_capacity_bytes"] == host.allocator.total_tokens * token_bytes
    assert got["hicache_host_used_bytes"] == host.allocator.used_tokens * token_bytes > 0
