"""Prometheus metrics in SGLang's names and labels, read from the engine at scrape time.

Counters and gauges are produced by a custom collector from the engine's own counters, so the
engine thread never touches them; only the latency histograms are live objects, observed through
the engine's hooks. Each ``sglang:*`` family carries the labels of the SGLang collector that
exports it (newest release): the scheduler's (model, engine type, ranks), the tokenizer's (model,
engine type, and ``is_streaming`` on per-request counts), the radix cache's (cache type, ranks)
or the storage's (backend, ranks). The runtime is one unified (non-disaggregated) scheduler whose
metrics rank is TP rank 0.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# SGLang exports gen_throughput as 0 once no decode report arrived for this long
GEN_THROUGHPUT_STALENESS_SECONDS = 30.0


def scheduler_labels(model_name: str) -> dict[str, str]:
    return {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


def tokenizer_labels(model_name: str) -> dict[str, str]:
    return {"model_name": model_name, "engine_type": "unified"}


def radix_cache_labels(hierarchical: bool) -> dict[str, str]:
    cache_type = "UnifiedRadixCache" if hierarchical else "RadixCache"
    return {"cache_type": cache_type, "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}


def storage_labels(backend: str) -> dict[str, str]:
    return {"storage_backend": backend, "tp_rank": "0", "dp_rank": "0", "pp_rank": "0", "pp_size": "1",
            "attn_cp_rank": "0", "attn_cp_size": "1"}


def _streaming(stream: bool) -> str:
    return "true" if stream else "false"


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine
        model_name = engine.args.served_name
        self.scheduler = scheduler_labels(model_name)
        self.tokenizer = tokenizer_labels(model_name)
        self.radix = radix_cache_labels(engine.cache.host is not None)
        self.storage_backend: str | None = None

    def collect(self):
        e = self.engine
        cache = e.cache
        s, c = e.stats, cache.counters

        def family(kind, name, doc, labels: dict, values: list[tuple[tuple, float]], extra: tuple = ()):
            m = kind(name, doc, labels=[*labels, *extra])
            for extra_values, value in values:
                m.add_metric([*labels.values(), *extra_values], value)
            return m

        def gauge(name, doc, labels, value):
            return family(GaugeMetricFamily, name, doc, labels, [((), value)])

        def counter(name, doc, labels, value):
            return family(CounterMetricFamily, name, doc, labels, [((), value)])

        def plain_gauge(name, doc, value):
            return gauge(name, doc, {}, value)

        def plain_counter(name, doc, value):
            return counter(name, doc, {}, value)

        sched = self.scheduler
        yield gauge("sglang:num_running_reqs", "The number of running requests.", sched, e.num_running)
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", sched, e.num_queued)
        stale = time.monotonic() - s.gen_throughput_at > GEN_THROUGHPUT_STALENESS_SECONDS
        yield gauge("sglang:gen_throughput", "The generation throughput (token/s).", sched,
                    0.0 if stale else s.gen_throughput)
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate of the last batch of admitted requests.",
                    sched, s.cache_hit_rate)
        dev = e.runner.device_pool.allocator
        yield gauge("sglang:token_usage", "The token usage.", sched, dev.used_tokens / dev.total_tokens)
        host = cache.host
        if host is not None:
            yield gauge("sglang:hicache_host_used_tokens", "Number of tokens currently used in the host KV cache.",
                        sched, host.allocator.used_tokens)
            yield gauge("sglang:hicache_host_total_tokens", "Total capacity of the host KV cache in tokens.",
                        sched, host.allocator.total_tokens)
        token_bytes = host.page_bytes / host.page_size if host else 0
        yield plain_gauge("hicache_host_used_bytes", "L2 host pool bytes in use (one rank's pool).",
                          host.allocator.used_tokens * token_bytes if host else 0)
        yield plain_gauge("hicache_host_capacity_bytes", "L2 host pool capacity in bytes (one rank's pool).",
                          host.allocator.total_tokens * token_bytes if host else 0)
        io = cache.io
        yield plain_counter("hicache_storage_read_bytes", "Bytes prefetched from L3 into L2 (all ranks).",
                            io.read_bytes)
        yield plain_counter("hicache_storage_written_bytes", "Bytes backed up from L2 to L3 (all ranks).",
                            io.written_bytes)
        for name, doc, latency in (
                ("hicache_prefetch_duration_seconds", "L3 prefetches that fetched pages: issue to last page in L2.",
                 io.prefetch),
                ("hicache_backup_duration_seconds", "L3 backups that wrote pages: issue to last page in L3.",
                 io.backup)):
            buckets, total = latency.snapshot()
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)

        tok = self.tokenizer
        yield family(CounterMetricFamily, "sglang:cached_tokens", "Number of cached prompt tokens by source.", tok,
                     [(("device",), s.cached_device), (("host",), s.cached_host), (("storage",), s.cached_storage)],
                     extra=("cache_source",))
        streams = sorted(s.by_stream.items())
        for name, doc, attr in (("sglang:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
                                ("sglang:generation_tokens", "Number of generation tokens processed.",
                                 "generation_tokens"),
                                ("sglang:num_requests", "Number of requests processed.", "requests")):
            yield family(CounterMetricFamily, name, doc, tok,
                         [((_streaming(stream),), getattr(t, attr)) for stream, t in streams], extra=("is_streaming",))

        radix = self.radix
        yield counter("sglang:evicted_tokens", "The number of device KV token slots freed by eviction.", radix,
                      c.evicted_tokens)
        yield family(CounterMetricFamily, "sglang:load_back_tokens", "The number of tokens loaded back from host to "
                     "device, by host pool.", radix, [(("kv",), c.load_back_tokens)], extra=("pool",))

        # SGLang's storage collector exists from the first attach on and keeps the last backend's labels
        self.storage_backend = cache.storage_backend_name or self.storage_backend
        if self.storage_backend is not None:
            st = storage_labels(self.storage_backend)
            yield counter("sglang:prefetched_tokens", "Prompt tokens transferred from L3 storage into host memory.",
                          st, c.prefetched_tokens)
            yield counter("sglang:backuped_tokens", "Number of backuped tokens.", st, c.backuped_tokens)

        yield plain_counter("hicache_l2_backup_tokens", "Tokens copied from L1 to L2.", c.l2_backup_tokens)
        yield plain_counter("hicache_l2_evicted_tokens", "Tokens evicted from L2.", c.host_evicted_tokens)
        yield plain_counter("hicache_prefetch_skipped", "L3 prefetches not issued: no room in L2 (in flight or free).",
                            c.prefetch_skipped)
        yield plain_counter("hicache_request_errors", "Requests that failed inside the engine.", s.requests_failed)
        degraded = 1 if e.storage_admin.degraded() else 0
        yield plain_gauge("hicache_storage_degraded",
                          "1 when the L3 backend is unreachable and the runtime runs on L1+L2.", degraded)


class Metrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self._labels = tokenizer_labels(engine.args.served_name)
        names = [*self._labels, "is_streaming"]
        self._ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               names, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in "
                              "seconds", names, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def first_token(self, req, seconds: float) -> None:
        self._ttft.labels(**self._labels, is_streaming=_streaming(req.stream)).observe(seconds)

    def finished(self, req) -> None:
        self._e2e.labels(**self._labels, is_streaming=_streaming(req.stream)).observe(time.monotonic() - req.arrival)
