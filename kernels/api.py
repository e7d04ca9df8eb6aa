"""Public transfer API (contract K in docs/interfaces.md).

Every request is checked in full first, and its indices are put where the
chosen backend reads them; then CPU device pools go to the torch fallback, and
CUDA device pools go to the compiled kernels when they loaded, else to the
fallback (staging through torch). A layer-by-layer load does the checking and
index placement once for all layers (`prepare_load`), so each per-layer call
only enqueues copies.
"""

from __future__ import annotations

import torch

from kernels import fallback, library, validate


class LayerLoads:
    """A host -> device load of every layer, checked and placed once, issued per layer.

    `load(i)` reads no index and never waits for the device: it enqueues layer i
    on the current stream. Indices uploaded on one stream and loaded on another
    are ordered by an event, never by a host sync.
    """

    def __init__(self, t: validate.Transfer) -> None:
        self.num_layers = len(t.device_k)
        self._lib = _compiled(t)
        self._prep = None
        self._uploaded = self._upload_stream = None
        if self._lib is None:
            self._prep = fallback.prepare(t)
        else:
            t = library.place(t)
            if t.io_backend == "kernel":
                self._upload_stream = torch.cuda.current_stream(t.device)
                self._uploaded = torch.cuda.Event()
                self._uploaded.record(self._upload_stream)
        self._t = t

    def load(self, layer_id: int) -> None:
        """Enqueue the copy of layer `layer_id` (K and V, or the MLA latent)."""
        validate.check_int("layer_id", layer_id, 0, self.num_layers - 1)
        one = self._t.layer(layer_id)
        if self._lib is None:
            fallback.run(one, self._prep)
            return
        if self._uploaded is not None:
            stream = torch.cuda.current_stream(one.device)
            if stream != self._upload_stream:
                stream.wait_event(self._uploaded)
                for idx in (one.host_indices, one.device_indices):
                    idx.record_stream(stream)
        self._lib.run(one)


def prepare_load(
    host_kv: torch.Tensor,
    device_k_layers: list[torch.Tensor],
    device_v_layers: list[torch.Tensor] | None,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    layout: str,
    page_size: int,
    *,
    io_backend: str = "kernel",
    num_ctas: int | None = None,
) -> LayerLoads:
    """Check a host -> device load of every layer and place its indices, once."""
    return LayerLoads(_check_all_layers(host_kv, device_k_layers, device_v_layers, host_indices, device_indices,
                                        layout, page_size, to_host=False, io_backend=io_backend, num_ctas=num_ctas))


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
    """Host -> device copy of one layer (K and V, or the MLA latent), checked on its own.

    Loading several layers of one request this way repeats the index work per layer;
    `prepare_load` does it once.
    """
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
    t = _check_all_layers(host_kv, device_k_layers, device_v_layers, host_indices, device_indices, layout, page_size,
                          to_host=True, io_backend=io_backend, num_ctas=num_ctas)
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


def _check_all_layers(host_kv: torch.Tensor, device_k_layers: list[torch.Tensor],
                      device_v_layers: list[torch.Tensor] | None, host_indices: torch.Tensor,
                      device_indices: torch.Tensor, layout: str, page_size: int, *, to_host: bool,
                      io_backend: str, num_ctas: int | None) -> validate.Transfer:
    """A transfer of every layer, checked in full (the lists are per-layer tensors)."""
    for name, layers in (("device_k_layers", device_k_layers), ("device_v_layers", device_v_layers)):
        if layers is not None and not isinstance(layers, (list, tuple)):
            raise TypeError(f"{name} must be a list of per-layer tensors, got {type(layers).__name__}")
    return validate.check(
        host_kv=host_kv,
        device_k=list(device_k_layers),
        device_v=None if device_v_layers is None else list(device_v_layers),
        layer_begin=0,
        all_layers=True,
        host_indices=host_indices,
        device_indices=device_indices,
        layout=layout,
        page_size=page_size,
        to_host=to_host,
        io_backend=io_backend,
        num_ctas=num_ctas,
    )


def _compiled(t: validate.Transfer) -> library.Library | None:
    """The compiled library for a CUDA pool when it loaded and sees a GPU, else None."""
    if t.device.type != "cuda":
        return None
    b = library.backend()
    return b.library if b.name == "cuda" else None


def _run(t: validate.Transfer) -> None:
    lib = _compiled(t)
    if lib is None:
        fallback.run(t)
    else:
        lib.run(library.place(t))
