"""A fleet whose page format changes finds none of the old L3 pages: a miss, never wrong KV.

Page bytes are in host-layout order, and neither engine's file names nor Mooncake keys say which
layout, dtype or split wrote them. The operator therefore gives both engines the same namespaced
extra config (``render.effective_extra_config``): a file sub-directory, a Mooncake
``extra_backend_tag``. Here the real SGLang (``HiCacheFile``, ``MooncakeStore``) and the runtime
write and read pages under the configs the operator renders for two specs that differ only in
layout: the pages of one are a miss for the other, and still read as the same KV by the other
engine of the same format.
"""

from __future__ import annotations

import dataclasses

import pytest

from cache_runtime.storage import create_storage_backend
from hicache_operator.plan import render
from hicache_operator.fleet.storage_config import page_namespace
from hicache_operator.api.spec import HiCacheDeploymentSpec
from testbed import sglang_oracle
from testbed.mooncake import CLIENT_ENV, mooncake_env, mooncake_master  # noqa: F401  (fixtures)
from testbed.sglang_storage import (
    MODEL,
    PAGE,
    SGLANG_SIDE,
    Case,
    io_backend,
    runtime_keys,
    runtime_read,
    runtime_write,
    sglang_request,
)

# the newest oracle: the operator needs 0.5.22 for the file backend and 0.5.21 for Mooncake
VERSION = next((v for v in ("0.5.23", "0.5.22") if sglang_oracle.installed(v)), None)
needs_oracle = pytest.mark.skipif(VERSION is None, reason="no sglang >= 0.5.22 oracle: run scripts/install-sglang.sh")


def spec(layout: str, backend: str, extra: dict, engine: str = "sglang", **fields) -> HiCacheDeploymentSpec:
    body = {"image": f"lmsysorg/sglang:v{VERSION or '0.5.23'}" if engine == "sglang" else "hicache-runtime:0.1.0",
            "engine": engine, "model": MODEL, "pageSize": PAGE,
            "hicache": {"memLayout": layout, "ioBackend": io_backend(layout),
                        "storage": {"backend": backend, "extraConfig": extra}}}
    body.update(fields)
    return HiCacheDeploymentSpec.model_validate(body)


def effective(layout: str, backend: str, extra: dict, engine: str = "sglang", **fields) -> dict:
    return render.storage_config(spec(layout, backend, extra, engine, **fields)).extra_config


def _kv_equal(case: Case, kv) -> bool:
    k, v = case.kv()
    return not isinstance(kv, int) and kv[0].equal(k) and (v is None or kv[1].equal(v))


# --------------------------------------------------------------------------- the namespace itself

def test_namespace_names_every_field_that_changes_page_bytes():
    base = dict(mem_layout="page_first", kv_dtype="bfloat16", page_size=16, tp_size=2)
    name = page_namespace(**base)
    assert name == "kv-pl-bfloat16-p16-tp2"
    for change in ({"mem_layout": "layer_first"}, {"kv_dtype": "float16"}, {"page_size": 32}, {"tp_size": 4},
                   {"pp_size": 2}, {"attn_dp_size": 2}):
        assert page_namespace(**{**base, **change}) != name, change
    # the same byte order: layer_first and page_first_direct pages are interchangeable
    assert page_namespace(**{**base, "mem_layout": "layer_first"}) == page_namespace(
        **{**base, "mem_layout": "page_first_direct"})
    with pytest.raises(ValueError):
        page_namespace(**{**base, "mem_layout": "page_head"})
    with pytest.raises(ValueError):
        page_namespace(**{**base, "kv_dtype": "../x"})


def test_operator_renders_one_namespaced_config_for_both_engines(tmp_path):
    extra = {"file_storage_path": str(tmp_path)}
    first = effective("page_first", "file", extra)
    assert first == {"file_storage_path": f"{tmp_path}/kv-pl-auto-p{PAGE}-tp1"}
    assert effective("page_first", "file", extra, engine="bundled") == first
    assert effective("layer_first", "file", extra) != first
    assert effective("page_first", "file", extra, pageSize=2 * PAGE) != first
    assert effective("page_first", "file", extra, parallelism={"tp": 2}) != first
    assert effective("page_first", "file", extra, extraArgs=["--kv-cache-dtype", "fp8_e4m3"]) != first
    assert effective("page_first", "file", extra, extraArgs=["--dtype=float16"]) != first
    assert effective("page_first", "file", {})["file_storage_path"].startswith("/tmp/hicache/kv-pl-")
    tag = effective("page_first", "mooncake", {"extra_backend_tag": "blue", "master_server_address": "m:1"})
    assert tag["extra_backend_tag"] == f"blue_kv-pl-auto-p{PAGE}-tp1"
    assert effective("page_first_direct", "mooncake", {"master_server_address": "m:1"})["extra_backend_tag"] == \
        f"kv-lp-auto-p{PAGE}-tp1"
    # what each engine is started with carries the same config as the swap target
    s = spec("page_first", "file", extra)
    args = render.args(s, None)
    assert args[args.index("--hicache-storage-backend-extra-config") + 1] == \
        '{"file_storage_path":"%s/kv-pl-auto-p%d-tp1"}' % (tmp_path, PAGE)
    owner = render.Owner(name="f", namespace="default", uid="u")
    assert str(tmp_path / f"kv-pl-auto-p{PAGE}-tp1") in render.configmap(s, owner)["data"]["extra_config.json"]


# --------------------------------------------------------------------------- the file backend

def test_bundled_fleet_misses_its_old_pages_after_a_layout_change(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    before = Case("file", "page_first", False, 0, 1, None, None, 901)
    after = dataclasses.replace(before, layout="layer_first")
    extra = {"file_storage_path": str(tmp_path)}
    old = create_storage_backend("file", before.storage_config(effective("page_first", "file", extra, "bundled")))
    assert runtime_write(before, old)
    new = create_storage_backend("file", after.storage_config(effective("layer_first", "file", extra, "bundled")))
    assert runtime_read(after, new, runtime_keys(after)) == 0
    # the hazard the namespace removes: the same pages read in the other layout are wrong KV
    same_dir = create_storage_backend("file", after.storage_config(effective("page_first", "file", extra, "bundled")))
    assert not _kv_equal(after, runtime_read(after, same_dir, runtime_keys(after)))


@needs_oracle
def test_sglang_file_pages_miss_after_a_layout_change_and_still_interoperate(tmp_path, monkeypatch):
    """SGLang's HiCacheFile writes page_first pages under the rendered config; pods restarted with
    layer_first (SGLang's or the runtime's) miss them, a runtime pod of the old format reads them."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    before = Case("file", "page_first", False, 0, 1, None, None, 902)
    after = dataclasses.replace(before, layout="layer_first")
    extra = {"file_storage_path": str(tmp_path)}
    dir_before = effective("page_first", "file", extra)["file_storage_path"]
    dir_after = effective("layer_first", "file", extra)["file_storage_path"]

    def sglang(case_dir: str, **request) -> dict:
        return sglang_oracle.run(VERSION, SGLANG_SIDE, sglang_request(**request),
                                 env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": case_dir})

    written = sglang(dir_before, write=[before.for_sglang()])["written"][0]
    assert written["ok"] and written["keys"] == runtime_keys(before)
    read_after = sglang(dir_after, read=[after.for_sglang((None, "x"))])["read"][0]
    assert read_after["hits"] == 0, "a restarted SGLang pod read the old layout's pages"

    runtime_after = create_storage_backend("file", after.storage_config(
        effective("layer_first", "file", extra, "bundled")))
    assert runtime_read(after, runtime_after, runtime_keys(after)) == 0
    runtime_before = create_storage_backend("file", before.storage_config(
        effective("page_first", "file", extra, "bundled")))
    assert _kv_equal(before, runtime_read(before, runtime_before, runtime_keys(before)))


# --------------------------------------------------------------------------- Mooncake

@needs_oracle
def test_mooncake_io_backend_flip_is_a_miss_for_both_engines(mooncake_master):
    """ioBackend kernel -> direct moves a Mooncake fleet from page_first to page_first_direct."""
    before = Case("mooncake", "page_first", False, 0, 1, None, None, 903)
    after = dataclasses.replace(before, layout="page_first_direct")
    user = {"master_server_address": mooncake_master.address}
    tag_before = effective("page_first", "mooncake", user)["extra_backend_tag"]
    tag_after = effective("page_first_direct", "mooncake", user)["extra_backend_tag"]
    sglang_mooncake = {"master_server_address": mooncake_master.address, "local_hostname": "127.0.0.1",
                       "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "global_segment_size": 0}
    backends = []

    def runtime(case: Case, tag: str):
        b = create_storage_backend("mooncake", case.storage_config(
            mooncake_master.extra_config(extra_backend_tag=tag)))
        backends.append(b)
        return b

    try:
        # the runtime lends the store its memory; SGLang's clients lend none
        old_runtime = runtime(before, tag_before)
        answer = sglang_oracle.run(VERSION, SGLANG_SIDE, sglang_request(
            mooncake=dict(sglang_mooncake, extra_backend_tag=tag_before), write=[before.for_sglang()]),
            env=CLIENT_ENV)
        assert answer["written"][0]["ok"], answer["written"][0]
        assert runtime_read(after, runtime(after, tag_after), runtime_keys(after)) == 0
        assert _kv_equal(before, runtime_read(before, old_runtime, runtime_keys(before)))
        read_after = sglang_oracle.run(VERSION, SGLANG_SIDE, sglang_request(
            mooncake=dict(sglang_mooncake, extra_backend_tag=tag_after), read=[after.for_sglang((None, "x"))]),
            env=CLIENT_ENV)["read"][0]
        assert read_after["hits"] == 0, "a restarted SGLang pod read the other layout's pages"
        # and the runtime's own pages: written before, a miss after
        mine = dataclasses.replace(before, seed=904)
        assert runtime_write(mine, old_runtime)
        assert runtime_read(dataclasses.replace(mine, layout="page_first_direct"), backends[1],
                            runtime_keys(mine)) == 0
    finally:
        for b in backends:
            b.close()
