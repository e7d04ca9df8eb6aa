"""L1<->L2 KV transfer throughput, as a ratio to a contiguous copy of the same bytes.

Protocol: shared/docs/kernels.md section 5. Everything runs in one process on
the same pools (and, on a GPU, the same non-default stream), so each variant's
GB/s is divided by the limit measured beside it in the same run.

A load (h2d) moves K and V of every layer, issued layer by layer as the runtime
does while the forward pass waits for each layer; a write-back (d2h) moves every
layer in one call. Every variant starts from the same CPU index tensors (as the
runtime's allocators hand them out) and pays for moving them where it reads
them inside its timing: once per transfer for ours (`kernels.prepare_load`) and
for sgl-kernel alike.

  GPU: limit = one contiguous pinned<->device copy_ of equal bytes (plus both
  directions at once on two streams); ours-kernel = the SM kernel at each
  --ctas value; ours-direct = the DMA path (cuMemcpyBatchAsync where the driver
  has it); memcpy-loop = one cudaMemcpyAsync per merged run; torch-staging =
  gather into pinned staging, one copy, scatter on the far side; sgl-kernel /
  sgl-direct = SGLang's sgl_kernel.kvcacheio transfer_kv_* functions on the same
  pools, when sgl-kernel is importable. `vs_sgl` = ours GB/s / sgl GB/s, same
  backend kind (SM kernel or DMA), same run.
  CPU: limit = a contiguous copy_ of equal bytes; ours = the torch fallback;
  page-loop = one slice copy per page and plane; naive = per-index Python.

Bytes are payload once; GB = 1e9. Device times come from CUDA events; `host_ms`
is how long the host took to issue the transfer (what bounds small loads).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import kernels
from kernels import library, validate
from kernels.layouts import (
    LAYER_FIRST,
    LAYOUTS,
    PAGE_FIRST,
    PAGE_FIRST_DIRECT,
    host_geometry,
    host_shape,
    plane_view,
)
from kernels.reference import naive_copy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


@dataclass
class Row:
    direction: str
    layout: str
    page_size: int
    layers: int
    item_bytes: int
    tokens: int
    bytes: int
    variant: str
    ctas: int | None
    median_s: float
    p10_s: float
    p90_s: float
    host_ms: float
    gbps: float
    ratio: float = math.nan
    vs_sgl: float | None = None


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument("--page-sizes", type=_ints, default=[1, 16, 64])
    p.add_argument("--layers", type=_ints, default=None, help="default 32,80 (cuda), 4 (cpu)")
    p.add_argument("--item-bytes", type=_ints, default=None,
                   help="bytes per token per layer of K (or V): heads = item / (head_dim x dtype); "
                        "default 2048,4096 (8 and 16 heads of 128 bf16)")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS))
    p.add_argument("--directions", type=lambda s: s.split(","), default=["h2d", "d2h"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tokens", type=_ints, default=None,
                   help="tokens per transfer, random whole pages (default 4096 cuda, 256 cpu)")
    p.add_argument("--pool-factor", type=int, default=2, help="pool slots = factor x largest call")
    p.add_argument("--ctas", type=_ints, default=[1, 4, 8, 32, 0],
                   help="kernel CTA counts (0 = one warp per item, the full grid); cuda only")
    p.add_argument("--repeats", type=int, default=None, help="timed calls at most (default 10 cuda, 3 cpu)")
    p.add_argument("--budget-s", type=float, default=2.0,
                   help="stop repeating a variant after this long (at least 3 calls)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--skip-naive", action="store_true", help="cpu: skip the per-index Python loop")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json-out", type=Path)
    a = p.parse_args(argv)
    on_gpu = a.device == "cuda"
    if on_gpu and not cuda:
        p.error("--device cuda but torch sees no CUDA device")
    a.layers = a.layers or ([32, 80] if on_gpu else [4])
    a.item_bytes = a.item_bytes or [2048, 4096]
    a.tokens = a.tokens or ([4096] if on_gpu else [256])
    a.repeats = a.repeats or (10 if on_gpu else 3)
    elem = torch.empty((), dtype=DTYPES[a.dtype]).element_size()
    for item in a.item_bytes:
        if item % (a.head_dim * elem):
            p.error(f"--item-bytes {item} is not a multiple of head_dim x {a.dtype} ({a.head_dim * elem})")
    bad = set(a.layouts) - set(LAYOUTS)
    if bad:
        p.error(f"unknown layouts {sorted(bad)}")
    return a


class Timer:
    """Median/spread of repeated calls (CUDA events on the current stream, or wall time),
    plus the host time to issue each call."""

    def __init__(self, cuda: bool, warmup: int, repeats: int, budget_s: float):
        self.cuda, self.warmup, self.repeats, self.budget_s = cuda, warmup, repeats, budget_s

    def __call__(self, fn) -> tuple[list[float], list[float]]:
        for i in range(self.warmup):
            fn(i)
        self._sync()
        times, host = [], []
        t_end = time.perf_counter() + self.budget_s
        for i in range(self.repeats):
            if len(times) >= 3 and time.perf_counter() > t_end:
                break
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                t0 = time.perf_counter()
                fn(i)
                host.append(time.perf_counter() - t0)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn(i)
                times.append(time.perf_counter() - t0)
                host.append(times[-1])
        return times, host

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


class Pools:
    """One flat host buffer and one flat device buffer, viewed per shape."""

    def __init__(self, a, max_planes_bytes: int, slots: int):
        self.a = a
        self.dtype = DTYPES[a.dtype]
        self.slots = slots
        pin = a.device == "cuda"
        self.host_bytes = torch.empty(max_planes_bytes, dtype=torch.uint8, pin_memory=pin)
        self.dev_bytes = torch.empty(max_planes_bytes, dtype=torch.uint8, device=a.device)
        # Random bits everywhere (no all-zero fast paths), generated where it is fast.
        self.dev_bytes.random_()
        self.host_bytes.copy_(self.dev_bytes)
        self.dev_bytes.random_()
        if pin:
            torch.cuda.synchronize()  # the timed work runs on another stream

    def host(self, layout, layers, page_size, heads):
        shape = host_shape(layout, False, layers, self.slots, page_size, heads, self.a.head_dim)
        return self.host_bytes.view(self.dtype)[: math.prod(shape)].view(shape)

    def device(self, layers, heads):
        per = self.slots * heads * self.a.head_dim
        flat = self.dev_bytes.view(self.dtype)
        views = [flat[i * per : (i + 1) * per].view(self.slots, heads, self.a.head_dim)
                 for i in range(2 * layers)]
        return views[:layers], views[layers:]


def index_sets(slots, tokens, page_size, count):
    """Scattered whole pages (random permutations) on the CPU, built outside the timing."""
    pages, want = slots // page_size, max(1, tokens // page_size)
    gen = torch.Generator().manual_seed(1234)
    offs = torch.arange(page_size)
    out = []
    for _ in range(count):
        h = (torch.randperm(pages, generator=gen)[:want, None] * page_size + offs).flatten()
        d = (torch.randperm(pages, generator=gen)[:want, None] * page_size + offs).flatten()
        out.append((h, d))
    return out


def upload(idx: torch.Tensor, device) -> torch.Tensor:
    """CPU indices to the GPU without waiting for the stream: the same way for every variant."""
    return idx.pin_memory().to(device, non_blocking=True)


@dataclass
class Config:
    direction: str
    layout: str
    page_size: int
    layers: int
    item_bytes: int
    tokens: int


def bench_config(a, pools, timer, cfg: Config, backend, sgl):
    cuda = a.device == "cuda"
    elem = torch.empty((), dtype=pools.dtype).element_size()
    heads = cfg.item_bytes // (a.head_dim * elem)
    host = pools.host(cfg.layout, cfg.layers, cfg.page_size, heads)
    dev_k, dev_v = pools.device(cfg.layers, heads)
    geom = host_geometry(host, cfg.layout, cfg.page_size, False)
    sets = index_sets(pools.slots, cfg.tokens, cfg.page_size, 4)
    tokens = sets[0][0].numel()
    nbytes = tokens * geom.item_bytes * 2 * cfg.layers
    h2d = cfg.direction == "h2d"
    rows: list[Row] = []

    def record(variant, timed, ctas=None, moved=nbytes):
        times, host_t = timed
        med = statistics.median(times)
        q = statistics.quantiles(times, n=10) if len(times) > 1 else [med] * 9
        rows.append(Row(cfg.direction, cfg.layout, cfg.page_size, cfg.layers, geom.item_bytes, tokens,
                        moved, variant, ctas, med, q[0], q[-1], statistics.median(host_t) * 1e3,
                        moved / med / 1e9))

    def pick(i):
        return sets[i % len(sets)]

    def ours(i, **kw):
        h, d = pick(i)
        if h2d:
            loads = kernels.prepare_load(host, dev_k, dev_v, h, d, cfg.layout, cfg.page_size, **kw)
            for layer in range(cfg.layers):
                loads.load(layer)
        else:
            kernels.backup_all_layers(dev_k, dev_v, host, d, h, cfg.layout, cfg.page_size, **kw)

    # The limit: one contiguous copy of the same bytes, same buffers.
    if pools.host_bytes.numel() < nbytes:
        raise SystemExit("pool smaller than one call; raise --pool-factor")
    src_h, dst_d = pools.host_bytes[:nbytes], pools.dev_bytes[:nbytes]
    if h2d:
        record("limit", timer(lambda i: dst_d.copy_(src_h, non_blocking=cuda)))
    else:
        record("limit", timer(lambda i: src_h.copy_(dst_d, non_blocking=cuda)))
    limit = rows[-1].gbps

    if cuda:
        _gpu_variants(a, pools, timer, record, ours, pick, host, geom, dev_k, dev_v, cfg, nbytes,
                      backend, sgl)
    else:
        record("ours-fallback", timer(ours))
        record("page-loop", timer(lambda i: _page_loop(host, geom, dev_k, dev_v, *pick(i), h2d, cfg.layers)))
        if not a.skip_naive:

            def naive(i):
                h, d = pick(i)
                naive_copy(host, dev_k, dev_v, h, d, range(cfg.layers), cfg.layout, cfg.page_size, not h2d)

            record("naive-per-index", timer(naive))
    best = {}
    for r in rows:
        r.ratio = r.gbps / limit
        if r.variant.startswith("sgl-"):
            best[r.variant] = r.gbps
    for r in rows:
        kind = "sgl-kernel" if r.variant == "ours-kernel" else "sgl-direct" if r.variant == "ours-direct" else None
        if kind in best:
            r.vs_sgl = r.gbps / best[kind]
    return rows


def _page_loop(host, geom, dev_k, dev_v, h, d, h2d, layers):
    """One slice copy per page and plane: the CPU analogue of a per-page memcpy loop."""
    p = geom.page_size
    h_pages, d_starts = (h[::p] // p).tolist(), d[::p].tolist()
    for kv, pool in enumerate((dev_k, dev_v)):
        for layer in range(layers):
            view = plane_view(host, geom, kv, layer)
            dev = pool[layer]
            for hp, ds in zip(h_pages, d_starts):
                if h2d:
                    dev[ds : ds + p].copy_(view[hp])
                else:
                    view[hp].copy_(dev[ds : ds + p])


def _gpu_variants(a, pools, timer, record, ours, pick, host, geom, dev_k, dev_v, cfg, nbytes, backend,
                  sgl):
    h2d = cfg.direction == "h2d"
    # Both directions at once on two streams (2 x nbytes moved): the bidirectional ceiling.
    host_b, dev_b = pools.host_bytes, pools.dev_bytes
    if host_b.numel() >= 2 * nbytes:
        other = torch.cuda.Stream()

        def bidir(i):
            other.wait_stream(torch.cuda.current_stream())
            dev_b[:nbytes].copy_(host_b[:nbytes], non_blocking=True)
            with torch.cuda.stream(other):
                host_b[nbytes : 2 * nbytes].copy_(dev_b[nbytes : 2 * nbytes], non_blocking=True)
            torch.cuda.current_stream().wait_stream(other)

        record("limit-bidir", timer(bidir), moved=2 * nbytes)

    for ctas in a.ctas:
        planes_per_launch = 2 if h2d else min(2 * cfg.layers, 128)
        n = ctas or max(1, math.ceil(pick(0)[0].numel() * planes_per_launch * 32 / 1024))
        record("ours-kernel", timer(lambda i, n=n: ours(i, num_ctas=n)), n)
    record("ours-direct", timer(lambda i: ours(i, io_backend="direct")))

    lib = backend.library

    def memcpy_loop(i):
        h, d = pick(i)
        t = validate.check(host_kv=host, device_k=dev_k, device_v=dev_v, layer_begin=0, all_layers=True,
                           host_indices=h, device_indices=d, layout=cfg.layout, page_size=cfg.page_size,
                           to_host=not h2d, io_backend="direct", num_ctas=None)
        t = library.place(t)
        if h2d:
            for layer in range(cfg.layers):
                lib.run(t.layer(layer), allow_batch=False)
        else:
            lib.run(t, allow_batch=False)

    record("memcpy-loop", timer(memcpy_loop))
    record("torch-staging", timer(_torch_staging(host, geom, dev_k, dev_v, pick, h2d, cfg.layers)))
    if sgl is not None:
        for variant, fn in _sgl_variants(sgl, host, geom, dev_k, dev_v, pick, cfg):
            record(variant, timer(fn))


def _torch_staging(host, geom, dev_k, dev_v, pick, h2d, layers):
    tokens = pick(0)[0].numel()
    row = dev_k[0].shape[1:]
    stage = torch.empty((tokens, *row), dtype=host.dtype, pin_memory=True)
    buf = torch.empty((tokens, *row), dtype=host.dtype, device=dev_k[0].device)
    p = geom.page_size

    def run(i):
        h, d = pick(i)
        dd = upload(d, dev_k[0].device)
        page, within = h // p, h % p
        for kv, pool in enumerate((dev_k, dev_v)):
            for layer in range(layers):
                view = plane_view(host, geom, kv, layer)
                if h2d:
                    torch.cuda.current_stream().synchronize()  # staging reuse
                    stage.copy_(view[page, within])
                    buf.copy_(stage, non_blocking=True)
                    pool[layer].index_copy_(0, dd, buf)
                else:
                    torch.index_select(pool[layer], 0, dd, out=buf)
                    stage.copy_(buf, non_blocking=True)
                    torch.cuda.current_stream().synchronize()
                    view.index_put_((page, within), stage)

    return run


def load_sgl():
    """sgl_kernel.kvcacheio when importable (it needs a CUDA build of sgl-kernel), else None."""
    try:
        return importlib.import_module("sgl_kernel.kvcacheio")
    except Exception:  # noqa: BLE001  (ImportError, or a CUDA/ABI mismatch raised at import)
        return None


def _sgl_variants(sgl, host, geom, dev_k, dev_v, pick, cfg):
    """sgl-kernel's transfer_kv_* on the same pools and indices, called as SGLang's host
    pools call them (sglang/srt/mem_cache/pool_host/mha.py); pointer tables built once,
    as SGLang does when it creates its pools."""
    device = dev_k[0].device
    item = geom.item_bytes
    L = cfg.layers
    h2d = cfg.direction == "h2d"
    k_half, v_half = host[0], host[1]

    def table(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, device=device)

    out = []
    if cfg.layout == LAYER_FIRST:
        host_k = [k_half[layer] for layer in range(L)]
        host_v = [v_half[layer] for layer in range(L)]
        if h2d:
            def kernel(i):
                h, d = (upload(x, device) for x in pick(i))
                for layer in range(L):
                    sgl.transfer_kv_per_layer(src_k=host_k[layer], dst_k=dev_k[layer], src_v=host_v[layer],
                                              dst_v=dev_v[layer], src_indices=h, dst_indices=d, item_size=item)

            def direct(i):
                h, d = pick(i)
                for layer in range(L):
                    sgl.transfer_kv_direct(src_layers=[host_k[layer], host_v[layer]],
                                           dst_layers=[dev_k[layer], dev_v[layer]],
                                           src_indices=h, dst_indices=d, page_size=cfg.page_size)
        else:
            tables = (table(dev_k), table(host_k), table(dev_v), table(host_v))

            def kernel(i):
                h, d = (upload(x, device) for x in pick(i))
                sgl.transfer_kv_all_layer(src_k_layers=tables[0], dst_k_layers=tables[1],
                                          src_v_layers=tables[2], dst_v_layers=tables[3],
                                          src_indices=d, dst_indices=h, item_size=item, num_layers=L)

            def direct(i):
                h, d = pick(i)
                sgl.transfer_kv_direct(src_layers=dev_k + dev_v, dst_layers=host_k + host_v,
                                       src_indices=d, dst_indices=h, page_size=cfg.page_size)
        out += [("sgl-kernel", kernel), ("sgl-direct", direct)]
    elif cfg.layout == PAGE_FIRST:
        if h2d:
            def kernel(i):
                h, d = (upload(x, device) for x in pick(i))
                for layer in range(L):
                    sgl.transfer_kv_per_layer_pf_lf(src_k=k_half, dst_k=dev_k[layer], src_v=v_half,
                                                    dst_v=dev_v[layer], src_indices=h, dst_indices=d,
                                                    layer_id=layer, item_size=item, src_layout_dim=L * item)
        else:
            tables = (table(dev_k), table(dev_v))

            def kernel(i):
                h, d = (upload(x, device) for x in pick(i))
                sgl.transfer_kv_all_layer_lf_pf(src_k_layers=tables[0], dst_k=k_half, src_v_layers=tables[1],
                                                dst_v=v_half, src_indices=d, dst_indices=h, item_size=item,
                                                dst_layout_dim=L * item, num_layers=L)
        out.append(("sgl-kernel", kernel))
    elif cfg.layout == PAGE_FIRST_DIRECT:
        if h2d:
            def direct(i):
                h, d = pick(i)
                for layer in range(L):
                    sgl.transfer_kv_per_layer_direct_pf_lf(src_ptrs=[k_half, v_half],
                                                           dst_ptrs=[dev_k[layer], dev_v[layer]],
                                                           src_indices=h, dst_indices=d, layer_id=layer,
                                                           page_size=cfg.page_size)
        else:
            def direct(i):
                h, d = pick(i)
                sgl.transfer_kv_all_layer_direct_lf_pf(src_ptrs=dev_k + dev_v, dst_ptrs=[k_half, v_half],
                                                       src_indices=d, dst_indices=h, page_size=cfg.page_size)
        out.append(("sgl-direct", direct))
    return out


def environment(a, sgl):
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": a.device,
        "kernels": kernels.backend_info(),
    }
    if a.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                    driver=_driver_version(), sgl_kernel=_sgl_version(sgl))
    else:
        info.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def _sgl_version(sgl):
    if sgl is None:
        return None
    try:
        from importlib.metadata import version

        return version("sgl-kernel")
    except Exception:  # noqa: BLE001
        return "unknown"


def _driver_version():
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
    except OSError:
        return None


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    backend = library.backend()
    if a.device == "cuda" and backend.name != "cuda":
        print(f"error: CUDA present but kernels unavailable: {backend.reason}", file=sys.stderr)
        return 1
    sgl = load_sgl() if a.device == "cuda" else None
    env = environment(a, sgl)
    print(json.dumps(env))
    if a.device == "cuda" and sgl is None:
        print("# sgl-kernel not importable: no sgl-kernel rows")
    timer = Timer(a.device == "cuda", a.warmup, a.repeats, a.budget_s)
    step = math.lcm(*a.page_sizes)
    slots = math.ceil(a.pool_factor * max(a.tokens) / step) * step
    pools = Pools(a, 2 * max(a.layers) * slots * max(a.item_bytes), slots)
    stream = torch.cuda.Stream() if a.device == "cuda" else None
    rows: list[Row] = []
    t0 = time.perf_counter()
    print(f"{'dir':4} {'layout':18} {'P':>3} {'L':>3} {'item':>5} {'tokens':>6} {'MiB':>7} "
          f"{'variant':14} {'ctas':>5} {'GB/s':>8} {'ratio':>6} {'host_ms':>8} {'vs_sgl':>6}")
    with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
        for direction in a.directions:
            for layers in a.layers:
                for item in a.item_bytes:
                    for tokens in a.tokens:
                        for page_size in a.page_sizes:
                            for layout in a.layouts:
                                cfg = Config(direction, layout, page_size, layers, item, tokens)
                                for r in bench_config(a, pools, timer, cfg, backend, sgl):
                                    rows.append(r)
                                    vs = "" if r.vs_sgl is None else f"{r.vs_sgl:.2f}"
                                    print(f"{r.direction:4} {r.layout:18} {r.page_size:>3} {r.layers:>3} "
                                          f"{r.item_bytes:>5} {r.tokens:>6} {r.bytes / 2**20:>7.1f} "
                                          f"{r.variant:14} {r.ctas if r.ctas else '':>5} {r.gbps:>8.2f} "
                                          f"{r.ratio:>6.2f} {r.host_ms:>8.3f} {vs:>6}")
    print(f"# {len(rows)} measurements in {time.perf_counter() - t0:.1f} s; ratio = GB/s / limit GB/s; "
          "vs_sgl = ours GB/s / sgl-kernel GB/s (same backend kind, same run)")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
        a.json_out.write_text(json.dumps({"env": env, "args": args, "rows": [asdict(r) for r in rows]},
                                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
