"""L2<->L3 traffic on background threads: prefetch (L3 -> L2) and backup (L2 -> L3).

Both threads touch the host pool only while holding their op's lock and only if the engine has
not cancelled/terminated the op, so the engine can always take an op back instantly (prefetch
budget expired, detach) even while the backend call itself is still hanging. Any backend
failure marks the worker degraded: the engine then runs on L1+L2 until a probe succeeds.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from typing import Callable

import torch

from cache_runtime.memory import HostPool

log = logging.getLogger(__name__)

STORAGE_BATCH_SIZE = 128  # pages per backend call, as SGLang
PROBE_INTERVAL_S = 15.0  # how often a degraded backend is probed for recovery
_PROBE_KEY = "0" * 64


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Latency:
    """A latency histogram the I/O threads write and a metrics scrape reads (no prometheus objects here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) pairs ending with +Inf, and the sum."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, seen = [], 0
        for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), counts):
            seen += n
            out.append((bound, seen))
        return out, total


class StorageIoStats:
    """L2<->L3 traffic since start: prefetch and backup latency, bytes read and written (all ranks)."""

    def __init__(self) -> None:
        self.prefetch = Latency()  # a prefetch that fetched pages: from its issue to the last page in L2
        self.backup = Latency()  # a backup that wrote pages: from its issue to the last page in L3
        self.read_bytes = 0  # written by the prefetch thread only
        self.written_bytes = 0  # written by the backup thread only


class RankedStorage:
    """The L3 backends of every tensor-parallel rank and the L2 pools their pages move to and from.

    MHA: one backend per rank, each with its own keys (SGLang's per-rank names), backend r <-> pool
    r. MLA: the latent is the same on every rank, so one backend (rank 0's keys) feeds every pool.
    """

    def __init__(self, backends: list, hosts: list[HostPool]) -> None:
        if len(backends) not in (1, len(hosts)):
            raise ValueError(f"{len(backends)} L3 backends for {len(hosts)} ranks")
        self.backends, self.hosts = backends, hosts

    @property
    def shared(self) -> bool:
        return len(self.backends) == 1 and len(self.hosts) > 1

    def exists(self, keys: list[str]) -> int:
        """Pages present from the start on every rank."""
        return min(max(0, min(int(b.batch_exists(keys)), len(keys))) for b in self.backends)

    def clear(self) -> None:
        for b in self.backends:
            b.clear()

    def close(self) -> None:
        for b in self.backends:
            b.close()


class PrefetchOp:
    def __init__(self, keys: list[str], host_slots: torch.Tensor, tokens: list[int], prefix_len: int,
                 page_size: int, ns=None) -> None:
        self.keys = keys
        self.host_slots = host_slots
        self.tokens = tokens  # prefix_len matched tokens + len(keys) pages to fetch
        self.prefix_len = prefix_len
        self.ns = ns  # the request's cache namespace (radix.Namespace): where the fetched pages go in the tree
        self.num_tokens = len(keys) * page_size
        self.start = time.monotonic()
        self.lock = threading.Lock()
        self.terminated = False
        self.completed_pages = 0
        self.hit_pages: int | None = None
        self.finished = False  # the thread is done with it (all fetched, miss, or error)
        self.anchor = None  # last cached node of the prefix, L2-pinned by the engine while the op lives
        self.sync_point = 0  # tensor parallelism: follower commands to wait for before touching their pools


class BackupStorageOp:
    def __init__(self, keys: list[str], host_slots: torch.Tensor, pin_node) -> None:
        self.keys = keys
        self.host_slots = host_slots
        self.pin_node = pin_node  # L2 path pin held until the engine acks
        self.lock = threading.Lock()
        self.cancelled = False
        self.written_pages = 0
        self.finished = False
        self.sync_point = 0
        self.start = time.monotonic()


class StorageWorker:
    def __init__(self, ranks: RankedStorage, wake: Callable[[], None], prefetch_threshold_tokens: int,
                 wait_for: Callable[[int], None] | None = None, stats: StorageIoStats | None = None) -> None:
        self.ranks = ranks
        self.stats = stats if stats is not None else StorageIoStats()
        self.host = ranks.hosts[0]
        self._wait_for = wait_for
        self._wake = wake
        self._threshold = prefetch_threshold_tokens
        self.degraded: str | None = None
        self._degraded_at = 0.0
        self.completed: queue.SimpleQueue = queue.SimpleQueue()
        self._prefetch_q: queue.Queue = queue.Queue()
        self._backup_q: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._prefetch_loop, name="hicache-prefetch", daemon=True),
            threading.Thread(target=self._backup_loop, name="hicache-backup", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # --- engine-facing -------------------------------------------------
    def submit_prefetch(self, op: PrefetchOp) -> None:
        self._prefetch_q.put(op)

    def submit_backup(self, op: BackupStorageOp) -> None:
        self._backup_q.put(op)

    def stop(self, timeout: float = 5.0) -> bool:
        """Stops both threads; True if they exited (a thread stuck in the backend is abandoned)."""
        self._stopping.set()
        self._prefetch_q.put(None)
        self._backup_q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    # --- threads -------------------------------------------------------
    def _mark_degraded(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if self.degraded is None:
            log.error("L3 storage backend failed, continuing with L1+L2 only: %s", reason)
        self.degraded = reason
        self._degraded_at = time.monotonic()
        self._wake()

    def _finish(self, op) -> None:
        op.finished = True
        self.completed.put(op)
        self._wake()

    def _prefetch_loop(self) -> None:
        torch.set_num_threads(1)  # page copies are memory-bound; the cores belong to the engine thread
        while True:
            op = self._prefetch_q.get()
            if op is None:
                return
            try:
                if not op.terminated and self.degraded is None and not self._stopping.is_set():
                    self._prefetch(op)
                    if op.completed_pages:
                        self.stats.prefetch.observe(time.monotonic() - op.start)
            except Exception as exc:
                self._mark_degraded(exc)
            finally:
                self._finish(op)

    def _prefetch(self, op: PrefetchOp) -> None:
        hit = 0
        for i in range(0, len(op.keys), STORAGE_BATCH_SIZE):
            batch = op.keys[i : i + STORAGE_BATCH_SIZE]
            n = self.ranks.exists(batch)
            hit += n
            if n < len(batch) or op.terminated:
                break
        op.hit_pages = hit
        ps = self.host.page_size
        if hit * ps < self._threshold:
            return  # not worth the I/O: SGLang revokes such prefetches
        if self._wait_for is not None:
            self._wait_for(op.sync_point)  # no follower load still reads the slots this op fills
        hosts = self.ranks.hosts
        for i in range(0, hit, STORAGE_BATCH_SIZE):
            if op.terminated or self._stopping.is_set():
                return
            keys = op.keys[i : min(hit, i + STORAGE_BATCH_SIZE)]
            sizes = [self.host.page_bytes] * len(keys)  # a page of any other size is a miss, not KV
            per_rank = [b.batch_get(keys, target_sizes=sizes) or [] for b in self.ranks.backends]
            for j in range(len(keys)):
                pages = [values[j] if j < len(values) else None for values in per_rank]
                if any(v is None or v.numel() * v.element_size() != self.host.page_bytes for v in pages):
                    return  # a miss or an unusable page on any rank ends the usable prefix
                with op.lock:
                    if op.terminated:
                        return
                    slot = int(op.host_slots[(i + j) * ps])
                    for r, host in enumerate(hosts):
                        host.set_page(slot, pages[0 if self.ranks.shared else r])
                    op.completed_pages += 1
                self.stats.read_bytes += self.host.page_bytes * len(hosts)

    def _backup_loop(self) -> None:
        torch.set_num_threads(1)  # page copies are memory-bound; the cores belong to the engine thread
        while True:
            try:
                op = self._backup_q.get(timeout=PROBE_INTERVAL_S)
            except queue.Empty:
                if self.degraded:
                    self._probe()
                continue
            if op is None:
                return
            try:
                if not op.cancelled and self.degraded is None and not self._stopping.is_set():
                    self._backup(op)
                    if op.written_pages:
                        self.stats.backup.observe(time.monotonic() - op.start)
            except Exception as exc:
                self._mark_degraded(exc)
            finally:
                self._finish(op)
            if self.degraded and time.monotonic() - self._degraded_at > PROBE_INTERVAL_S:
                self._probe()

    def _probe(self) -> None:
        try:
            self.ranks.exists([_PROBE_KEY])
        except Exception as exc:
            self._degraded_at = time.monotonic()
            log.debug("L3 still unavailable: %s", exc)
            return
        log.warning("L3 storage backend reachable again; resuming L3 prefetch and backup")
        self.degraded = None
        self._wake()

    def _backup(self, op: BackupStorageOp) -> None:
        ps = self.host.page_size
        if self._wait_for is not None:
            self._wait_for(op.sync_point)  # the followers' L1->L2 copies of these pages have run
        for i in range(0, len(op.keys), STORAGE_BATCH_SIZE):
            keys = op.keys[i : i + STORAGE_BATCH_SIZE]
            for r, (backend, host) in enumerate(zip(self.ranks.backends, self.ranks.hosts)):
                skip = max(0, min(int(backend.batch_exists(keys)), len(keys)))
                if skip == len(keys):
                    continue
                with op.lock:  # copy out under the lock: after a cancel the slots may belong to someone else
                    if op.cancelled:
                        return
                    values = [host.get_page(int(op.host_slots[(i + j) * ps])) for j in range(skip, len(keys))]
                if not backend.batch_set(keys[skip:], values):
                    log.warning("L3 backend refused %d pages (batch_set returned False)", len(values))
                    return
                self.stats.written_bytes += host.page_bytes * len(values)
                if r == 0:  # counted once, as SGLang counts one rank's backups
                    op.written_pages += len(values)
