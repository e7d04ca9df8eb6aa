"""Argument checks shared by every backend.

Everything is checked before any copy starts, so a rejected call leaves both
pools untouched; the CUDA kernel and DMA planner additionally skip any pair
outside the pools, so even an unchecked index cannot write out of bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.layouts import LAYOUTS, HostGeometry, host_geometry

# Rows move as raw bytes, so any fixed-width dtype is safe; these are the KV-cache ones
# (fp8 pools included).
DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.uint8,
)
IO_BACKENDS = ("kernel", "direct")
MAX_CTAS = 65535


@dataclass(frozen=True)
class Transfer:
    """A checked request: copy `indices` pairs for layers [layer_begin, +len(device_k))."""

    host_kv: torch.Tensor
    geom: HostGeometry
    device_k: tuple[torch.Tensor, ...]
    device_v: tuple[torch.Tensor, ...] | None
    layer_begin: int
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    to_host: bool
    io_backend: str
    num_ctas: int | None

    def layer(self, i: int) -> Transfer:
        """The same request restricted to layer ``layer_begin + i``; indices are shared."""
        return replace(
            self,
            device_k=(self.device_k[i],),
            device_v=None if self.device_v is None else (self.device_v[i],),
            layer_begin=self.layer_begin + i,
        )

    @property
    def device(self) -> torch.device:
        return self.device_k[0].device

    @property
    def device_slots(self) -> int:
        return self.device_k[0].shape[0]

    def planes(self) -> list[tuple[int, int, torch.Tensor]]:
        """(kv, host layer, device tensor) for every plane moved."""
        out = [(0, self.layer_begin + i, t) for i, t in enumerate(self.device_k)]
        if self.device_v is not None:
            out += [(1, self.layer_begin + i, t) for i, t in enumerate(self.device_v)]
        return out


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
        )
    return t


def _check_device_pool(
    name: str, tensors: list[torch.Tensor], dtype: torch.dtype, geom: HostGeometry
) -> None:
    for i, t in enumerate(tensors):
        _check_tensor(f"{name}[{i}]", t)
    first = tensors[0]
    if first.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be on cpu or cuda, got {first.device}")
    want = (geom.heads, geom.head_dim)
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise TypeError(f"{name}[{i}] dtype {t.dtype} does not match host_kv dtype {dtype}")
        if t.device != first.device:
            raise ValueError(f"{name}[{i}] is on {t.device}, {name}[0] on {first.device}")
        if t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] != first.shape[0]:
            raise ValueError(
                f"{name}[{i}] must be (slots, {want[0]}, {want[1]}) like {name}[0] "
                f"{tuple(first.shape)}, got {tuple(t.shape)}"
            )


def _check_indices(
    host_indices: object,
    device_indices: object,
    device: torch.device,
    host_slots: int,
    dev_slots: int,
    to_host: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = (
        ("host_indices", host_indices, host_slots),
        ("device_indices", device_indices, dev_slots),
    )
    for name, idx, _ in pairs:
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
        if idx.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {idx.dtype}")
        if idx.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")
        if idx.device.type != "cpu" and idx.device != device:
            raise ValueError(f"{name} is on {idx.device}; use cpu or the pool's device {device}")
    if host_indices.numel() != device_indices.numel():
        raise ValueError(
            f"host_indices ({host_indices.numel()}) and device_indices "
            f"({device_indices.numel()}) must have equal length"
        )
    if host_indices.numel():
        top_host, top_dev, dup = _summary(host_indices, device_indices, to_host)
        for (name, _, limit), top in zip(pairs, (top_host, top_dev)):
            if top >= limit:
                raise ValueError(f"{name} has index {top} >= pool size {limit}")
        if dup >= 0:
            name = pairs[0][0] if to_host else pairs[1][0]
            raise ValueError(
                f"{name} names destination slot {dup} twice; "
                "each destination row may be written by one pair only"
            )
    return host_indices.contiguous(), device_indices.contiguous()


def _summary(host: torch.Tensor, dev: torch.Tensor, to_host: bool) -> list[int]:
    """[max host index, max device index, a destination slot used twice or -1], read
    from the device in one transfer: device-resident indices cost one sync, CPU ones none."""
    h = host.to(dev.device) if host.device != dev.device else host
    src, dst = (dev, h) if to_host else (h, dev)
    live = torch.where((src >= 0) & (dst >= 0), dst, -1).sort().values
    repeated = torch.where((live[1:] == live[:-1]) & (live[1:] >= 0), live[1:], -1)
    dup = repeated.max() if repeated.numel() else torch.full((), -1, device=dst.device)
    return torch.stack([h.max(), dev.max(), dup]).tolist()


def check(
    *,
    host_kv: object,
    device_k: list,
    device_v: list | None,
    layer_begin: int,
    all_layers: bool,
    host_indices: object,
    device_indices: object,
    layout: object,
    page_size: object,
    to_host: bool,
    io_backend: object,
    num_ctas: object,
) -> Transfer:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"io_backend must be one of {IO_BACKENDS}, got {io_backend!r}")
    check_int("page_size", page_size, 1)
    if num_ctas is not None:
        check_int("num_ctas", num_ctas, 1, MAX_CTAS)
    host_kv = _check_tensor("host_kv", host_kv)
    if host_kv.dtype not in DTYPES:
        raise TypeError(f"host_kv dtype must be one of {DTYPES}, got {host_kv.dtype}")
    if host_kv.device.type != "cpu":
        raise ValueError(f"host_kv must be a CPU tensor (the host pool), got {host_kv.device}")
    is_mla = device_v is None
    geom = host_geometry(host_kv, layout, page_size, is_mla)
    if not device_k:
        raise ValueError("device_k must name at least one layer")
    _check_device_pool("device_k", device_k, host_kv.dtype, geom)
    if device_v is not None:
        if len(device_v) != len(device_k):
            raise ValueError(f"device_v has {len(device_v)} layers, device_k {len(device_k)}")
        _check_device_pool("device_v", device_v, host_kv.dtype, geom)
        if device_v[0].shape != device_k[0].shape or device_v[0].device != device_k[0].device:
            raise ValueError("device_v must match device_k in shape and device")
    elif geom.heads != 1:
        raise ValueError(f"MLA (device_v is None) expects H == 1, host_kv has H = {geom.heads}")
    if all_layers and len(device_k) != geom.num_layers:
        raise ValueError(f"host_kv has {geom.num_layers} layers, device pool {len(device_k)}")
    check_int("layer_id", layer_begin, 0, geom.num_layers - 1)
    device = device_k[0].device
    if device.type == "cuda" and io_backend == "kernel" and not host_kv.is_pinned():
        raise ValueError(
            "host_kv must be pinned (torch.empty(..., pin_memory=True)) for io_backend='kernel'; "
            "the GPU kernel reads and writes it directly"
        )
    h_idx, d_idx = _check_indices(
        host_indices, device_indices, device, geom.num_slots, device_k[0].shape[0], to_host
    )
    return Transfer(
        host_kv=host_kv,
        geom=geom,
        device_k=tuple(device_k),
        device_v=None if device_v is None else tuple(device_v),
        layer_begin=layer_begin,
        host_indices=h_idx,
        device_indices=d_idx,
        to_host=to_host,
        io_backend=io_backend,
        num_ctas=num_ctas,
    )
