"""The compiled address arithmetic agrees with torch's own offsets for every layout."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kernels import validate
from kernels.layouts import LAYOUTS, host_geometry
from kernels.reference import host_row, make_pools

DTYPES = (torch.bfloat16, torch.float32, torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_host_offsets_match_torch(lib, layout, mla, dtype, page_size):
    layers, slots, heads, dim = 3, 5 * page_size, 2, 6
    host, _, _ = make_pools(
        layout,
        mla,
        layers=layers,
        host_slots=slots,
        dev_slots=1,
        page_size=page_size,
        heads=heads,
        head_dim=dim,
        dtype=dtype,
    )
    geom = host_geometry(host, layout, page_size, mla)
    triples = list(itertools.product(range(1 if mla else 2), range(layers), range(slots)))
    kv, layer, slot = (torch.tensor(col) for col in zip(*triples))
    got = lib.host_offsets(geom, kv, layer, slot).tolist()
    base = host.data_ptr()
    want = [
        host_row(host, layout, mla, k, ly, s, page_size).data_ptr() - base for k, ly, s in triples
    ]
    assert got == want
    assert len(set(got)) == len(got)  # every row has its own place


def test_host_offsets_reject_bad_layout(lib):
    host = torch.zeros(2, 3, 8, 1, 4)
    geom = host_geometry(host, "layer_first", 4, False)
    bad = dataclasses.replace(geom, page_size=3)  # 8 slots is not whole pages of 3
    with pytest.raises(Exception, match="inconsistent host layout"):
        lib.host_offsets(bad, [0], [0], [0])


def _transfer(host, dev_k, dev_v, layout, page_size, n=4):
    idx = torch.arange(n)
    return validate.check(
        host_kv=host,
        device_k=dev_k,
        device_v=dev_v,
        layer_begin=0,
        all_layers=True,
        host_indices=idx,
        device_indices=idx,
        layout=layout,
        page_size=page_size,
        to_host=True,
        io_backend="kernel",
        num_ctas=None,
    )


@pytest.mark.parametrize(
    "dtype,heads,dim,want",
    [
        (torch.bfloat16, 8, 128, 16),  # 2 KiB rows: 16-byte vectors
        (torch.float32, 1, 2, 8),
        (torch.float16, 1, 2, 4),
        (torch.float16, 1, 3, 1),  # 6-byte rows
    ],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vector_width_follows_alignment(lib, layout, dtype, heads, dim, want):
    host, dev_k, dev_v = make_pools(
        layout,
        False,
        layers=2,
        host_slots=8,
        dev_slots=8,
        page_size=2,
        heads=heads,
        head_dim=dim,
        dtype=dtype,
    )
    assert lib.vector_width(_transfer(host, dev_k, dev_v, layout, 2)) == want


def test_vector_width_drops_for_misaligned_device_tensor(lib):
    host, dev_k, dev_v = make_pools(
        "layer_first",
        False,
        layers=1,
        host_slots=4,
        dev_slots=4,
        page_size=1,
        heads=1,
        head_dim=8,
        dtype=torch.bfloat16,
    )
    storage = torch.zeros(4 * 8 + 1, dtype=torch.bfloat16)
    shifted = storage[1:].view(4, 1, 8)  # base 2 bytes past a 16-byte boundary
    assert lib.vector_width(_transfer(host, [shifted], dev_v, "layer_first", 1)) == 1
