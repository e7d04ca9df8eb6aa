"""The hierarchical cache: radix tree + L1/L2 pools + write/eviction/prefetch policies (the L3
bookkeeping, which shares the tree's pins, is ``hicache_l3.L3Tier``, a base of ``HiCache``).

Every method here runs on the engine thread, which is the only thread that mutates the tree,
the reference counts or the allocators. Copies run on the transfer / storage threads and come
back as acks in ``poll()``. The invariants the policies keep (and the tests check):

* I1: every tree node holds its KV in L1, in L2, or in both (a pending copy counts as present).
* I2: L1 nodes form a prefix-closed subtree: a node on L1 has its parent on L1.
* lock_ref > 0 (path-based) pins a node's L1 copy; host_ref > 0 pins its L2 copy. A transfer
  holds both for its node until its ack is processed, so no copy ever reads or writes freed slots.
* L1 eviction frees a node's L1 copy only if it is backed up; otherwise write_back copies it to
  L2 first, and anything else deletes it (with the L2-only subtree under it, if nothing pins it).
* L2 eviction deletes unpinned L2-only leaves first, then drops spare L2 copies of L1 nodes.

A request's cache namespace (``radix.namespace``: SGLang's ``extra_key`` / ``cache_salt``) keeps
its prefixes apart in the tree and seeds its first L3 page key (``hashing.namespace_seed``), so
salted tenants share nothing in L1, L2 or L3, and their L3 keys are the ones SGLang computes.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import torch

from cache_runtime.hicache_l3 import L3Tier
from cache_runtime.memory import DevicePool, HostPool
from cache_runtime.policies import write_through_threshold
from cache_runtime.radix import Namespace, RadixTree, TreeNode
from cache_runtime.transfer import BackupOp, LoadOp, TransferWorker


@dataclass
class CacheCounters:
    evicted_tokens: int = 0  # L1 evictions
    host_evicted_tokens: int = 0
    load_back_tokens: int = 0  # L2 -> L1
    l2_backup_tokens: int = 0  # L1 -> L2
    prefetched_tokens: int = 0  # L3 -> L2, inserted into the tree
    backuped_tokens: int = 0  # L2 -> L3, written
    prefetch_skipped: int = 0  # prefetches not issued (capacity or no host room)


@dataclass
class Prefix:
    """A request's cached prefix, locked in L1 (possibly still arriving from L2)."""

    nodes: list[TreeNode]
    length: int
    device_tokens: int  # hit in L1
    host_tokens: int  # hit in L2 and loaded back
    slots: torch.Tensor
    lock_node: TreeNode
    pending_loads: list[LoadOp] = field(default_factory=list)


class HiCache(L3Tier):
    def __init__(self, device: DevicePool, host: HostPool | None, page_size: int, write_policy: str,
                 io_backend: str, wake, enabled: bool = True, tp=None) -> None:
        self.device, self.host = device, host
        self.page_size = page_size
        self.write_policy = write_policy
        self.enabled = enabled
        self.tree = RadixTree(page_size)
        self.counters = CacheCounters()
        self._wake = wake
        # tp: cache_runtime.engine.tp.Leader under tensor parallelism: copies are mirrored to the followers,
        # and L3 ops wait until the followers ran every copy sent before them
        self.tp = tp
        self.transfer = (TransferWorker(device, host, io_backend, wake, mirror=tp.send if tp else None)
                         if host is not None else None)
        self._transfers_in_flight = 0
        self._init_l3()

    # ------------------------------------------------------------------ state
    @property
    def root(self) -> TreeNode:
        return self.tree.root

    def busy_ops(self) -> int:
        return self._transfers_in_flight + len(self._backup_ops) + len(self._prefetch_ops)

    def cached_tokens(self) -> tuple[int, int]:
        """(tokens in L1 owned by the tree, tokens in L2 owned by the tree)."""
        dev = host = 0
        for n in self.tree.nodes():
            dev += len(n.key) if n.on_device else 0
            host += len(n.key) if n.host_value is not None else 0
        return dev, host

    # ------------------------------------------------------------------ matching
    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def acquire_prefix(self, key: list[int], ns: Namespace = None) -> Prefix:
        """Longest cached prefix of ``key`` in namespace ``ns``: L1 part locked, L2 part loaded back in the
        background."""
        if not self.enabled:
            self.tree.lock(self.root)
            return Prefix([], 0, 0, 0, torch.empty(0, dtype=torch.int64), self.root)
        path = self.tree.match(key, ns=ns)
        dev = [n for n in path if n.on_device]
        host_nodes = path[len(dev):]
        lock_node = dev[-1] if dev else self.root
        if host_nodes:
            last = host_nodes[-1]
            self.tree.lock(last)
            self.tree.pin_host(last)
            num = sum(len(n.key) for n in host_nodes)
            slots = self.alloc_device(num)
            if slots is None:
                self.tree.unpin_host(last)
                self.tree.unlock(last)
                host_nodes = []
            else:
                op = LoadOp(host_nodes, slots, torch.cat([n.host_value for n in host_nodes]), last,
                            len(self.device.k))
                pos = 0
                for n in host_nodes:  # the op keeps the lock and pin taken above until its ack
                    n.value = slots[pos : pos + len(n.key)]
                    n.load_op = op
                    pos += len(n.key)
                self._transfers_in_flight += 1
                self.transfer.submit_load(op)
                self.counters.load_back_tokens += num
                lock_node = last
        self.tree.lock(lock_node)
        nodes = dev + host_nodes
        pending = []
        for n in nodes:
            if n.load_op is not None and not n.load_op.done and n.load_op not in pending:
                pending.append(n.load_op)
        slots = torch.cat([n.value for n in nodes]) if nodes else torch.empty(0, dtype=torch.int64)
        dev_tokens = sum(len(n.key) for n in dev)
        host_tokens = sum(len(n.key) for n in host_nodes)
        return Prefix(nodes, dev_tokens + host_tokens, dev_tokens, host_tokens, slots, lock_node, pending)

    def release_prefix(self, prefix: Prefix) -> None:
        self.tree.unlock(prefix.lock_node)

    def peek_match(self, key: list[int], ns: Namespace = None) -> tuple[list[TreeNode], int]:
        """Cached path and its length, without locking (used to plan an L3 prefetch)."""
        if not self.enabled:
            return [], 0
        path = self.tree.match(key, touch=False, ns=ns)
        return path, sum(len(n.key) for n in path)

    # ------------------------------------------------------------------ allocation / eviction
    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        alloc = self.device.allocator
        slots = alloc.alloc(num_tokens)
        if slots is None and self.enabled:
            self.evict(self.aligned(num_tokens + self.page_size - 1) - alloc.free_tokens)
            slots = alloc.alloc(num_tokens)
        return slots

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        alloc = self.host.allocator
        slots = alloc.alloc(num_tokens)
        if slots is None:
            self.evict_host(self.aligned(num_tokens + self.page_size - 1) - alloc.free_tokens)
            slots = alloc.alloc(num_tokens)
        return slots

    def _is_attached(self, node: TreeNode) -> bool:
        parent = node.parent
        return parent is not None and parent.children.get(self.tree.node_key(node)) is node

    @staticmethod
    def _device_leaf(node: TreeNode) -> bool:
        return node.on_device and node.lock_ref == 0 and not any(c.on_device for c in node.children.values())

    def evict(self, num_tokens: int) -> int:
        """Frees at least ``num_tokens`` of L1 if possible (LRU leaves of the L1 subtree)."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self.tree.nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._is_attached(node) or not self._device_leaf(node):
                continue
            parent = node.parent
            size = len(node.key)
            if node.backed_up or (self.write_policy == "write_back" and self._write_back_now(node)):
                self.device.allocator.free(node.value)
                node.value = None
                node.load_op = None
            elif node.host_ref == 0:
                self._delete_subtree(node)
            else:
                continue
            freed += size
            if parent is not self.root and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self.counters.evicted_tokens += freed
        return freed

    def _delete_subtree(self, node: TreeNode) -> None:
        """Removes an unpinned node and its (L2-only) descendants from the tree."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.value is not None:
                self.device.allocator.free(n.value)
                n.value = None
            if n.host_value is not None:
                self.host.allocator.free(n.host_value)
                n.host_value = None
        node.children = {}
        self.tree.remove_leaf(node)

    def _write_back_now(self, node: TreeNode) -> bool:
        """write_back: copy an unbacked node to L2 synchronously so L1 can drop it."""
        if self.host is None:
            return False
        host = self.alloc_host(len(node.key))
        if host is None:
            return False
        self.transfer.backup_now(node.value, host)
        node.host_value = host
        node.backup_op = None
        self.counters.l2_backup_tokens += len(node.key)
        self._backup_to_storage(node, host)
        return True

    def evict_host(self, num_tokens: int) -> int:
        if num_tokens <= 0 or self.host is None:
            return 0

        def host_leaf(n: TreeNode) -> bool:
            return (n.host_value is not None and not n.on_device and n.host_ref == 0 and not n.children
                    and n.backed_up)

        heap = [(n.last_access, n.id, n) for n in self.tree.nodes() if host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._is_attached(node) or not host_leaf(node):
                continue
            parent = node.parent
            self.host.allocator.free(node.host_value)
            node.host_value = None
            self.tree.remove_leaf(node)
            freed += len(node.key)
            if parent is not self.root and host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed < num_tokens:  # then spare L2 copies of nodes that still live in L1
            spare = sorted((n for n in self.tree.nodes()
                            if n.on_device and n.host_value is not None and n.host_ref == 0 and n.backed_up),
                           key=lambda n: n.last_access)
            for node in spare:
                if freed >= num_tokens:
                    break
                self.host.allocator.free(node.host_value)
                node.host_value = None
                node.backup_op = None
                freed += len(node.key)
        self.counters.host_evicted_tokens += freed
        return freed

    # ------------------------------------------------------------------ insertion / write policies
    def insert(self, tokens: list[int], slots: torch.Tensor, owned_from: int, ns: Namespace = None) -> None:
        """Caches a finished request's KV in namespace ``ns``. ``slots[owned_from:]`` belong to the caller:
        those the tree does not adopt (duplicates of cached pages) are freed here. ``len(tokens)`` is
        page-aligned."""
        if not self.enabled:
            self.device.allocator.free(slots[owned_from:])
            return
        node, pos, now = self.root, 0, time.monotonic()
        touched: list[TreeNode] = []
        while pos < len(tokens):
            child = node.children.get(self.tree.page_key(tokens, pos, ns))
            if child is None:
                child = self.tree.add_child(node, tuple(tokens[pos:]), ns)
                child.value = slots[pos:]
                touched.append(child)
                break
            n = self.tree._common_pages(child.key, tokens, pos)
            if n < len(child.key):
                child = self.tree.split(child, n)
            child.last_access = now
            if child.value is None:
                child.value = slots[pos : pos + n]  # an L2-only node gets its L1 copy back for free
            elif pos + n > owned_from:
                self.device.allocator.free(slots[max(pos, owned_from) : pos + n])
            touched.append(child)
            node, pos = child, pos + n
        if self.host is None or self.write_policy == "write_back":
            return
        threshold = write_through_threshold(self.write_policy)
        for n in touched:  # after the walk: backing up may evict L2 leaves the walk would still visit
            n.hit_count += 1
            if n.hit_count >= threshold and n.host_value is None and self._is_attached(n):
                self._write_backup(n)

    def _write_backup(self, node: TreeNode) -> None:
        host = self.alloc_host(len(node.key))
        if host is None:
            return
        op = BackupOp([node], node.value, host, node)
        node.host_value = host
        node.backup_op = op
        self.tree.lock(node)
        self.tree.pin_host(node)
        if self.storage_active:
            op.hashes = self._hashes(node)
        self._transfers_in_flight += 1
        self.transfer.submit_backup(op)

    # ------------------------------------------------------------------ acks
    def poll(self) -> None:
        if self.transfer is not None:
            while not self.transfer.completed.empty():
                self._on_transfer_done(self.transfer.completed.get())
        self._poll_storage()

    def _on_transfer_done(self, op) -> None:
        self._transfers_in_flight -= 1
        op.done = True
        self.tree.unlock(op.lock_node)
        self.tree.unpin_host(op.lock_node)
        if isinstance(op, LoadOp):
            if op.error is not None:
                for n in op.nodes:
                    if n.load_op is op:
                        n.value = None
                self.device.allocator.free(op.device_slots)
            return
        if op.error is not None:
            for n in op.nodes:
                if n.backup_op is op:
                    n.host_value = None
            self.host.allocator.free(op.host_slots)
            return
        self.counters.l2_backup_tokens += op.host_slots.numel()
        if op.hashes is not None and self.storage_active and self._is_attached(op.lock_node):
            self._submit_storage_backup(op.hashes, op.host_slots, op.lock_node)

    def wait_transfers(self, timeout: float) -> bool:
        """Blocks the calling (engine) thread until every L1<->L2 copy is acked."""
        deadline = time.monotonic() + timeout
        while self._transfers_in_flight:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                self._on_transfer_done(self.transfer.completed.get(timeout=remaining))
            except Exception:  # queue.Empty
                return False
        return True

    # ------------------------------------------------------------------ flush
    def reset(self) -> None:
        """Empties L1 and L2 (not L3). Caller guarantees no request, transfer or L3 op is in flight."""
        assert self.busy_ops() == 0, "reset with copies in flight"
        self.tree.reset()
        self.device.allocator.clear()
        if self.host is not None:
            self.host.allocator.clear()
