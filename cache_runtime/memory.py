"""KV pools: the L1 device pool and the L2 host pool in SGLang's three host layouts.

Both pools hand out memory in whole pages of ``page_size`` token slots, so a radix node,
a transfer and an L3 object always cover complete pages.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
GB = 1e9  # SGLang's --hicache-size unit
_HOST_RAM_RESERVE = 10 * (1 << 30)  # SGLang keeps 10 GiB of RAM for everything else


class PageAllocator:
    """Free list of pages that hands out token-slot indices.

    Tracks ownership so that a double free or a free of a never-allocated page (a reference
    counting bug) raises instead of silently handing the same slots to two owners.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.clear()

    def clear(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._in_use = bytearray(self.num_pages)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    @property
    def used_tokens(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_size

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` rounded up to whole pages, or None when there is not enough room."""
        pages = -(-num_tokens // self.page_size)
        if pages > len(self._free):
            return None
        got = [self._free.pop() for _ in range(pages)]
        for p in got:
            self._in_use[p] = 1
        page_ids = torch.tensor(got, dtype=torch.int64)
        return (page_ids[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if slots.numel() % self.page_size:
            raise RuntimeError(f"free of {slots.numel()} slots is not a whole number of pages")
        pages = (slots[:: self.page_size] // self.page_size).tolist()
        for p in pages:
            if not self._in_use[p]:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._in_use[p] = 0
        self._free.extend(pages)


def _pin_ok(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def device_pool_tokens(num_tokens: int, page_size: int) -> int:
    """The slots of an L1 pool asked for ``num_tokens`` (--max-total-tokens): whole pages, at least one."""
    pages = num_tokens // page_size
    if pages < 1:
        raise ValueError(f"--max-total-tokens {num_tokens} is smaller than one page ({page_size})")
    return pages * page_size


class DevicePool:
    """L1: one K and one V tensor per layer, shape (slots, heads, head_dim), as contract K expects.

    MLA (``mla=True``): one latent tensor per layer, (slots, 1, kv_dim), and ``v`` is None.
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, mla: bool = False) -> None:
        self.size = device_pool_tokens(num_tokens, page_size)
        pages = self.size // page_size
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        if mla and num_heads != 1:
            raise ValueError("an MLA pool has one latent row per token (num_heads 1)")
        self.k = [torch.zeros(self.size, num_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = None if mla else [torch.zeros(self.size, num_heads, head_dim, dtype=dtype, device=device)
                                   for _ in range(num_layers)]
        self.allocator = PageAllocator(pages, page_size)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_pool_tokens(device_tokens: int, page_size: int, ratio: float, size_gb: float, token_bytes: int) -> int:
    """SGLang's host-pool sizing (memory_pool_host.py): --hicache-size (GB per rank) wins over the ratio."""
    if size_gb > 0:
        size = int(size_gb * GB // token_bytes)
    else:
        if ratio <= 1:
            raise ValueError(f"--hicache-ratio must be > 1 (host pool larger than the device pool), got {ratio}")
        size = int(device_tokens * ratio)
    page_num = size // page_size + 1
    size = page_num * page_size
    if size <= device_tokens:
        raise ValueError(
            f"host pool ({size} tokens) must be larger than the device pool ({device_tokens} tokens); "
            "raise --hicache-size or --hicache-ratio"
        )
    need = size * token_bytes
    avail = _mem_available()
    if avail is not None and need > avail - _HOST_RAM_RESERVE and need > avail // 2:
        raise ValueError(
            f"host pool needs {need / GB:.2f} GB but only {avail / GB:.2f} GB of RAM is available "
            "(SGLang keeps 10 GiB free); lower --hicache-size or --hicache-ratio"
        )
    return size


class HostPool:
    """L2: one buffer in SGLang's host layout (contract K); index 0 of the leading 2 is K, 1 is V.

    MLA (``mla=True``): SGLang's MLA shapes, without the leading 2 (one latent row per token).
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, layout: str, pin: bool, mla: bool = False, buffer_file: str | None = None
                 ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unsupported --hicache-mem-layout {layout!r}; the bundled runtime supports {LAYOUTS}")
        if num_tokens % page_size:
            raise ValueError("host pool size must be a whole number of pages")
        self.size = num_tokens
        self.page_size = page_size
        self.page_num = num_tokens // page_size
        self.layout = layout
        self.dtype = dtype
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        L, H, D = num_layers, num_heads, head_dim
        shape = {
            "layer_first": (L, num_tokens, H, D),
            "page_first": (num_tokens, L, H, D),
            "page_first_direct": (self.page_num, L, page_size, H, D),
        }[layout]
        self.mla = mla
        pin = pin and torch.cuda.is_available()
        full = shape if mla else (2, *shape)
        if buffer_file is None:
            self.kv_buffer = torch.zeros(full, dtype=dtype, pin_memory=pin)
        else:  # a tensor-parallel follower's pool, mapped by it and by rank 0 (which does its L3 I/O)
            numel = 1
            for d in full:
                numel *= d
            self.kv_buffer = torch.from_file(buffer_file, shared=True, size=numel, dtype=dtype).view(full)
            if pin:
                torch.cuda.cudart().cudaHostRegister(self.kv_buffer.data_ptr(), numel * self.kv_buffer.element_size(), 0)
        self.pinned = pin
        self.allocator = PageAllocator(self.page_num, page_size)
        self.page_bytes = (1 if mla else 2) * L * page_size * H * D * self.kv_buffer.element_size()

    def page_view(self, first_slot: int) -> torch.Tensor:
        """The page starting at ``first_slot``, viewed in the order SGLang's ``get_data_page`` flattens it:
        (2, L, page_size, H, D) for layer_first and page_first_direct, (2, page_size, L, H, D) for
        page_first; MLA the same without the leading 2 (H = 1)."""
        if first_slot % self.page_size:
            raise ValueError(f"slot {first_slot} is not the start of a page")
        s, e = first_slot, first_slot + self.page_size
        buf = self.kv_buffer.unsqueeze(0) if self.mla else self.kv_buffer
        if self.layout == "layer_first":
            view = buf[:, :, s:e]
        elif self.layout == "page_first":
            view = buf[:, s:e]
        else:
            view = buf[:, first_slot // self.page_size]
        return view[0] if self.mla else view

    def get_page(self, first_slot: int) -> torch.Tensor:
        """A contiguous copy of one page in SGLang's L3 byte order for this layout (``page_view``): what
        SGLang's own backends store, so either engine reads the other's pages as the same KV. The order
        depends on the layout, as in SGLang: engines sharing an L3 must use layouts with the same order."""
        return self.page_view(first_slot).contiguous().view(-1)

    def set_page(self, first_slot: int, flat: torch.Tensor) -> None:
        if flat.numel() * flat.element_size() != self.page_bytes:
            raise ValueError(f"page data is {flat.numel() * flat.element_size()} bytes, expected {self.page_bytes}")
        view = self.page_view(first_slot)
        view.copy_(flat.reshape(-1).view(torch.uint8).view(self.dtype).view(view.shape))
