"""L1 (device) <-> L2 (host) KV-cache transfer kernels with a torch fallback.

See kernels/README.md and contract K in docs/interfaces.md.
"""

from kernels.api import backend_info, backup_all_layers, load_per_layer
from kernels.layouts import LAYOUTS

__all__ = ["LAYOUTS", "backend_info", "backup_all_layers", "load_per_layer"]
