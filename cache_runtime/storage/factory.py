"""Backend names -> constructors, and the extra_config keys each backend understands."""

from __future__ import annotations

from cache_runtime.storage import dynamic, file_backend, mooncake_config
from cache_runtime.storage.base import HiCacheStorage, HiCacheStorageConfig
from cache_runtime.storage.mooncake_backend import MooncakeStore  # the mooncake client itself loads on connect

BACKENDS = ("file", "mooncake", "dynamic")

# For the operator's "unknown key" warnings. "_prefetch" holds the knobs the engine pops from
# extra_config before building the backend (SGLang's HiRadixCache does the same).
KNOWN_EXTRA_CONFIG_KEYS: dict[str, set[str]] = {
    "file": set(file_backend.EXTRA_CONFIG_KEYS),
    "mooncake": mooncake_config.SGLANG_KEYS | mooncake_config.RUNTIME_KEYS,
    "dynamic": set(dynamic.EXTRA_CONFIG_KEYS),
    "_prefetch": {"prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                  "prefetch_timeout_max", "hicache_storage_pass_prefix_keys"},
}


def create_storage_backend(name: str, config: HiCacheStorageConfig) -> HiCacheStorage:
    """Raises ValueError for an unknown name or bad config, StorageUnavailable if the store cannot be reached."""
    if not isinstance(config, HiCacheStorageConfig):
        raise ValueError(f"config must be a HiCacheStorageConfig, got {type(config).__name__}")
    if config.extra_config is not None and not isinstance(config.extra_config, dict):
        raise ValueError(f"extra_config must be a dict, got {type(config.extra_config).__name__}")
    if name == "file":
        return file_backend.HiCacheFile(config)
    if name == "mooncake":
        return MooncakeStore(config)
    if name == "dynamic":
        return dynamic.create_dynamic_backend(config)
    raise ValueError(f"unknown storage backend {name!r}; available: {', '.join(BACKENDS)}")
