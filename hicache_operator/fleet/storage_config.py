"""The L3 storage configuration a pod should run with, and how it compares to
what a runtime reports.

A rollout decides "does this pod need a swap?" and "did the swap take?" by
comparing the target with the runtime's own answer to
``GET /hicache/storage-backend`` — never with what the operator believes it
sent — so both sides are normalised here in one place.

Hostnames: a Mooncake client must register under its OWN node's address
(SGLang issue #23457: one broadcast ``local_hostname`` pointed every rank at
the same host). Each pod gets ``MOONCAKE_LOCAL_HOSTNAME`` from the downward
API, so a target carrying ``local_hostname`` is refused, and a hostname that a
runtime reports (e.g. from its command line) is ignored when comparing and
stripped before it could ever be sent back in a rollback.

Page namespaces: :func:`with_page_namespace` puts a fleet's L3 pages under a
name that says their byte format (:func:`page_namespace`),
through what both engines read: the file backend's ``file_storage_path``
gets a sub-directory, Mooncake's ``extra_backend_tag`` a suffix (a tag the
user set stays in front). A fleet whose layout, dtype, page size or split
changes then finds none of the old pages instead of reading them as wrong KV.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

#: Backends a target may name (the operator's CRD enum). A pod may report
#: others (an SGLang pod started by hand with ``hf3fs``); those are accepted
#: as a *previous* config so a rollback can restore them.
TARGET_BACKENDS = ("none", "file", "mooncake", "dynamic")
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
WritePolicy = Literal["write_back", "write_through", "write_through_selective"]

#: Keys that name the node a client registers as. Matched case-insensitively
#: at any depth of extra_config.
HOSTNAME_KEYS = frozenset({"local_hostname"})

_MESSAGE_LIMIT = 300

#: Where both engines' file backend puts pages when nothing names a directory.
FILE_DEFAULT_DIR = "/tmp/hicache"


def hostname_paths(value: Any, path: str = "") -> list[str]:
    """Where ``value`` names a hostname (a key of ``HOSTNAME_KEYS``, at any depth)."""
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if str(key).lower() in HOSTNAME_KEYS:
                found.append(where)
            found.extend(hostname_paths(item, where))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found.extend(hostname_paths(item, f"{path}[{i}]"))
    return found


def without_hostnames(value: Any) -> Any:
    """``value`` with every hostname key removed, at any depth."""
    if isinstance(value, Mapping):
        return {
            k: without_hostnames(v) for k, v in value.items() if str(k).lower() not in HOSTNAME_KEYS
        }
    if isinstance(value, list):
        return [without_hostnames(v) for v in value]
    return value


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


class StorageConfig(BaseModel):
    """One L3 configuration. ``backend="none"`` means "no L3 attached"; its
    policies and extra_config are then meaningless (a detached runtime cannot
    take policies: they only travel with an attach) and are ignored.

    A policy of ``None`` means "whatever the runtime has" (older SGLang status
    responses omit policies, so a config restored from one has none). Keys
    may be snake_case or camelCase (``render.storage_config`` uses the CRD's)."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)

    backend: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")
    prefetch_policy: PrefetchPolicy | None = "best_effort"
    write_policy: WritePolicy | None = "write_through"
    extra_config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("extra_config")
    @classmethod
    def _plain_json_without_hostname(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            _canonical_json(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"extra_config must be plain JSON (objects, lists, strings, finite numbers): {exc}") from None
        paths = hostname_paths(value)
        if paths:
            raise ValueError(
                f"extra_config must not carry a hostname ({', '.join(paths)}): each pod registers as its own node "
                "via MOONCAKE_LOCAL_HOSTNAME, which the operator sets from the downward API; remove the key"
            )
        return value

    @property
    def attached(self) -> bool:
        return self.backend != "none"

    def canonical(self) -> dict[str, Any]:
        """The comparable form: what matters for this backend, nothing else."""
        if not self.attached:
            return {"backend": "none"}
        return {
            "backend": self.backend,
            "prefetch_policy": self.prefetch_policy,
            "write_policy": self.write_policy,
            "extra_config": json.loads(_canonical_json(self.extra_config)),
        }

    def describe(self) -> str:
        if not self.attached:
            return "none"
        parts = [f"prefetch={self.prefetch_policy or '?'}", f"write={self.write_policy or '?'}"]
        if self.extra_config:
            parts.append(f"extra={_canonical_json(self.extra_config)}")
        return clip_message(f"{self.backend} ({', '.join(parts)})")


# Page byte order of each host layout (the runtime's ``HostPool.page_view``, SGLang's
# ``get_data_page``): layer_first and page_first_direct flatten a page as (2, layers, tokens,
# heads, dim), page_first as (2, tokens, layers, heads, dim).
_PAGE_ORDER = {"layer_first": "lp", "page_first_direct": "lp", "page_first": "pl"}


def page_namespace(mem_layout: str, kv_dtype: str, page_size: int, tp_size: int, pp_size: int = 1,
                   attn_dp_size: int = 1) -> str:
    """Name of the L3 namespace whose pages share one byte format, e.g. ``kv-lp-bfloat16-p16-tp2``.

    Everything that changes what a page's bytes mean and that neither engine puts in its file
    names or Mooncake keys by itself: the host layout's byte order, the KV dtype, the page size,
    the tensor / pipeline / attention-DP split (Mooncake keys carry a rank, not the sizes). Two
    configurations share a namespace only if their pages are byte-compatible."""
    if mem_layout not in _PAGE_ORDER:
        raise ValueError(f"unknown host layout {mem_layout!r}; known: {', '.join(_PAGE_ORDER)}")
    if not kv_dtype or not all(c.isalnum() or c == "_" for c in kv_dtype):
        raise ValueError(f"kv dtype must be a plain name, got {kv_dtype!r}")
    for what, n in (("page_size", page_size), ("tp_size", tp_size), ("pp_size", pp_size),
                    ("attn_dp_size", attn_dp_size)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be a positive integer, got {n!r}")
    name = f"kv-{_PAGE_ORDER[mem_layout]}-{kv_dtype}-p{page_size}-tp{tp_size}"
    if pp_size > 1:
        name += f"-pp{pp_size}"
    if attn_dp_size > 1:
        name += f"-dp{attn_dp_size}"
    return name


def with_page_namespace(backend: str, extra_config: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """``extra_config`` with the page namespace applied for ``backend`` (file, mooncake); other
    backends' keys are their own, so their config is returned unchanged."""
    extra = dict(extra_config)
    if backend == "file":
        base = str(extra.get("file_storage_path") or FILE_DEFAULT_DIR).rstrip("/") or "/"
        extra["file_storage_path"] = f"{base.rstrip('/')}/{namespace}"
    elif backend == "mooncake":
        tag = extra.get("extra_backend_tag")
        extra["extra_backend_tag"] = namespace if tag is None else f"{tag}_{namespace}"
    return extra


def as_storage_config(cfg: StorageConfig | Mapping[str, Any]) -> StorageConfig:
    return cfg if isinstance(cfg, StorageConfig) else StorageConfig.model_validate(dict(cfg))


def as_target(cfg: StorageConfig | Mapping[str, Any]) -> StorageConfig:
    """A config a rollout may aim at: one of the CRD's backends."""
    config = as_storage_config(cfg)
    if config.backend not in TARGET_BACKENDS:
        raise ValueError(f"target backend {config.backend!r} is not one of {', '.join(TARGET_BACKENDS)}")
    return config


def storage_fingerprint(cfg: StorageConfig | Mapping[str, Any]) -> str:
    """Stable id of a config: equal iff the canonical forms are equal, so key
    order, and the policies of ``none``, never start a rollout."""
    digest = hashlib.sha256(_canonical_json(as_storage_config(cfg).canonical()).encode()).hexdigest()
    return digest[:16]


def attach_payload(cfg: StorageConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Body of SGLang's ``PUT /hicache/storage-backend``
    (``AttachHiCacheStorageReqInput``). The extra config travels as a JSON
    *string*; prefetch knobs (``prefetch_threshold`` …) ride inside it."""
    config = as_storage_config(cfg)
    if not config.attached:
        raise ValueError("backend 'none' has no attach payload: a pod reaches it by detaching")
    payload: dict[str, Any] = {
        "hicache_storage_backend": config.backend,
        "hicache_storage_backend_extra_config_json": _canonical_json(config.extra_config),
    }
    if config.prefetch_policy is not None:
        payload["hicache_storage_prefetch_policy"] = config.prefetch_policy
    if config.write_policy is not None:
        payload["hicache_write_policy"] = config.write_policy
    return payload


class ReportedBackend(BaseModel):
    """A runtime's answer to ``GET /hicache/storage-backend``.

    ``extra_config_unreadable`` marks a reported extra config that is not a
    JSON object (e.g. ``@/path/file.json`` when the flag pointed at a file):
    such a pod cannot be shown to match any target, so it is swapped once,
    after which it reports the JSON it was given. ``start_failure``: with no
    backend attached, why the one on the runtime's command line could not be
    attached when it started (the bundled runtime's ``hicache_storage_degraded``;
    it then serves from L1+L2)."""

    model_config = ConfigDict(frozen=True)

    backend: str | None
    extra_config: dict[str, Any] | None = None
    extra_config_unreadable: bool = False
    prefetch_policy: str | None = None
    write_policy: str | None = None
    start_failure: str | None = None

    @classmethod
    def from_response(cls, body: Any) -> ReportedBackend:
        if not isinstance(body, Mapping):
            raise ValueError(f"storage-backend status must be a JSON object, got {type(body).__name__}")
        backend = body.get("hicache_storage_backend")
        if backend is not None and not isinstance(backend, str):
            raise ValueError(f"hicache_storage_backend must be a string or null, got {backend!r}")
        raw = body.get("hicache_storage_backend_extra_config")
        extra: dict[str, Any] | None = None
        unreadable = False
        if isinstance(raw, Mapping):
            extra = dict(raw)
        elif isinstance(raw, str) and raw.strip():
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                extra = parsed
            else:
                unreadable = True
        elif raw not in (None, ""):
            unreadable = True
        policies = {}
        for field, key in (("prefetch_policy", "hicache_storage_prefetch_policy"), ("write_policy", "hicache_write_policy")):
            value = body.get(key)
            policies[field] = value if isinstance(value, str) and value else None
        degraded = body.get("hicache_storage_degraded")
        start_failure = clip_message(degraded) if not backend and isinstance(degraded, str) and degraded else None
        return cls(backend=backend or None, extra_config=extra, extra_config_unreadable=unreadable,
                   start_failure=start_failure, **policies)

    def comparable_extra(self) -> dict[str, Any] | None:
        if self.extra_config_unreadable:
            return None
        return without_hostnames(self.extra_config or {})

    def to_config(self) -> StorageConfig | None:
        """What to restore in a rollback; a hostname is dropped because the
        pod's environment supplies it. None when the report cannot be
        re-sent faithfully."""
        if self.backend is None:
            return StorageConfig(backend="none")
        extra = self.comparable_extra()
        if extra is None:
            return None
        try:
            return StorageConfig(
                backend=self.backend,
                prefetch_policy=self.prefetch_policy,
                write_policy=self.write_policy,
                extra_config=extra,
            )
        except ValueError:
            return None

    def describe(self) -> str:
        if self.backend is None:
            return "none"
        extra = "<unreadable>" if self.extra_config_unreadable else _canonical_json(self.comparable_extra() or {})
        return clip_message(
            f"{self.backend} (prefetch={self.prefetch_policy or '?'}, write={self.write_policy or '?'}, extra={extra})"
        )


def config_matches(reported: ReportedBackend, want: StorageConfig) -> bool:
    """Does the runtime run ``want``? A policy the runtime does not report,
    or that ``want`` leaves open, is not compared."""
    if not want.attached:
        return reported.backend is None
    if reported.backend != want.backend or not same_extra(reported, want):
        return False
    for mine, theirs in ((want.prefetch_policy, reported.prefetch_policy), (want.write_policy, reported.write_policy)):
        if mine is not None and theirs is not None and mine != theirs:
            return False
    return True


def same_extra(reported: ReportedBackend, want: StorageConfig) -> bool:
    extra = reported.comparable_extra()
    return extra is not None and extra == want.extra_config  # 256 == 256.0: a JSON echo may retype numbers


def updatable_in_place(reported: ReportedBackend, want: StorageConfig) -> bool:
    """SGLang's attach on an already-attached backend of the same name only
    updates the policies (the extra config is kept), so anything else needs a
    detach first."""
    return want.attached and reported.backend == want.backend and same_extra(reported, want)


def clip_message(text: str) -> str:
    return text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 1] + "…"

