"""L1/L2 eviction rules and the three write policies, on a real HiCache with real copies."""

from __future__ import annotations

import threading

import pytest
import torch

from cache_runtime.hicache import HiCache
from cache_runtime.memory import DevicePool, HostPool
from tests.unit.runtime.conftest import (accounting_ok as _accounting_ok, generate, on_engine, page_by_layer, prompt,
                                        settle)

L, H, D, PS = 2, 2, 4, 2


def _cache(policy: str, device_tokens=32, host_tokens=64, with_host=True) -> HiCache:
    dev = DevicePool(device_tokens, PS, L, H, D, torch.float32, torch.device("cpu"))
    for t in dev.k + dev.v:
        t.copy_(torch.randn_like(t))
    host = HostPool(host_tokens, PS, L, H, D, torch.float32, "page_first", pin=False) if with_host else None
    return HiCache(dev, host, PS, policy, "kernel", wake=lambda: None)


def _put(cache: HiCache, tokens: list[int]):
    """What a finished request does: own slots for the uncached part, insert, release."""
    prefix = cache.acquire_prefix(tokens)
    own = cache.alloc_device(len(tokens) - prefix.length)
    assert own is not None
    cache.insert(tokens, torch.cat([prefix.slots, own]), prefix.length)
    cache.release_prefix(prefix)
    if cache.transfer is not None:
        assert cache.wait_transfers(10)
    return prefix


def test_l1_eviction_is_lru_and_skips_locked_nodes():
    cache = _cache("write_through", with_host=False)
    _put(cache, [1, 1, 1, 1])
    _put(cache, [2, 2, 2, 2])
    _put(cache, [3, 3, 3, 3])
    cache.tree.match([1, 1, 1, 1])  # touch: 2 is now least recently used
    locked = cache.acquire_prefix([3, 3, 3, 3])
    assert cache.evict(4) == 4
    keys = {n.key for n in cache.tree.nodes()}
    assert (2, 2, 2, 2) not in keys and (3, 3, 3, 3) in keys and (1, 1, 1, 1) in keys
    cache.evict(100)
    assert {n.key for n in cache.tree.nodes()} == {(3, 3, 3, 3)}  # locked survives
    cache.release_prefix(locked)
    _accounting_ok(cache)


def test_l1_eviction_cascades_to_parents():
    cache = _cache("write_through", with_host=False)
    _put(cache, [1, 1, 2, 2])
    _put(cache, [1, 1, 3, 3])
    assert cache.evict(6) >= 6
    assert list(cache.tree.nodes()) == []
    assert cache.device.allocator.used_tokens == 0


def test_write_through_backs_up_on_insert_and_l1_eviction_keeps_l2():
    cache = _cache("write_through")
    _put(cache, [5, 6, 7, 8])
    (node,) = cache.tree.nodes()
    assert node.backed_up and cache.counters.l2_backup_tokens == 4
    device_k = cache.device.k[1][node.value].clone()
    cache.evict(100)
    assert not node.on_device and node.backed_up
    # the L2 copy holds the same bytes the L1 copy had
    page = page_by_layer(cache.host, cache.host.get_page(int(node.host_value[0])))
    assert torch.equal(page[0, 1], device_k[:PS])
    prefix = _put(cache, [5, 6, 7, 8, 9, 9])
    assert prefix.host_tokens == 4 and prefix.device_tokens == 0
    _accounting_ok(cache)


def test_write_through_selective_backs_up_on_second_use():
    cache = _cache("write_through_selective")
    _put(cache, [5, 6, 7, 8])
    assert not next(iter(cache.tree.nodes())).backed_up
    _put(cache, [5, 6, 7, 8])
    assert next(iter(cache.tree.nodes())).backed_up
    _accounting_ok(cache)


def test_write_back_copies_only_on_eviction():
    cache = _cache("write_back")
    _put(cache, [5, 6, 7, 8])
    (node,) = cache.tree.nodes()
    assert node.host_value is None
    device_v = cache.device.v[0][node.value].clone()
    cache.evict(100)
    assert not node.on_device and node.backed_up
    page = page_by_layer(cache.host, cache.host.get_page(int(node.host_value[0])))
    assert torch.equal(page[1, 0], device_v[:PS])
    _accounting_ok(cache)


def test_l1_only_node_without_backup_is_deleted_with_its_subtree():
    cache = _cache("write_through_selective")
    _put(cache, [1, 1, 2, 2])
    cache.evict(100)
    assert list(cache.tree.nodes()) == []
    _accounting_ok(cache)


def test_l2_eviction_frees_only_unpinned_l1_evicted_leaves_first():
    cache = _cache("write_through", device_tokens=32, host_tokens=16)
    _put(cache, [1, 1, 1, 1])
    _put(cache, [2, 2, 2, 2])
    cache.evict(4)  # [1,1,1,1] leaves L1, stays in L2
    n1 = next(n for n in cache.tree.nodes() if n.key == (1, 1, 1, 1))
    n2 = next(n for n in cache.tree.nodes() if n.key == (2, 2, 2, 2))
    cache.tree.pin_host(n1)
    assert cache.evict_host(4) == 4  # cannot take pinned n1: drops n2's spare L2 copy (n2 still in L1)
    assert n1.host_value is not None and n2.host_value is None and n2.on_device
    cache.tree.unpin_host(n1)
    assert cache.evict_host(4) == 4
    assert n1 not in set(cache.tree.nodes())
    _accounting_ok(cache)


def test_pending_backup_pins_node_in_both_tiers():
    cache = _cache("write_through")
    gate = threading.Event()
    real = cache.transfer._execute

    def slow(op):
        gate.wait(10)
        real(op)

    cache.transfer._execute = slow
    prefix = cache.acquire_prefix([4, 4, 4, 4])
    own = cache.alloc_device(4)
    cache.insert([4, 4, 4, 4], own, 0)
    cache.release_prefix(prefix)
    (node,) = cache.tree.nodes()
    assert node.host_value is not None and not node.backed_up
    assert cache.evict(100) == 0 and cache.evict_host(100) == 0
    gate.set()
    assert cache.wait_transfers(10)
    assert node.backed_up
    _accounting_ok(cache)


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
def test_policies_under_concurrency_keep_outputs_and_accounting(engines, policy):
    """Many clients, shared prefixes, L1 far smaller than the working set: same answers as no cache."""
    engine = engines(enable_hierarchical_cache=True, page_size=4, max_total_tokens=512, hicache_ratio=2.5,
                     hicache_write_policy=policy, max_running_requests=4)
    ref_engine = engines(disable_radix_cache=True, max_total_tokens=512)
    prompts = [prompt(s % 3, 120) + prompt(100 + s, 20 + 5 * s) for s in range(12)]
    reference = [generate(ref_engine, p, n=5).output_ids for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(worker: int) -> None:
        try:
            for rnd in range(3):
                for i in range(worker, len(prompts), 4):
                    out = generate(engine, prompts[i], n=5)
                    assert out.output_ids == reference[i], (i, rnd)
                    results[i] = out.output_ids
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(results) == len(prompts)
    settle(engine)
    stats = engine.stats
    assert stats.cached_device + stats.cached_host > 0
    if policy != "write_through_selective":
        assert stats.cached_host > 0  # L1 is too small for the working set, so L2 served some hits
    on_engine(engine, lambda: _accounting_ok(engine.cache))
