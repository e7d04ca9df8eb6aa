"""The engine: one thread that owns the model and the cache, with a waiting queue and continuous batching.

HTTP handlers only enqueue requests, abort them, or post closures (admin operations) that run
on this thread between steps; outputs flow back through each request's ``emit`` callback. One
step = admit what fits (FCFS, after L3 prefetch policies allow), then one forward over every
running request: one token for those decoding, a prefill chunk for the others.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cache_runtime import cpu_kernels
from cache_runtime.args import ServerArgs, parse_extra_config
from cache_runtime.hicache import HiCache, Prefix
from cache_runtime.memory import DevicePool, HostPool, host_pool_tokens
from cache_runtime.models import load_model, resolve_config, resolve_dtype
from cache_runtime.models.config import CheckpointError, ModelConfig, kv_bytes_per_token
from cache_runtime.models.layers import ForwardBatch, SeqSpan
from cache_runtime.policies import PREFETCH_POLICIES, WRITE_POLICIES, PrefetchConfig, check_policy
from cache_runtime.radix import namespace
from cache_runtime.sampling import SamplingParams, sample
from cache_runtime.storage.base import HiCacheStorageConfig
from cache_runtime.storage.factory import create_storage_backend
from cache_runtime.storage_io import PrefetchOp, RankedStorage
from cache_runtime.tp import Leader, forward_command

log = logging.getLogger(__name__)

# stop strings are looked for in the text of this many last tokens
_STOP_WINDOW_TOKENS = 64


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


def _pick_device(name: str, rank: int = 0) -> torch.device:
    """The device of TP rank ``rank``: GPU ``rank`` of the pod's visible GPUs, or the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available")
    if name == "cuda":
        if rank >= torch.cuda.device_count():
            raise ValueError(f"--tp-size needs {rank + 1} GPUs, {torch.cuda.device_count()} visible")
        return torch.device("cuda", rank)
    return torch.device(name)


@dataclass(frozen=True)
class ModelSetup:
    """What every TP rank resolves the same way from the flags and config.json."""

    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    context_length: int


def model_setup(args: ServerArgs, rank: int = 0) -> ModelSetup:
    cfg = resolve_config(args.model_path)
    device = _pick_device(args.device, rank)
    dtype = resolve_dtype(args.dtype, cfg, device)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype, cfg, device)
    if args.context_length is not None and args.context_length > cfg.max_position_embeddings:
        raise CheckpointError(f"--context-length {args.context_length} exceeds the model's "
                              f"max_position_embeddings {cfg.max_position_embeddings} (config.json)")
    return ModelSetup(cfg, device, dtype, kv_dtype, args.context_length or cfg.max_position_embeddings)


@dataclass(frozen=True)
class StorageAttach:
    """One L3 configuration to attach, from the command line or ``PUT /hicache/storage-backend``."""

    name: str
    extra_json: str | None
    prefetch_policy: str
    write_policy: str
    extra: dict
    backend_extra: dict  # without the prefetch knobs, which the engine keeps
    prefetch: PrefetchConfig

    @classmethod
    def parse(cls, name: str, extra_json: str | None, prefetch_policy: str, write_policy: str) -> "StorageAttach":
        """Raises ValueError naming what is wrong."""
        check_policy("hicache_write_policy", write_policy, WRITE_POLICIES)
        check_policy("hicache_storage_prefetch_policy", prefetch_policy, PREFETCH_POLICIES)
        extra = parse_extra_config(extra_json)
        prefetch, backend_extra = PrefetchConfig.from_extra_config(prefetch_policy, extra)
        return cls(name, extra_json, prefetch_policy, write_policy, extra, backend_extra, prefetch)


class Engine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        # One thread here: the engine thread computes with --cpu-threads (see _loop). A thread
        # team left on this thread would oversubscribe the cores, and OpenMP then sleeps its
        # workers between the thousand small parallel ops of a step (~30% slower decoding).
        torch.set_num_threads(1)
        setup = model_setup(args)
        cfg = self.model_cfg = setup.cfg
        self.device, self.dtype, self.kv_dtype = setup.device, setup.dtype, setup.kv_dtype
        self.context_length = setup.context_length
        heads, width = cfg.kv_row(args.tp_size)
        self.device_pool = DevicePool(args.max_total_tokens, args.page_size, cfg.num_layers, heads, width,
                                      self.kv_dtype, self.device, mla=cfg.is_mla)
        host_tokens = None
        if args.enable_hierarchical_cache:
            token_bytes = kv_bytes_per_token(cfg, str(self.kv_dtype).removeprefix("torch."), tp=args.tp_size)
            host_tokens = host_pool_tokens(self.device_pool.size, args.page_size, args.hicache_ratio,
                                           args.hicache_size, token_bytes)
        # followers start first, so they load their shards while this rank loads its own
        self.tp = Leader(args, self.device, host_tokens) if args.tp_size > 1 else None
        loaded = load_model(args.model_path, self.dtype, self.device, self.context_length,
                            shard=self.tp.shard() if self.tp else None)
        self.model = loaded.model
        if self.device.type == "cpu":
            cpu_kernels.calibrate(self.model.layer_matrices())
        self.tokenizer = loaded.tokenizer
        self.generation = loaded.generation
        hosts: list[HostPool] = []
        if host_tokens:
            files = [None, *(self.tp.host_files if self.tp else [])]
            hosts = [HostPool(host_tokens, args.page_size, cfg.num_layers, heads, width, self.kv_dtype,
                              args.hicache_mem_layout, pin=self.device.type == "cuda", mla=cfg.is_mla, buffer_file=f)
                     for f in files]
        self.rank_hosts = hosts  # every TP rank's L2 (this rank's first): L3 I/O reads and writes them all
        self._wake = threading.Event()
        self.cache = HiCache(self.device_pool, hosts[0] if hosts else None, args.page_size, args.hicache_write_policy,
                             args.hicache_io_backend, self._wake.set, enabled=not args.disable_radix_cache,
                             tp=self.tp)
        self.stats = EngineStats()
        # metrics hooks, called on the engine thread: (request, seconds since arrival), (request)
        self.on_first_token: Callable[[Request, float], None] | None = None
        self.on_finish: Callable[[Request], None] | None = None
        self._inbox: collections.deque[Request] = collections.deque()
        # Requests, not rids: a client-chosen rid need not be unique, and one client's disconnect
        # must never abort another's request.
        self._aborts: collections.deque[Request] = collections.deque()
        self._commands: collections.deque = collections.deque()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.storage_status_reason: str | None = None
        if args.hicache_storage_backend:
            self._attach_at_boot()

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

    def _attach_at_boot(self) -> None:
        """The command line's L3 backend, attached as ``PUT /hicache/storage-backend`` attaches one.
        A bad configuration fails the boot with its message; an L3 that cannot be reached leaves
        the server on L1+L2, saying why (``storage_status_reason``)."""
        a = self.args
        want = StorageAttach.parse(a.hicache_storage_backend, a.hicache_storage_backend_extra_config,
                                   a.hicache_storage_prefetch_policy, a.hicache_write_policy)
        try:
            backend = self.open_storage(want)
        except ValueError:
            raise
        except Exception as exc:
            self.storage_status_reason = f"{type(exc).__name__}: {exc}"
            log.error("L3 backend %s unavailable at boot, running with L1+L2 only: %s",
                      a.hicache_storage_backend, self.storage_status_reason)
            return
        self.install_storage(want, backend)

    def install_storage(self, want: StorageAttach, backend: RankedStorage) -> None:
        """Attach an opened backend (on the engine thread, or before the engine starts) and keep
        the configuration it runs, which ``GET /hicache/storage-backend`` reports."""
        self.cache.attach_storage(want.name, backend, want.prefetch, want.extra)
        self.storage_status_reason = None
        self.args.hicache_storage_backend, self.args.hicache_storage_backend_extra_config = want.name, want.extra_json
        self.set_storage_policies(want)

    def set_storage_policies(self, want: StorageAttach) -> None:
        """The write and prefetch policies of ``want`` (an attach of the backend already attached
        changes only these), kept in the args ``GET /hicache/storage-backend`` reports."""
        self.cache.write_policy, self.cache.prefetch = want.write_policy, want.prefetch
        a = self.args
        a.hicache_storage_prefetch_policy, a.hicache_write_policy = want.prefetch_policy, want.write_policy

    def open_storage(self, want: StorageAttach) -> RankedStorage:
        """Every TP rank's L3 backend (its own keys), or one for MLA, whose latent every rank shares."""
        ranks = 1 if self.model_cfg.is_mla else self.args.tp_size
        backends = []
        try:
            for r in range(ranks):
                backends.append(create_storage_backend(want.name, self.storage_config(want.backend_extra, r)))
        except BaseException:
            for b in backends:
                b.close()
            raise
        return RankedStorage(backends, self.rank_hosts)

    def storage_config(self, backend_extra: dict, tp_rank: int = 0):
        a = self.args
        return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=a.tp_size, pp_rank=0, pp_size=a.pp_size,
                                    is_mla_model=self.model_cfg.is_mla,
                                    is_page_first_layout=a.hicache_mem_layout != "layer_first",
                                    model_name=a.served_name, extra_config=backend_extra)

    # ------------------------------------------------------------------ API for the server (any thread)
    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError with a client-facing message if the request can never run."""
        if not input_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        for t in input_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"input_ids must be integers in 0..{vocab - 1}, got {t!r}")
        params.validate(vocab)
        total = len(input_ids) + params.max_new_tokens
        if total > self.context_length:
            raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the context length ({self.context_length})")
        if total > self.device_pool.size:
            raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the KV pool (--max-total-tokens {self.device_pool.size})")

    def submit(self, req: Request) -> None:
        self.validate(req.input_ids, req.params)
        self._inbox.append(req)
        self._wake.set()

    def abort(self, req: "Request") -> None:
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
        return len(self.running)

    @property
    def num_queued(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def is_idle(self) -> bool:
        """No request queued or running (what attach and detach wait for)."""
        return not self.running and not self.waiting and not self._inbox

    def is_fully_idle(self) -> bool:
        """Idle, with no L1<->L2 copy, L3 prefetch or L3 backup in flight: SGLang's is_fully_idle, which
        /flush_cache waits for, so a flush never drops pages still on their way to L2 or L3."""
        return self.is_idle() and self.cache.busy_ops() == 0

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        torch.set_num_threads(self.args.cpu_threads)
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
                for req in list(self.running):
                    self._finish(req, error="internal error in the engine step")
                worked = True
            if not worked:
                pending = any(r.prefetch_op is not None for r in self.waiting) or self.waiting
                self._wake.wait(0.005 if pending else 0.5)
        for req in self.waiting + self.running + list(self._inbox):
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
            req = self._inbox.popleft()
            if self.cache.host is not None:
                req.prefetch_op = self.cache.maybe_prefetch(self._cache_key(req.input_ids), req.ns)
            self.waiting.append(req)
        while self._aborts:
            self._aborts.popleft().aborted = True
        self.cache.poll()
        self._admit()
        worked = self._step()
        if self.tp is not None:
            self.tp.flush()  # copies sent without a forward (backups after the last step, write_back)
        return worked

    def _cache_key(self, input_ids: list[int]) -> list[int]:
        # the last prompt token is always recomputed: its logits start generation
        return input_ids[: self.cache.aligned(len(input_ids) - 1)]

    def _admit(self) -> None:
        hit = total = 0
        i = 0
        while i < len(self.waiting):
            req = self.waiting[i]
            if req.aborted:
                if req.prefetch_op is not None:
                    self.cache.terminate_prefetch(req.prefetch_op)
                del self.waiting[i]
                self._emit_final(req, {"type": "abort"})
                continue
            if len(self.running) >= self.args.max_running_requests:
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
                    req.prefetch_op = self.cache.maybe_prefetch(self._cache_key(req.input_ids), req.ns)
                break
            del self.waiting[i]
            hit, total = hit + req.prefix.length, total + len(req.input_ids)
        if total:  # SGLang reports the hit rate of each prefill batch
            self.stats.cache_hit_rate = hit / total

    def _start(self, req: Request) -> bool:
        prefix = self.cache.acquire_prefix(self._cache_key(req.input_ids), req.ns)
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

    def _step(self) -> bool:
        for req in [r for r in self.running if r.aborted]:
            self._finish(req, reason={"type": "abort"})
        if not self.running:
            return False
        ids: list[int] = []
        seqs: list[SeqSpan] = []
        stepped: list[tuple[Request, int]] = []
        loads = []
        budget = self.args.chunked_prefill_size
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
            start = len(ids)
            ids.extend(tokens[req.kv_len : req.kv_len + n])
            seqs.append(SeqSpan(start, n, req.slots[: req.kv_len + n], req.kv_len + n == len(tokens)))
            stepped.append((req, n))
            for op in req.prefix.pending_loads:
                if not op.done and op not in loads:
                    loads.append(op)
        if not stepped:
            return False
        positions = torch.cat([torch.arange(r.kv_len, r.kv_len + n) for r, n in stepped])
        out_slots = torch.cat([r.slots[r.kv_len : r.kv_len + n] for r, n in stepped])
        dev = self.device
        batch = ForwardBatch(
            torch.tensor(ids, dtype=torch.int64, device=dev), positions.to(dev), out_slots.to(dev),
            [SeqSpan(s.start, s.num_new, s.ctx_slots.to(dev), s.want_logits) for s in seqs],
            wait_layer=(lambda layer: [op.wait_layer(layer) for op in loads]) if loads else None,
        )
        if self.tp is not None:
            self.tp.send(forward_command(batch))
            self.tp.flush()
        logits = self.model(batch, self.device_pool.k, self.device_pool.v)
        self._count_decode(sum(1 for r, _ in stepped if r.kv_len >= len(r.input_ids)))
        row = 0
        for (req, n), seq in zip(stepped, seqs):
            req.kv_len += n
            req.prefix.pending_loads = []  # this forward waited for every layer of them
            if not seq.want_logits:
                continue
            self._after_token(req, logits[row])
            row += 1
        return True

    def _count_decode(self, decoded: int) -> None:
        """SGLang's gen_throughput: tokens decoded per second, reported every DECODE_LOG_INTERVAL decode steps."""
        if not decoded:
            return
        s = self.stats
        s.decode_steps += 1
        s.decoded_tokens += decoded
        if s.decode_steps % DECODE_LOG_INTERVAL == 0:
            now = time.monotonic()
            s.gen_throughput = s.decoded_tokens / max(now - s.gen_throughput_at, 1e-9)
            s.gen_throughput_at, s.decoded_tokens = now, 0

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
        if tok in p.stop_token_ids or not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
            reason = {"type": "stop", "matched": tok}
        elif p.stop:
            text = self.tokenizer.decode(req.output_ids[-_STOP_WINDOW_TOKENS:])
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
        self.running.remove(req)
        prefix = req.prefix
        if error is None:
            aligned = self.cache.aligned(req.kv_len)
            self.cache.insert(req.tokens[:aligned], req.slots[:aligned], prefix.length, req.ns)
            self.device_pool.allocator.free(req.slots[aligned:])
        else:
            self.device_pool.allocator.free(req.slots[prefix.length :])
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
