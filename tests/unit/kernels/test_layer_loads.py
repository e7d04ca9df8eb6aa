"""A layer-by-layer load reads and places its indices once, never per layer.

Per-layer loads run back to back on the transfer stream while the forward pass
waits for each layer; a host read of an index on that path would be a
host-device synchronisation per layer on a GPU. These tests count such reads
(tests/unit/kernels/host_reads.py) through the public API, the compiled
library's per-layer entry and the runtime's transfer worker.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from cache_runtime.memory import DevicePool, HostPool
from cache_runtime.transfer import LoadOp, TransferWorker
from kernels import library, validate
from kernels.layouts import LAYOUTS
from kernels.reference import make_pools, naive_copy, same_bits
from tests.unit.kernels.host_reads import HostReads, counted


def _request(layout, page_size, *, layers=4, heads=2, head_dim=8, pages=5, seed=0):
    pools = make_pools(
        layout,
        False,
        layers=layers,
        host_slots=8 * page_size,
        dev_slots=10 * page_size,
        page_size=page_size,
        heads=heads,
        head_dim=head_dim,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed)
    offs = torch.arange(page_size)
    h = (torch.randperm(8, generator=gen)[:pages, None] * page_size + offs).flatten()
    d = (torch.randperm(10, generator=gen)[:pages, None] * page_size + offs).flatten()
    d[1] = -1  # a skipped pair
    return pools, h, d


CASES = [
    *[(layout, p, 8) for layout in LAYOUTS for p in (1, 4)],
    ("layer_first", 16, 1024),  # 32 KiB pages: the fallback's slice-copy loop
    ("page_first_direct", 16, 1024),
]


@pytest.mark.parametrize("layout,page_size,head_dim", CASES)
def test_per_layer_loads_read_no_index(layout, page_size, head_dim):
    (host, dev_k, dev_v), h, d = _request(layout, page_size, head_dim=head_dim)
    want = (host.clone(), [t.clone() for t in dev_k], [t.clone() for t in dev_v])
    with HostReads() as prep:
        loads = kernels.prepare_load(host, dev_k, dev_v, counted(h), counted(d), layout, page_size)
    assert prep.ops  # the check and placement do read them, once
    with HostReads() as per_layer:
        for layer in range(loads.num_layers):
            loads.load(layer)
    assert per_layer.ops == []
    naive_copy(*want, h, d, range(4), layout, page_size, to_host=False)
    assert all(same_bits(a, b) for a, b in zip(dev_k + dev_v, want[1] + want[2]))


def test_prepare_reads_do_not_grow_with_layers():
    counts = []
    for layers in (2, 8):
        (host, dev_k, dev_v), h, d = _request("layer_first", 4, layers=layers)
        with HostReads() as reads:
            kernels.prepare_load(host, dev_k, dev_v, counted(h), counted(d), "layer_first", 4)
        counts.append(reads.ops)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_compiled_per_layer_call_reads_no_index(lib, io_backend):
    """The library's per-layer entry passes pointers only; here it gets as far as the
    CUDA driver, which this machine lacks (on a GPU the same call enqueues the copy)."""
    if torch.cuda.is_available():
        pytest.skip("checks the call up to a missing driver; tests/gpu covers the device")
    (host, dev_k, dev_v), h, d = _request("layer_first", 4)
    t = validate.check(
        host_kv=host,
        device_k=dev_k,
        device_v=dev_v,
        layer_begin=0,
        all_layers=True,
        host_indices=counted(h),
        device_indices=counted(d),
        layout="layer_first",
        page_size=4,
        to_host=False,
        io_backend=io_backend,
        num_ctas=None,
    )
    with HostReads() as reads:
        for layer in range(4):
            with pytest.raises(library.KernelLibraryError, match="hicache transfer failed"):
                lib.run(t.layer(layer), stream=0)
    assert reads.ops == []


def test_compiled_call_refuses_unplaced_indices(lib):
    (host, dev_k, dev_v), h, d = _request("layer_first", 4)
    t = validate.check(
        host_kv=host,
        device_k=dev_k[:1],
        device_v=dev_v[:1],
        layer_begin=0,
        all_layers=False,
        host_indices=h[::2],
        device_indices=d[::2],
        layout="layer_first",
        page_size=4,
        to_host=False,
        io_backend="kernel",
        num_ctas=None,
    )
    bad = dataclasses.replace(t, host_indices=h[::2])
    with pytest.raises(ValueError, match="host_indices must be contiguous"):
        lib.run(bad, stream=0)


def test_layer_out_of_range():
    (host, dev_k, dev_v), h, d = _request("page_first", 1)
    loads = kernels.prepare_load(host, dev_k, dev_v, h, d, "page_first", 1)
    with pytest.raises(ValueError, match=r"layer_id must be in \[0, 3\], got 4"):
        loads.load(4)


def test_prepare_load_checks_like_the_one_shot_calls():
    (host, dev_k, dev_v), h, d = _request("layer_first", 4)
    with pytest.raises(ValueError, match="host_kv has 4 layers, device pool 3"):
        kernels.prepare_load(host, dev_k[:3], dev_v[:3], h, d, "layer_first", 4)
    with pytest.raises(TypeError, match="device_k_layers must be a list"):
        kernels.prepare_load(host, dev_k[0], dev_v, h, d, "layer_first", 4)
    with pytest.raises(ValueError, match="device_indices has index 40 >= pool size 40"):
        kernels.prepare_load(host, dev_k, dev_v, h, torch.full_like(d, 40), "layer_first", 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_runtime_load_places_indices_once(layout):
    """The transfer worker's L2 -> L1 load of every layer costs what one prepare_load costs."""
    L, P = 6, 4
    device = DevicePool(12 * P, P, L, 2, 8, torch.bfloat16, torch.device("cpu"))
    host = HostPool(16 * P, P, L, 2, 8, torch.bfloat16, layout, pin=False)
    host.kv_buffer.view(torch.uint8).random_(generator=torch.Generator().manual_seed(1))
    h = torch.arange(3 * P, 7 * P)
    d = torch.arange(5 * P, 9 * P)
    with HostReads() as lone:
        kernels.prepare_load(host.kv_buffer, device.k, device.v, counted(h), counted(d), layout, P)
    worker = TransferWorker(device, host, "kernel", wake=lambda: None)
    try:
        op = LoadOp([], counted(d), counted(h), None, L)
        with HostReads() as whole:
            worker.submit_load(op)
            assert worker.completed.get(timeout=60) is op
    finally:
        worker.stop()
    assert op.error is None
    assert sorted(whole.ops) == sorted(lone.ops)
    want_k = [torch.zeros_like(t) for t in device.k]
    want_v = [torch.zeros_like(t) for t in device.v]
    naive_copy(host.kv_buffer, want_k, want_v, h, d, range(L), layout, P, to_host=False)
    assert all(same_bits(a, b) for a, b in zip(device.k + device.v, want_k + want_v))
