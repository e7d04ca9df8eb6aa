"""L1<->L2 KV transfer throughput, as a ratio to a contiguous copy of the same bytes.

Protocol: shared/docs/kernels.md section 5. Everything runs in one process on
the same buffers (and, on a GPU, the same non-default stream), so each variant's
GB/s is divided by the limit measured beside it in the same run:

  GPU: limit = one contiguous pinned<->device copy_ of equal bytes (plus both
  directions at once on two streams); ours = the SM kernel at each --ctas value
  and the DMA path (cuMemcpyBatchAsync where the driver has it); memcpy-loop =
  one cudaMemcpyAsync per merged run (per page); torch-staging = gather into
  pinned staging, one copy, scatter on the far side.
  CPU: limit = a contiguous copy_ of equal bytes; ours = the torch fallback;
  page-loop = one slice copy per page and plane; naive = per-index Python.

Per-layer loads move K+V of one layer; write-backs move every layer. Bytes are
payload once; GB = 1e9.
"""

from __future__ import annotations

import argparse
import contextlib
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels import library, validate  # noqa: E402
from kernels.layouts import LAYOUTS, host_geometry, host_shape, plane_view  # noqa: E402
from kernels.reference import naive_copy  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Row:
    direction: str
    layout: str
    page_size: int
    layers: int
    tokens: int
    bytes: int
    variant: str
    ctas: int | None
    median_s: float
    p10_s: float
    p90_s: float
    gbps: float
    ratio: float = math.nan


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument("--page-sizes", type=_ints, default=[1, 16, 64])
    p.add_argument("--layers", type=_ints, default=[32, 64])
    p.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS))
    p.add_argument("--directions", type=lambda s: s.split(","), default=["h2d", "d2h"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--load-tokens",
        type=int,
        default=None,
        help="tokens per per-layer load (default: 16384 on cuda = 64 MiB, 256 on cpu)",
    )
    p.add_argument(
        "--backup-tokens",
        type=int,
        default=None,
        help="tokens per all-layer write-back (default: 1024 on cuda, 64 on cpu)",
    )
    p.add_argument("--pool-factor", type=int, default=2, help="pool slots = factor x largest call")
    p.add_argument(
        "--ctas",
        type=_ints,
        default=[1, 2, 4, 8, 16, 32, 0],
        help="kernel CTA counts (0 = one warp per item, the full grid); cuda only",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 20 cuda, 3 cpu)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip-naive", action="store_true", help="cpu: skip the per-index Python loop")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json-out", type=Path)
    a = p.parse_args(argv)
    on_gpu = a.device == "cuda"
    if on_gpu and not cuda:
        p.error("--device cuda but torch sees no CUDA device")
    a.load_tokens = a.load_tokens or (16384 if on_gpu else 256)
    a.backup_tokens = a.backup_tokens or (1024 if on_gpu else 64)
    a.repeats = a.repeats or (20 if on_gpu else 3)
    bad = set(a.layouts) - set(LAYOUTS)
    if bad:
        p.error(f"unknown layouts {sorted(bad)}")
    return a


class Timer:
    """Median/spread of repeated calls: CUDA events on the current stream, or wall time."""

    def __init__(self, cuda: bool, warmup: int, repeats: int):
        self.cuda, self.warmup, self.repeats = cuda, warmup, repeats

    def __call__(self, fn) -> list[float]:
        for i in range(self.warmup):
            fn(i)
        self._sync()
        out = []
        for i in range(self.repeats):
            if self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn(i)
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn(i)
                out.append(time.perf_counter() - t0)
        return out

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


class Pools:
    """One flat host buffer and one flat device buffer, viewed per layout and layer count."""

    def __init__(self, a, max_layers: int, slots: int):
        self.a = a
        self.dtype = DTYPES[a.dtype]
        self.slots = slots
        self.row = (a.heads, a.head_dim)
        numel = 2 * max_layers * slots * a.heads * a.head_dim
        pin = a.device == "cuda"
        self.host_flat = torch.empty(numel, dtype=self.dtype, pin_memory=pin)
        self.dev_flat = torch.empty(numel, dtype=self.dtype, device=a.device)
        # Random bits everywhere (no all-zero fast paths), generated where it is fast.
        self.dev_flat.view(torch.uint8).random_()
        self.host_flat.copy_(self.dev_flat)
        self.dev_flat.view(torch.uint8).random_()
        if pin:
            torch.cuda.synchronize()  # the timed work runs on another stream

    def host(self, layout, layers, page_size):
        shape = host_shape(layout, False, layers, self.slots, page_size, *self.row)
        return self.host_flat[: math.prod(shape)].view(shape)

    def device(self, layers):
        per = self.slots * self.row[0] * self.row[1]
        views = [
            self.dev_flat[i * per : (i + 1) * per].view(self.slots, *self.row)
            for i in range(2 * layers)
        ]
        return views[:layers], views[layers:]


def index_sets(slots, tokens, page_size, count, device):
    """Scattered whole pages (random permutations), built outside the timing."""
    pages, want = slots // page_size, max(1, tokens // page_size)
    gen = torch.Generator().manual_seed(1234)
    offs = torch.arange(page_size)
    out = []
    for _ in range(count):
        h = (torch.randperm(pages, generator=gen)[:want, None] * page_size + offs).flatten()
        d = (torch.randperm(pages, generator=gen)[:want, None] * page_size + offs).flatten()
        out.append((h, d, h.to(device), d.to(device)))
    return out


def bench_config(a, pools, timer, direction, layout, page_size, layers, backend):
    cuda = a.device == "cuda"
    host = pools.host(layout, layers, page_size)
    dev_k, dev_v = pools.device(layers)
    geom = host_geometry(host, layout, page_size, False)
    tokens = a.load_tokens if direction == "h2d" else a.backup_tokens
    sets = index_sets(pools.slots, tokens, page_size, 4, a.device)
    tokens = sets[0][0].numel()
    layer_list = list(range(layers))
    planes = 2 * (1 if direction == "h2d" else layers)
    nbytes = tokens * geom.item_bytes * planes
    rows: list[Row] = []

    def record(variant, times, ctas=None, moved=nbytes):
        med = statistics.median(times)
        q = statistics.quantiles(times, n=10) if len(times) > 1 else [med] * 9
        rows.append(
            Row(
                direction,
                layout,
                page_size,
                layers,
                tokens,
                moved,
                variant,
                ctas,
                med,
                q[0],
                q[-1],
                moved / med / 1e9,
            )
        )

    def pick(i):
        return sets[i % len(sets)]

    def ours(i, **kw):
        h, d, hd, dd = pick(i)
        if direction == "h2d":
            layer = i % layers
            kernels.load_per_layer(
                host, dev_k[layer], dev_v[layer], hd, dd, layer, layout, page_size, **kw
            )
        else:
            kernels.backup_all_layers(dev_k, dev_v, host, dd, hd, layout, page_size, **kw)

    # The limit: one contiguous copy of the same bytes, same buffers.
    src_h, dst_d = (
        pools.host_flat.view(torch.uint8)[:nbytes],
        pools.dev_flat.view(torch.uint8)[:nbytes],
    )
    limit_ok = src_h.numel() == nbytes
    if direction == "h2d":
        record("limit", timer(lambda i: dst_d.copy_(src_h, non_blocking=cuda)))
    else:
        record("limit", timer(lambda i: src_h.copy_(dst_d, non_blocking=cuda)))
    limit = rows[-1].gbps
    assert limit_ok, "pool smaller than one call; raise --pool-factor"

    if cuda:
        _gpu_variants(
            a,
            pools,
            timer,
            record,
            ours,
            pick,
            host,
            geom,
            dev_k,
            dev_v,
            direction,
            layout,
            page_size,
            layers,
            nbytes,
            backend,
        )
    else:
        record("ours-fallback", timer(ours))
        record(
            "page-loop",
            timer(
                lambda i: _page_loop(host, geom, dev_k, dev_v, *pick(i)[:2], direction, layers, i)
            ),
        )
        if not a.skip_naive:

            def naive(i):
                h, d = pick(i)[:2]
                lay = layer_list if direction == "d2h" else [i % layers]
                naive_copy(host, dev_k, dev_v, h, d, lay, layout, page_size, direction == "d2h")

            record("naive-per-index", timer(naive))
    for r in rows:
        r.ratio = r.gbps / limit
    return rows


def _page_loop(host, geom, dev_k, dev_v, h, d, direction, layers, i):
    """One slice copy per page and plane: the CPU analogue of a per-page memcpy loop."""
    p = geom.page_size
    lay = range(layers) if direction == "d2h" else [i % layers]
    h_pages, d_starts = (h[::p] // p).tolist(), d[::p].tolist()
    for kv, pool in enumerate((dev_k, dev_v)):
        for layer in lay:
            view = plane_view(host, geom, kv, layer)
            dev = pool[layer]
            for hp, ds in zip(h_pages, d_starts):
                if direction == "d2h":
                    view[hp].copy_(dev[ds : ds + p])
                else:
                    dev[ds : ds + p].copy_(view[hp])


def _gpu_variants(
    a,
    pools,
    timer,
    record,
    ours,
    pick,
    host,
    geom,
    dev_k,
    dev_v,
    direction,
    layout,
    page_size,
    layers,
    nbytes,
    backend,
):
    # Both directions at once on two streams (2 x nbytes moved): the bidirectional ceiling.
    host_b, dev_b = pools.host_flat.view(torch.uint8), pools.dev_flat.view(torch.uint8)
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
        total_warps = pick(0)[0].numel() * (2 if direction == "h2d" else 2 * layers)
        n = ctas or max(1, math.ceil(total_warps * 32 / 1024))
        record("ours-kernel", timer(lambda i, n=n: ours(i, num_ctas=n)), n)
    record("ours-direct", timer(lambda i: ours(i, io_backend="direct")))

    lib = backend.library

    def memcpy_loop(i):
        h, d = pick(i)[:2]
        layer = i % layers
        ks, vs = ([dev_k[layer]], [dev_v[layer]]) if direction == "h2d" else (dev_k, dev_v)
        t = validate.check(
            host_kv=host,
            device_k=ks,
            device_v=vs,
            layer_begin=layer if direction == "h2d" else 0,
            all_layers=direction == "d2h",
            host_indices=h,
            device_indices=d,
            layout=layout,
            page_size=page_size,
            to_host=direction == "d2h",
            io_backend="direct",
            num_ctas=None,
        )
        lib.run(t, allow_batch=False)

    record("memcpy-loop", timer(memcpy_loop))
    record(
        "torch-staging", timer(_torch_staging(host, geom, dev_k, dev_v, pick, direction, layers))
    )


def _torch_staging(host, geom, dev_k, dev_v, pick, direction, layers):
    tokens = pick(0)[0].numel()
    row = dev_k[0].shape[1:]
    stage = torch.empty((tokens, *row), dtype=host.dtype, pin_memory=True)
    buf = torch.empty((tokens, *row), dtype=host.dtype, device=dev_k[0].device)
    p = geom.page_size

    def run(i):
        h, d, _, dd = pick(i)
        page, within = h // p, h % p
        lay = range(layers) if direction == "d2h" else [i % layers]
        for kv, pool in enumerate((dev_k, dev_v)):
            for layer in lay:
                view = plane_view(host, geom, kv, layer)
                if direction == "h2d":
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


def environment(a):
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": a.device,
        "kernels": kernels.backend_info(),
    }
    if a.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            cuda=torch.version.cuda,
            driver=_driver_version(),
        )
    else:
        info.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def _driver_version():
    try:
        return subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
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
    env = environment(a)
    print(json.dumps(env))
    timer = Timer(a.device == "cuda", a.warmup, a.repeats)
    slots_needed = a.pool_factor * max(a.load_tokens, a.backup_tokens)
    step = math.lcm(*a.page_sizes)
    slots = math.ceil(slots_needed / step) * step
    pools = Pools(a, max(a.layers), slots)
    stream = torch.cuda.Stream() if a.device == "cuda" else None
    rows: list[Row] = []
    t0 = time.perf_counter()
    print(
        f"{'dir':4} {'layout':18} {'P':>3} {'L':>3} {'tokens':>6} {'MiB':>7} "
        f"{'variant':16} {'ctas':>5} {'GB/s':>8} {'ratio':>6}"
    )
    with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
        for direction in a.directions:
            for layers in a.layers:
                for page_size in a.page_sizes:
                    for layout in a.layouts:
                        for r in bench_config(
                            a, pools, timer, direction, layout, page_size, layers, backend
                        ):
                            rows.append(r)
                            print(
                                f"{r.direction:4} {r.layout:18} {r.page_size:>3} {r.layers:>3} "
                                f"{r.tokens:>6} {r.bytes / 2**20:>7.1f} {r.variant:16} "
                                f"{r.ctas if r.ctas else '':>5} {r.gbps:>8.2f} {r.ratio:>6.2f}"
                            )
    print(
        f"# {len(rows)} measurements in {time.perf_counter() - t0:.1f} s; ratio = GB/s / limit GB/s"
    )
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
        a.json_out.write_text(
            json.dumps({"env": env, "args": args, "rows": [asdict(r) for r in rows]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
