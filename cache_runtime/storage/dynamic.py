"""``dynamic`` backend: a third-party HiCacheStorage class named in extra_config (SGLang's contract).

extra_config ``module_path`` + ``class_name`` (+ ``backend_name``, used in messages) pick the
class; it must subclass our :class:`HiCacheStorage` and is built as ``cls(storage_config, kwargs)``
exactly like SGLang's factory, so the same plugin works in both engines (given the same base).
"""

from __future__ import annotations

import importlib
import logging

from cache_runtime.storage.base import HiCacheStorage, HiCacheStorageConfig

log = logging.getLogger(__name__)

REQUIRED_KEYS = ("backend_name", "module_path", "class_name")
EXTRA_CONFIG_KEYS = set(REQUIRED_KEYS) | {"interface_v1"}


def load_backend_class(module_path: str, class_name: str, backend_name: str) -> type[HiCacheStorage]:
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ValueError(f"dynamic backend {backend_name!r}: cannot import module {module_path!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"dynamic backend {backend_name!r}: module {module_path!r} has no {class_name!r}")
    if not isinstance(cls, type) or not issubclass(cls, HiCacheStorage):
        raise ValueError(f"dynamic backend {backend_name!r}: {module_path}.{class_name} must be a subclass of "
                         "cache_runtime.storage.base.HiCacheStorage")
    return cls


def create_dynamic_backend(config: HiCacheStorageConfig, **kwargs) -> HiCacheStorage:
    extra = config.extra_config or {}
    missing = [k for k in REQUIRED_KEYS if not extra.get(k)]
    if missing:
        raise ValueError(f"dynamic backend: extra_config is missing {', '.join(missing)} "
                         f"(needs {', '.join(REQUIRED_KEYS)})")
    cls = load_backend_class(str(extra["module_path"]), str(extra["class_name"]), str(extra["backend_name"]))
    log.info("creating dynamic storage backend %r (%s.%s)", extra["backend_name"], extra["module_path"],
             extra["class_name"])
    return cls(config, kwargs)
