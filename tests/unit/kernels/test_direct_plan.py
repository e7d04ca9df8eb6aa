"""The DMA path's copy plan, replayed with memmove on CPU tensors, equals the fallback.

hc_plan_direct is the host-side half of io_backend="direct": it turns index
pairs into merged (dst, src, bytes) runs with the same address functions the
kernel uses. Replaying it on CPU memory tests that logic bit for bit without a GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from kernels import fallback, validate
from kernels.layouts import LAYOUTS
from kernels.reference import make_pools, same_bits

P = 4


def _check(host, dev_k, dev_v, h_idx, d_idx, layout, to_host, layer_begin=0, all_layers=True):
    return validate.check(
        host_kv=host,
        device_k=dev_k,
        device_v=dev_v,
        layer_begin=layer_begin,
        all_layers=all_layers,
        host_indices=h_idx,
        device_indices=d_idx,
        layout=layout,
        page_size=P,
        to_host=to_host,
        io_backend="direct",
        num_ctas=None,
    )


def _replay(plan):
    for dst, src, nbytes in plan:
        ctypes.memmove(dst, src, nbytes)


def _pages_to_slots(pages):
    return (pages[:, None] * P + torch.arange(P)).flatten()


def _clone(host, dev_k, dev_v):
    return (
        host.clone(),
        [t.clone() for t in dev_k],
        None if dev_v is None else [t.clone() for t in dev_v],
    )


@pytest.mark.parametrize("to_host", [False, True], ids=["load", "backup"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_replay_equals_fallback(lib, layout, mla, to_host):
    gen = torch.Generator().manual_seed(7)
    host, dev_k, dev_v = make_pools(
        layout,
        mla,
        layers=3,
        host_slots=8 * P,
        dev_slots=10 * P,
        page_size=P,
        heads=2,
        head_dim=8,
        seed=1,
    )
    h_idx = _pages_to_slots(torch.randperm(8, generator=gen)[:5])
    d_idx = _pages_to_slots(torch.randperm(10, generator=gen)[:5])
    h_idx[3] = -1  # skipped pair
    d_idx[9] = -5
    oracle = _clone(host, dev_k, dev_v)
    if to_host:
        t = _check(host, dev_k, dev_v, h_idx, d_idx, layout, True)
        fallback.run(_check(*oracle, h_idx, d_idx, layout, True))
    else:  # one layer, as load_per_layer does
        one = lambda pool: None if pool is None else [pool[1]]  # noqa: E731
        t = _check(host, one(dev_k), one(dev_v), h_idx, d_idx, layout, False, 1, False)
        fallback.run(
            _check(oracle[0], one(oracle[1]), one(oracle[2]), h_idx, d_idx, layout, False, 1, False)
        )
    _replay(lib.plan_direct(t))
    assert same_bits(host, oracle[0])
    for mine, ref in zip(dev_k + (dev_v or []), oracle[1] + (oracle[2] or [])):
        assert same_bits(mine, ref)


def _run_count(lib, layout, h_idx, d_idx, mla=False):
    host, dev_k, dev_v = make_pools(
        layout, mla, layers=2, host_slots=8 * P, dev_slots=8 * P, page_size=P, heads=1, head_dim=8
    )
    return len(lib.plan_direct(_check(host, dev_k, dev_v, h_idx, d_idx, layout, True)))


def test_contiguous_indices_merge_into_one_run_per_plane(lib):
    idx = torch.arange(3 * P, 7 * P)
    assert _run_count(lib, "layer_first", idx, idx) == 4  # 2 layers x K/V
    assert _run_count(lib, "layer_first", idx, idx, mla=True) == 2


def test_page_first_direct_moves_whole_pages(lib):
    pages = torch.tensor([5, 0, 3])
    slots = _pages_to_slots(pages)
    # Each page is contiguous on both sides: one copy per page per plane.
    assert _run_count(lib, "page_first_direct", slots, slots) == 3 * 4


def test_page_first_cannot_merge_tokens(lib):
    idx = torch.arange(P)  # host tokens are interleaved with the other layers
    assert _run_count(lib, "page_first", idx, idx) == P * 4


def test_plan_skips_out_of_range_pairs_even_unvalidated(lib):
    host, dev_k, dev_v = make_pools(
        "layer_first", False, layers=1, host_slots=8, dev_slots=8, page_size=1, heads=1, head_dim=8
    )
    good = _check(
        host, dev_k, dev_v, torch.tensor([0, 1]), torch.tensor([2, 3]), "layer_first", True
    )
    bad_h, bad_d = torch.tensor([0, 1, 8, 2]), torch.tensor([2, 3, 4, 99])
    bad = dataclasses.replace(good, host_indices=bad_h, device_indices=bad_d)
    assert lib.plan_direct(bad) == lib.plan_direct(good)
