"""Radix tree: page-aligned matching, splitting, path locks."""

from __future__ import annotations

import torch

from cache_runtime.radix import RadixTree


def _insert(tree: RadixTree, tokens):
    """Plain radix insert (what HiCache.insert does for the tree shape), returning the last node."""
    node, pos = tree.root, 0
    while pos < len(tokens):
        child = node.children.get(tree.page_key(tokens, pos))
        if child is None:
            child = tree.add_child(node, tuple(tokens[pos:]))
            child.value = torch.arange(pos, len(tokens))
            return child
        n = tree._common_pages(child.key, tokens, pos)
        if n < len(child.key):
            child = tree.split(child, n)
        node, pos = child, pos + n
    return node


def test_match_returns_longest_page_aligned_prefix():
    tree = RadixTree(page_size=2)
    _insert(tree, [1, 2, 3, 4, 5, 6])
    path = tree.match([1, 2, 3, 4, 5, 6, 7])
    assert sum(len(n.key) for n in path) == 6
    # a partial trailing page never matches
    path = tree.match([1, 2, 3])
    assert sum(len(n.key) for n in path) == 2
    assert tree.match([9, 9]) == []


def test_match_splits_node_at_mismatch_and_keeps_values():
    tree = RadixTree(page_size=2)
    leaf = _insert(tree, [1, 2, 3, 4, 5, 6])
    path = tree.match([1, 2, 3, 4, 9, 9])
    assert [n.key for n in path] == [(1, 2, 3, 4)]
    assert path[0].children[(5, 6)] is leaf
    assert leaf.parent is path[0]
    assert path[0].value.tolist() == [0, 1, 2, 3]
    assert leaf.value.tolist() == [4, 5]


def test_mismatch_inside_a_page_does_not_match_that_page():
    tree = RadixTree(page_size=4)
    _insert(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    path = tree.match([1, 2, 3, 4, 5, 6, 0, 8])
    assert sum(len(n.key) for n in path) == 4


def test_branches_share_prefix():
    tree = RadixTree(page_size=1)
    _insert(tree, [1, 2, 3])
    _insert(tree, [1, 2, 4])
    assert len(tree.root.children) == 1
    shared = tree.root.children[(1,)]
    assert shared.key == (1, 2)
    assert set(shared.children) == {(3,), (4,)}
    assert len(list(tree.nodes())) == 3


def test_path_locks_stay_balanced_across_splits():
    tree = RadixTree(page_size=1)
    leaf = _insert(tree, [1, 2, 3, 4])
    tree.lock(leaf)
    tree.pin_host(leaf)
    tree.match([1, 2, 9])  # splits the locked node
    parent = leaf.parent
    assert parent is not tree.root and parent.lock_ref == 1 and parent.host_ref == 1
    tree.unlock(leaf)
    tree.unpin_host(leaf)
    assert all(n.lock_ref == 0 and n.host_ref == 0 for n in tree.nodes())
    assert tree.root.lock_ref == 1  # the root's own permanent lock
