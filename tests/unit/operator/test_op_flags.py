"""The flag table drives the spec model, the CRD and both command lines."""

from __future__ import annotations

import typing

import pytest

from hicache_operator.api import flags
from hicache_operator.api.spec import HiCacheDeploymentSpec


def _field(path: str):
    model, info = HiCacheDeploymentSpec, None
    for part in path.split("."):
        by_alias = {(f.alias or n): f for n, f in model.model_fields.items()}
        info = by_alias[part]
        ann = info.annotation
        args = [a for a in typing.get_args(ann) if isinstance(a, type) and hasattr(a, "model_fields")]
        model = args[0] if args else ann
    return info


@pytest.mark.parametrize("flag", flags.FLAGS, ids=lambda f: f.key)
def test_every_flag_is_a_spec_field_with_the_table_enum_and_default(flag):
    info = _field(flag.key)
    if flag.choices:
        assert set(typing.get_args(info.annotation)) == set(flag.choices)
    if not flag.key.startswith("hicache.hostPool.") and flag.key != "hicache.storage.extraConfig":
        assert info.default == flag.default
    assert flag.help in (info.description or "")


def _spec(**kw) -> dict:
    return HiCacheDeploymentSpec.model_validate({"image": "img", **kw}).dump()


def test_bundled_and_sglang_share_sglang_flag_names_but_not_engine_only_flags():
    spec = _spec(hicache={"storage": {"backend": "file"}})
    bundled = flags.render_args(spec, "bundled", host_pool=("ratio", 2.0))
    sglang = flags.render_args(spec, "sglang", host_pool=("ratio", 2.0))
    assert "--enable-metrics" in sglang and "--enable-metrics" not in bundled
    for args in (bundled, sglang):
        assert args[:4] == ["--host", "$(POD_IP)", "--port", "30000"]
        assert args[args.index("--hicache-ratio") + 1] == "2.0"
        assert args[args.index("--hicache-storage-backend") + 1] == "file"
    extra = "--hicache-storage-backend-extra-config"
    assert bundled[bundled.index(extra) + 1].startswith("@/etc/hicache/storage/")
    # SGLang echoes the flag back from GET /hicache/storage-backend: it must be the JSON itself.
    assert sglang[sglang.index(extra) + 1] == "{}"
    assert flags.command("sglang") == ["python", "-m", "sglang.launch_server"]
    assert flags.command("bundled") == ["python", "-m", "cache_runtime", "serve"]


def test_admin_key_is_referenced_through_env_never_literal():
    spec = _spec()
    sglang = flags.render_args(spec, "sglang", host_pool=("ratio", 2.0))
    assert sglang[sglang.index("--admin-api-key") + 1] == "$(HICACHE_ADMIN_API_KEY)"
    assert "--admin-api-key" not in flags.render_args(spec, "bundled", host_pool=("ratio", 2.0))


def test_storage_flags_are_left_out_for_backend_none_and_for_the_restart_hash():
    none = flags.render_args(_spec(), "bundled", host_pool=("ratio", 2.0))
    assert not [a for a in none if a.startswith("--hicache-storage")]
    with_file = _spec(hicache={"storage": {"backend": "file", "prefetchPolicy": "timeout"}})
    stripped = flags.render_args(with_file, "bundled", host_pool=("ratio", 2.0), include_storage=False)
    assert stripped == none


def test_only_one_host_pool_flag_and_bool_flags_are_bare():
    spec = _spec(enableCacheReport=True, hicache={"hostPool": {"sizeGBPerRank": 12}})
    args = flags.render_args(spec, "sglang", host_pool=("sizeGBPerRank", 12))
    assert args[args.index("--hicache-size") + 1] == "12"
    assert "--hicache-ratio" not in args
    i = args.index("--enable-cache-report")
    assert i == len(args) - 1 or args[i + 1].startswith("--")


def test_user_values_cannot_reference_container_env():
    spec = _spec(model="org/$(HICACHE_ADMIN_API_KEY)", engine="sglang",
                 hicache={"storage": {"backend": "file", "extraConfig": {"file_storage_path": "/x/$(POD_IP)"}}})
    args = flags.render_args(spec, "sglang", host_pool=("ratio", 2.0))
    assert args[args.index("--model-path") + 1] == "org/$$(HICACHE_ADMIN_API_KEY)"
    assert "$$(POD_IP)" in args[args.index("--hicache-storage-backend-extra-config") + 1]
    assert args[:2] == ["--host", "$(POD_IP)"]  # ours stay expandable
    assert args[args.index("--admin-api-key") + 1] == "$(HICACHE_ADMIN_API_KEY)"
