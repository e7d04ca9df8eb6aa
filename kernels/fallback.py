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

from dataclasses import dataclass

import torch

from kernels.layouts import PAGE_FIRST, host_rows, row_words, word_dtype
from kernels.validate import Transfer

# Rows at least this large (whole pages of 16+ tokens of 2 KiB) move faster as
# per-row slice copies than through index_select/index_copy_ on the CPU.
LOOP_MIN_BYTES = 32 * 1024


@dataclass(frozen=True)
class Prepared:
    """A transfer's indices in the form every layer reuses, computed once per transfer."""

    host_idx: torch.Tensor  # CPU, first slot of each unit, skipped pairs removed
    dev_idx: torch.Tensor  # on the pool's device, in units
    unit: int  # slots moved as one row: page_size for whole aligned pages, else 1
    pairs: list[tuple[int, int]] | None  # (host slot, device unit) for the slice-copy loop


def prepare(t: Transfer) -> Prepared:
    """Drop skipped pairs, find the page unit, move device indices to the pool's device."""
    host_idx = t.host_indices.to("cpu")
    dev_idx = t.device_indices.to("cpu")
    keep = (host_idx >= 0) & (dev_idx >= 0)
    host_idx, dev_idx = host_idx[keep], dev_idx[keep]
    unit = _page_unit(t, host_idx, dev_idx) if host_idx.numel() else 1
    if unit > 1:  # move whole pages: one index entry per page instead of per token
        host_idx, dev_idx = host_idx[::unit], dev_idx[::unit]
    dev_units = dev_idx // unit
    loop = t.device.type == "cpu" and t.geom.item_bytes * unit >= LOOP_MIN_BYTES
    pairs = list(zip(host_idx.tolist(), dev_units.tolist())) if loop else None
    return Prepared(host_idx, dev_units.to(t.device), unit, pairs)


def run(t: Transfer, prep: Prepared | None = None) -> None:
    """Copy every plane of `t`; `prep` (from prepare(t), or from the same transfer with
    more layers) carries the index work so a per-layer call does none of it again."""
    prep = prep or prepare(t)
    if prep.host_idx.numel() == 0:
        return
    unit, dev_idx = prep.unit, prep.dev_idx
    row_bytes = t.geom.item_bytes * unit
    pools = [t.device_k] if t.device_v is None else [t.device_k, t.device_v]
    halves = [t.host_kv] if t.device_v is None else [t.host_kv[0], t.host_kv[1]]
    words = word_dtype(t.host_kv, *t.device_k, *(t.device_v or ()), row_bytes=t.geom.item_bytes)
    layers = range(t.layer_begin, t.layer_begin + len(t.device_k))
    # One reused CPU buffer per call: fresh multi-MiB allocations per plane cost
    # more in page faults than the copy itself.
    buf = None
    if prep.pairs is None:
        buf = torch.empty((prep.host_idx.numel(), row_bytes // words.itemsize), dtype=words)
    whole = t.device_slots // unit * unit
    for half, pool in zip(halves, pools):
        host = row_words(half, row_bytes, words)
        for layer, dev in zip(layers, pool):
            dev = row_words(dev[:whole], row_bytes, words)
            if prep.pairs is not None:
                _copy_rows(host, t.geom, layer, unit, prep.pairs, dev, t.to_host)
                continue
            rows = host_rows(t.geom, layer, prep.host_idx) // unit
            if t.to_host:
                if dev.is_cuda:
                    buf.copy_(dev.index_select(0, dev_idx))
                else:
                    torch.index_select(dev, 0, dev_idx, out=buf)
                host.index_copy_(0, rows, buf)
            else:
                torch.index_select(host, 0, rows, out=buf)
                dev.index_copy_(0, dev_idx, buf.to(dev.device))


def _copy_rows(host, geom, layer, unit, pairs, dev, to_host) -> None:
    """One slice copy per row: a single pass, where index ops would gather then scatter."""
    for h, d in pairs:
        r = host_rows(geom, layer, h) // unit
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
