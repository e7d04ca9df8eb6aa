"""Flag normalisation (SGLang's boot-time rewrites), extra-config parsing, and auth levels."""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from cache_runtime.args import ServerArgs, args_from_namespace, build_parser, normalise, parse_extra_config
from cache_runtime.auth import Level, check, key_matches


def _parse(*argv):
    return args_from_namespace(build_parser().parse_args(["serve", *argv]))


def test_sglang_flag_names_and_defaults():
    a = _parse("--enable-hierarchical-cache", "--hicache-size", "4", "--tp-size", "2", "--page-size", "16")
    assert (a.host, a.port, a.model_path) == ("127.0.0.1", 30000, "builtin:tiny")
    assert (a.hicache_ratio, a.hicache_size, a.hicache_write_policy) == (2.0, 4.0, "write_through")
    assert (a.hicache_io_backend, a.hicache_mem_layout) == ("kernel", "layer_first")
    assert a.hicache_storage_prefetch_policy == "best_effort" and a.tp_size == 2 and a.normalisations == []


def test_page_first_direct_forces_direct_io():
    a = _parse("--enable-hierarchical-cache", "--hicache-mem-layout", "page_first_direct")
    assert a.hicache_io_backend == "direct"
    assert "Kernel io backend does not support page first direct layout" in a.normalisations[0]


@pytest.mark.parametrize("io,layout", [("kernel", "page_first"), ("direct", "page_first_direct")])
def test_mooncake_rewrites_layer_first(io, layout):
    a = _parse("--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", "--hicache-io-backend", io)
    assert a.hicache_mem_layout == layout
    assert "Mooncake storage backend does not support layer_first" in a.normalisations[-1]


@pytest.mark.parametrize("overrides,msg", [
    ({"hicache_write_policy": "write_sometimes"}, "hicache-write-policy"),
    ({"hicache_mem_layout": "page_head"}, "not supported"),
    ({"enable_hierarchical_cache": True, "hicache_ratio": 1.0}, "must be > 1"),
    ({"hicache_storage_backend": "file"}, "needs --enable-hierarchical-cache"),
    ({"page_size": 0}, "page-size"),
    ({"hicache_storage_backend_extra_config": "{nope"}, "not valid JSON"),
    ({"pp_size": 2}, "--pp-size 2: the bundled runtime runs tensor parallelism only"),
    ({"dp_size": 4}, "--dp-size 4: the bundled runtime runs tensor parallelism only"),
])
def test_bad_flags_fail_with_a_clear_message(overrides, msg):
    with pytest.raises(ValueError, match=msg):
        normalise(ServerArgs(**overrides))


def test_extra_config_from_json_toml_yaml(tmp_path):
    assert parse_extra_config('{"a": 1}') == {"a": 1}
    (tmp_path / "c.toml").write_text("prefetch_threshold = 64\n")
    (tmp_path / "c.yaml").write_text("file_storage_path: /data\n")
    (tmp_path / "c.json").write_text(json.dumps({"x": True}))
    assert parse_extra_config(f"@{tmp_path}/c.toml") == {"prefetch_threshold": 64}
    assert parse_extra_config(f"@{tmp_path}/c.yaml") == {"file_storage_path": "/data"}
    assert parse_extra_config(f"@{tmp_path}/c.json") == {"x": True}
    with pytest.raises(ValueError, match="JSON object"):
        parse_extra_config("[1, 2]")
    with pytest.raises(ValueError, match="cannot read"):
        parse_extra_config(f"@{tmp_path}/missing.json")


def test_admin_key_falls_back_to_env(monkeypatch):
    monkeypatch.setenv("HICACHE_ADMIN_API_KEY", "from-env")
    assert normalise(ServerArgs()).admin_api_key == "from-env"
    assert normalise(ServerArgs(admin_api_key="flag")).admin_api_key == "flag"


def _req(headers: dict) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "headers": raw, "method": "GET", "path": "/"})


def test_auth_levels():
    bearer = {"Authorization": "Bearer adm"}
    # admin routes: admin key only; the API key does not open them
    assert check(_req(bearer), Level.ADMIN_REQUIRED, "api", "adm") is None
    assert check(_req({"x-api-key": "adm"}), Level.ADMIN_REQUIRED, "api", "adm") is None
    assert check(_req({"x-api-key": "api"}), Level.ADMIN_REQUIRED, "api", "adm").status_code == 401
    assert check(_req({}), Level.ADMIN_REQUIRED, None, None).status_code == 400  # needs a configured key
    # admin-optional: falls back to the API key, else open
    assert check(_req({"x-api-key": "api"}), Level.ADMIN_OPTIONAL, "api", None) is None
    assert check(_req({}), Level.ADMIN_OPTIONAL, None, None) is None
    assert check(_req({}), Level.ADMIN_OPTIONAL, "api", None).status_code == 401
    # normal routes: API key when set
    assert check(_req({}), Level.NORMAL, None, "adm") is None
    assert check(_req({"x-api-key": "bad"}), Level.NORMAL, "api", None).status_code == 401
    assert check(_req({}), Level.OPEN, "api", "adm") is None
    assert not key_matches(None, "k") and not key_matches("k2", "k") and key_matches("k", "k")


def test_the_operator_knows_the_default_device_pool():
    """The operator sizes a bundled pod's host pool (and memory request) from this default."""
    from hicache_operator.plan.engine import features as engine

    assert ServerArgs().max_total_tokens == engine.BUNDLED_DEVICE_TOKENS
