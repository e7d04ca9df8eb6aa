"""Target configs, fingerprints, attach payloads and matching a runtime's report."""

from __future__ import annotations

import json

import pytest

from hicache_operator.fleet.storage_config import ReportedBackend, StorageConfig, attach_payload, config_matches, storage_fingerprint
from hicache_operator.fleet.storage_config import as_target, updatable_in_place

MOONCAKE = {
    "backend": "mooncake",
    "prefetch_policy": "timeout",
    "write_policy": "write_through",
    "extra_config": {"master_server_address": "master:50051", "protocol": "tcp", "prefetch_threshold": 256},
}


def report(backend, extra=None, prefetch="best_effort", write="write_through", *, extra_as_string=True):
    return ReportedBackend.from_response({
        "hicache_storage_backend": backend,
        "hicache_storage_backend_extra_config": json.dumps(extra) if extra_as_string and extra is not None else extra,
        "hicache_storage_prefetch_policy": prefetch,
        "hicache_write_policy": write,
    })


def test_attach_payload_is_sglangs_body_with_extra_config_as_a_json_string():
    payload = attach_payload(MOONCAKE)
    assert payload == {
        "hicache_storage_backend": "mooncake",
        "hicache_storage_backend_extra_config_json": payload["hicache_storage_backend_extra_config_json"],
        "hicache_storage_prefetch_policy": "timeout",
        "hicache_write_policy": "write_through",
    }
    assert isinstance(payload["hicache_storage_backend_extra_config_json"], str)
    assert json.loads(payload["hicache_storage_backend_extra_config_json"]) == MOONCAKE["extra_config"]


def test_attach_payload_omits_policies_left_open():
    payload = attach_payload({"backend": "file", "prefetch_policy": None, "write_policy": None})
    assert payload == {"hicache_storage_backend": "file", "hicache_storage_backend_extra_config_json": "{}"}


def test_no_attach_payload_for_none():
    with pytest.raises(ValueError, match="detach"):
        attach_payload({"backend": "none"})


@pytest.mark.parametrize("extra", [
    {"local_hostname": "10.0.0.1"},
    {"LOCAL_HOSTNAME": "node-a"},
    {"master_server_address": "m:1", "nested": {"Local_Hostname": "x"}},
    {"list": [{"local_hostname": "x"}]},
])
def test_a_target_carrying_a_hostname_is_refused_with_advice(extra):
    with pytest.raises(ValueError, match="MOONCAKE_LOCAL_HOSTNAME"):
        attach_payload({**MOONCAKE, "extra_config": extra})
    with pytest.raises(ValueError, match="hostname"):
        storage_fingerprint({**MOONCAKE, "extra_config": extra})


@pytest.mark.parametrize("bad, match", [
    ({**MOONCAKE, "extra_config": {"x": float("nan")}}, "plain JSON"),
    ({**MOONCAKE, "extra_config": {"x": object()}}, "plain JSON"),
    ({**MOONCAKE, "prefetch_policy": "eager"}, "prefetch_policy"),
    ({**MOONCAKE, "write_policy": "write_around"}, "write_policy"),
    ({**MOONCAKE, "unknown": 1}, "unknown"),
    ({"backend": "Mooncake!"}, "backend"),
    ({}, "backend"),
])
def test_bad_configs_get_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        StorageConfig.model_validate(bad)


def test_targets_are_limited_to_the_crd_backends():
    for backend in ("none", "file", "mooncake", "dynamic"):
        as_target({"backend": backend})
    with pytest.raises(ValueError, match="hf3fs.*none, file, mooncake, dynamic"):
        as_target({"backend": "hf3fs"})


def test_fingerprint_is_independent_of_key_order():
    reordered = {
        "extra_config": dict(reversed(list(MOONCAKE["extra_config"].items()))),
        "write_policy": "write_through",
        "prefetch_policy": "timeout",
        "backend": "mooncake",
    }
    assert storage_fingerprint(reordered) == storage_fingerprint(MOONCAKE)
    assert storage_fingerprint(StorageConfig.model_validate(MOONCAKE)) == storage_fingerprint(MOONCAKE)


@pytest.mark.parametrize("change", [
    {"backend": "file"},
    {"prefetch_policy": "best_effort"},
    {"write_policy": "write_through_selective"},
    {"extra_config": {"master_server_address": "master:50051", "protocol": "rdma", "prefetch_threshold": 256}},
])
def test_fingerprint_changes_with_anything_that_matters(change):
    assert storage_fingerprint({**MOONCAKE, **change}) != storage_fingerprint(MOONCAKE)


def test_camel_case_keys_from_the_crd_are_the_same_config():
    camel = {"backend": "mooncake", "prefetchPolicy": "timeout", "writePolicy": "write_through",
             "extraConfig": MOONCAKE["extra_config"]}
    assert storage_fingerprint(camel) == storage_fingerprint(MOONCAKE)
    assert attach_payload(camel) == attach_payload(MOONCAKE)


def test_policies_of_none_do_not_matter():
    a = {"backend": "none", "prefetch_policy": "timeout", "write_policy": "write_back", "extra_config": {"a": 1}}
    assert storage_fingerprint(a) == storage_fingerprint({"backend": "none"})


def test_report_parses_sglang_status_with_extra_config_string():
    reported = report("mooncake", MOONCAKE["extra_config"], "timeout")
    assert reported.backend == "mooncake"
    assert reported.extra_config == MOONCAKE["extra_config"]
    assert config_matches(reported, StorageConfig.model_validate(MOONCAKE))


def test_report_accepts_extra_config_as_an_object_too():
    reported = report("mooncake", MOONCAKE["extra_config"], "timeout", extra_as_string=False)
    assert config_matches(reported, StorageConfig.model_validate(MOONCAKE))


def test_report_of_older_sglang_without_policies_matches_on_backend_and_extra():
    reported = ReportedBackend.from_response({
        "hicache_storage_backend": "mooncake",
        "hicache_storage_backend_extra_config": json.dumps(MOONCAKE["extra_config"]),
    })
    assert reported.prefetch_policy is None
    assert config_matches(reported, StorageConfig.model_validate(MOONCAKE))


@pytest.mark.parametrize("body", [None, [], "mooncake", {"hicache_storage_backend": 3}])
def test_report_that_is_not_a_status_object_is_an_error(body):
    with pytest.raises(ValueError):
        ReportedBackend.from_response(body)


@pytest.mark.parametrize("extra", ["@/etc/hicache/extra.json", "[1, 2]", "{not json", 5])
def test_unreadable_reported_extra_config_never_matches_and_cannot_be_restored(extra):
    reported = ReportedBackend.from_response({"hicache_storage_backend": "file",
                                              "hicache_storage_backend_extra_config": extra})
    assert reported.extra_config_unreadable
    assert not config_matches(reported, StorageConfig(backend="file", extra_config={}))
    assert reported.to_config() is None


def test_reported_hostname_is_ignored_when_comparing_and_stripped_before_restoring():
    extra = {**MOONCAKE["extra_config"], "local_hostname": "10.1.2.3"}
    reported = report("mooncake", extra, "timeout")
    assert config_matches(reported, StorageConfig.model_validate(MOONCAKE))
    restored = reported.to_config()
    assert "local_hostname" not in restored.extra_config
    assert "10.1.2.3" not in json.dumps(attach_payload(restored))


@pytest.mark.parametrize("reported, target, expected", [
    (report(None), {"backend": "none"}, True),
    (report(None), {"backend": "file"}, False),
    (report("file", {}), {"backend": "none"}, False),
    (report("file", {}), {"backend": "file"}, True),
    (report("file", None), {"backend": "file"}, True),  # no extra reported == {}
    (report("file", {}), {"backend": "mooncake"}, False),
    (report("file", {}, "timeout"), {"backend": "file"}, False),
    (report("file", {}, "timeout"), {"backend": "file", "prefetch_policy": None}, True),
    (report("file", {}, write="write_back"), {"backend": "file"}, False),
    (report("file", {"a": 1}), {"backend": "file"}, False),
    (report("file", {"a": 1}), {"backend": "file", "extra_config": {"a": 1.0}}, True),
])
def test_config_matches(reported, target, expected):
    assert config_matches(reported, StorageConfig.model_validate(target)) is expected


@pytest.mark.parametrize("reported, target, expected", [
    (report("file", {}), {"backend": "file", "write_policy": "write_through_selective"}, True),
    (report("file", {}), {"backend": "file", "extra_config": {"prefetch_threshold": 64}}, False),
    (report("file", {}), {"backend": "mooncake"}, False),
    (report(None), {"backend": "file"}, False),
    (report("file", {}), {"backend": "none"}, False),
])
def test_same_backend_and_extra_can_be_updated_without_detach(reported, target, expected):
    assert updatable_in_place(reported, StorageConfig.model_validate(target)) is expected
