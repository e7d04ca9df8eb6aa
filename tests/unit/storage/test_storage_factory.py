import importlib

import pytest
import torch

from cache_runtime.storage import (
    BACKENDS,
    KNOWN_EXTRA_CONFIG_KEYS,
    HiCacheStorageConfig,
    StorageUnavailable,
    create_storage_backend,
)

PLUGIN = "tests.unit.storage.dynamic_plugin"


def dyn(**extra):
    return HiCacheStorageConfig(extra_config={"backend_name": "dict", "module_path": PLUGIN,
                                              "class_name": "DictStorage", **extra})


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="unknown storage backend 'nixl'.*file, mooncake, dynamic"):
        create_storage_backend("nixl", HiCacheStorageConfig())


def test_bad_config_types():
    with pytest.raises(ValueError, match="HiCacheStorageConfig"):
        create_storage_backend("file", {"file_storage_path": "/tmp"})
    with pytest.raises(ValueError, match="extra_config must be a dict"):
        create_storage_backend("file", HiCacheStorageConfig(extra_config="file_storage_path=/tmp"))


def test_dynamic_backend_is_built_like_sglang():
    cfg = dyn()
    backend = create_storage_backend("dynamic", cfg)
    cls = importlib.import_module(PLUGIN).DictStorage
    assert type(backend) is cls
    assert backend.storage_config is cfg and backend.kwargs == {}
    value = torch.arange(16, dtype=torch.float32)
    assert backend.batch_set(["a", "b"], [value, value * 2])
    assert backend.batch_exists(["a", "b", "c"]) == 2  # the base class's longest-prefix default
    target = torch.empty(16, dtype=torch.float32)
    assert backend.get("b", target) is target and torch.equal(target, value * 2)


@pytest.mark.parametrize("extra,message", [
    ({"module_path": None}, "missing module_path"),
    ({"class_name": ""}, "missing class_name"),
    ({"backend_name": None, "class_name": None}, "missing backend_name, class_name"),
    ({"module_path": "tests.unit.storage.no_such_module"}, "cannot import module"),
    ({"class_name": "Missing"}, "has no 'Missing'"),
    ({"class_name": "NotABackend"}, "must be a subclass"),
])
def test_dynamic_backend_errors_are_clear(extra, message):
    cfg = dyn(**extra)
    cfg.extra_config = {k: v for k, v in cfg.extra_config.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        create_storage_backend("dynamic", cfg)


def test_known_extra_config_keys_cover_every_backend_and_the_prefetch_knobs():
    assert set(KNOWN_EXTRA_CONFIG_KEYS) == set(BACKENDS) | {"_prefetch"}
    assert {"file_storage_path", "max_size", "min_free_space", "eviction_ratio"} <= KNOWN_EXTRA_CONFIG_KEYS["file"]
    assert "storage_dir" not in KNOWN_EXTRA_CONFIG_KEYS["file"]  # SGLang has no such key
    assert {"master_server_address", "local_hostname", "extra_backend_tag", "global_segment_size"} <= \
        KNOWN_EXTRA_CONFIG_KEYS["mooncake"]
    assert {"backend_name", "module_path", "class_name"} <= KNOWN_EXTRA_CONFIG_KEYS["dynamic"]
    assert KNOWN_EXTRA_CONFIG_KEYS["_prefetch"] == {"prefetch_threshold", "prefetch_timeout_base",
                                                    "prefetch_timeout_per_ki_token", "prefetch_timeout_max",
                                                    "hicache_storage_pass_prefix_keys"}


def test_mooncake_without_any_master_config(monkeypatch):
    for var in ("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="no master configured"):
        create_storage_backend("mooncake", HiCacheStorageConfig())


def test_mooncake_with_master_down_is_unavailable_not_a_hang():
    pytest.importorskip("mooncake.store", reason="run scripts/install-mooncake.sh")
    from testbed.mooncake import free_port

    cfg = HiCacheStorageConfig(extra_config={"master_server_address": f"127.0.0.1:{free_port()}",
                                             "master_wait_s": 0.3})
    with pytest.raises(StorageUnavailable, match="not reachable within 0.3s"):
        create_storage_backend("mooncake", cfg)
