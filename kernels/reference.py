"""Per-index reference copy and pool factories.

The reference indexes SGLang's host shapes directly, one token row at a time,
independently of layouts.plane_view and of the compiled offset math: it is the
oracle the fallback is tested against and the naive baseline bench/transfer.py
times.
"""

from __future__ import annotations

import math

import torch

from kernels.layouts import LAYER_FIRST, PAGE_FIRST, host_shape


def host_row(host_kv, layout, is_mla, kv, layer, slot, page_size):
    """The (H, D) row of token `slot`, layer `layer`, K (kv=0) or V (kv=1)."""
    base = host_kv if is_mla else host_kv[kv]
    if layout == LAYER_FIRST:
        return base[layer, slot]
    if layout == PAGE_FIRST:
        return base[slot, layer]
    return base[slot // page_size, layer, slot % page_size]


def naive_copy(host_kv, dev_k, dev_v, host_idx, dev_idx, layers, layout, page_size, to_host):
    """Copy pair by pair; dev_k/dev_v are per-layer lists indexed by host layer number."""
    is_mla = dev_v is None
    pools = [dev_k] if is_mla else [dev_k, dev_v]
    pairs = [(h, d) for h, d in zip(host_idx.tolist(), dev_idx.tolist()) if h >= 0 and d >= 0]
    for kv, pool in enumerate(pools):
        for layer in layers:
            for h, d in pairs:
                row = host_row(host_kv, layout, is_mla, kv, layer, h, page_size)
                if to_host:
                    row.copy_(pool[layer][d])
                else:
                    pool[layer][d].copy_(row)


def random_bits(shape, dtype, gen, device="cpu", pin_memory=False):
    """Uniformly random bytes (NaN patterns included), so checks are bit for bit."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    out = raw.view(dtype).reshape(shape)
    if pin_memory:
        return out.pin_memory()
    return out.to(device)


def make_pools(
    layout,
    is_mla,
    *,
    layers,
    host_slots,
    dev_slots,
    page_size,
    heads,
    head_dim,
    dtype=torch.bfloat16,
    seed=0,
    device="cpu",
    pin_memory=False,
):
    """Random host pool in `layout` plus per-layer device pools (dev_v None for MLA)."""
    gen = torch.Generator().manual_seed(seed)
    h = 1 if is_mla else heads
    shape = host_shape(layout, is_mla, layers, host_slots, page_size, h, head_dim)
    host = random_bits(shape, dtype, gen, pin_memory=pin_memory)
    dev_k = [random_bits((dev_slots, h, head_dim), dtype, gen, device) for _ in range(layers)]
    dev_v = None
    if not is_mla:
        dev_v = [random_bits((dev_slots, h, head_dim), dtype, gen, device) for _ in range(layers)]
    return host, dev_k, dev_v


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )
