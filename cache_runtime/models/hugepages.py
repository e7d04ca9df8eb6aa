"""A CPU model's weight matrices moved onto transparent huge pages.

Batch-1 decoding streams every weight matrix from memory once per token. On 4 KiB pages the
read crosses a page (a page-table walk, and the hardware prefetchers starting over) every 4 KiB;
on 2 MiB pages the native GEMV streamed the demo checkpoint's matrices about 20% faster (17 vs
21 GiB/s on a 2-core Zen 3). Every 2-D tensor of the model of 1 MiB and more (the weight
matrices, the rotary tables) is copied, one at a time, into one arena advised ``MADV_HUGEPAGE``
before its first touch (the kernel then backs it with huge pages where it can); each original is
freed as its copy lands, so loading peaks at the weights plus one tensor. Where transparent huge
pages are off (``never``), or off Linux, nothing moves.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MIN_BYTES = 1 << 20  # smaller tensors are not worth a huge page's alignment
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), None where unknown."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _advise(address: int, length: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, _MADV_HUGEPAGE) == 0


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` (uint8) of untouched memory starting on a huge page boundary, advised MADV_HUGEPAGE."""
    whole = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # whole huge pages (the tail is never touched)
    raw = torch.empty(whole + HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    if not _advise(raw.data_ptr() + start, whole):
        log.debug("madvise(MADV_HUGEPAGE) failed (errno %d): weights stay on small pages", ctypes.get_errno())
    return raw[start : start + nbytes]


def _slots(obj, seen: set[int]):
    """(holder, key) of every tensor reachable from the model's own objects (attributes, lists)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    items = (enumerate(obj) if isinstance(obj, list)
             else vars(obj).items() if type(obj).__module__.startswith("cache_runtime.models") else ())
    for key, value in items:
        if isinstance(value, torch.Tensor):
            yield obj, key
        elif isinstance(value, list) or type(value).__module__.startswith("cache_runtime.models"):
            yield from _slots(value, seen)


def _get(holder, key):
    return holder[key] if isinstance(holder, list) else getattr(holder, key)


def _set(holder, key, value) -> None:
    if isinstance(holder, list):
        holder[key] = value
    else:
        setattr(holder, key, value)


def _matrices(model) -> dict[int, list]:
    """data_ptr -> [tensor, (holder, key), ...] for the CPU weight matrices worth moving."""
    groups: dict[int, list] = {}
    for holder, key in _slots(model, set()):
        t = _get(holder, key)
        if t.device.type == "cpu" and t.dim() == 2 and t.is_contiguous() and t.nbytes >= _MIN_BYTES:
            groups.setdefault(t.data_ptr(), [t]).append((holder, key))
    return groups


def move_weights(model) -> int:
    """Moves the model's 2-D CPU tensors of 1 MiB and more into one huge-page arena; returns the
    bytes moved. A tensor held in two places (tied embeddings) is moved once and stays shared."""
    if not sys.platform.startswith("linux") or thp_mode() in (None, "never"):
        return 0
    groups = _matrices(model)
    if not groups:
        return 0
    align = 64
    total = sum((g[0].nbytes + align - 1) // align * align for g in groups.values())
    arena = huge_page_buffer(total)
    offset = 0
    for ptr in list(groups):
        tensor, *places = groups.pop(ptr)
        moved = arena[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor)
        offset += (tensor.nbytes + align - 1) // align * align
        del tensor
        for holder, key in places:
            _set(holder, key, moved)  # the last reference to the original goes: its memory is freed
    return total
