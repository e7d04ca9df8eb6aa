"""Torch index-op implementation of a checked Transfer.

Used when the device pool is on the CPU, when CUDA or the kernel library is
unavailable, and as the oracle the GPU tests compare the kernels against. With
a CUDA device pool it stages through torch (gather, one copy across the link,
scatter), which is correct but slower than the kernels.

Rows move as raw integer words: bit-exact for every dtype (NaN payloads
included), and 4x fewer elements than bf16, which keeps torch's CPU index ops
on their single-thread path; on a small, busy machine their multi-thread path
costs milliseconds per call in thread wake-ups.
"""

from __future__ import annotations

import torch

from kernels.layouts import PAGE_FIRST, host_rows, row_words, word_dtype
from kernels.validate import Transfer

# Rows at least this large (whole pages of 16+ tokens of 2 KiB) move faster as
# per-row slice copies than through index_select/index_copy_ on the CPU.
LOOP_MIN_BYTES = 32 * 1024


def run(t: Transfer) -> None:
    host_idx = t.host_indices.to("cpu")
    dev_idx = t.device_indices.to("cpu")
    keep = (host_idx >= 0) & (dev_idx >= 0)
    host_idx, dev_idx = host_idx[keep], dev_idx[keep]
    if host_idx.numel() == 0:
        return
    unit = _page_unit(t, host_idx, dev_idx)
    if unit > 1:  # move whole pages: one index entry per page instead of per token
        host_idx, dev_idx = host_idx[::unit], dev_idx[::unit]
    dev_idx = (dev_idx // unit).to(t.device)
    row_bytes = t.geom.item_bytes * unit
    pools = [t.device_k] if t.device_v is None else [t.device_k, t.device_v]
    halves = [t.host_kv] if t.device_v is None else [t.host_kv[0], t.host_kv[1]]
    words = word_dtype(t.host_kv, *t.device_k, *(t.device_v or ()), row_bytes=t.geom.item_bytes)
    layers = range(t.layer_begin, t.layer_begin + len(t.device_k))
    # One reused CPU buffer per call: fresh multi-MiB allocations per plane cost
    # more in page faults than the copy itself.
    buf = torch.empty((host_idx.numel(), row_bytes // words.itemsize), dtype=words)
    whole = t.device_slots // unit * unit
    for half, pool in zip(halves, pools):
        host = row_words(half, row_bytes, words)
        for layer, dev in zip(layers, pool):
            dev = row_words(dev[:whole], row_bytes, words)
            rows = host_rows(t.geom, layer, host_idx) // unit
            if not dev.is_cuda and row_bytes >= LOOP_MIN_BYTES:
                _copy_rows(host, rows, dev, dev_idx, t.to_host)
            elif t.to_host:
                if dev.is_cuda:
                    buf.copy_(dev.index_select(0, dev_idx))
                else:
                    torch.index_select(dev, 0, dev_idx, out=buf)
                host.index_copy_(0, rows, buf)
            else:
                torch.index_select(host, 0, rows, out=buf)
                dev.index_copy_(0, dev_idx, buf.to(dev.device))


def _copy_rows(host, rows, dev, dev_idx, to_host) -> None:
    """One slice copy per row: a single pass, where index ops would gather then scatter."""
    for r, d in zip(rows.tolist(), dev_idx.tolist()):
        if to_host:
            host[r].copy_(dev[d])
        else:
            dev[d].copy_(host[r])


def _page_unit(t: Transfer, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> int:
    """page_size if both sides are whole, aligned pages stored contiguously, else 1."""
    p = t.geom.page_size
    if p == 1 or t.geom.layout == PAGE_FIRST or host_idx.numel() % p:
        return 1  # page_first interleaves layers between a page's tokens
    offs = torch.arange(p)
    for idx in (host_idx, dev_idx):
        starts = idx[::p]
        if (starts % p).any() or not torch.equal(idx.view(-1, p), starts[:, None] + offs):
            return 1
    return p
