"""L1 (device) <-> L2 (host) KV-cache transfer kernels with a torch fallback.

See kernels/README.md and contract K in docs/interfaces.md. The API is imported
on first use, so `python -m kernels build` needs no torch.
"""

from __future__ import annotations

_API = ("LayerLoads", "backend_info", "backup_all_layers", "load_per_layer", "prepare_load")
__all__ = ["LAYOUTS", *_API]


def __getattr__(name: str):
    if name in _API:
        from kernels import api

        return getattr(api, name)
    if name == "LAYOUTS":
        from kernels.layouts import LAYOUTS

        return LAYOUTS
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
