"""The L3 storage contract shared by every backend (mirrors SGLang's ``HiCacheStorage``).

Keeping SGLang's method names and argument order lets a backend written for SGLang's
``dynamic`` loader run here unchanged, and lets the engine treat all backends alike.

Failure model (the engine relies on it):
- a missing, corrupt, truncated or wrong-sized page is a *miss* (``None`` / ``False`` /
  a shorter ``batch_exists`` prefix); a backend never returns bytes it cannot vouch for;
- a backend that cannot be reached at all (store master gone, storage dir unusable)
  raises :class:`StorageUnavailable` from the constructor and from any call made while it
  is down, promptly; the engine then runs on L1+L2 and probes again later;
- programming errors by the caller (non-contiguous or non-CPU tensors, list lengths that
  do not match) raise ``ValueError``/``TypeError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


class StorageUnavailable(Exception):
    """The backend cannot be reached; the engine should degrade to L1+L2 and retry later."""


@dataclass
class HiCacheStorageConfig:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    is_page_first_layout: bool = True
    model_name: str = "builtin:tiny"
    extra_config: dict = field(default_factory=dict)


def as_byte_view(tensor: Any, what: str) -> torch.Tensor:
    """Flat uint8 view of a contiguous CPU tensor, sharing its memory.

    Backends move pages as raw bytes; a view (never a copy) is what lets ``get`` fill
    a host-pool slice in place.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU tensor (got device {tensor.device})")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    return tensor.reshape(-1).view(torch.uint8)


def check_same_length(keys: list[str], other: Any, what: str) -> None:
    if other is not None and len(other) != len(keys):
        raise ValueError(f"{what} has {len(other)} entries for {len(keys)} keys")


class HiCacheStorage(ABC):
    """Key/value store of KV pages; keys are SGLang page hashes (see ``hashing.py``)."""

    @abstractmethod
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Page bytes as a flat uint8 tensor, or None on miss.

        With ``target_location`` the bytes land in that tensor (which is returned); on a
        miss its contents are unspecified. ``target_sizes`` (bytes) rejects pages of any
        other size when there is no target.
        """

    @abstractmethod
    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        ...

    @abstractmethod
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store ``value`` (or the tensor in ``target_location``) as raw bytes; True if stored or already there."""

    @abstractmethod
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """True only if every page is stored (SGLang semantics; earlier pages may persist on False)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        ...

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of consecutive stored pages from the start (pages are chained, so a gap ends the prefix)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def clear(self) -> None:
        """Wipe this backend's pages (the engine's ``/hicache/storage-backend/clear``)."""

    def get_stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Release connections and handles; never deletes stored pages."""

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Announce a long-lived host buffer (the L2 pool) that pages will be read into and written from.

        Backends with a zero-copy path (Mooncake) use it; the default has nothing to do.
        """


def values_from(keys: list[str], values: Any, target_locations: Any) -> list[Any]:
    """The tensors a batch_set stores: ``values`` if given, else ``target_locations`` (SGLang passes either)."""
    chosen = values if values is not None else target_locations
    if chosen is None:
        raise ValueError("batch_set needs values or target_locations")
    check_same_length(keys, chosen, "values")
    return list(chosen)
