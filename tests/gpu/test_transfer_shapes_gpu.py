"""The kernels on real model shapes and real concurrency (needs a GPU).

Real rows are 2-4 KiB (8-16 heads x 128 bf16), so the copy loop takes more than
one pass per row; pages of 64 tokens; pools past 4 GiB; base pointers that are
not 16-byte aligned; work on a stream other than the default one; two transfers
in flight; fp8 pools; and a per-layer load path that never waits for the device.
Each copy is compared bit for bit with the torch fallback or with the source rows.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading

import pytest
import torch

import kernels
from kernels import fallback, library, validate
from kernels.layouts import LAYOUTS, host_shape
from kernels.reference import make_pools, random_bits, same_bits
from tests.unit.kernels.host_reads import HostReads, counted

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s on an H100, longer than any copy here


@pytest.fixture(scope="module")
def cuda_lib():
    b = library.backend()
    if b.name != "cuda":
        pytest.fail(f"CUDA is available but the kernels are not: {b.reason}")
    return b.library


def _pools(layout, *, layers=3, page_size=64, heads=8, head_dim=128, dtype=torch.bfloat16, seed=0,
           host_pages=12, dev_pages=20, mla=False):
    return make_pools(layout, mla, layers=layers, host_slots=host_pages * page_size,
                      dev_slots=dev_pages * page_size, page_size=page_size, heads=1 if mla else heads,
                      head_dim=head_dim, dtype=dtype, seed=seed, device="cuda", pin_memory=True)


def _clone(pools):
    host, dev_k, dev_v = pools
    return (host.clone().pin_memory(), [t.clone() for t in dev_k],
            None if dev_v is None else [t.clone() for t in dev_v])


def _indices(page_size, seed, *, host_pages=12, dev_pages=20, pages=7, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    offs = torch.arange(page_size)
    h = (torch.randperm(host_pages, generator=gen)[:pages, None] * page_size + offs).flatten()
    d = (torch.randperm(dev_pages, generator=gen)[:pages, None] * page_size + offs).flatten()
    h[2] = -1
    d[-2] = -9
    return h.to(device), d.to(device)


def _oracle(pools, h, d, layout, page_size, to_host):
    host, dev_k, dev_v = pools
    fallback.run(validate.check(host_kv=host, device_k=dev_k, device_v=dev_v, layer_begin=0, all_layers=True,
                                host_indices=h, device_indices=d, layout=layout, page_size=page_size,
                                to_host=to_host, io_backend="kernel", num_ctas=None))


def _same(got, want):
    torch.cuda.synchronize()
    assert same_bits(got[0], want[0])
    for a, b in zip(got[1] + (got[2] or []), want[1] + (want[2] or [])):
        assert same_bits(a, b)


def _load_all(pools, h, d, layout, page_size, **kw):
    host, dev_k, dev_v = pools
    loads = kernels.prepare_load(host, dev_k, dev_v, h, d, layout, page_size, **kw)
    for layer in range(loads.num_layers):
        loads.load(layer)


SHAPES = [
    dict(heads=8, head_dim=128),  # 2 KiB rows
    dict(heads=16, head_dim=128),  # 4 KiB rows: two passes of the 16-byte loop
    dict(heads=8, head_dim=128, dtype=torch.float8_e4m3fn),  # fp8, 1 KiB rows
    dict(heads=16, head_dim=128, dtype=torch.float8_e5m2),
    dict(heads=1, head_dim=576, mla=True),  # MLA latent, 1152-byte rows
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_rows_match_fallback(cuda_lib, layout, page_size, io_backend, shape):
    pools = _pools(layout, page_size=page_size, **shape)
    want = _clone(pools)
    h, d = _indices(page_size, seed=11)
    _load_all(pools, h, d, layout, page_size, io_backend=io_backend)
    _oracle(want, h, d, layout, page_size, to_host=False)
    _same(pools, want)
    h, d = _indices(page_size, seed=12)
    host, dev_k, dev_v = pools
    kernels.backup_all_layers(dev_k, dev_v, host, d, h, layout, page_size, io_backend=io_backend)
    _oracle(want, h, d, layout, page_size, to_host=True)
    _same(pools, want)


@pytest.mark.parametrize("shift_bytes,vec", [(0, 16), (8, 8), (4, 4), (2, 1)])
@pytest.mark.parametrize("side", ["host", "device"])
def test_misaligned_base_pointers(cuda_lib, side, shift_bytes, vec):
    """A pool that starts off a 16-byte boundary takes a narrower vector, still bit-exact."""
    layout, P, heads, D = "layer_first", 16, 8, 128
    shift = shift_bytes // 2  # bf16 elements
    gen = torch.Generator().manual_seed(3)
    shape = host_shape(layout, False, 2, 12 * P, P, heads, D)
    numel = torch.Size(shape).numel()
    if side == "host":
        flat = random_bits((numel + 8,), torch.bfloat16, gen, pin_memory=True)
        host = flat[shift: shift + numel].view(shape)
        dev_k = [random_bits((20 * P, heads, D), torch.bfloat16, gen, "cuda") for _ in range(2)]
        dev_v = [random_bits((20 * P, heads, D), torch.bfloat16, gen, "cuda") for _ in range(2)]
    else:
        host = random_bits(shape, torch.bfloat16, gen, pin_memory=True)
        per = 20 * P * heads * D
        flat = random_bits((4 * per + 8,), torch.bfloat16, gen, "cuda")
        planes = [flat[shift + i * per: shift + (i + 1) * per].view(20 * P, heads, D) for i in range(4)]
        dev_k, dev_v = planes[:2], planes[2:]
    assert host.is_pinned()
    assert (host if side == "host" else dev_k[0]).data_ptr() % 16 == shift_bytes
    pools = (host, dev_k, dev_v)
    want = (host.clone().pin_memory(), [t.clone() for t in dev_k], [t.clone() for t in dev_v])
    h, d = _indices(P, seed=5)
    t = validate.check(host_kv=host, device_k=dev_k, device_v=dev_v, layer_begin=0, all_layers=True,
                       host_indices=h, device_indices=d, layout=layout, page_size=P, to_host=True,
                       io_backend="kernel", num_ctas=None)
    assert cuda_lib.vector_width(t) == vec
    _load_all(pools, h, d, layout, P)
    _oracle(want, h, d, layout, P, to_host=False)
    _same(pools, want)
    kernels.backup_all_layers(dev_k, dev_v, host, d, h, layout, P)
    _oracle(want, h, d, layout, P, to_host=True)
    _same(pools, want)


def _free_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_offsets_above_4_gib(cuda_lib, io_backend):
    """Host and device rows more than 4 GiB past their pool's base (64-bit address math)."""
    heads, D, item = 16, 128, 4096
    host_slots, dev_slots = 600 * 1024, 1100 * 1024  # 4.7 GiB pinned host, 2 x 4.3 GiB device
    host_bytes, dev_bytes = 2 * host_slots * item, 2 * dev_slots * item
    if _free_host_bytes() < host_bytes + (8 << 30) or torch.cuda.mem_get_info()[0] < dev_bytes + (4 << 30):
        pytest.skip("needs ~13 GiB of free host memory and ~13 GiB of free GPU memory")
    host = torch.empty((2, 1, host_slots, heads, D), dtype=torch.bfloat16, pin_memory=True)
    dev_k = torch.empty((dev_slots, heads, D), dtype=torch.bfloat16, device="cuda")
    dev_v = torch.empty_like(dev_k)
    gen = torch.Generator().manual_seed(9)
    # Pages at both ends of each pool: rows of the V half sit past 4 GiB on the host.
    h = torch.cat([torch.arange(0, 64), torch.arange(host_slots - 192, host_slots)])
    d = torch.cat([torch.arange(dev_slots - 128, dev_slots), torch.arange(64, 192)])
    assert (1 * host_slots + int(h.max())) * item > 4 << 30 and int(d.max()) * item > 4 << 30
    rows = random_bits((2, h.numel(), heads, D), torch.bfloat16, gen, pin_memory=True)
    host[:, 0, h] = rows
    sentinel_rows = torch.tensor([dev_slots - 129, 63, 192])
    dev_k[sentinel_rows] = 0
    dev_v[sentinel_rows] = 0
    kernels.load_per_layer(host, dev_k, dev_v, h, d, 0, "layer_first", 1, io_backend=io_backend)
    torch.cuda.synchronize()
    assert same_bits(dev_k[d].cpu(), rows[0]) and same_bits(dev_v[d].cpu(), rows[1])
    assert (dev_k[sentinel_rows] == 0).all() and (dev_v[sentinel_rows] == 0).all()
    # Back the other way into fresh host rows past 4 GiB.
    h2 = torch.arange(host_slots - 512, host_slots - 256)
    host[:, 0, h2] = 0
    kernels.backup_all_layers([dev_k], [dev_v], host, d, h2, "layer_first", 1, io_backend=io_backend)
    torch.cuda.synchronize()
    assert same_bits(host[0, 0, h2], rows[0]) and same_bits(host[1, 0, h2], rows[1])


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_runs_on_the_current_stream(cuda_lib, io_backend):
    """Work goes on torch's current stream: ordered after that stream's earlier work, and
    nothing lands on the default stream (which stays idle while the side stream sleeps)."""
    pools = _pools("page_first_direct", layers=2, page_size=16)
    host, dev_k, dev_v = pools
    h, d = _indices(16, seed=2)
    fresh = [random_bits(t.shape, t.dtype, torch.Generator().manual_seed(i), "cuda") for i, t in
             enumerate(dev_k + dev_v)]
    want = _clone(pools)
    for t, f in zip(want[1] + want[2], fresh):
        t.copy_(f)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t, f in zip(dev_k + dev_v, fresh):  # the source the write-back must see
            t.copy_(f)
        kernels.backup_all_layers(dev_k, dev_v, host, d, h, "page_first_direct", 16, io_backend=io_backend)
    assert not side.query(), "the side stream finished before the check: raise SLEEP_CYCLES"
    assert torch.cuda.default_stream().query()
    side.synchronize()
    _oracle(want, h, d, "page_first_direct", 16, to_host=True)
    _same(pools, want)


def test_two_transfers_in_flight_on_two_streams(cuda_lib):
    """A load and a write-back on different streams at once, on disjoint rows."""
    layout, P = "layer_first", 16
    pools = _pools(layout, layers=4, page_size=P, heads=16)
    want = _clone(pools)
    host, dev_k, dev_v = pools
    h_load, d_load = torch.arange(0, 4 * P), torch.arange(0, 4 * P)
    h_back, d_back = torch.arange(6 * P, 10 * P), torch.arange(10 * P, 14 * P)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(SLEEP_CYCLES)
        _load_all(pools, h_load, d_load, layout, P)
    with torch.cuda.stream(b):
        torch.cuda._sleep(SLEEP_CYCLES)
        kernels.backup_all_layers(dev_k, dev_v, host, d_back, h_back, layout, P)
    assert not a.query() and not b.query()  # both still in flight
    torch.cuda.synchronize()
    _oracle(want, h_load, d_load, layout, P, to_host=False)
    _oracle(want, h_back, d_back, layout, P, to_host=True)
    _same(pools, want)


def test_concurrent_threads_each_on_its_stream(cuda_lib):
    """Two threads issuing per-layer loads at once: the library keeps no per-call state."""
    layout, P, L = "page_first", 16, 8
    pools = _pools(layout, layers=L, page_size=P, host_pages=24, dev_pages=24)
    want = _clone(pools)
    host, dev_k, dev_v = pools
    jobs = [(torch.arange(0, 8 * P), torch.arange(0, 8 * P)),
            (torch.arange(8 * P, 16 * P), torch.arange(12 * P, 20 * P))]
    errors = []

    def run(h, d):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(10):
                    _load_all(pools, h, d, layout, P)
            s.synchronize()
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for h, d in jobs:
        _oracle(want, h, d, layout, P, to_host=False)
    _same(pools, want)


@pytest.mark.parametrize("index_device", ["cpu", "cuda"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_per_layer_loads_never_synchronise(cuda_lib, io_backend, index_device):
    """torch's sync debug mode raises on any host-device synchronisation torch makes; the
    per-layer calls make none (CPU indices: neither does preparing them for the kernel)."""
    layout, P, L = "layer_first", 16, 32
    pools = _pools(layout, layers=L, page_size=P, heads=8)
    want = _clone(pools)
    host, dev_k, dev_v = pools
    h, d = _indices(P, seed=7, device=index_device)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        if index_device == "cpu":  # GPU-resident indices cost one sync here, for the bounds check
            torch.cuda.set_sync_debug_mode("error")
        try:
            loads = kernels.prepare_load(host, dev_k, dev_v, h, d, layout, P, io_backend=io_backend)
            torch.cuda.set_sync_debug_mode("error")
            for layer in range(L):
                loads.load(layer)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    side.synchronize()
    _oracle(want, h.cpu(), d.cpu(), layout, P, to_host=False)
    _same(pools, want)


def test_per_layer_loads_read_no_index_on_the_compiled_path(cuda_lib):
    pools = _pools("page_first", layers=8, page_size=16)
    host, dev_k, dev_v = pools
    h, d = _indices(16, seed=4)
    with HostReads() as prep:
        loads = kernels.prepare_load(host, dev_k, dev_v, counted(h), counted(d), "page_first", 16)
    assert "to" in prep.ops  # the one upload
    with HostReads() as per_layer:
        for layer in range(8):
            loads.load(layer)
    assert per_layer.ops == []


def test_load_prepared_on_one_stream_and_issued_on_another(cuda_lib):
    layout, P = "layer_first", 16
    pools = _pools(layout, layers=4, page_size=P)
    want = _clone(pools)
    host, dev_k, dev_v = pools
    h, d = _indices(P, seed=8)
    up, issue = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(up):
        torch.cuda._sleep(SLEEP_CYCLES)  # the upload lands late
        loads = kernels.prepare_load(host, dev_k, dev_v, h, d, layout, P)
    with torch.cuda.stream(issue):
        for layer in range(4):
            loads.load(layer)
    torch.cuda.synchronize()
    _oracle(want, h, d, layout, P, to_host=False)
    _same(pools, want)


def _current_context():
    libcuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert libcuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value


def test_calling_thread_keeps_its_context(cuda_lib):
    """A thread with no current CUDA context still has none after a transfer: the library
    restores what was current instead of leaving its device (or device 0) behind."""
    layout, P = "layer_first", 16
    pools = _pools(layout, layers=2, page_size=P)
    want = _clone(pools)
    host, dev_k, dev_v = pools
    h, d = _indices(P, seed=1)
    t = library.place(validate.check(host_kv=host, device_k=dev_k, device_v=dev_v, layer_begin=0,
                                     all_layers=True, host_indices=h, device_indices=d, layout=layout,
                                     page_size=P, to_host=True, io_backend="kernel", num_ctas=None))
    stream = torch.cuda.current_stream().cuda_stream
    seen = {}

    def worker():
        seen["before"] = _current_context()
        cuda_lib.run(t, stream=stream)
        seen["after"] = _current_context()

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert seen == {"before": None, "after": None}
    torch.cuda.synchronize()
    _oracle(want, h, d, layout, P, to_host=True)
    _same(pools, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_transfer_on_another_gpu_keeps_torch_current_device(cuda_lib):
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    host = random_bits((2, 1, 64, 8, 128), torch.bfloat16, gen, pin_memory=True)
    dev_k = torch.zeros(64, 8, 128, dtype=torch.bfloat16, device="cuda:1")
    dev_v = torch.zeros_like(dev_k)
    idx = torch.arange(32)
    with torch.cuda.device(1):
        kernels.load_per_layer(host, dev_k, dev_v, idx, idx, 0, "layer_first", 1)
        torch.cuda.synchronize(1)
    kernels.load_per_layer(host, dev_k, dev_v, idx, idx, 0, "layer_first", 1)  # called from device 0
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert same_bits(dev_k[:32].cpu(), host[0, 0, :32])


def test_pointer_checks_in_the_library(cuda_lib):
    """Arguments that bypass the Python checks are refused by the library, and the
    context stays usable: a pageable host pool, a device plane in host memory."""
    layout, P = "layer_first", 16
    host, dev_k, dev_v = _pools(layout, layers=2, page_size=P)
    h, d = _indices(P, seed=6)
    good = validate.check(host_kv=host, device_k=dev_k, device_v=dev_v, layer_begin=0, all_layers=True,
                          host_indices=h, device_indices=d, layout=layout, page_size=P, to_host=False,
                          io_backend="kernel", num_ctas=None)
    pageable = torch.empty(host.shape, dtype=host.dtype).copy_(host)
    with pytest.raises(library.KernelLibraryError, match="host pool is not pinned"):
        cuda_lib.run(library.place(dataclasses.replace(good, host_kv=pageable)))
    on_host = tuple(t.cpu().pin_memory() for t in dev_k)
    stream = torch.cuda.current_stream().cuda_stream
    for io_backend in ("kernel", "direct"):
        bad = dataclasses.replace(good, device_k=on_host, io_backend=io_backend,
                                  host_indices=h, device_indices=d)
        with pytest.raises(library.KernelLibraryError, match="not memory of the transfer's CUDA device"):
            cuda_lib.run(bad, stream=stream)
    cuda_lib.run(library.place(good))
    torch.cuda.synchronize()
