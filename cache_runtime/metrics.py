"""Prometheus metrics in SGLang's names, read from the engine at scrape time.

Counters and gauges are produced by a custom collector from the engine's own counters, so the
engine thread never touches prometheus objects; only the latency histograms are live objects.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        e = self.engine
        cache = e.cache
        s, c = e.stats, cache.counters

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc)
            m.add_metric([], value)
            return m

        yield gauge("sglang:num_running_reqs", "Requests in the running batch.", e.num_running)
        yield gauge("sglang:num_queue_reqs", "Requests waiting to be scheduled.", e.num_queued)
        total_cached = s.cached_device + s.cached_host + s.cached_storage
        yield gauge("sglang:cache_hit_rate", "Cached prompt tokens / prompt tokens since start.",
                    total_cached / s.prompt_tokens if s.prompt_tokens else 0.0)
        dev = e.device_pool.allocator
        yield gauge("sglang:token_usage", "Fraction of the L1 pool in use.", dev.used_tokens / dev.total_tokens)
        host = cache.host
        yield gauge("sglang:hicache_host_used_tokens", "L2 host pool tokens in use.",
                    host.allocator.used_tokens if host else 0)
        yield gauge("sglang:hicache_host_total_tokens", "L2 host pool capacity in tokens.",
                    host.allocator.total_tokens if host else 0)
        token_bytes = host.page_bytes / host.page_size if host else 0
        yield gauge("hicache_host_used_bytes", "L2 host pool bytes in use (one rank's pool).",
                    host.allocator.used_tokens * token_bytes if host else 0)
        yield gauge("hicache_host_capacity_bytes", "L2 host pool capacity in bytes (one rank's pool).",
                    host.allocator.total_tokens * token_bytes if host else 0)
        io = cache.io
        yield counter("hicache_storage_read_bytes", "Bytes prefetched from L3 into L2 (all ranks).", io.read_bytes)
        yield counter("hicache_storage_written_bytes", "Bytes backed up from L2 to L3 (all ranks).", io.written_bytes)
        for name, doc, latency in (
                ("hicache_prefetch_duration_seconds", "L3 prefetches that fetched pages: issue to last page in L2.",
                 io.prefetch),
                ("hicache_backup_duration_seconds", "L3 backups that wrote pages: issue to last page in L3.",
                 io.backup)):
            buckets, total = latency.snapshot()
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)
        cached = CounterMetricFamily("sglang:cached_tokens", "Prompt tokens served from cache, by tier.",
                                     labels=["cache_source"])
        cached.add_metric(["device"], s.cached_device)
        cached.add_metric(["host"], s.cached_host)
        cached.add_metric(["storage"], s.cached_storage)
        yield cached
        yield counter("sglang:prefetched_tokens", "Tokens prefetched from L3 into L2.", c.prefetched_tokens)
        yield counter("sglang:backuped_tokens", "Tokens written from L2 to L3.", c.backuped_tokens)
        yield counter("sglang:evicted_tokens", "Tokens evicted from L1.", c.evicted_tokens)
        yield counter("sglang:load_back_tokens", "Tokens loaded from L2 back to L1.", c.load_back_tokens)
        yield counter("sglang:prompt_tokens", "Prompt tokens of scheduled requests.", s.prompt_tokens)
        yield counter("sglang:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("sglang:num_requests", "Finished requests.", s.requests_finished)
        yield counter("hicache_l2_backup_tokens", "Tokens copied from L1 to L2.", c.l2_backup_tokens)
        yield counter("hicache_l2_evicted_tokens", "Tokens evicted from L2.", c.host_evicted_tokens)
        yield counter("hicache_prefetch_skipped", "L3 prefetches not issued: no room in L2 (in flight or free).",
                      c.prefetch_skipped)
        yield counter("hicache_request_errors", "Requests that failed inside the engine.", s.requests_failed)
        storage = cache.storage
        degraded = 1 if (storage is not None and storage.degraded) or e.storage_status_reason else 0
        yield gauge("hicache_storage_degraded", "1 when the L3 backend is unreachable and the runtime runs on L1+L2.",
                    degraded)


class Metrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
