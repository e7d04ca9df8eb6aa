"""Radix tree over token pages: the index of which prefixes live in L1 and/or L2.

Keys are tuples of token ids whose length is a multiple of ``page_size``; children are keyed
by their first page. Locks are path-based as in SGLang: locking a node increments the counter
on it and on every ancestor, so splitting a node can copy its counter to the new parent and
later unlocks (which walk up from the original node) stay balanced.

Cache namespaces: a request's ``extra_key`` / ``cache_salt`` (see :func:`namespace`) is part of
every child key on its path, ``(namespace, first page)`` instead of the bare page, as in SGLang's
``RadixKey.child_key``. Requests in different namespaces therefore never match each other's
prefixes, even for identical tokens, while requests without one share the plain tree. Every node
records its namespace (``ns``), which a split hands down unchanged.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterator

import torch

_ids = itertools.count(1)

Namespace = tuple[str | None, str | None] | None


def namespace(extra_key: str | None = None, cache_salt: str | None = None) -> Namespace:
    """A request's cache namespace: None when it sets neither field (an empty string counts as unset, as in SGLang)."""
    extra_key, cache_salt = extra_key or None, cache_salt or None
    if extra_key is None and cache_salt is None:
        return None
    return (extra_key, cache_salt)


class TreeNode:
    __slots__ = (
        "id", "parent", "children", "key", "ns", "value", "host_value", "lock_ref", "host_ref",
        "last_access", "hit_count", "hashes", "backup_op", "load_op",
    )

    def __init__(self, parent: "TreeNode | None" = None, key: tuple[int, ...] = (), ns: Namespace = None) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.children: dict[tuple, TreeNode] = {}
        self.key = key
        self.ns = ns
        self.value: torch.Tensor | None = None  # L1 slots, one per token
        self.host_value: torch.Tensor | None = None  # L2 slots, one per token
        self.lock_ref = 0  # >0: L1 copy in use (requests, transfers): never evicted from L1
        self.host_ref = 0  # >0: L2 copy in use (transfers, L3 backups): never evicted from L2
        self.last_access = time.monotonic()
        self.hit_count = 0
        self.hashes: list[str] | None = None  # L3 page hash per page, chained from the root
        self.backup_op = None  # the L1->L2 copy that filled host_value (pending until op.done)
        self.load_op = None  # the L2->L1 copy that filled value (pending until op.done)

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def backed_up(self) -> bool:
        """Has a complete L2 copy (a pending L1->L2 copy does not count)."""
        return self.host_value is not None and (self.backup_op is None or self.backup_op.done)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, dev={self.on_device}, host={self.host_value is not None})"


class RadixTree:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted

    def page_key(self, tokens, start: int = 0, ns: Namespace = None) -> tuple:
        """The child-dict key of the page of ``tokens`` at ``start`` in namespace ``ns``."""
        page = tuple(tokens[start : start + self.page_size])
        return page if ns is None else (ns, page)

    def node_key(self, node: TreeNode) -> tuple:
        """The key ``node`` is filed under in its parent's children."""
        return self.page_key(node.key, 0, node.ns)

    def _common_pages(self, key: tuple[int, ...], tokens, start: int) -> int:
        """Tokens (a multiple of page_size) that ``key`` shares with ``tokens[start:]``."""
        ps = self.page_size
        n = min(len(key), len(tokens) - start)
        n -= n % ps
        if key[:n] == tuple(tokens[start : start + n]):
            return n
        i = 0
        while i < n and tuple(key[i : i + ps]) == tuple(tokens[start + i : start + i + ps]):
            i += ps
        return i

    def match(self, tokens, touch: bool = True, ns: Namespace = None) -> list[TreeNode]:
        """Nodes covering the longest cached page-aligned prefix of ``tokens`` in namespace ``ns``, splitting a
        node at the end."""
        path: list[TreeNode] = []
        node, pos = self.root, 0
        now = time.monotonic()
        while len(tokens) - pos >= self.page_size:
            child = node.children.get(self.page_key(tokens, pos, ns))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.key):
                child = self.split(child, n)
            if touch:
                child.last_access = now
            path.append(child)
            pos += n
            node = child
        return path

    def split(self, child: TreeNode, n: int) -> TreeNode:
        """Cuts ``child`` after ``n`` tokens; returns the new parent holding the first ``n``."""
        assert 0 < n < len(child.key) and n % self.page_size == 0
        new = TreeNode(child.parent, child.key[:n], child.ns)
        new.children = {self.page_key(child.key, n, child.ns): child}
        new.value = child.value[:n] if child.value is not None else None
        new.host_value = child.host_value[:n] if child.host_value is not None else None
        new.lock_ref, new.host_ref = child.lock_ref, child.host_ref
        new.last_access, new.hit_count = child.last_access, child.hit_count
        if child.hashes is not None:
            new.hashes, child.hashes = child.hashes[: n // self.page_size], child.hashes[n // self.page_size :]
        new.backup_op, new.load_op = child.backup_op, child.load_op
        for op in (child.backup_op, child.load_op):
            if op is not None and not op.done:
                op.nodes.append(new)
        child.parent.children[self.node_key(child)] = new
        child.parent = new
        child.key = child.key[n:]
        if child.value is not None:
            child.value = child.value[n:]
        if child.host_value is not None:
            child.host_value = child.host_value[n:]
        return new

    def add_child(self, parent: TreeNode, key: tuple[int, ...], ns: Namespace = None) -> TreeNode:
        assert key and len(key) % self.page_size == 0
        assert parent is self.root or parent.ns == ns, "a namespace's nodes hang only under its own"
        node = TreeNode(parent, key, ns)
        parent.children[self.node_key(node)] = node
        return node

    def remove_leaf(self, node: TreeNode) -> None:
        assert not node.children and node is not self.root
        del node.parent.children[self.node_key(node)]

    @staticmethod
    def lock(node: TreeNode) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    @staticmethod
    def unlock(node: TreeNode) -> None:
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unbalanced unlock"
            node = node.parent

    @staticmethod
    def pin_host(node: TreeNode) -> None:
        while node is not None:
            node.host_ref += 1
            node = node.parent

    @staticmethod
    def unpin_host(node: TreeNode) -> None:
        while node is not None:
            node.host_ref -= 1
            assert node.host_ref >= 0, "unbalanced host unpin"
            node = node.parent

    def nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def path_tokens(node: TreeNode) -> int:
        n = 0
        while node.parent is not None:
            n += len(node.key)
            node = node.parent
        return n
