import json

import pytest

from cache_runtime.storage.mooncake_config import load_mooncake_config, parse_segment_size


def test_extra_config_wins_over_file_and_env(tmp_path):
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"master_server_address": "file-host:1"}))
    env = {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_MASTER": "env-host:2"}
    cfg = load_mooncake_config({"master_server_address": "extra-host:3", "protocol": "rdma"}, env)
    assert (cfg.master_server_address, cfg.protocol, cfg.source) == ("extra-host:3", "rdma", "extra_config")
    # fields the extra_config omits take defaults, not env values (SGLang)
    assert cfg.metadata_server == "P2PHANDSHAKE" and cfg.global_segment_size == 4 * 1024**3


def test_file_wins_over_env_when_extra_has_no_master(tmp_path):
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"master_server_address": "file-host:1", "global_segment_size": "2gb",
                                "local_hostname": "node-a"}))
    env = {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_MASTER": "env-host:2"}
    cfg = load_mooncake_config({"extra_backend_tag": "t"}, env)
    assert (cfg.master_server_address, cfg.global_segment_size, cfg.local_hostname) == ("file-host:1", 2 << 30, "node-a")


def test_env_config():
    env = {"MOONCAKE_MASTER": "m:50051", "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1048576",
           "MOONCAKE_TE_META_DATA_SERVER": "http://m:8080/metadata", "MOONCAKE_MASTER_METRICS_PORT": "9100"}
    cfg = load_mooncake_config(None, env)
    assert (cfg.endpoints, cfg.global_segment_size, cfg.metadata_server, cfg.master_metrics_port) == \
        ([("m", 50051)], 1 << 20, "http://m:8080/metadata", 9100)
    assert not cfg.through_etcd


def test_ha_masters_are_found_through_etcd():
    cfg = load_mooncake_config({"master_server_address": "etcd://etcd-0.etcd:2379;10.0.0.3:2379"}, {})
    assert cfg.through_etcd and cfg.endpoints == [("etcd-0.etcd", 2379), ("10.0.0.3", 2379)]
    assert cfg.local_hostname == "localhost"


@pytest.mark.parametrize("source", ["extra", "file", "env"])
def test_pod_hostname_from_env_always_wins(tmp_path, source):
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"master_server_address": "h:1", "local_hostname": "from-file"}))
    env = {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7", "LOCAL_HOSTNAME": "legacy", "MOONCAKE_MASTER": "h:1"}
    if source == "file":
        env["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"] = str(path)
    extra = {"master_server_address": "h:1", "local_hostname": "broadcast"} if source == "extra" else {}
    assert load_mooncake_config(extra, env).local_hostname == "10.0.0.7"
    del env["MOONCAKE_LOCAL_HOSTNAME"]
    assert load_mooncake_config(extra, env).local_hostname == "legacy"


@pytest.mark.parametrize("extra,message", [
    ({"master_server_address": "no-port"}, "host:port"),
    ({"master_server_address": "h:99999"}, "host:port"),
    ({"master_server_address": "h:1", "global_segment_size": "lots"}, "global_segment_size"),
    ({"master_server_address": "h:1", "check_server": "maybe"}, "check_server"),
    ({"master_server_address": "h:1", "master_metrics_port": "x"}, "master_metrics_port"),
    ({"master_server_address": "etcd://e:2379;e"}, "etcd://host:port"),
    ({"master_server_address": "etcd://e:2379", "check_server": True}, "check_server"),
])
def test_bad_values_are_rejected(extra, message):
    with pytest.raises(ValueError, match=message):
        load_mooncake_config(extra, {})


def test_unreadable_or_incomplete_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_mooncake_config({}, {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(tmp_path / "missing.json")})
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match="master_server_address is required"):
        load_mooncake_config({}, {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(tmp_path / "c.json")})


def test_parse_segment_size():
    assert parse_segment_size("4gb") == 4 << 30 and parse_segment_size(0) == 0 and parse_segment_size("123") == 123
    with pytest.raises(ValueError):
        parse_segment_size(-1)
