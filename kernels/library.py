"""ctypes binding of the compiled transfer library and the backend decision.

The C ABI takes raw pointers, so this module owns the mirror structs and keeps
every tensor whose pointer it passes alive for the duration of the call; the
kernels are enqueued on torch's current stream, where torch's caching allocator
already orders any reuse of those tensors' memory after them.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kernels import build
from kernels.layouts import LAYOUT_CODES, HostGeometry
from kernels.validate import Transfer

ABI_VERSION = 1  # HC_ABI_VERSION in transfer.cu
_I64 = ctypes.c_int64
_U64 = ctypes.c_uint64
_P_I64 = ctypes.POINTER(_I64)
_P_U64 = ctypes.POINTER(_U64)


class HostLayout(ctypes.Structure):
    _fields_ = [
        ("kind", _I64),
        ("has_v", _I64),
        ("num_layers", _I64),
        ("num_slots", _I64),
        ("page_size", _I64),
        ("item_bytes", _I64),
    ]

    @classmethod
    def of(cls, geom: HostGeometry) -> HostLayout:
        return cls(
            LAYOUT_CODES[geom.layout],
            0 if geom.is_mla else 1,
            geom.num_layers,
            geom.num_slots,
            geom.page_size,
            geom.item_bytes,
        )


class TransferArgs(ctypes.Structure):
    _fields_ = [
        ("host", HostLayout),
        ("host_base", _U64),
        ("dev_k", _P_U64),
        ("dev_v", _P_U64),
        ("dev_slots", _I64),
        ("layer_begin", _I64),
        ("layer_count", _I64),
        ("host_idx", _P_I64),
        ("dev_idx", _P_I64),
        ("n", _I64),
        ("to_host", _I64),
        ("num_ctas", _I64),
        ("device", _I64),
        ("stream", _U64),
    ]


class KernelLibraryError(RuntimeError):
    """A call into the compiled library failed (CUDA error or bad arguments)."""


class Library:
    """Typed handle on one loaded copy of the shared library."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        sigs = {
            "hc_abi_version": (ctypes.c_int, []),
            "hc_cudart_version": (ctypes.c_int, []),
            "hc_error_string": (ctypes.c_char_p, [ctypes.c_int]),
            "hc_device_count": (ctypes.c_int, [_P_I64]),
            "hc_host_offsets": (
                ctypes.c_int,
                [ctypes.POINTER(HostLayout), _I64, _P_I64, _P_I64, _P_I64, _P_I64],
            ),
            "hc_vector_width": (ctypes.c_int, [ctypes.POINTER(TransferArgs)]),
            "hc_plan_direct": (
                _I64,
                [ctypes.POINTER(TransferArgs), _P_U64, _P_U64, _P_U64, _I64],
            ),
            "hc_batch_memcpy_available": (ctypes.c_int, []),
            "hc_transfer_kernel": (ctypes.c_int, [ctypes.POINTER(TransferArgs)]),
            "hc_transfer_direct": (ctypes.c_int, [ctypes.POINTER(TransferArgs), ctypes.c_int]),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._lib = lib
        abi = lib.hc_abi_version()
        if abi != ABI_VERSION:
            raise KernelLibraryError(f"{path} has ABI {abi}, this wrapper expects {ABI_VERSION}")

    def error(self, code: int) -> str:
        return f"{self._lib.hc_error_string(code).decode()} (code {code})"

    def cudart_version(self) -> int:
        return self._lib.hc_cudart_version()

    def device_count(self) -> tuple[int, int]:
        """(cudaGetDeviceCount status, count)."""
        count = _I64(0)
        status = self._lib.hc_device_count(ctypes.byref(count))
        return status, count.value

    def batch_memcpy_available(self) -> bool:
        return bool(self._lib.hc_batch_memcpy_available())

    def host_offsets(self, geom: HostGeometry, kv, layer, slot) -> torch.Tensor:
        """Byte offsets of (kv, layer, slot) triples as the compiled code computes them."""
        kv, layer, slot = (
            torch.as_tensor(x, dtype=torch.int64).contiguous() for x in (kv, layer, slot)
        )
        out = torch.empty_like(slot)
        layout = HostLayout.of(geom)
        rc = self._lib.hc_host_offsets(
            ctypes.byref(layout), slot.numel(), _ptr(kv), _ptr(layer), _ptr(slot), _ptr(out)
        )
        if rc:
            raise KernelLibraryError(self.error(rc))
        return out

    def vector_width(self, t: Transfer) -> int:
        args, _keep = _args(t, t.host_indices, t.device_indices, stream=0)
        rc = self._lib.hc_vector_width(ctypes.byref(args))
        if rc < 0:
            raise KernelLibraryError(self.error(rc))
        return rc

    def plan_direct(self, t: Transfer) -> list[tuple[int, int, int]]:
        """The DMA path's (dst, src, bytes) copies; indices must be on the CPU."""
        args, _keep = _args(t, t.host_indices.contiguous(), t.device_indices.contiguous(), stream=0)
        cap = max(1, t.host_indices.numel() * len(t.planes()))
        dst, src, size = (torch.empty(cap, dtype=torch.int64) for _ in range(3))
        got = self._lib.hc_plan_direct(
            ctypes.byref(args), _ptr(dst, _U64), _ptr(src, _U64), _ptr(size, _U64), cap
        )
        if got < 0:
            raise KernelLibraryError(self.error(got))
        # User-space addresses are below 2**63, so int64 holds them unchanged.
        return list(zip(*(x[:got].tolist() for x in (dst, src, size))))

    def run(self, t: Transfer, *, stream: int | None = None, allow_batch: bool = True) -> None:
        """Enqueue a placed transfer (see place()) on `stream`, by default torch's current
        stream of the pool's device. Only pointers and sizes cross into C: nothing here
        reads an index, so a call never waits for the device."""
        kernel = t.io_backend == "kernel"
        want = t.device if kernel else torch.device("cpu")
        for name, idx in (("host_indices", t.host_indices), ("device_indices", t.device_indices)):
            if idx.device != want or not idx.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous on {want} for io_backend={t.io_backend!r} "
                    f"(library.place() puts them there), got {idx.device}"
                )
        if stream is None:
            stream = torch.cuda.current_stream(t.device).cuda_stream
        args, _keep = _args(t, t.host_indices, t.device_indices, stream)
        if kernel:
            rc = self._lib.hc_transfer_kernel(ctypes.byref(args))
        else:
            rc = self._lib.hc_transfer_direct(ctypes.byref(args), int(allow_batch))
        if rc:
            raise KernelLibraryError(f"hicache transfer failed: {self.error(rc)}")


def place(t: Transfer) -> Transfer:
    """`t` with its indices where the compiled path reads them; done once per transfer.

    SM kernel: on the pool's device, CPU indices uploaded through torch's pinned caching
    allocator on the current stream (a copy from pageable memory may wait for the stream,
    which would stall the caller). DMA path: on the CPU, where the planner reads them (a
    sync only if they were given on the GPU).
    """
    if t.io_backend == "direct":
        h, d = (x.to("cpu").contiguous() for x in (t.host_indices, t.device_indices))
    else:
        h, d = (_to_device(x, t.device) for x in (t.host_indices, t.device_indices))
    return replace(t, host_indices=h, device_indices=d)


def _to_device(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    if idx.device.type == "cpu":
        idx = idx.contiguous().pin_memory()
    return idx.to(device, non_blocking=True).contiguous()


def _ptr(t: torch.Tensor, ctype=_I64):
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype))


def _args(t: Transfer, h_idx: torch.Tensor, d_idx: torch.Tensor, stream: int):
    """TransferArgs plus the ctypes arrays it points into (keep them alive)."""
    dev_k = (_U64 * len(t.device_k))(*(x.data_ptr() for x in t.device_k))
    dev_v = (
        None
        if t.device_v is None
        else (_U64 * len(t.device_v))(*(x.data_ptr() for x in t.device_v))
    )
    args = TransferArgs(
        host=HostLayout.of(t.geom),
        host_base=t.host_kv.data_ptr(),
        dev_k=ctypes.cast(dev_k, _P_U64),
        dev_v=None if dev_v is None else ctypes.cast(dev_v, _P_U64),
        dev_slots=t.device_slots,
        layer_begin=t.layer_begin,
        layer_count=len(t.device_k),
        host_idx=_ptr(h_idx),
        dev_idx=_ptr(d_idx),
        n=h_idx.numel(),
        to_host=int(t.to_host),
        num_ctas=t.num_ctas or 0,
        device=t.device.index if t.device.type == "cuda" and t.device.index is not None else 0,
        stream=stream,
    )
    return args, (dev_k, dev_v, h_idx, d_idx)


@dataclass(frozen=True)
class Backend:
    name: str  # "cuda" or "cpu-fallback"
    reason: str
    library: Library | None  # loaded even without a device, for the offset checks


_lock = threading.Lock()
_backend: Backend | None = None


LIBRARY_ENV = "HICACHE_KERNELS_LIBRARY"


def load(path: Path | None = None) -> Library:
    """Load a prebuilt library (argument, else env HICACHE_KERNELS_LIBRARY, as in the runtime
    image, which has no nvcc), else build it (cached) and load it; BuildError / OSError on failure."""
    prebuilt = path or (Path(os.environ[LIBRARY_ENV]) if os.environ.get(LIBRARY_ENV) else None)
    return Library(prebuilt or build.build())


def backend() -> Backend:
    """Decide once per process whether CUDA transfers use the compiled kernels."""
    global _backend
    with _lock:
        if _backend is None:
            _backend = _decide()
        return _backend


_STATUS_HINTS = {
    35: "; no NVIDIA driver is loaded on this machine",
    100: "; the driver sees no GPU",
}


def _decide() -> Backend:
    if os.environ.get("HICACHE_KERNELS_DISABLE", "") not in ("", "0"):
        return Backend("cpu-fallback", "disabled by HICACHE_KERNELS_DISABLE", None)
    try:
        lib = load()
    except (build.BuildError, OSError, KernelLibraryError) as exc:
        return Backend("cpu-fallback", f"kernel library unavailable: {exc}", None)
    status, count = lib.device_count()
    if status != 0:
        hint = _STATUS_HINTS.get(status, "")
        return Backend(
            "cpu-fallback", f"no CUDA device: cudaGetDeviceCount: {lib.error(status)}{hint}", lib
        )
    if count == 0:
        return Backend("cpu-fallback", "no CUDA device: cudaGetDeviceCount returned 0", lib)
    if not torch.cuda.is_available():
        return Backend("cpu-fallback", f"torch {torch.__version__} cannot use CUDA", lib)
    return Backend("cuda", f"{count} CUDA device(s); kernels from {lib.path}", lib)
