"""Scheduling policy: which waiting requests start (admission) and what one forward computes
(batch composition). Engine thread only, like the cache it asks.

Admission is FCFS: a request whose L3 prefetch its policy still waits for keeps its place and
lets those behind it pass; the first request that does not fit in L1 (after eviction) stops
admission for this step. A batch
holds every running request: decodes first (one token each), then prefill chunks within
``--chunked-prefill-size`` tokens, all in one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_runtime.engine.requests import Request
from cache_runtime.hicache import HiCache
from cache_runtime.models.layers import ForwardBatch, SeqSpan


@dataclass
class Batch:
    """One forward: the requests it steps (and by how many tokens) and the batch the model runs."""

    stepped: list[tuple[Request, int]]
    seqs: list[SeqSpan]
    forward: ForwardBatch
    decoding: int  # requests in it that decode one token (the others prefill)


class Scheduler:
    def __init__(self, cache: HiCache, max_running: int, chunked_prefill_size: int) -> None:
        self.cache = cache
        self.max_running = max_running
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def cache_key(self, input_ids: list[int]) -> list[int]:
        """The part of a prompt that is looked up and cached: the last prompt token is always
        recomputed, its logits start generation."""
        return input_ids[: self.cache.aligned(len(input_ids) - 1)]

    def enqueue(self, req: Request) -> None:
        """Queues an arrived request; its prompt beyond L1+L2 starts coming from L3 at once."""
        if self.cache.host is not None:
            req.prefetch_op = self.cache.maybe_prefetch(self.cache_key(req.input_ids), req.ns)
        self.waiting.append(req)

    def admit(self) -> tuple[list[Request], float | None]:
        """Starts what fits. Returns the waiting requests dropped because they were aborted, and the
        prefix hit rate of the requests admitted (None when none was)."""
        dropped: list[Request] = []
        hit = total = 0
        i = 0
        while i < len(self.waiting):
            req = self.waiting[i]
            if req.aborted:
                if req.prefetch_op is not None:
                    self.cache.terminate_prefetch(req.prefetch_op)
                del self.waiting[i]
                dropped.append(req)
                continue
            if len(self.running) >= self.max_running:
                break
            fetched = False
            if req.prefetch_op is not None:
                if not self.cache.can_terminate(req.prefetch_op):
                    i += 1
                    continue
                req.storage_tokens = max(req.storage_tokens, self.cache.terminate_prefetch(req.prefetch_op))
                req.prefetch_op = None
                fetched = True
            if not self._start(req):
                if fetched:  # no L1 room yet: keep the L3 pages coming while it waits
                    req.prefetch_op = self.cache.maybe_prefetch(self.cache_key(req.input_ids), req.ns)
                break
            del self.waiting[i]
            hit, total = hit + req.prefix.length, total + len(req.input_ids)
        return dropped, (hit / total if total else None)

    def _start(self, req: Request) -> bool:
        """Locks the request's cached prefix and allocates L1 for the rest of its tokens, if there is room."""
        prefix = self.cache.acquire_prefix(self.cache_key(req.input_ids), req.ns)
        need = len(req.input_ids) + req.params.max_new_tokens - prefix.length
        own = self.cache.alloc_device(need)
        if own is None:
            self.cache.release_prefix(prefix)
            return False
        req.prefix = prefix
        req.slots = torch.cat([prefix.slots, own])
        req.kv_len = prefix.length
        self.running.append(req)
        return True

    def compose(self, device: torch.device) -> Batch | None:
        """The next forward over the running requests, or None when none has a token to compute."""
        ids: list[int] = []
        seqs: list[SeqSpan] = []
        stepped: list[tuple[Request, int]] = []
        loads = []
        decoding = 0
        budget = self.chunked_prefill_size
        # decodes first (one token each), then prefill chunks within the budget
        for req in sorted(self.running, key=lambda r: r.kv_len < len(r.input_ids)):
            tokens = req.tokens
            remaining = len(tokens) - req.kv_len
            prefilling = req.kv_len < len(req.input_ids)
            n = min(remaining, budget) if prefilling else remaining
            if n <= 0:
                continue
            if prefilling:
                budget -= n
            else:
                decoding += 1
            start = len(ids)
            ids.extend(tokens[req.kv_len : req.kv_len + n])
            seqs.append(SeqSpan(start, n, req.slots[: req.kv_len + n], req.kv_len + n == len(tokens)))
            stepped.append((req, n))
            for op in req.prefix.pending_loads:
                if not op.done and op not in loads:
                    loads.append(op)
        if not stepped:
            return None
        positions = torch.cat([torch.arange(r.kv_len, r.kv_len + n) for r, n in stepped])
        out_slots = torch.cat([r.slots[r.kv_len : r.kv_len + n] for r, n in stepped])
        forward = ForwardBatch(
            torch.tensor(ids, dtype=torch.int64, device=device), positions.to(device), out_slots.to(device),
            [SeqSpan(s.start, s.num_new, s.ctx_slots.to(device), s.want_logits) for s in seqs],
            wait_layer=(lambda layer: [op.wait_layer(layer) for op in loads]) if loads else None,
        )
        return Batch(stepped, seqs, forward, decoding)

    @staticmethod
    def advance(batch: Batch) -> list[Request]:
        """Records that ``batch`` ran; returns the requests whose logits it produced, in row order."""
        sampled = []
        for (req, n), seq in zip(batch.stepped, batch.seqs):
            req.kv_len += n
            req.prefix.pending_loads = []  # this forward waited for every layer of them
            if seq.want_logits:
                sampled.append(req)
        return sampled
