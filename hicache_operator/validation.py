"""Validation and normalisation of a HiCacheDeployment spec.

``validate`` is the one entry point the handlers (and tests) use: it parses the spec, collects
every error (never stops at the first), applies the normalisations SGLang would otherwise do
silently at boot, and sizes the host pool. Each finding names its rule (see ``rules``) so the
handler can put it in ``status.effectiveConfig`` and a Warning Event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils.quantity import parse_quantity
from pydantic import ValidationError

from hicache_operator import flags, sizing
from hicache_operator.rules import rule
from hicache_operator.spec import HiCacheDeploymentSpec

DYNAMIC_REQUIRED = ("backend_name", "module_path", "class_name")
MOONCAKE_DEFAULTS = {"protocol": "tcp", "metadata_server": "P2PHANDSHAKE"}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message}


def finding(name: str, **params: Any) -> Finding:
    r = rule(name)
    return Finding(name, r.severity, r.message.format(**params) if params else r.message)


@dataclass
class Outcome:
    spec: HiCacheDeploymentSpec | None  # the effective (normalised) spec; None when unparseable
    findings: list[Finding] = field(default_factory=list)
    sizing: dict[str, Any] | None = None

    def of(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity]

    @property
    def errors(self) -> list[Finding]:
        return self.of("error")

    @property
    def ok(self) -> bool:
        return self.spec is not None and not self.errors


def parse(raw: dict[str, Any]) -> tuple[HiCacheDeploymentSpec | None, list[Finding]]:
    try:
        return HiCacheDeploymentSpec.model_validate(raw or {}), []
    except ValidationError as exc:
        out = []
        for err in exc.errors(include_url=False):
            where = ".".join(str(p) for p in err["loc"]) or "spec"
            out.append(finding("schema", detail=f"spec.{where}: {err['msg']}"))
        return None, out


def check_static(spec: HiCacheDeploymentSpec, name: str | None = None) -> list[Finding]:
    """Rules decidable from the object alone (the CEL ones, plus those needing extraConfig)."""
    out: list[Finding] = []
    hc, pool, storage = spec.hicache, spec.hicache.host_pool, spec.hicache.storage
    if name is not None and len(name) > 52:
        out.append(finding("name-too-long"))
    modes = [pool.ratio, pool.size_gb_per_rank, pool.from_node_memory]
    if sum(m is not None for m in modes) != 1:
        out.append(finding("host-pool-mode"))
    if pool.ratio is not None and pool.ratio <= 1:
        out.append(finding("host-ratio"))
    if hc.write_policy == "write_back":
        out.append(finding("write-back-allowed" if hc.allow_write_back else "write-back-not-allowed"))
    if spec.parallelism.pp > 1 and storage.backend != "none":
        out.append(finding("pp-with-storage"))
    if spec.parallelism.tp % spec.parallelism.dp:
        out.append(finding("dp-divides-tp"))
    if spec.engine == "sglang" and spec.model.startswith("builtin:"):
        out.append(finding("builtin-model-needs-bundled"))
    if isinstance(spec.rollout.max_unavailable, str) and not re.fullmatch(r"\d+%", spec.rollout.max_unavailable):
        out.append(finding("max-unavailable", value=spec.rollout.max_unavailable))
    if storage.backend == "mooncake":
        master = (storage.mooncake.master_address if storage.mooncake else None)
        if not master and not storage.extra_config.get("master_server_address"):
            out.append(finding("mooncake-master-required"))
    if storage.backend == "dynamic":
        missing = [k for k in DYNAMIC_REQUIRED if not storage.extra_config.get(k)]
        if missing:
            out.append(finding("dynamic-backend-config", missing=", ".join(missing)))
    return out


def normalise(spec: HiCacheDeploymentSpec) -> tuple[HiCacheDeploymentSpec, list[Finding]]:
    """The effective spec and one finding per rewrite (in SGLang's order of _handle_hicache)."""
    d = spec.dump()
    hc = d["hicache"]
    st = hc["storage"]
    out: list[Finding] = []
    if hc["memLayout"] == "page_first_direct" and hc["ioBackend"] == "kernel":
        hc["ioBackend"] = "direct"
        out.append(finding("page-first-direct-kernel-io"))
    if st["backend"] == "mooncake" and hc["memLayout"] == "layer_first":
        hc["memLayout"] = "page_first" if hc["ioBackend"] == "kernel" else "page_first_direct"
        out.append(finding("mooncake-layer-first", layout=hc["memLayout"], io=hc["ioBackend"]))
    if hc["memLayout"] == "page_first" and hc["ioBackend"] == "direct":
        hc["memLayout"] = "page_first_direct"
        out.append(finding("page-first-direct-io"))

    extra = dict(st["extraConfig"] or {})
    if "local_hostname" in extra:
        del extra["local_hostname"]
        out.append(finding("extra-config-local-hostname"))
    if st["backend"] != "none":
        known = flags.KNOWN_EXTRA_CONFIG_KEYS[st["backend"]] | flags.PREFETCH_KNOBS
        for key in sorted(set(extra) - known):
            out.append(finding("extra-config-unknown-key", key=key, backend=st["backend"],
                               known=", ".join(sorted(flags.KNOWN_EXTRA_CONFIG_KEYS[st["backend"]]))))
    if st["backend"] == "mooncake":
        for fld, key, _env in flags.MOONCAKE_SETTINGS:
            ours = (st.get("mooncake") or {}).get(fld)
            if ours is None:
                continue
            if key in extra and extra[key] != ours:
                out.append(finding("mooncake-config-conflict", field=fld, ours=ours, key=key, theirs=extra[key]))
            else:
                extra[key] = ours
        for key, value in MOONCAKE_DEFAULTS.items():
            extra.setdefault(key, value)
    st["extraConfig"] = extra
    return HiCacheDeploymentSpec.model_validate(d), out


def check_memory_request(spec: HiCacheDeploymentSpec, record: dict[str, Any]) -> list[Finding]:
    need = record.get("podMemoryBytes")
    out = []
    for which in ("requests", "limits"):
        given = getattr(spec.resources, which).get("memory")
        if need and given is not None and int(parse_quantity(given)) < need:
            out.append(finding("memory-request-too-small", which=which, given=given,
                               needed=sizing.fmt_bytes(need)))
    return out


def validate(raw_spec: dict[str, Any], *, name: str | None = None, nodes: list[dict] | None = None,
             pinned_sizing: dict[str, Any] | None = None) -> Outcome:
    """Parse, check, normalise and size one spec.

    ``nodes``: the cluster's nodes as API dicts, or None when unknown (then node-dependent rules
    are skipped and fromNodeMemory is not sized). ``pinned_sizing``: the sizing record from the
    last status; reused while its inputs hash matches so node changes never re-size by themselves.
    """
    spec, findings = parse(raw_spec)
    if spec is None:
        return Outcome(None, findings)
    findings += check_static(spec, name)
    effective, notes = normalise(spec)
    findings += notes
    outcome = Outcome(effective, findings)
    if outcome.errors:
        return outcome
    if pinned_sizing and pinned_sizing.get("inputsHash") == sizing.inputs_hash(effective):
        outcome.sizing = pinned_sizing
    elif nodes is not None or effective.hicache.host_pool.from_node_memory is None:
        try:
            outcome.sizing = sizing.compute(effective, nodes)
        except sizing.SizingError as exc:
            findings.append(finding(exc.rule, **exc.params))
            return outcome
        if "ineligible" in outcome.sizing:
            findings.append(finding("no-eligible-nodes-yet", gpus=effective.ranks_per_pod,
                                    why=outcome.sizing["ineligible"]))
    if outcome.sizing:
        findings += check_memory_request(effective, outcome.sizing)
    return outcome
