"""The public API on CPU tensors (the torch fallback) against the per-index reference."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import fallback, validate
from kernels.layouts import LAYOUTS, host_geometry
from kernels.reference import host_row, make_pools, naive_copy, same_bits

LAYERS = 3


def _pools(layout, mla, dtype, page_size, seed=0):
    return make_pools(
        layout,
        mla,
        layers=LAYERS,
        host_slots=6 * page_size,
        dev_slots=9 * page_size,
        page_size=page_size,
        heads=2,
        head_dim=8,
        dtype=dtype,
        seed=seed,
    )


def _clone(host, dev_k, dev_v):
    return (
        host.clone(),
        [t.clone() for t in dev_k],
        None if dev_v is None else [t.clone() for t in dev_v],
    )


def _indices(page_size, seed):
    """Scattered whole pages on both sides, with a few pairs masked out by negatives."""
    gen = torch.Generator().manual_seed(seed)
    h_pages = torch.randperm(6, generator=gen)[:4]
    d_pages = torch.randperm(9, generator=gen)[:4]
    offs = torch.arange(page_size)
    h_idx = (h_pages[:, None] * page_size + offs).flatten()
    d_idx = (d_pages[:, None] * page_size + offs).flatten()
    h_idx[1] = -1
    d_idx[-1] = -3
    return h_idx, d_idx


def _assert_pools_equal(got, want):
    assert same_bits(got[0], want[0])
    for mine, ref in zip(got[1] + (got[2] or []), want[1] + (want[2] or [])):
        assert same_bits(mine, ref)


CASES = pytest.mark.parametrize("layout", LAYOUTS)
MLA = pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
DTYPES = pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8],
    ids=str,
)
PAGES = pytest.mark.parametrize("page_size", [1, 4])


@PAGES
@DTYPES
@MLA
@CASES
def test_load_per_layer_matches_reference(layout, mla, dtype, page_size):
    pools = _pools(layout, mla, dtype, page_size)
    want = _clone(*pools)
    host, dev_k, dev_v = pools
    h_idx, d_idx = _indices(page_size, seed=3)
    layer = 1
    kernels.load_per_layer(
        host, dev_k[layer], None if mla else dev_v[layer], h_idx, d_idx, layer, layout, page_size
    )
    naive_copy(*want, h_idx, d_idx, [layer], layout, page_size, to_host=False)
    _assert_pools_equal(pools, want)
    # Destinations started random, so equal-to-reference means the copy happened.
    untouched = _pools(layout, mla, dtype, page_size)[1][layer]
    assert not same_bits(dev_k[layer], untouched)


@PAGES
@DTYPES
@MLA
@CASES
def test_backup_all_layers_matches_reference(layout, mla, dtype, page_size):
    pools = _pools(layout, mla, dtype, page_size, seed=5)
    want = _clone(*pools)
    host, dev_k, dev_v = pools
    h_idx, d_idx = _indices(page_size, seed=4)
    kernels.backup_all_layers(dev_k, dev_v, host, d_idx, h_idx, layout, page_size)
    naive_copy(*want, h_idx, d_idx, range(LAYERS), layout, page_size, to_host=True)
    _assert_pools_equal(pools, want)


@MLA
@CASES
def test_poisoned_destination_untouched_outside_indices(layout, mla):
    page_size = 2
    host, dev_k, dev_v = _pools(layout, mla, torch.float32, page_size)
    host.view(torch.uint8).fill_(0xAB)
    h_idx = torch.tensor([2, 3, 8, 9])
    d_idx = torch.tensor([10, 11, -1, 5])
    kernels.backup_all_layers(dev_k, dev_v, host, d_idx, h_idx, layout, page_size)
    copied = {2: 10, 3: 11, 9: 5}  # host slot 8 was paired with -1
    for kv, pool in enumerate([dev_k] if mla else [dev_k, dev_v]):
        for layer in range(LAYERS):
            for slot in range(host_geometry(host, layout, page_size, mla).num_slots):
                row = host_row(host, layout, mla, kv, layer, slot, page_size)
                if slot in copied:
                    assert same_bits(row, pool[layer][copied[slot]])
                else:
                    assert (row.view(torch.uint8) == 0xAB).all()


def test_io_backend_direct_and_ctas_give_same_result_on_cpu():
    base = _pools("page_first_direct", False, torch.bfloat16, 4)
    h_idx, d_idx = _indices(4, seed=9)
    results = []
    for kwargs in ({}, {"io_backend": "direct"}, {"num_ctas": 3}):
        host, dev_k, dev_v = _clone(*base)
        kernels.backup_all_layers(
            dev_k, dev_v, host, d_idx, h_idx, "page_first_direct", 4, **kwargs
        )
        results.append(host)
    assert same_bits(results[0], results[1]) and same_bits(results[0], results[2])
    assert not same_bits(results[0], base[0])


def test_empty_and_all_negative_indices_are_noops():
    host, dev_k, dev_v = _pools("layer_first", False, torch.bfloat16, 1)
    before = _clone(host, dev_k, dev_v)
    empty = torch.empty(0, dtype=torch.int64)
    kernels.load_per_layer(host, dev_k[0], dev_v[0], empty, empty, 0, "layer_first", 1)
    neg = torch.full((3,), -1, dtype=torch.int64)
    kernels.backup_all_layers(dev_k, dev_v, host, neg, torch.tensor([0, 1, 2]), "layer_first", 1)
    _assert_pools_equal((host, dev_k, dev_v), before)


@pytest.mark.parametrize("loop_min", [0, 1 << 30], ids=["row-loop", "index-ops"])
@pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "device-shifted"])
@pytest.mark.parametrize("to_host", [False, True], ids=["load", "backup"])
@MLA
@CASES
def test_whole_page_runs_match_reference(layout, mla, to_host, shift, loop_min, monkeypatch):
    """Whole aligned pages take the page-granular path; a shifted side must not.

    Both copy strategies (slice loop for large rows, index ops otherwise) run.
    """
    monkeypatch.setattr(fallback, "LOOP_MIN_BYTES", loop_min)
    page_size = 4
    pools = _pools(layout, mla, torch.bfloat16, page_size, seed=8)
    want = _clone(*pools)
    host, dev_k, dev_v = pools
    offs = torch.arange(page_size)
    h_idx = (torch.tensor([5, 0, 2])[:, None] * page_size + offs).flatten()
    d_idx = (torch.tensor([7, 3, 1])[:, None] * page_size + offs).flatten() + shift
    if to_host:
        kernels.backup_all_layers(dev_k, dev_v, host, d_idx, h_idx, layout, page_size)
        naive_copy(*want, h_idx, d_idx, range(LAYERS), layout, page_size, to_host=True)
    else:
        kernels.load_per_layer(
            host, dev_k[0], None if mla else dev_v[0], h_idx, d_idx, 0, layout, page_size
        )
        naive_copy(*want, h_idx, d_idx, [0], layout, page_size, to_host=False)
    _assert_pools_equal(pools, want)


def test_page_unit_detection():
    host, dev_k, dev_v = _pools("layer_first", False, torch.bfloat16, 4)

    def unit(h, d, layout="layer_first", hk=host):
        t = validate.check(
            host_kv=hk,
            device_k=dev_k,
            device_v=dev_v,
            layer_begin=0,
            all_layers=True,
            host_indices=h,
            device_indices=d,
            layout=layout,
            page_size=4,
            to_host=True,
            io_backend="kernel",
            num_ctas=None,
        )
        return fallback._page_unit(t, h, d)

    assert unit(torch.arange(8, 16), torch.arange(4, 12)) == 4
    assert unit(torch.arange(8, 16), torch.arange(5, 13)) == 1  # device side not aligned
    assert unit(torch.arange(8, 14), torch.arange(4, 10)) == 1  # partial page
    assert unit(torch.arange(8, 16), torch.arange(4, 12).flip(0)) == 1  # reversed tokens
    pf, _, _ = _pools("page_first", False, torch.bfloat16, 4)
    assert unit(torch.arange(8, 16), torch.arange(4, 12), "page_first", pf) == 1
