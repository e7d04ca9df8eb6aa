"""What each SGLang release offers the operator, read from the releases' own source (PyPI wheels).

A pod with ``engine: sglang`` runs one SGLang release, named by ``spec.engineVersion`` or the
image tag (``lmsysorg/sglang:v0.5.23-cu129`` -> 0.5.23). ``FEATURES`` gives, for each engine
feature the operator renders or relies on, the first release that has it; a release has a feature
iff it is at least that version (none disappears again up to NEWEST_CHECKED). Paths in the
evidence comments are relative to ``sglang/srt/`` in the wheel of the version named. Every other
flag and choice the operator renders (``--tp-size`` ... ``--enable-metrics``, ``--api-key``, the
write/IO/prefetch/backend choices incl. ``timeout`` and ``dynamic``) is in every 0.5.x release on
PyPI (0.5.1 is the first; there is no 0.5.0).

The operator swaps L3 backends live through the runtime attach/detach API, which only a server
started with ``--admin-api-key`` serves, so a release needs both (``REQUIRED``): 0.5.9 is the
oldest. ``tests/unit/sglang/test_feature_table.py`` checks the table against the installed
``ORACLE_VERSIONS`` (scripts/install-sglang.sh installs them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Feature:
    name: str
    min_version: str
    what: str


OLDEST_SUPPORTED = "0.5.9"
NEWEST_CHECKED = "0.5.23"
# Installed for the tests (scripts/install-sglang.sh): the window's ends, and 0.5.21, the first
# release with the per-pod Mooncake hostname and the host headroom check (the Mooncake sample's).
ORACLE_VERSIONS = (OLDEST_SUPPORTED, "0.5.21", NEWEST_CHECKED)

_FEATURES = (
    # 0.5.8 server_args.py:3302; 0.5.9 server_args.py:3621; 0.5.23 arg_groups/fields/serving.py:164.
    Feature("admin_api_key", "0.5.8", "the --admin-api-key flag"),
    # 0.5.9 entrypoints/http_server.py:758 (PUT), :790 (DELETE), :817 (GET), all ADMIN_OPTIONAL;
    # 0.5.8 only has /clear_hicache_storage_backend (entrypoints/http_server.py:694).
    Feature("storage_attach_api", "0.5.9",
            "runtime attach/detach of the L3 backend (PUT/DELETE/GET /hicache/storage-backend)"),
    # 0.5.21 mem_cache/storage/mooncake_store/mooncake_store.py:110-126 (_resolve_local_hostname:
    # MOONCAKE_LOCAL_HOSTNAME, then LOCAL_HOSTNAME, then extra-config local_hostname), used by
    # load_from_extra_config at :230 (PR #29668, issue #23457). Up to 0.5.20 (e.g. 0.5.9 :194-196)
    # load_from_extra_config takes extra_config.get("local_hostname", "localhost") and ignores the env.
    Feature("mooncake_hostname_env_with_extra_config", "0.5.21",
            "Mooncake's local hostname from env MOONCAKE_LOCAL_HOSTNAME when the extra config is given"),
    # 0.5.22 arg_groups/fields/parallel.py:81 (attn_dp_size, alias --attention-data-parallel-size);
    # --enable-dp-attention kept as deprecated spelling (server_args.py:418, arg_groups/parallel_hook.py:39
    # turns --dp-size N --enable-dp-attention into attn_dp_size=N, dp_size=1). Before: --dp-size N
    # --enable-dp-attention (0.5.9 server_args.py:3706, :4570, :2109-2118).
    Feature("attn_dp_size_flag", "0.5.22",
            "--attn-dp-size (attention data parallelism inside the TP group)"),
    # 0.5.22 mem_cache/hicache_storage.py:388-393; 0.5.23 :730-736: env
    # SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else extra-config file_storage_path, else /tmp/hicache.
    # Up to 0.5.21 (0.5.9 :188-190): the env, else /tmp/hicache.
    Feature("file_storage_path_key", "0.5.22",
            "the file backend's directory from extra-config key file_storage_path"),
    # 0.5.21 mem_cache/host_memory.py:18-90 (cgroup memory.max/high - memory.current, or v1
    # limit - usage), :93; mem_cache/pool_host/base.py:29 (HICACHE_HOST_MEMORY_RESERVE_BYTES =
    # 10 GiB), :85-102 (free // ranks_per_host), :227 (ValueError "Not enough host memory available").
    # 0.5.19-0.5.20 pool_host/base.py:58-59: (psutil available - 10 GiB) // ranks, no cgroup.
    # Up to 0.5.18 (0.5.9 memory_pool_host.py:172-183): psutil available - 10 GiB per pool.
    Feature("host_pool_headroom_check", "0.5.21",
            "the host pool refuses more than (cgroup limit - usage - 10 GiB) / ranks on the host"),
    # 0.5.22 and 0.5.23 mem_cache/host_memory.py:93-123: usage less the cgroup's file LRU
    # (memory.stat active_file + inactive_file) unless a descendant sets memory.min. 0.5.21
    # host_memory.py:80-82, :93-94: memory.current as is ("charged file cache is not assumed
    # reclaimable"), so the checkpoint the ranks just read counts against the host pools.
    Feature("host_headroom_page_cache_free", "0.5.22",
            "the host headroom check counts the cgroup's page cache as free (0.5.21 counts it as used)"),
    # /server_info and /get_server_info carry no auth_level (NORMAL: open unless --api-key is set,
    # utils/auth.py:143 in 0.5.9, :148 in 0.5.23) and return every server arg, admin_api_key included:
    # 0.5.8 entrypoints/http_server.py:571, :581, :594 (dataclasses.asdict); 0.5.23
    # entrypoints/http_server.py:853, :863, utils/common.py:3584-3593 (resolved_dict + launch_command).
    Feature("server_info_exposes_admin_key", "0.5.8",
            "/server_info and /get_server_info, open without --api-key, return admin_api_key"),
    # 0.5.2 server_args.py:1794.
    Feature("extra_config_flag", "0.5.2", "--hicache-storage-backend-extra-config"),
    # 0.5.3 server_args.py:2333 (0.5.2 :1775 offers layer_first, page_first only).
    Feature("page_first_direct_layout", "0.5.3", "--hicache-mem-layout page_first_direct"),
    # Defaults (the operator always renders both flags): 0.5.12 server_args.py:669 timeout (0.5.11
    # :597 best_effort); 0.5.14 server_args.py:1810 page_first (0.5.13 :694 layer_first);
    # 0.5.23 arg_groups/fields/memory.py:147, :176.
    Feature("default_prefetch_policy_timeout", "0.5.12",
            "--hicache-storage-prefetch-policy defaults to timeout (before: best_effort)"),
    Feature("default_mem_layout_page_first", "0.5.14",
            "--hicache-mem-layout defaults to page_first (before: layer_first)"),
)
FEATURES: dict[str, Feature] = {f.name: f for f in _FEATURES}

# What a release must have for the operator to manage it at all.
REQUIRED = ("admin_api_key", "storage_attach_api")

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?")
_TAG = re.compile(_VERSION.pattern + r"(?:-[A-Za-z0-9][A-Za-z0-9._-]*)?")


def parse_version(text: str) -> tuple[int, int, int, int]:
    """Sort key of a release: "0.5.6", "v0.5.6-cu129", "0.5.15.post1", "v0.5.23". A post release
    sorts after its base (the 4th item is 0 for the base, N+1 for .postN). Raises ValueError for
    anything else (pre-releases, dev builds, tags without a version)."""
    m = _TAG.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not an SGLang release version: {text!r}")
    major, minor, patch, post = m.groups()
    return int(major), int(minor), int(patch), 0 if post is None else int(post) + 1


def normalize(text: str) -> str:
    """Canonical spelling: "v0.5.15.post1-cu129" -> "0.5.15.post1"."""
    major, minor, patch, post = parse_version(text)
    return f"{major}.{minor}.{patch}" + (f".post{post - 1}" if post else "")


def version_from_image(image: str) -> str | None:
    """The release in an image reference's tag (``lmsysorg/sglang:v0.5.6-cu129`` -> "0.5.6"); None
    when the tag names none (latest, dev, nightly...), there is no tag, or the reference is
    pinned by digest (what runs is the digest, whatever the tag says)."""
    if not image or "@" in image:
        return None
    last = image.rsplit("/", 1)[-1]  # a registry's :port is never in the last component
    if ":" not in last:
        return None
    tag = last.split(":", 1)[1]
    try:
        return normalize(tag)
    except ValueError:
        return None


def _feature(feature: str | Feature) -> Feature:
    return feature if isinstance(feature, Feature) else FEATURES[feature]


def has(version: str, feature: str | Feature) -> bool:
    return parse_version(version) >= parse_version(_feature(feature).min_version)


def missing(version: str, features: Iterable[str | Feature]) -> list[Feature]:
    return [_feature(f) for f in features if not has(version, f)]


def supported(version: str) -> bool:
    return parse_version(version) >= parse_version(OLDEST_SUPPORTED)


def newer_than_checked(version: str) -> bool:
    """Past the newest release this table was read from (its post releases included): features
    are assumed to persist, flags and defaults may have moved."""
    return parse_version(version) > parse_version(NEWEST_CHECKED)


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def used_by(spec: dict) -> list[str]:
    """Features an sglang spec (a by-alias dict) needs from the release itself. Attention DP is
    left out: the renderer falls back to ``--enable-dp-attention --dp-size``. The Mooncake hostname
    has no fallback: a per-pod ``local_hostname`` in the extra config would make every pod's
    attach body and reported config differ, so releases before 0.5.21 are refused for Mooncake."""
    backend = _get(spec, "hicache.storage.backend") or "none"
    out = []
    if backend != "none":
        out.append("extra_config_flag")
    if backend == "file":
        out.append("file_storage_path_key")
    if backend == "mooncake":
        out.append("mooncake_hostname_env_with_extra_config")
    if _get(spec, "hicache.memLayout") == "page_first_direct":
        out.append("page_first_direct_layout")
    return out
