"""The engine loop: the one thread that owns the model, the cache and every request's state.

Invariants: only the engine thread touches the radix tree, reference counts, allocators and the
scheduler's queues; HTTP handlers only enqueue requests (``submit``), flag them aborted
(``abort``) or post closures that run here between steps (``call``: admin operations); outputs
flow back through each request's ``emit`` callback. Copies run on the transfer and L3 threads
and come back as acks the cache polls here. One step = run posted closures, queue arrivals
(starting their L3 prefetch), admit what fits, then one forward over every running request
(``Scheduler.compose``), broadcast first to the TP followers. A failed step fails the running
batch; with tensor parallelism it stops the server, since the ranks may no longer be in step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from typing import Any, Callable

import torch

from cache_runtime.args import ServerArgs
from cache_runtime.engine.requests import Output, Request
from cache_runtime.engine.runner import ModelRunner, l2_tokens, model_setup
from cache_runtime.engine.scheduler import Scheduler
from cache_runtime.engine.stats import EngineStats
from cache_runtime.engine.storage_admin import StorageAdmin
from cache_runtime.engine.tp import Leader, forward_command
from cache_runtime.hicache import HiCache
from cache_runtime.sampling import SamplingParams, sample

log = logging.getLogger(__name__)

# stop strings are looked for in the text of this many last tokens
_STOP_WINDOW_TOKENS = 64


class Engine:
    """Rank 0's engine: its ``ModelRunner``, the cache over its pools, the scheduler, the TP
    leader (with --tp-size > 1) and the L3 admin, stepped by one thread."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        # One thread here: the engine thread computes with --cpu-threads (see _loop). A thread
        # team left on this thread would oversubscribe the cores, and OpenMP then sleeps its
        # workers between the thousand small parallel ops of a step (~30% slower decoding).
        torch.set_num_threads(1)
        setup = model_setup(args)
        host_tokens = l2_tokens(args, setup)
        # followers start first, so they load their shards while this rank loads its own
        self.tp = Leader(args, setup.device, host_tokens) if args.tp_size > 1 else None
        runner = self.runner = ModelRunner(args, setup, 0, host_tokens,
                                           [None, *(self.tp.host_files if self.tp else [])])
        self.device = runner.device  # where the engine's batches go
        self._wake = threading.Event()
        self.cache = HiCache(runner.device_pool, runner.host_pool, args.page_size, args.hicache_write_policy,
                             args.hicache_io_backend, self._wake.set, enabled=not args.disable_radix_cache,
                             tp=self.tp)
        self.scheduler = Scheduler(self.cache, args.max_running_requests, args.chunked_prefill_size)
        self.stats = EngineStats()
        # metrics hooks, called on the engine thread: (request, seconds since arrival), (request)
        self.on_first_token: Callable[[Request, float], None] | None = None
        self.on_finish: Callable[[Request], None] | None = None
        self._inbox: collections.deque[Request] = collections.deque()
        # Requests, not rids: a client-chosen rid need not be unique, and one client's disconnect
        # must never abort another's request.
        self._aborts: collections.deque[Request] = collections.deque()
        self._commands: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.storage_admin = StorageAdmin(args, runner, self.cache, self)
        if args.hicache_storage_backend:
            self.storage_admin.attach_at_boot()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.cache.detach_storage()
        if self.cache.transfer is not None:
            self.cache.transfer.stop()
        if self.tp is not None:
            self.tp.stop()

    # ------------------------------------------------------------------ API for the server (any thread)
    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError with a client-facing message if the request can never run."""
        if not input_ids:
            raise ValueError("the prompt is empty")
        vocab = self.runner.cfg.vocab_size
        for t in input_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"input_ids must be integers in 0..{vocab - 1}, got {t!r}")
        params.validate(vocab)
        total = len(input_ids) + params.max_new_tokens
        if total > self.runner.context_length:
            raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the context length ({self.runner.context_length})")
        pool = self.runner.device_pool.size
        if total > pool:
            raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the KV pool (--max-total-tokens {pool})")

    def submit(self, req: Request) -> None:
        self.validate(req.input_ids, req.params)
        self._inbox.append(req)
        self._wake.set()

    def abort(self, req: Request) -> None:
        self._aborts.append(req)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs ``fn`` on the engine thread between steps (admin operations)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append((fn, fut))
        self._wake.set()
        return fut

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_queued(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    def is_idle(self) -> bool:
        """No request queued or running (what attach and detach wait for)."""
        return not self.scheduler.running and not self.scheduler.waiting and not self._inbox

    def is_fully_idle(self) -> bool:
        """Idle, with no L1<->L2 copy, L3 prefetch or L3 backup in flight: SGLang's is_fully_idle, which
        /flush_cache waits for, so a flush never drops pages still on their way to L2 or L3."""
        return self.is_idle() and self.cache.busy_ops() == 0

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        torch.set_num_threads(self.args.cpu_threads)
        sched = self.scheduler
        while not self._stop.is_set():
            self._wake.clear()
            if self.tp is not None:
                self.tp.check_alive()
            try:
                worked = self._iterate()
            except Exception:
                if self.tp is not None:  # the ranks may no longer be in step: restart them all
                    log.critical("engine step failed with tensor parallelism; stopping the server", exc_info=True)
                    os._exit(3)
                log.exception("engine step failed; failing the running batch")
                for req in list(sched.running):
                    self._finish(req, error="internal error in the engine step")
                worked = True
            if not worked:
                pending = any(r.prefetch_op is not None for r in sched.waiting) or sched.waiting
                self._wake.wait(0.005 if pending else 0.5)
        for req in sched.waiting + sched.running + list(self._inbox):
            req.emit(Output(req.output_ids, True, req.meta(), error="server shutting down"))

    def _iterate(self) -> bool:
        while self._commands:
            fn, fut = self._commands.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:
                    fut.set_exception(exc)
        while self._inbox:
            self.scheduler.enqueue(self._inbox.popleft())
        while self._aborts:
            self._aborts.popleft().aborted = True
        self.cache.poll()
        dropped, hit_rate = self.scheduler.admit()
        for req in dropped:
            self._emit_final(req, {"type": "abort"})
        if hit_rate is not None:  # SGLang reports the hit rate of each prefill batch
            self.stats.cache_hit_rate = hit_rate
        worked = self._step()
        if self.tp is not None:
            self.tp.flush()  # copies sent without a forward (backups after the last step, write_back)
        return worked

    def _step(self) -> bool:
        for req in [r for r in self.scheduler.running if r.aborted]:
            self._finish(req, reason={"type": "abort"})
        if not self.scheduler.running:
            return False
        batch = self.scheduler.compose(self.device)
        if batch is None:
            return False
        if self.tp is not None:
            self.tp.send(forward_command(batch.forward))
            self.tp.flush()
        logits = self.runner.forward(batch.forward)
        self.stats.count_decode(batch.decoding)
        for row, req in enumerate(self.scheduler.advance(batch)):
            self._after_token(req, logits[row])
        return True

    def _after_token(self, req: Request, logits: torch.Tensor) -> None:
        p = req.params
        if len(req.output_ids) >= p.max_new_tokens:  # max_new_tokens == 0: prefill only
            self._finish(req, reason={"type": "length", "length": p.max_new_tokens})
            return
        tok, logprob = sample(logits, p, req.generator)
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            if self.on_first_token is not None:
                self.on_first_token(req, now - req.arrival)
        req.output_ids.append(tok)
        req.logprobs.append(logprob)
        reason = None
        if tok in p.stop_token_ids or not p.ignore_eos and tok in self.runner.tokenizer.eos_token_ids:
            reason = {"type": "stop", "matched": tok}
        elif p.stop:
            text = self.runner.tokenizer.decode(req.output_ids[-_STOP_WINDOW_TOKENS:])
            for s in p.stop:
                if s and s in text:  # the output stops at its first occurrence; text after it is cut
                    reason = {"type": "stop", "matched": s}
                    break
        if reason is None and len(req.output_ids) >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        if reason is not None:
            self._finish(req, reason=reason)
        else:
            req.emit(Output(list(req.output_ids), False, req.meta(), logprobs=list(req.logprobs)))

    def _finish(self, req: Request, reason: dict | None = None, error: str | None = None) -> None:
        """Caches the request's KV (unless it failed), releases its locks and slots, and answers it."""
        self.scheduler.running.remove(req)
        prefix = req.prefix
        allocator = self.runner.device_pool.allocator
        if error is None:
            aligned = self.cache.aligned(req.kv_len)
            self.cache.insert(req.tokens[:aligned], req.slots[:aligned], prefix.length, req.ns)
            allocator.free(req.slots[aligned:])
        else:
            allocator.free(req.slots[prefix.length :])
        self.cache.release_prefix(prefix)
        self._emit_final(req, reason, error)

    def _emit_final(self, req: Request, reason: dict | None, error: str | None = None) -> None:
        req.finished = True
        s = self.stats
        if error is None:
            totals = s.by_stream[req.stream]
            totals.prompt_tokens += len(req.input_ids)
            totals.generation_tokens += len(req.output_ids)
            totals.requests += 1
            details = req.cached_details()
            s.cached_device += details["device"]
            s.cached_host += details["host"]
            s.cached_storage += details["storage"]
        else:
            s.requests_failed += 1
        if self.on_finish is not None:
            self.on_finish(req)
        req.emit(Output(list(req.output_ids), True, req.meta(), reason, list(req.logprobs), error))

    # ------------------------------------------------------------------ admin (engine thread only)
    def flush(self) -> bool:
        """SGLang's /flush_cache: drops L1 and L2 (never L3); refused unless fully idle."""
        self.cache.poll()  # copies that finished since the last step no longer count as in flight
        if not self.is_fully_idle():
            return False
        self.cache.reset()
        return True
