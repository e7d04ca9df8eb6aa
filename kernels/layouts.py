"""SGLang host-pool (L2) layouts: shape parsing and per-plane torch views.

A *plane* is one (K or V, layer) slice of a pool and a *row* one token of one
plane (H * D elements). The fallback moves rows as raw machine words through
``row_words`` and ``host_rows`` (bit-exact for every dtype, and few enough
elements per op that torch stays on its cheap single-thread path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYER_FIRST = "layer_first"
PAGE_FIRST = "page_first"
PAGE_FIRST_DIRECT = "page_first_direct"
LAYOUTS = (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT)
# Numbering shared with hc_host_layout.kind in transfer.cu.
LAYOUT_CODES = {LAYER_FIRST: 0, PAGE_FIRST: 1, PAGE_FIRST_DIRECT: 2}

# Expected host shapes, as names; "2" is the K/V axis (MHA only).
_MHA_SHAPES = {
    LAYER_FIRST: ("2", "L", "size", "H", "D"),
    PAGE_FIRST: ("2", "size", "L", "H", "D"),
    PAGE_FIRST_DIRECT: ("2", "page_num", "L", "page_size", "H", "D"),
}
_MLA_SHAPES = {layout: shape[1:] for layout, shape in _MHA_SHAPES.items()}


@dataclass(frozen=True)
class HostGeometry:
    layout: str
    is_mla: bool
    num_layers: int
    num_slots: int
    page_size: int
    heads: int
    head_dim: int
    element_size: int

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def item_bytes(self) -> int:
        """Bytes of one token of one layer of K (or V, or the MLA latent)."""
        return self.heads * self.head_dim * self.element_size

    @property
    def planes(self) -> int:
        return 1 if self.is_mla else 2


def expected_shape(layout: str, is_mla: bool) -> tuple[str, ...]:
    return (_MLA_SHAPES if is_mla else _MHA_SHAPES)[layout]


def host_shape(
    layout: str,
    is_mla: bool,
    num_layers: int,
    num_slots: int,
    page_size: int,
    heads: int,
    head_dim: int,
) -> tuple[int, ...]:
    """Shape of a host pool, as SGLang allocates it."""
    if num_slots % page_size:
        raise ValueError(f"num_slots {num_slots} is not a multiple of page_size {page_size}")
    dims = {
        "2": 2,
        "L": num_layers,
        "size": num_slots,
        "page_num": num_slots // page_size,
        "page_size": page_size,
        "H": heads,
        "D": head_dim,
    }
    return tuple(dims[name] for name in expected_shape(layout, is_mla))


def host_geometry(host_kv: torch.Tensor, layout: str, page_size: int, is_mla: bool) -> HostGeometry:
    """Read L, size, H, D from host_kv; ValueError if it does not fit the layout."""
    names = expected_shape(layout, is_mla)
    kind = "MLA" if is_mla else "MHA"
    if host_kv.dim() != len(names):
        raise ValueError(
            f"host_kv for {kind} {layout} must be ({', '.join(names)}), "
            f"got shape {tuple(host_kv.shape)}"
        )
    dims = dict(zip(names, host_kv.shape))
    if not is_mla and dims["2"] != 2:
        raise ValueError(f"host_kv leading dim must be 2 (K, V), got {dims['2']}")
    if layout == PAGE_FIRST_DIRECT:
        if dims["page_size"] != page_size:
            raise ValueError(
                f"host_kv page_first_direct page dim is {dims['page_size']}, "
                f"but page_size={page_size}"
            )
        num_slots = dims["page_num"] * page_size
    else:
        num_slots = dims["size"]
        if num_slots % page_size:
            raise ValueError(f"host_kv size {num_slots} is not a multiple of page_size={page_size}")
    return HostGeometry(
        layout=layout,
        is_mla=is_mla,
        num_layers=int(dims["L"]),
        num_slots=int(num_slots),
        page_size=page_size,
        heads=int(dims["H"]),
        head_dim=int(dims["D"]),
        element_size=host_kv.element_size(),
    )


def plane_view(host_kv: torch.Tensor, geom: HostGeometry, kv: int, layer: int) -> torch.Tensor:
    """View of one (kv, layer) plane as (pages, page_size, H, D); writes go to host_kv."""
    kv_part = host_kv if geom.is_mla else host_kv[kv]
    if geom.layout == LAYER_FIRST:
        tokens = kv_part[layer]
    elif geom.layout == PAGE_FIRST:
        tokens = kv_part[:, layer]
    else:
        return kv_part[:, layer]
    return tokens.unflatten(0, (geom.num_pages, geom.page_size))


def word_dtype(*tensors: torch.Tensor, row_bytes: int) -> torch.dtype:
    """Widest integer type that divides the row and every tensor's start."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dtype).element_size()
        if row_bytes % size == 0 and all(
            t.storage_offset() * t.element_size() % size == 0 for t in tensors
        ):
            return dtype
    return torch.uint8


def row_words(t: torch.Tensor, row_bytes: int, words: torch.dtype) -> torch.Tensor:
    """A contiguous tensor as (rows, words per row), sharing its memory."""
    return t.reshape(-1).view(torch.uint8).view(-1, row_bytes).view(words)


def host_rows(geom: HostGeometry, layer: int, slots):
    """Row numbers of (layer, slots) within one K/V half of the host pool (tensor or int)."""
    if geom.layout == LAYER_FIRST:
        return layer * geom.num_slots + slots
    if geom.layout == PAGE_FIRST:
        return slots * geom.num_layers + layer
    page, within = slots // geom.page_size, slots % geom.page_size
    return (page * geom.num_layers + layer) * geom.page_size + within
