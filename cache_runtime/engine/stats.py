"""The engine's own counters, which ``cache_runtime.metrics`` reads at scrape time.

Only the engine thread writes them (when a request finishes, a batch is admitted or a decode
step runs); the metrics collector reads them from the scrape thread without a lock, as plain
numbers it may see one step old.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# SGLang's scheduler reports gen_throughput every this many decode steps (--decode-log-interval)
DECODE_LOG_INTERVAL = 40


@dataclass
class StreamTotals:
    """Finished requests of one kind (streamed or not), counted when they finish, as SGLang's tokenizer does."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0


@dataclass
class EngineStats:
    by_stream: dict[bool, StreamTotals] = field(default_factory=lambda: {False: StreamTotals(), True: StreamTotals()})
    cached_device: int = 0  # cached prompt tokens of finished requests, by tier
    cached_host: int = 0
    cached_storage: int = 0
    requests_failed: int = 0
    # SGLang's per-report gauges: the hit rate of the last batch of admitted requests, and the
    # tokens per second decoded over the last DECODE_LOG_INTERVAL decode steps
    cache_hit_rate: float = 0.0
    gen_throughput: float = 0.0
    gen_throughput_at: float = field(default_factory=time.monotonic)  # when gen_throughput was last reported
    decode_steps: int = 0
    decoded_tokens: int = 0  # since the last report

    def count_decode(self, decoded: int) -> None:
        """SGLang's gen_throughput: tokens decoded per second, reported every DECODE_LOG_INTERVAL decode steps."""
        if not decoded:
            return
        self.decode_steps += 1
        self.decoded_tokens += decoded
        if self.decode_steps % DECODE_LOG_INTERVAL == 0:
            now = time.monotonic()
            self.gen_throughput = self.decoded_tokens / max(now - self.gen_throughput_at, 1e-9)
            self.gen_throughput_at, self.decoded_tokens = now, 0
