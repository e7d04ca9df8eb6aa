"""L2<->L3 traffic on background threads: prefetch (L3 -> L2) and backup (L2 -> L3).

Both threads touch the host pool only while holding their op's lock and only if the engine has
not cancelled/terminated the op, so the engine can always take an op back instantly (prefetch
budget expired, detach, flush) even while the backend call itself is still hanging. Any backend
failure marks the worker degraded: the engine then runs on L1+L2 until a probe succeeds.
"""

from __future__ import annotations

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


class PrefetchOp:
    def __init__(self, keys: list[str], host_slots: torch.Tensor, tokens: list[int], prefix_len: int,
                 page_size: int) -> None:
        self.keys = keys
        self.host_slots = host_slots
        self.tokens = tokens  # prefix_len matched tokens + len(keys) pages to fetch
        self.prefix_len = prefix_len
        self.num_tokens = len(keys) * page_size
        self.start = time.monotonic()
        self.lock = threading.Lock()
        self.terminated = False
        self.completed_pages = 0
        self.hit_pages: int | None = None
        self.finished = False  # the thread is done with it (all fetched, miss, or error)
        self.anchor = None  # last cached node of the prefix, L2-pinned by the engine while the op lives


class BackupStorageOp:
    def __init__(self, keys: list[str], host_slots: torch.Tensor, pin_node) -> None:
        self.keys = keys
        self.host_slots = host_slots
        self.pin_node = pin_node  # L2 path pin held until the engine acks
        self.lock = threading.Lock()
        self.cancelled = False
        self.written_pages = 0
        self.finished = False


class StorageWorker:
    def __init__(self, backend, host: HostPool, wake: Callable[[], None], prefetch_threshold_tokens: int) -> None:
        self.backend = backend
        self.host = host
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
        while True:
            op = self._prefetch_q.get()
            if op is None:
                return
            try:
                if not op.terminated and self.degraded is None and not self._stopping.is_set():
                    self._prefetch(op)
            except Exception as exc:
                self._mark_degraded(exc)
            finally:
                self._finish(op)

    def _prefetch(self, op: PrefetchOp) -> None:
        hit = 0
        for i in range(0, len(op.keys), STORAGE_BATCH_SIZE):
            batch = op.keys[i : i + STORAGE_BATCH_SIZE]
            n = int(self.backend.batch_exists(batch))
            hit += max(0, min(n, len(batch)))
            if n < len(batch) or op.terminated:
                break
        op.hit_pages = hit
        ps = self.host.page_size
        if hit * ps < self._threshold:
            return  # not worth the I/O: SGLang revokes such prefetches
        for i in range(0, hit, STORAGE_BATCH_SIZE):
            if op.terminated or self._stopping.is_set():
                return
            keys = op.keys[i : min(hit, i + STORAGE_BATCH_SIZE)]
            values = self.backend.batch_get(keys)
            for j, value in enumerate(values or []):
                if value is None or value.numel() * value.element_size() != self.host.page_bytes:
                    return  # a miss or a corrupt page ends the usable prefix
                with op.lock:
                    if op.terminated:
                        return
                    self.host.set_page(int(op.host_slots[(i + j) * ps]), value)
                    op.completed_pages += 1
            if len(values or []) < len(keys):
                return

    def _backup_loop(self) -> None:
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
            except Exception as exc:
                self._mark_degraded(exc)
            finally:
                self._finish(op)
            if self.degraded and time.monotonic() - self._degraded_at > PROBE_INTERVAL_S:
                self._probe()

    def _probe(self) -> None:
        try:
            self.backend.batch_exists([_PROBE_KEY])
        except Exception as exc:
            self._degraded_at = time.monotonic()
            log.debug("L3 still unavailable: %s", exc)
            return
        log.warning("L3 storage backend reachable again; resuming L3 prefetch and backup")
        self.degraded = None
        self._wake()

    def _backup(self, op: BackupStorageOp) -> None:
        ps = self.host.page_size
        for i in range(0, len(op.keys), STORAGE_BATCH_SIZE):
            keys = op.keys[i : i + STORAGE_BATCH_SIZE]
            skip = max(0, min(int(self.backend.batch_exists(keys)), len(keys)))
            if skip == len(keys):
                continue
            with op.lock:  # copy out under the lock: after a cancel the slots may belong to someone else
                if op.cancelled:
                    return
                values = [self.host.get_page(int(op.host_slots[(i + j) * ps])) for j in range(skip, len(keys))]
            if not self.backend.batch_set(keys[skip:], values):
                log.warning("L3 backend refused %d pages (batch_set returned False)", len(values))
                return
            op.written_pages += len(values)
