"""L3 storage backends for the bundled runtime, behind SGLang's HiCacheStorage interface."""

from cache_runtime.storage.base import HiCacheStorage, HiCacheStorageConfig, StorageUnavailable
from cache_runtime.storage.factory import BACKENDS, KNOWN_EXTRA_CONFIG_KEYS, create_storage_backend
from cache_runtime.storage.hashing import get_hash_str, page_hashes

__all__ = [
    "BACKENDS",
    "KNOWN_EXTRA_CONFIG_KEYS",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "StorageUnavailable",
    "create_storage_backend",
    "get_hash_str",
    "page_hashes",
]
