"""Bundled hierarchical KV cache runtime (L1 device pool, L2 host pool, L3 storage).

The runtime speaks SGLang's HTTP API and flag names so that the operator (and users)
can drive it exactly like ``sglang.launch_server``; see ``cache_runtime/README.md``.
"""

__version__ = "0.1.0"
