"""SGLang release versions: parsing, ordering, image tags, and the feature table's lookups."""
import pytest

from hicache_operator.plan.engine import versions as ev


@pytest.mark.parametrize("text,key", [
    ("0.5.6", (0, 5, 6, 0)),
    ("v0.5.6-cu129", (0, 5, 6, 0)),
    ("0.5.15.post1", (0, 5, 15, 2)),
    ("v0.5.15.post1-cu130-runtime", (0, 5, 15, 2)),
    ("v0.5.23", (0, 5, 23, 0)),
    ("0.5.6.post0", (0, 5, 6, 1)),
])
def test_parse_version(text, key):
    assert ev.parse_version(text) == key


@pytest.mark.parametrize("text", ["", "latest", "dev", "0.5", "0.5.x", "v0.5.10rc0-cu126", "0.5.6.dev1",
                                  "nightly-dev-20260107-dce8b060", "0.5.6-", "0.5.6.post", "v0.5.6 cu129"])
def test_parse_version_rejects(text):
    with pytest.raises(ValueError):
        ev.parse_version(text)


def test_order_is_numeric_and_post_after_base():
    ordered = ["0.5.1", "0.5.2", "0.5.9", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.15", "0.5.15.post1",
               "0.5.15.post2", "0.5.23", "0.6.0", "1.0.0"]
    assert sorted(ordered, key=ev.parse_version) == ordered
    assert sorted(reversed(ordered), key=ev.parse_version) == ordered


@pytest.mark.parametrize("text,canonical", [
    ("v0.5.6-cu129", "0.5.6"), ("0.5.15.post1", "0.5.15.post1"), ("v0.5.13.post1-cu130", "0.5.13.post1"),
])
def test_normalize(text, canonical):
    assert ev.normalize(text) == canonical


@pytest.mark.parametrize("image,version", [
    ("lmsysorg/sglang:v0.5.6-cu129", "0.5.6"),
    ("lmsysorg/sglang:v0.5.23", "0.5.23"),
    ("lmsysorg/sglang:v0.5.9-cu129-amd64-runtime", "0.5.9"),
    ("lmsysorg/sglang:v0.5.21-cu130", "0.5.21"),
    ("lmsysorg/sglang:v0.5.9-rocm700-mi35x", "0.5.9"),
    ("lmsysorg/sglang:v0.5.15.post1-cu129", "0.5.15.post1"),
    ("docker.io/lmsysorg/sglang:v0.5.20", "0.5.20"),
    ("registry.local:5000/team/sglang:v0.5.12-cu130", "0.5.12"),
    ("ghcr.io/lmsys/sglang:0.5.6", "0.5.6"),
    # no usable version
    ("lmsysorg/sglang", None),
    ("lmsysorg/sglang:latest", None),
    ("lmsysorg/sglang:latest-cu129", None),
    ("lmsysorg/sglang:dev", None),
    ("lmsysorg/sglang:dev-cu13", None),
    ("lmsysorg/sglang:nightly-dev-20260107-dce8b060", None),
    ("lmsysorg/sglang:v0.5.10rc0-rocm720-mi35x-20260412", None),
    ("registry.local:5000/lmsysorg/sglang", None),
    ("lmsysorg/sglang@sha256:" + "a" * 64, None),
    ("lmsysorg/sglang:v0.5.20-runtime@sha256:" + "0" * 64, None),
    ("registry.local/sglang:prod", None),
    ("", None),
])
def test_version_from_image(image, version):
    assert ev.version_from_image(image) == version


def test_oracle_versions_and_window():
    assert (ev.ORACLE_VERSIONS[0], ev.ORACLE_VERSIONS[-1]) == (ev.OLDEST_SUPPORTED, ev.NEWEST_CHECKED)
    assert list(ev.ORACLE_VERSIONS) == sorted(ev.ORACLE_VERSIONS, key=ev.parse_version)
    assert ev.parse_version(ev.OLDEST_SUPPORTED) <= ev.parse_version(ev.NEWEST_CHECKED)


def test_table_is_consistent():
    for name, f in ev.FEATURES.items():
        assert f.name == name and f.what
        ev.parse_version(f.min_version)
        assert ev.parse_version(f.min_version) <= ev.parse_version(ev.NEWEST_CHECKED), name
    # the oldest supported release is exactly the first with everything REQUIRED
    assert ev.OLDEST_SUPPORTED == max((ev.FEATURES[n].min_version for n in ev.REQUIRED), key=ev.parse_version)


def test_has_and_missing():
    assert ev.has("0.5.9", "storage_attach_api")
    assert not ev.has("0.5.8.post1", "storage_attach_api")
    assert ev.has("v0.5.8-cu129", "admin_api_key")
    assert not ev.has("0.5.20", "mooncake_hostname_env_with_extra_config")
    assert ev.has("0.5.21", "mooncake_hostname_env_with_extra_config")
    assert ev.has("0.5.21.post1", ev.FEATURES["host_pool_headroom_check"])
    assert [f.name for f in ev.missing("0.5.8", ev.REQUIRED)] == ["storage_attach_api"]
    assert ev.missing(ev.NEWEST_CHECKED, ev.FEATURES) == []
    assert {f.name for f in ev.missing("0.5.9", ev.FEATURES)} == {
        "mooncake_hostname_env_with_extra_config", "attn_dp_size_flag", "file_storage_path_key",
        "host_pool_headroom_check", "host_headroom_page_cache_free", "default_prefetch_policy_timeout",
        "default_mem_layout_page_first"}
    with pytest.raises(KeyError):
        ev.has("0.5.9", "no_such_feature")


def test_supported_and_unchecked():
    assert not ev.supported("0.5.8.post1")
    assert ev.supported("0.5.9") and ev.supported("0.5.9.post1") and ev.supported("0.5.23")
    assert ev.supported("0.6.0")
    assert not ev.newer_than_checked("0.5.23") and not ev.newer_than_checked("0.5.9")
    assert ev.newer_than_checked("0.5.23.post1") and ev.newer_than_checked("0.5.24")


def test_used_by():
    assert ev.used_by({"hicache": {"storage": {"backend": "none"}}}) == []
    assert ev.used_by({}) == []
    assert set(ev.used_by({"hicache": {"storage": {"backend": "file"}}})) == {"extra_config_flag",
                                                                              "file_storage_path_key"}
    assert "mooncake_hostname_env_with_extra_config" in ev.used_by(
        {"hicache": {"memLayout": "page_first_direct", "storage": {"backend": "mooncake"}}})
    assert "page_first_direct_layout" in ev.used_by({"hicache": {"memLayout": "page_first_direct"}})
    assert "attn_dp_size_flag" not in ev.used_by({"parallelism": {"tp": 4, "dp": 2}})
