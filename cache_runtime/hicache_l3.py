"""The L2<->L3 half of ``HiCache``: page keys, L3 backups, prefetches into L2, attach and detach.

``L3Tier`` is a base class of ``HiCache``, not an object of its own, because it keeps no state
apart from the cache's: every method here takes and drops host pins (``host_ref``) on the same
tree nodes as the L1/L2 half, under the invariants stated in hicache.py, and runs on the engine
thread. L3 calls themselves run on the storage threads (``storage_io``); their results come
back as acks in ``_poll_storage``. A prefetch or backup issued under tensor parallelism carries
the TP sync point, so the storage thread waits until every follower ran the copies sent before.
"""

from __future__ import annotations

import logging
import time

import torch

from cache_runtime.policies import PrefetchConfig
from cache_runtime.radix import Namespace, TreeNode
from cache_runtime.storage.hashing import namespace_seed, page_hashes
from cache_runtime.storage_io import BackupStorageOp, PrefetchOp, RankedStorage, StorageIoStats, StorageWorker

log = logging.getLogger(__name__)


def _seed(ns: Namespace) -> str | None:
    """Prior hash of a namespace's first L3 page."""
    return None if ns is None else namespace_seed(*ns)


class L3Tier:
    def _init_l3(self) -> None:
        self.io = StorageIoStats()  # L2<->L3 latency and bytes, across attaches
        self.storage: StorageWorker | None = None
        self.storage_backend_name: str | None = None
        self.storage_extra_config: dict = {}
        self.prefetch = PrefetchConfig()
        self._prefetch_ops: set[PrefetchOp] = set()
        self._prefetch_tokens_in_flight = 0
        self._backup_ops: set[BackupStorageOp] = set()

    @property
    def storage_active(self) -> bool:
        return self.storage is not None and self.storage.degraded is None

    def _poll_storage(self) -> None:
        if self.storage is not None:
            while not self.storage.completed.empty():
                op = self.storage.completed.get()
                if isinstance(op, BackupStorageOp) and op in self._backup_ops:
                    self._backup_ops.discard(op)
                    self.tree.unpin_host(op.pin_node)
                    self.counters.backuped_tokens += op.written_pages * self.page_size

    def _hashes(self, node: TreeNode) -> list[str]:
        """L3 keys of a node's pages, chained from its namespace's seed at the root (computed once per node)."""
        chain = []
        n = node
        while n is not self.root and n.hashes is None:
            chain.append(n)
            n = n.parent
        prior = n.hashes[-1] if n is not self.root else _seed(node.ns)
        for n in reversed(chain):
            n.hashes = page_hashes(list(n.key), self.page_size, prior)
            prior = n.hashes[-1]
        return node.hashes

    def _backup_to_storage(self, node: TreeNode, host_slots: torch.Tensor) -> None:
        if self.storage_active:
            self._submit_storage_backup(self._hashes(node), host_slots, node)

    def _submit_storage_backup(self, hashes: list[str], host_slots: torch.Tensor, pin_node: TreeNode) -> None:
        op = BackupStorageOp(list(hashes), host_slots, pin_node)
        op.sync_point = self.tp.sync_point() if self.tp else 0
        self.tree.pin_host(pin_node)
        self._backup_ops.add(op)
        self.storage.submit_backup(op)

    def attach_storage(self, name: str, storage: RankedStorage, prefetch: PrefetchConfig, extra_config: dict) -> None:
        if self.host is None:
            raise ValueError("an L3 storage backend needs --enable-hierarchical-cache (L2)")
        self.prefetch = prefetch
        self.storage = StorageWorker(storage, self._wake, max(prefetch.threshold, self.page_size),
                                     wait_for=self.tp.wait_for if self.tp else None, stats=self.io)
        self.storage_backend_name = name
        self.storage_extra_config = extra_config

    def detach_storage(self, timeout: float = 5.0) -> None:
        """Stops L3 traffic and releases every pin it held; never deletes L3 data."""
        if self.storage is None:
            return
        storage = self.storage
        for op in list(self._prefetch_ops):
            self.terminate_prefetch(op)
        for op in list(self._backup_ops):
            with op.lock:
                op.cancelled = True
        if not storage.stop(timeout):
            log.warning("L3 backend call still running at detach; abandoning its thread")
        self.poll()
        for op in list(self._backup_ops):  # never acked: the thread is stuck, its pins are ours to drop
            self._backup_ops.discard(op)
            self.tree.unpin_host(op.pin_node)
        try:
            storage.ranks.close()
        except Exception:
            log.exception("closing the L3 backend failed")
        self.storage = None
        self.storage_backend_name = None
        self.storage_extra_config = {}

    def maybe_prefetch(self, key: list[int], ns: Namespace = None) -> PrefetchOp | None:
        """Starts fetching the page-aligned part of ``key`` beyond L1+L2 from L3, if worth it."""
        if not self.enabled or not self.storage_active:
            return None
        path, matched = self.peek_match(key, ns)
        num = self.aligned(len(key) - matched)
        if num < max(self.prefetch.threshold, self.page_size):
            return None
        capacity = self.host.size // 2  # newer SGLang: prefetch may hold at most half of L2
        if self._prefetch_tokens_in_flight + num > capacity:
            self.counters.prefetch_skipped += 1
            return None
        host = self.alloc_host(num)
        if host is None:
            self.counters.prefetch_skipped += 1
            return None
        prior = self._hashes(path[-1])[-1] if path else _seed(ns)
        keys = page_hashes(list(key[matched : matched + num]), self.page_size, prior)
        op = PrefetchOp(keys, host, list(key[: matched + num]), matched, self.page_size, ns)
        op.sync_point = self.tp.sync_point() if self.tp else 0
        if path:  # keep the L2 copy of the prefix the fetched pages will hang under (SGLang pins it too)
            op.anchor = path[-1]
            self.tree.pin_host(op.anchor)
        self._prefetch_ops.add(op)
        self._prefetch_tokens_in_flight += num
        self.storage.submit_prefetch(op)
        return op

    def can_terminate(self, op: PrefetchOp) -> bool:
        if op.finished or self.storage is None or self.storage.degraded is not None:
            return True
        policy = self.prefetch.policy
        if policy == "best_effort":
            return True
        elapsed = time.monotonic() - op.start
        if policy == "timeout":
            return elapsed > self.prefetch.timeout_for(op.num_tokens)
        return elapsed > self.prefetch.timeout_max  # wait_complete, with a cap so a hung L3 cannot stall us

    def terminate_prefetch(self, op: PrefetchOp) -> int:
        """Stops a prefetch and caches the pages that arrived; returns the tokens added to L2."""
        if op not in self._prefetch_ops:
            return 0
        with op.lock:
            op.terminated = True
            done = op.completed_pages
        self._prefetch_ops.discard(op)
        self._prefetch_tokens_in_flight -= op.num_tokens
        ps = self.page_size
        kept = self._insert_prefetched(op, done * ps) if done else 0
        if not done:
            self.host.allocator.free(op.host_slots)
        if op.anchor is not None:
            self.tree.unpin_host(op.anchor)
        self.counters.prefetched_tokens += kept
        return kept

    def _insert_prefetched(self, op: PrefetchOp, num: int) -> int:
        """Adds fetched pages as L2 nodes under their (still cached) prefix; frees what is not used."""
        slots = op.host_slots
        path = self.tree.match(op.tokens[: op.prefix_len], touch=False, ns=op.ns)
        if sum(len(n.key) for n in path) < op.prefix_len:  # the prefix left the cache meanwhile
            self.host.allocator.free(slots)
            return 0
        node = path[-1] if path else self.root
        pos, end, kept = op.prefix_len, op.prefix_len + num, 0
        used = torch.zeros(slots.numel(), dtype=torch.bool)
        while pos < end:
            child = node.children.get(self.tree.page_key(op.tokens, pos, op.ns))
            if child is None:
                child = self.tree.add_child(node, tuple(op.tokens[pos:end]), op.ns)
                child.host_value = slots[pos - op.prefix_len : end - op.prefix_len]
                child.hashes = op.keys[(pos - op.prefix_len) // self.page_size : num // self.page_size]
                used[pos - op.prefix_len : end - op.prefix_len] = True
                kept += end - pos
                break
            n = self.tree._common_pages(child.key, op.tokens[:end], pos)
            if n < len(child.key):
                child = self.tree.split(child, n)
            if child.host_value is None and child.on_device:  # L1-only node: the fetched pages become its L2 copy
                child.host_value = slots[pos - op.prefix_len : pos - op.prefix_len + n]
                child.backup_op = None
                used[pos - op.prefix_len : pos - op.prefix_len + n] = True
                kept += n
            node, pos = child, pos + n
        unused = slots[~used]
        if unused.numel():
            self.host.allocator.free(unused)
        return kept
