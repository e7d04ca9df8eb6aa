"""Public transfer API (contract K in docs/interfaces.md).

Every call is checked in full first; then CPU device pools go to the torch
fallback, and CUDA device pools go to the compiled kernels when they loaded,
else to the fallback (staging through torch).
"""

from __future__ import annotations

import torch

from kernels import fallback, library, validate


def load_per_layer(
    host_kv: torch.Tensor,
    device_k: torch.Tensor,
    device_v: torch.Tensor | None,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    layer_id: int,
    layout: str,
    page_size: int,
    *,
    io_backend: str = "kernel",
    num_ctas: int | None = None,
) -> None:
    """Host -> device copy of one layer (K and V, or the MLA latent)."""
    t = validate.check(
        host_kv=host_kv,
        device_k=[device_k],
        device_v=None if device_v is None else [device_v],
        layer_begin=layer_id,
        all_layers=False,
        host_indices=host_indices,
        device_indices=device_indices,
        layout=layout,
        page_size=page_size,
        to_host=False,
        io_backend=io_backend,
        num_ctas=num_ctas,
    )
    _run(t)


def backup_all_layers(
    device_k_layers: list[torch.Tensor],
    device_v_layers: list[torch.Tensor] | None,
    host_kv: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    layout: str,
    page_size: int,
    *,
    io_backend: str = "kernel",
    num_ctas: int | None = None,
) -> None:
    """Device -> host write-back of every layer."""
    for name, layers in (
        ("device_k_layers", device_k_layers),
        ("device_v_layers", device_v_layers),
    ):
        if layers is not None and not isinstance(layers, (list, tuple)):
            raise TypeError(
                f"{name} must be a list of per-layer tensors, got {type(layers).__name__}"
            )
    t = validate.check(
        host_kv=host_kv,
        device_k=list(device_k_layers),
        device_v=None if device_v_layers is None else list(device_v_layers),
        layer_begin=0,
        all_layers=True,
        host_indices=host_indices,
        device_indices=device_indices,
        layout=layout,
        page_size=page_size,
        to_host=True,
        io_backend=io_backend,
        num_ctas=num_ctas,
    )
    _run(t)


def backend_info() -> dict:
    """Which path CUDA pools take and why; builds/loads the library on first call."""
    b = library.backend()
    return {
        "backend": b.name,
        "reason": b.reason,
        "library": str(b.library.path) if b.library else None,
        "cudart_version": b.library.cudart_version() if b.library else None,
        "batch_memcpy": b.library.batch_memcpy_available() if b.name == "cuda" else False,
    }


def _run(t: validate.Transfer) -> None:
    if t.device.type == "cuda":
        b = library.backend()
        if b.library is not None and b.name == "cuda":
            b.library.run(t)
            return
    fallback.run(t)
