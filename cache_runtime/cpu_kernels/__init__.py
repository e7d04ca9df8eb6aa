"""Native CPU kernels for the decode hot path, loaded with ctypes; torch is the fallback.

``linear`` streams the weights once per 16 rows of input, converting bf16/fp16 to float32 in
registers; ``decode_attention`` attends each decoding query over its context read
straight from the paged L1 pool through its slot indices (GQA, and MLA's latent rows);
``add_rms_norm``, ``silu_mul`` and ``rope_store`` fuse the elementwise steps around them, rounding
where torch's op sequence rounds (a decode step is otherwise dozens of tiny torch ops);
``decode_stack`` runs every layer of a Llama-family decoder over a batch of decoding rows in one
call (ten ops a layer from Python cost about a fifth of a batch-1 step in call overhead). Which
batch sizes run natively is measured at load (``calibrate``): torch's own GEMM wins from some
number of rows on, a number that depends on the CPU (AVX512-BF16, AMX) and the shapes. The
library (``python cache_runtime/cpu_kernels/build.py``, run by scripts/setup.sh) picks the widest
variant the CPU runs: AVX-512, else AVX2+FMA+F16C. Without the library, on a CPU without AVX2,
on CUDA tensors, or with ``HICACHE_CPU_KERNELS=0``, every op runs on torch instead.
``HICACHE_CPU_KERNELS_LIBRARY`` loads the library from another path (an image's fixed one);
``HICACHE_CPU_KERNELS_VARIANT`` picks a narrower variant (``avx2``: as on an AVX2-only CPU).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import time

import torch
import torch.nn.functional as F

from cache_runtime.cpu_kernels import abi
from cache_runtime.cpu_kernels.build import LIBRARY, sources_digest

log = logging.getLogger(__name__)

# dtype codes of common.h
_CODES = {dtype: abi.dtype_codes()[name] for dtype, name in
          ((torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16"))}
# Rows up to which ``linear`` runs natively, per dtype, until ``calibrate`` measures them on the
# model's own weights. float32: a decode batch; above it torch's float32 GEMM (MKL) does more
# multiply-adds per cycle. bf16 and fp16: every batch, prefill chunks included, as on CPUs without
# AVX512-BF16/AMX, where torch's own GEMM for them is several times slower than this one; where the
# CPU has them, torch's bf16 GEMM wins from a few rows on, by how many depends on the shapes.
UNBOUNDED = 1 << 62
DEFAULT_MAX_ROWS = {torch.float32: 16, torch.float16: UNBOUNDED, torch.bfloat16: UNBOUNDED}
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)
_max_rows = dict(DEFAULT_MAX_ROWS)


def _load() -> ctypes.CDLL | None:
    path = os.environ.get("HICACHE_CPU_KERNELS_LIBRARY") or str(LIBRARY)
    if os.environ.get("HICACHE_CPU_KERNELS", "1") == "0" or not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.hc_sources.restype = ctypes.c_char_p
        stale = lib.hc_sources().decode() != sources_digest()
    except (OSError, AttributeError) as exc:
        log.warning("CPU kernels not loaded (%s): running on torch", exc)
        return None
    if stale:
        log.warning("%s was built from other sources (python cache_runtime/cpu_kernels/build.py rebuilds it): "
                    "running on torch", path)
        return None
    abi.bind(lib)  # every signature as api.cpp declares it
    if lib.hc_select(b"") != 0:
        return None  # no AVX2+FMA+F16C: nothing here runs on this CPU
    forced = os.environ.get("HICACHE_CPU_KERNELS_VARIANT", "")
    if forced and lib.hc_select(forced.encode()) != 0:
        log.warning("HICACHE_CPU_KERNELS_VARIANT=%s does not run here (have: %s): using %s", forced,
                    lib.hc_variants().decode(), lib.hc_active().decode())
    return lib


_loaded = _load()
_lib = _loaded  # None while the native ops are off


def linear_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which ``linear`` (and the decoder stack) run natively for ``dtype``."""
    return _max_rows.get(dtype, 0)


def set_linear_max_rows(limits: dict[torch.dtype, int]) -> None:
    """Pins the native row limits (tests pin the dispatch they check; ``calibrate`` sets measured ones)."""
    _max_rows.update(limits)


def choose_max_rows(native_s: dict[int, float], torch_s: dict[int, float]) -> int:
    """The row limit from timings per batch size: the limit L whose batches up to L gain most in
    all, summing log(torch / native) over the measured sizes up to L, so that one noisy size
    neither ends nor extends the native range; 0 (torch for every batch) when no L gains;
    ``UNBOUNDED`` when the gain peaks at the largest size measured."""
    sizes = sorted(native_s)
    best, limit, gain = 0.0, 0, 0.0
    for m in sizes:
        gain += math.log(torch_s[m] / native_s[m])
        if gain > best:
            best, limit = gain, m
    return UNBOUNDED if limit == sizes[-1] and len(sizes) > 1 else limit


def calibrate(weights: list[torch.Tensor], rows: tuple[int, ...] = CALIBRATION_ROWS, repeats: int = 5
              ) -> dict[torch.dtype, int]:
    """Times the native GEMM against torch's on ``weights`` (one decoder layer's 2-D matrices) at
    each batch size in ``rows`` and sets the dtype's row limit to what ``choose_max_rows`` picks.
    ``HICACHE_CPU_LINEAR_MAX_ROWS`` skips the measurement for a reproducible dispatch: ``default``
    keeps ``DEFAULT_MAX_ROWS``, a number N pins N rows for every dtype. Returns the limits in force;
    nothing is measured while the native ops are off."""
    pinned = os.environ.get("HICACHE_CPU_LINEAR_MAX_ROWS", "")
    if pinned:
        set_linear_max_rows(DEFAULT_MAX_ROWS if pinned == "default" else {dt: int(pinned) for dt in _CODES})
        return dict(_max_rows)
    mats = [w for w in weights if w.dim() == 2 and _native(w) and w.is_contiguous()]
    if not mats:
        return dict(_max_rows)
    dtype = mats[0].dtype
    mats = [w for w in mats if w.dtype == dtype]
    gen = torch.Generator().manual_seed(0)
    inputs = {m: [torch.randn(m, w.shape[1], generator=gen).to(dtype) for w in mats] for m in rows}
    paths = {"native": lambda xs: [_native_linear(x, w, None) for x, w in zip(xs, mats)],
             "torch": lambda xs: [F.linear(x, w) for x, w in zip(xs, mats)]}
    best = {(p, m): float("inf") for p in paths for m in rows}
    for r in range(repeats + 1):  # round 0 warms up (first touch, torch's kernel choice)
        for m in rows:  # interleaved, best of the rounds: other work on the cores hits both paths alike
            for p, run in paths.items():
                t0 = time.perf_counter()
                run(inputs[m])
                if r:
                    best[p, m] = min(best[p, m], time.perf_counter() - t0)
    native_s, torch_s = ({m: best[p, m] for m in rows} for p in paths)
    limit = choose_max_rows(native_s, torch_s)
    set_linear_max_rows({dtype: limit})
    log.info("CPU GEMM calibrated for %s on %d matrices (variant %s): native up to %s rows; torch/native time "
             "per rows %s", str(dtype).removeprefix("torch."), len(mats), variant(),
             "any number of" if limit == UNBOUNDED else limit,
             {m: round(torch_s[m] / native_s[m], 2) for m in rows})
    return dict(_max_rows)


def variant() -> str | None:
    """The variant in use ('avx512', 'avx2', 'avx2_w16'), or None when every op runs on torch."""
    return _lib.hc_active().decode() if _lib is not None else None


def variants() -> list[str]:
    """Every variant this CPU runs, best first (empty without the library)."""
    return [v for v in _loaded.hc_variants().decode().split(",") if v] if _loaded is not None else []


def select(name: str | None) -> None:
    """Uses variant ``name`` from now on; None turns the native ops off (tests compare both paths)."""
    global _lib
    if name is None:
        _lib = None
        return
    if _loaded is None or _loaded.hc_select(name.encode()) != 0:
        raise ValueError(f"CPU kernel variant {name!r} is not available here (have: {variants()})")
    _lib = _loaded


def _native(t: torch.Tensor) -> bool:
    return _lib is not None and t.device.type == "cpu" and t.dtype in _CODES


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for 2-D ``x``; natively for up to ``linear_max_rows`` rows."""
    m = x.shape[0]
    if (not _native(x) or x.dim() != 2 or m == 0 or m > linear_max_rows(x.dtype) or w.dtype != x.dtype
            or (bias is not None and bias.dtype != x.dtype) or x.stride(1) != 1 or not w.is_contiguous()):
        return F.linear(x, w, bias)
    return _native_linear(x, w, bias)


def _native_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m, (n, k) = x.shape[0], w.shape
    y = x.new_empty(m, n)
    _lib.hc_linear(x.data_ptr(), m, k, x.stride(0), w.data_ptr(), n, k, bias.data_ptr() if bias is not None else None,
                   y.data_ptr(), n, _CODES[x.dtype], torch.get_num_threads())
    return y


def decode_attention_supported(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    return (_native(q) and k_pool.dtype in _CODES and v_pool.dtype == k_pool.dtype and q.stride(-1) == 1
            and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                     offsets: torch.Tensor, slots: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """For each i: ``out[rows[i]]`` = softmax(q[rows[i]] K^T * scale) V over pool rows
    ``slots[offsets[i]:offsets[i+1]]``; q (N, Hq, Dk), pools (slots, Hkv, Dk/Dv), Hq a multiple of
    Hkv; int64 index tensors. Scores and softmax in float32."""
    _, hq, dk = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[2]
    _lib.hc_decode_attention(q.data_ptr(), q.stride(0), q.stride(1), hq, dk, k_pool.data_ptr(), k_pool.stride(0),
                             k_pool.stride(1), v_pool.data_ptr(), v_pool.stride(0), v_pool.stride(1), dv, hkv,
                             _CODES[k_pool.dtype], _CODES[q.dtype], rows.shape[0], rows.data_ptr(),
                             offsets.data_ptr(), slots.data_ptr(), scale, out.data_ptr(), out.stride(0), out.stride(1),
                             torch.get_num_threads())


def rows_supported(*tensors: torch.Tensor | None) -> bool:
    """Whether the elementwise ops run natively on these: CPU, one dtype, contiguous."""
    first = tensors[0]
    return _native(first) and all(t is None or (t.dtype == first.dtype and t.is_contiguous() and t.device == first.device)
                                  for t in tensors)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (rounded, when given), then transformers' RMSNorm of ``h`` (rows, dim)."""
    out = torch.empty_like(h)
    _lib.hc_add_rms_norm(h.data_ptr(), delta.data_ptr() if delta is not None else None, weight.data_ptr(), h.shape[0],
                         h.shape[1], eps, out.data_ptr(), _CODES[h.dtype], torch.get_num_threads())
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of ``x`` = [gate | up] (rows, 2I) -> (rows, I)."""
    rows, width = x.shape
    out = x.new_empty(rows, width // 2)
    _lib.hc_silu_mul(x.data_ptr(), rows, width // 2, out.data_ptr(), _CODES[x.dtype], torch.get_num_threads())
    return out


def rope_store_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, k_pool: torch.Tensor) -> bool:
    return (_native(q) and k_pool.dtype in _CODES and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous()
            and cos.dtype == q.dtype and k_pool.stride(-1) == 1)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotary embedding (split halves) in place on q (N, Hq, D) and k (N, Hkv, D) with ``cos``/``sin``
    (N, D/2) in their dtype, then ``k_pool[slots] = k``, ``v_pool[slots] = v`` in the pools' dtype."""
    n, hq, dim = q.shape
    _lib.hc_rope_store(q.data_ptr(), q.stride(0), q.stride(1), hq, k.data_ptr(), k.stride(0), k.stride(1),
                       v.data_ptr(), v.stride(0), v.stride(1), k.shape[1], dim, n, cos.data_ptr(), sin.data_ptr(),
                       k_pool.data_ptr(), k_pool.stride(0), k_pool.stride(1), v_pool.data_ptr(), v_pool.stride(0),
                       v_pool.stride(1), slots.data_ptr(), _CODES[q.dtype], _CODES[k_pool.dtype],
                       torch.get_num_threads())


DecoderLayer = abi.struct_type(
    "DecoderLayer", "common.h's DecoderLayer: one layer's tensors (None where the model has none) and KV pools.")
DecoderShape = abi.struct_type(
    "DecoderShape", "common.h's DecoderShape: what every layer of the stack shares (pool strides in elements).")


def decoder_stack(layers: list[dict], hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                  scale: float, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor]
                  ) -> tuple[ctypes.Array, DecoderShape]:
    """The arguments of ``decode_stack`` that stay the same from step to step: per layer, its
    tensors by DecoderLayer field name (all of one dtype, contiguous) and its pools."""
    arr = (DecoderLayer * len(layers))()
    for entry, tensors, k, v in zip(arr, layers, k_pool, v_pool):
        for name, t in tensors.items():
            setattr(entry, name, t.data_ptr() if t is not None else None)
        entry.k_pool, entry.v_pool = k.data_ptr(), v.data_ptr()
    dt = next(t for t in layers[0].values() if t is not None).dtype
    shape = DecoderShape(len(layers), hidden, heads, kv_heads, head_dim, inter, k_pool[0].stride(0),
                         k_pool[0].stride(1), v_pool[0].stride(0), v_pool[0].stride(1), eps, scale, _CODES[dt],
                         _CODES[k_pool[0].dtype])
    return arr, shape


def decode_stack_supported(h: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether ``decode_stack`` runs these rows: CPU, dtypes it computes in, no more rows than the
    native matmul takes (beyond them torch's GEMM is used op by op), contiguous pools."""
    return (_native(h) and h.is_contiguous() and h.shape[0] <= linear_max_rows(h.dtype) and k_pool.dtype in _CODES
            and v_pool.dtype == k_pool.dtype and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1)


def decode_stack(stack: tuple[ctypes.Array, DecoderShape], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 out_slots: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor) -> None:
    """Every layer of the stack over the decoding rows ``h`` (N, hidden), in place: on return ``h``
    is the residual stream after the last layer. cos/sin (N, head_dim/2) in h's dtype; out_slots,
    rows, offsets, slots int64 as ``decode_attention`` takes them."""
    layers, shape = stack
    _lib.hc_decode_stack(ctypes.addressof(layers), ctypes.addressof(shape), h.data_ptr(), h.shape[0], cos.data_ptr(),
                         sin.data_ptr(), out_slots.data_ptr(), rows.data_ptr(), offsets.data_ptr(), slots.data_ptr(),
                         torch.get_num_threads())
