"""Counts every operation that hands an index tensor's values to the host or moves them.

On a GPU each such operation on a device tensor is a host-device synchronisation
(`.tolist()`, `.item()`, `bool()`, `.cpu()`, `torch.equal`) or a copy across the
link (`.to()`, `.pin_memory()`); on the CPU the same calls run without a device,
so counting them shows where a GPU run would wait. Tensors derived from a
counted one are counted too, so a read of `idx.max()` or `idx[mask]` shows up.
"""

from __future__ import annotations

import threading

import torch

HOST_OPS = frozenset(
    {
        "tolist",
        "item",
        "cpu",
        "cuda",
        "numpy",
        "to",
        "pin_memory",
        "equal",
        "__bool__",
        "__int__",
        "__index__",
        "__float__",
        "__array__",
    }
)


class Counted(torch.Tensor):
    """A torch.Tensor subclass whose host-facing operations append to `log`."""

    log: list[str] = []
    _lock = threading.Lock()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_OPS:
            with cls._lock:
                cls.log.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def counted(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(Counted)


class HostReads:
    """`with reads:` collects the host operations made inside the block into `reads.ops`."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def __enter__(self) -> HostReads:
        Counted.log = self.ops = []
        return self

    def __exit__(self, *exc) -> None:
        Counted.log = []
