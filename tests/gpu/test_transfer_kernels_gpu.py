"""CUDA kernels and DMA path, bit-exact against the torch fallback (needs a GPU).

Every case runs the same request twice, once through the compiled library and
once through kernels.fallback on clones, and compares the whole pools bit for
bit, so untouched rows, skipped pairs and poisoned destinations are all covered.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from kernels import fallback, library, validate
from kernels.layouts import LAYOUTS
from kernels.reference import make_pools, random_bits, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_lib():
    b = library.backend()
    if b.name != "cuda":
        pytest.fail(f"CUDA is available but the kernels are not: {b.reason}")
    return b.library


def _pools(
    layout, mla, *, layers=3, page_size=4, heads=2, head_dim=64, dtype=torch.bfloat16, seed=0
):
    return make_pools(
        layout,
        mla,
        layers=layers,
        host_slots=12 * page_size,
        dev_slots=20 * page_size,
        page_size=page_size,
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
        device="cuda",
        pin_memory=True,
    )


def _clone(host, dev_k, dev_v):
    return (
        host.clone().pin_memory(),
        [t.clone() for t in dev_k],
        None if dev_v is None else [t.clone() for t in dev_v],
    )


def _indices(page_size, seed, pages=7, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    offs = torch.arange(page_size)
    h = (torch.randperm(12, generator=gen)[:pages, None] * page_size + offs).flatten()
    d = (torch.randperm(20, generator=gen)[:pages, None] * page_size + offs).flatten()
    h[2] = -1
    d[-2] = -9
    return h.to(device), d.to(device)


def _assert_same(got, want):
    torch.cuda.synchronize()
    assert same_bits(got[0], want[0])
    for a, b in zip(got[1] + (got[2] or []), want[1] + (want[2] or [])):
        assert same_bits(a, b)


def _oracle(pools, h_idx, d_idx, layout, page_size, to_host, layer=None):
    host, dev_k, dev_v = pools
    if layer is not None:
        dev_k, dev_v = [dev_k[layer]], None if dev_v is None else [dev_v[layer]]
    fallback.run(
        validate.check(
            host_kv=host,
            device_k=dev_k,
            device_v=dev_v,
            layer_begin=layer or 0,
            all_layers=layer is None,
            host_indices=h_idx,
            device_indices=d_idx,
            layout=layout,
            page_size=page_size,
            to_host=to_host,
            io_backend="kernel",
            num_ctas=None,
        )
    )


VARIANTS = [
    dict(),
    dict(num_ctas=1),
    dict(num_ctas=5),
    dict(page_size=1),
    dict(page_size=16, head_dim=128),
    dict(dtype=torch.float16, heads=1, head_dim=3),  # 6-byte rows: byte-wide path
    dict(dtype=torch.float32, heads=1, head_dim=2),  # 8-byte rows
    dict(dtype=torch.uint8, head_dim=20),  # 40-byte rows, 8-byte aligned
    dict(index_device="cuda"),
]


@pytest.mark.parametrize(
    "variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) or "base"
)
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_and_backup_match_fallback(cuda_lib, layout, mla, io_backend, variant):
    variant = dict(variant)
    num_ctas = variant.pop("num_ctas", None)
    index_device = variant.pop("index_device", "cpu")
    page_size = variant.get("page_size", 4)
    if mla and variant.get("heads") is None:
        variant["heads"] = 1
    pools = _pools(layout, mla, **variant)
    want = _clone(*pools)
    h_idx, d_idx = _indices(page_size, seed=11, device=index_device)
    host, dev_k, dev_v = pools
    kw = dict(io_backend=io_backend, num_ctas=num_ctas)

    kernels.load_per_layer(
        host, dev_k[2], None if mla else dev_v[2], h_idx, d_idx, 2, layout, page_size, **kw
    )
    _oracle(want, h_idx, d_idx, layout, page_size, to_host=False, layer=2)
    _assert_same(pools, want)

    h_idx, d_idx = _indices(page_size, seed=12, device=index_device)
    kernels.backup_all_layers(dev_k, dev_v, host, d_idx, h_idx, layout, page_size, **kw)
    _oracle(want, h_idx, d_idx, layout, page_size, to_host=True)
    _assert_same(pools, want)
    assert not same_bits(host, _pools(layout, mla, **variant)[0])  # something was written


def test_backend_info_reports_cuda(cuda_lib):
    info = kernels.backend_info()
    assert info["backend"] == "cuda" and info["library"] == str(cuda_lib.path)


@pytest.mark.parametrize("allow_batch", [True, False])
def test_direct_on_side_stream(cuda_lib, allow_batch):
    """A non-default stream is where cuMemcpyBatchAsync may be used."""
    pools = _pools("page_first_direct", False, page_size=16, head_dim=128)
    want = _clone(*pools)
    h_idx, d_idx = _indices(16, seed=3)
    host, dev_k, dev_v = pools
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    t = validate.check(
        host_kv=host,
        device_k=dev_k,
        device_v=dev_v,
        layer_begin=0,
        all_layers=True,
        host_indices=h_idx,
        device_indices=d_idx,
        layout="page_first_direct",
        page_size=16,
        to_host=True,
        io_backend="direct",
        num_ctas=None,
    )
    with torch.cuda.stream(stream):
        cuda_lib.run(t, allow_batch=allow_batch)
    stream.synchronize()
    _oracle(want, h_idx, d_idx, "page_first_direct", 16, to_host=True)
    _assert_same(pools, want)


@pytest.mark.parametrize("layers", [64, 65])  # 128 planes fill one launch; 130 need two
def test_many_layers_chunk_launches(cuda_lib, layers):
    pools = _pools("layer_first", False, layers=layers, head_dim=16)
    want = _clone(*pools)
    h_idx, d_idx = _indices(4, seed=5)
    kernels.backup_all_layers(pools[1], pools[2], pools[0], d_idx, h_idx, "layer_first", 4)
    _oracle(want, h_idx, d_idx, "layer_first", 4, to_host=True)
    _assert_same(pools, want)


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_unvalidated_bad_index_never_writes_outside(cuda_lib, io_backend):
    """Bypass the wrapper's checks: the kernel/planner must skip out-of-range pairs."""
    gen = torch.Generator().manual_seed(0)
    host = random_bits((2, 1, 8, 2, 8), torch.bfloat16, gen, pin_memory=True)
    arena = torch.zeros(2, 16, 2, 8, dtype=torch.bfloat16, device="cuda")
    dev_k, dev_v = arena[0, :8], arena[1, :8]  # rows 8..15 of each half are sentinels
    good = validate.check(
        host_kv=host,
        device_k=[dev_k],
        device_v=[dev_v],
        layer_begin=0,
        all_layers=False,
        host_indices=torch.tensor([1, 2]),
        device_indices=torch.tensor([3, 4]),
        layout="layer_first",
        page_size=1,
        to_host=False,
        io_backend=io_backend,
        num_ctas=None,
    )
    bad = dataclasses.replace(
        good, host_indices=torch.tensor([1, 9, 2, 0]), device_indices=torch.tensor([3, 5, 4, 8])
    )
    cuda_lib.run(library.place(bad))
    torch.cuda.synchronize()
    assert (arena[:, 8:] == 0).all()
    assert same_bits(dev_k[3], host[0, 0, 1].cuda()) and same_bits(dev_v[4], host[1, 0, 2].cuda())
    assert (dev_k[5] == 0).all()


def test_pageable_host_needs_direct(cuda_lib):
    host, dev_k, dev_v = _pools("layer_first", False)
    pageable = torch.empty(host.shape, dtype=host.dtype).copy_(host)
    assert not pageable.is_pinned()
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="must be pinned"):
        kernels.load_per_layer(pageable, dev_k[0], dev_v[0], idx, idx, 0, "layer_first", 4)
    kernels.load_per_layer(
        pageable, dev_k[0], dev_v[0], idx, idx, 0, "layer_first", 4, io_backend="direct"
    )
    torch.cuda.synchronize()
    assert same_bits(dev_k[0][:2].cpu(), pageable[0, 0, :2])
