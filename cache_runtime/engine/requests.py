"""The engine's request types: what the server submits (``Request``) and what the engine emits
back after each step (``Output``).

A ``Request`` is created on an HTTP thread and handed to the engine with ``Engine.submit``; from
then on only the engine thread reads or writes its fields (prefix, slots, kv_len, outputs), and
the consumer sees it only through the ``Output`` objects passed to its ``emit`` callback.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from cache_runtime.hicache import Prefix
from cache_runtime.radix import namespace
from cache_runtime.sampling import SamplingParams
from cache_runtime.storage_io import PrefetchOp


@dataclass
class Output:
    """What the engine tells a request's consumer after each step."""

    output_ids: list[int]
    finished: bool
    meta: dict
    finish_reason: dict | None = None
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None


class Request:
    def __init__(self, input_ids: list[int], params: SamplingParams, emit: Callable[[Output], None],
                 rid: str | None = None, extra_key: str | None = None, cache_salt: str | None = None,
                 stream: bool = False) -> None:
        self.rid = rid or uuid.uuid4().hex
        self.stream = stream  # answered as a stream: SGLang's is_streaming metric label
        self.input_ids = input_ids
        self.ns = namespace(extra_key, cache_salt)  # its prefixes are cached apart from other namespaces
        self.params = params
        self.emit = emit
        self.arrival = time.monotonic()
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.prefix: Prefix | None = None
        self.prefetch_op: PrefetchOp | None = None
        self.storage_tokens = 0
        self.slots: torch.Tensor | None = None
        self.kv_len = 0
        self.first_token_at: float | None = None
        self.aborted = False
        self.finished = False
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None

    @property
    def tokens(self) -> list[int]:
        return self.input_ids + self.output_ids

    def cached_details(self) -> dict:
        if self.prefix is None:
            return {"device": 0, "host": 0, "storage": 0}
        storage = min(self.storage_tokens, self.prefix.host_tokens)
        return {"device": self.prefix.device_tokens, "host": self.prefix.host_tokens - storage, "storage": storage}

    def meta(self) -> dict:
        details = self.cached_details()
        return {
            "id": self.rid,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": sum(details.values()),
            "cached_tokens_details": details,
            "e2e_latency": time.monotonic() - self.arrival,
        }
