"""Validation and normalisation of a HiCacheDeployment spec.

``validate`` parses the spec, collects every error (never stops at the first), applies the
normalisations SGLang would otherwise do silently at boot, and sizes the host pool; once the
pod is rendered, ``check_rendered`` reads what spec.podTemplate may not change from it. Each finding names its rule (see ``rules``) so the
handler can put it in ``status.effectiveConfig`` and a Warning Event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from hicache_operator.plan.engine import features as engine, cli as engine_cli, versions as engine_versions
from hicache_operator.api import flags
from hicache_operator.plan.model import source as model_source
from hicache_operator.plan import overlay, render, sizing
from hicache_operator.fleet.storage_config import FILE_DEFAULT_DIR, hostname_paths, without_hostnames
from hicache_operator.api.rules import OPERATOR_KEY_PREFIX, OPERATOR_LABEL_KEYS, rule
from hicache_operator.api.status import SizingRecord
from hicache_operator.api.spec import HiCacheDeploymentSpec, resolve_max_unavailable

DYNAMIC_REQUIRED = ("backend_name", "module_path", "class_name")
MOONCAKE_DEFAULTS = {"protocol": "tcp", "metadata_server": "P2PHANDSHAKE"}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    message: str


def finding(name: str, **params: Any) -> Finding:
    r = rule(name)
    return Finding(name, r.severity, r.message.format(**params) if params else r.message)


@dataclass
class Outcome:
    spec: HiCacheDeploymentSpec | None  # the effective (normalised) spec; None when unparseable
    findings: list[Finding] = field(default_factory=list)
    sizing: SizingRecord | None = None

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
    if name is not None and not DNS_LABEL.fullmatch(name):
        out.append(finding("name-not-dns-label"))
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
    if spec.engine == "bundled":
        if not (spec.model.startswith("/") or spec.model in BUNDLED_BUILTINS or spec.model_source is not None):
            out.append(finding("bundled-model-source"))
        if spec.parallelism.dp > 1 or spec.parallelism.pp > 1:
            out.append(finding("bundled-parallelism"))
    out += check_model_source(spec)
    try:
        resolve_max_unavailable(spec.rollout.max_unavailable, spec.replicas)
    except ValueError:
        out.append(finding("max-unavailable"))
    out += check_mooncake(spec)
    if storage.backend == "dynamic":
        missing = [k for k in DYNAMIC_REQUIRED if not storage.extra_config.get(k)]
        if missing:
            out.append(finding("dynamic-backend-config", missing=", ".join(missing)))
    if storage.backend == "file":
        out += check_file_storage(spec)
    meta = spec.pod_template.metadata
    if any(k in OPERATOR_LABEL_KEYS or k.startswith(OPERATOR_KEY_PREFIX) for k in meta.labels) or any(
            k.startswith(OPERATOR_KEY_PREFIX) for k in meta.annotations):
        out.append(finding("pod-template-metadata"))
    out += check_extra_args(spec)
    if spec.router_on and spec.router.policy == "cache_aware" and spec.router.replicas > 1:
        out.append(finding("router-cache-split", replicas=spec.router.replicas))
    if spec.engine == "sglang" and not spec.router_on:
        out.append(finding("clients-hold-pods-key"))
    return out + check_engine(spec)


def check_extra_args(spec: HiCacheDeploymentSpec) -> list[Finding]:
    """Flags the operator renders, (as the engine's own parser tells) flags the engine does not know,
    and flags (with values) SGLang's own resolution refuses beside the rendered command or that
    move the pod's ranks off its node or GPUs (``engine_cli.REFUSED_ARGS``)."""
    names = {"owned": "extra-args-owned-flag", "unknown": "extra-args-unknown-flag"}
    version = engine.version(spec)
    out = [finding(names[kind], flag=flag, why=why)
           for kind, flag, why in engine_cli.check(spec.extra_args, spec.engine, version)]
    return out + [finding("extra-args-refused", flag=flag, why=why)
                  for flag, why in engine_cli.refused(spec.extra_args, spec.engine, version)]


def check_env(spec: HiCacheDeploymentSpec, name: str | None) -> list[Finding]:
    """spec.env against the env vars the operator sets and those that override what it sets."""
    ours = {e["name"]: e for e in render.operator_env(spec, render.Owner(name or "<name>", "", ""))}
    out = [finding("env-owned", index=i, var=e.name, source=_env_source(ours[e.name]))
           for i, e in enumerate(spec.env) if e.name in ours]
    return out + [finding("env-engine-override", index=i, var=e.name, why=engine_cli.ENGINE_ENV[e.name])
                  for i, e in enumerate(spec.env) if e.name in engine_cli.ENGINE_ENV and e.name not in ours]


def check_page_size(spec: HiCacheDeploymentSpec, eligible: list[sizing.NodeInfo] | None) -> list[Finding]:
    """SGLang serves spec.pageSize as written on every GPU the pods may land on (``eligible``; None:
    the nodes were not read), since status, sizing and the L3 keys all use it: an error where it
    would be rewritten, a warning where it may be (the GPU kind or the model's attention is unknown)."""
    given, release = spec.page_size, engine.version(spec)
    if release is None:
        return []
    every = engine.page_outcomes(spec, None)
    if every and all(o.size == every[0].size != given for o in every):  # whatever the GPU
        o = every[0]
        return [finding("page-size-rewritten", version=release, given=given, served=o.size, backend=o.backend,
                        where="on any GPU")]
    if eligible is None:
        return []
    nodes = {}
    for node in eligible:
        nodes.setdefault(engine.gpu_kind(node.labels), node.name)
    for kind, node in nodes.items():
        outcomes = engine.page_outcomes(spec, kind)
        if kind is not None and outcomes and all(o.size == outcomes[0].size != given for o in outcomes):
            return [finding("page-size-rewritten", version=release, given=given, served=outcomes[0].size,
                            backend=outcomes[0].backend, where=f"on the {engine.GPU_NAMES.get(kind, f'SM{kind}x')} "
                            f"GPUs of node {node}")]
    for kind, node in nodes.items():
        rewritten = [o for o in engine.page_outcomes(spec, kind) if o.size != given]
        if rewritten:
            o = rewritten[0]
            why = (f"node {node} does not say its GPU kind (label {engine.GPU_PRODUCT_LABEL} or "
                   f"{engine.GPU_COMPUTE_MAJOR_LABEL})" if kind is None else
                   f"the attention SGLang picks for {spec.model} on node {node} is not known here")
            return [finding("page-size-may-be-rewritten", version=release, given=given, served=o.size,
                            gpu=engine.GPU_NAMES.get(o.gpu, f"SM{o.gpu}x"), backend=o.backend, why=why,
                            safe=engine.safe_page_size(spec) or "a size every backend keeps")]
    return []


def check_rendered(spec: HiCacheDeploymentSpec, rendered: render.Rendered) -> list[Finding]:
    """spec.podTemplate against the pod the operator rendered (what it may not change is read from it)."""
    return [finding("pod-template-conflict", path=path, why=why)
            for path, why in overlay.conflicts(rendered.base_template, spec.pod_template.dump(), render.CONTAINER)]


def _env_source(item: dict[str, Any]) -> str:
    ref = item.get("valueFrom") or {}
    mooncake = {var: fld for fld, _key, var in flags.MOONCAKE_SETTINGS if var}
    if "fieldRef" in ref:
        return f" (the pod's {ref['fieldRef']['fieldPath']})"
    if "secretKeyRef" in ref:
        return f" (key {ref['secretKeyRef']['key']} of Secret {ref['secretKeyRef']['name']})"
    if item["name"] in mooncake:
        return f" (from hicache.storage.mooncake.{mooncake[item['name']]})"
    return ""


HUB_REPO_ID = re.compile(r"[A-Za-z0-9][-._A-Za-z0-9]*(/[A-Za-z0-9][-._A-Za-z0-9]*)?")


def check_model_source(spec: HiCacheDeploymentSpec) -> list[Finding]:
    src = spec.model_source
    if src is None:
        return []
    out = []
    if sum(s is not None for s in (src.hugging_face, src.pvc, src.host_path, src.image)) != 1:
        out.append(finding("model-source-one-of"))
    if not model_source.is_hub_id(spec.model):
        out.append(finding("model-source-name"))
    elif src.hugging_face is not None and not HUB_REPO_ID.fullmatch(spec.model):
        out.append(finding("hugging-face-repo-id"))
    return out


def check_mooncake(spec: HiCacheDeploymentSpec) -> list[Finding]:
    """Where the master comes from, the managed master's settings, and RDMA."""
    storage, out = spec.hicache.storage, []
    mc = storage.mooncake
    managed = mc.managed if mc else None
    extra_master = storage.extra_config.get("master_server_address")
    if managed is not None and (mc.master_address or extra_master):
        out.append(finding("mooncake-master-source"))
    if storage.backend == "mooncake" and not (mc and (mc.master_address or managed)) and not extra_master:
        out.append(finding("mooncake-master-required"))
    if managed is not None:
        ports = [managed.rpc_port, managed.metrics_port]
        if managed.http_metadata_server is not None:
            ports.append(managed.http_metadata_server.port)
        if len(set(ports)) != len(ports):
            out.append(finding("mooncake-master-ports"))
        if managed.ha is not None and managed.http_metadata_server is not None:
            out.append(finding("mooncake-ha-http-metadata"))
    if spec.rdma is not None:
        if not RDMA_RESOURCE.fullmatch(spec.rdma.resource) or KUBERNETES_DOMAIN.match(spec.rdma.resource):
            out.append(finding("rdma-resource"))
        if spec.rdma.privileged:
            out.append(finding("rdma-privileged"))
    protocol = storage.extra_config.get("protocol") if storage.backend == "mooncake" else None
    if spec.rdma is None and "rdma" in (protocol, mc.protocol if mc else None):
        out.append(finding("rdma-without-device"))
    return out


def check_file_storage(spec: HiCacheDeploymentSpec) -> list[Finding]:
    """The file backend's directory, read as both engines read it: extraConfig file_storage_path,
    else /tmp/hicache (the pod's own emptyDir); and its size bounds."""
    extra = spec.hicache.storage.extra_config
    if "storage_dir" in extra:
        return [finding("file-storage-dir-key")]
    out = check_file_sizes(spec)
    path = str(extra.get("file_storage_path") or FILE_DEFAULT_DIR).rstrip("/")
    mounts = [str(m.get("mountPath", "")).rstrip("/") for m in spec.extra_volume_mounts if isinstance(m, dict)]
    if not any(m and (path == m or path.startswith(m + "/")) for m in mounts):
        out.append(finding("file-storage-not-shared", path=path))
    return out


# The file backend's size bounds: extraConfig key, else env var (both engines read them alike).
FILE_SIZE_SETTINGS = {"max_size": "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE",
                      "min_free_space": "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"}
# SGLang's human_readable_int (utils/common.py), which its file backend reads them with.
SI_SIZE = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
IEC_SIZE = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
SGLANG_SIZE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")


def check_file_sizes(spec: HiCacheDeploymentSpec) -> list[Finding]:
    """Each size bound SGLang would read as something other than what was written: a string it cannot
    read (it logs a line and runs unbounded), a negative size (unbounded) or a boolean (1 byte)."""
    extra, env = spec.hicache.storage.extra_config, {e.name: e.value for e in spec.env if e.value is not None}
    out = []
    for key, var in FILE_SIZE_SETTINGS.items():
        where, value = ((f"hicache.storage.extraConfig.{key}", extra[key]) if extra.get(key) is not None else
                        (f"env {var}", env.get(var)))
        problem = file_size_problem(value)
        if problem is not None:
            out.append(finding("file-backend-size", where=where, value=value, problem=problem[0], fix=problem[1]))
    return out


NOT_READ = "is not a size SGLang reads, so it would run with no bound (logging one line)"


def file_size_problem(value: Any) -> tuple[str, str] | None:
    """(what SGLang makes of ``value``, what to write instead), or None when it reads what was written."""
    if isinstance(value, bool):
        return "is a boolean, which SGLang reads as 1 byte", "a size, e.g. '200G', or 0 for no bound"
    if value is None or isinstance(value, (int, float)):
        size = value or 0
    elif (text := str(value).strip()) in ("", "0"):
        size = 0
    elif m := SGLANG_SIZE.fullmatch(text):
        if "." in m.group(1) and m.group(2) in IEC_SIZE:
            return NOT_READ, _file_size_fix(text)
        size = (int(m.group(1)) * IEC_SIZE[m.group(2)] if m.group(2) in IEC_SIZE else
                int(Decimal(m.group(1)) * SI_SIZE[m.group(2)]))
    else:
        try:
            size = int(text)
        except ValueError:
            return NOT_READ, _file_size_fix(text)
    if size < 0:
        return "is negative, which SGLang reads as no bound", "a size, e.g. '200G', or 0 for no bound"
    return None


def _file_size_fix(text: str) -> str:
    m = sizing.LOOSE_SIZE.fullmatch(text)
    if not m:
        return "bytes, e.g. 200000000000, or '200G' (200 x 10^9 bytes) or '200Gi' (200 x 2^30 bytes)"
    number, unit = m.group(1), m.group(2).lower()
    power = sizing.UNIT_POWER[unit]
    si = f"{number}{'k' if unit == 'k' else unit.upper()}"
    iec_bytes = int(Decimal(number) * 1024**power)
    iec = (f"'{number}{unit.upper()}i' ({iec_bytes} bytes)" if "." not in number else
           f"{iec_bytes} ({number} x 2^{10 * power} bytes)")
    return f"'{si}' ({int(Decimal(number) * 1000**power)} bytes) or {iec}, whichever was meant"


def check_engine(spec: HiCacheDeploymentSpec) -> list[Finding]:
    """The SGLang release the pods run has every feature the spec makes the operator use."""
    if spec.engine != "sglang":
        return []
    version = engine.version(spec)
    if version is None:
        return [finding("engine-version-unknown", image=spec.image)]
    if not engine_versions.supported(version):
        lacking = engine_versions.missing(version, engine_versions.REQUIRED)
        return [finding("engine-version-unsupported", version=version, oldest=engine_versions.OLDEST_SUPPORTED,
                        why="it lacks " + ", ".join(f.what for f in lacking) if lacking else "never checked")]
    out = [finding("engine-version-feature", version=version, what=f.what, minimum=f.min_version)
           for f in engine_versions.missing(version, engine_versions.used_by(spec.dump()))]
    if engine_versions.newer_than_checked(version):
        out.append(finding("engine-version-unchecked", version=version, newest=engine_versions.NEWEST_CHECKED))
    return out


BUNDLED_BUILTINS = ("builtin:tiny", "builtin:small")


# Kubernetes' own syntax (apimachinery validation), for the fields copied into the pod template.
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
RDMA_RESOURCE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
                           r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # rule rdma-resource (also its CEL)
KUBERNETES_DOMAIN = re.compile(r"([^/]*\.)?kubernetes\.io/")
RFC1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME_PART = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
QUALIFIED_NAME = re.compile(rf"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_NAME_PART}")
LABEL_VALUE = re.compile(rf"({_NAME_PART})?")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


def _qualified(key: Any) -> bool:
    if not isinstance(key, str) or not QUALIFIED_NAME.fullmatch(key):
        return False
    prefix, _, part = key.rpartition("/")
    return len(part) <= 63 and len(prefix) <= 253


def _label_value(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 63 and bool(LABEL_VALUE.fullmatch(value))


def _check_tolerations(tolerations: list[dict[str, Any]]) -> list[tuple[str, str]]:
    out = []
    for i, tol in enumerate(tolerations):
        at = f"tolerations[{i}]"
        key, op, value = tol.get("key") or "", tol.get("operator") or "Equal", tol.get("value") or ""
        if key and not _qualified(key):
            out.append((f"{at}.key", f"{key!r} is not a valid label key"))
        if op not in TOLERATION_OPERATORS:
            out.append((f"{at}.operator", f"{op!r} must be Exists or Equal"))
        elif op == "Exists" and value:
            out.append((f"{at}.value", "must be empty when operator is Exists"))
        elif not key and op != "Exists":
            out.append((f"{at}.operator", "must be Exists when key is empty"))
        if op == "Equal" and not _label_value(value):
            out.append((f"{at}.value", f"{value!r} is not a valid label value"))
        if tol.get("effect", "") not in TAINT_EFFECTS:
            out.append((f"{at}.effect", f"{tol.get('effect')!r} must be one of NoSchedule, PreferNoSchedule, NoExecute"))
        if tol.get("tolerationSeconds") is not None and tol.get("effect") != "NoExecute":
            out.append((f"{at}.tolerationSeconds", "needs effect NoExecute"))
    return out


def _check_volumes(spec: HiCacheDeploymentSpec) -> list[tuple[str, str]]:
    out = []
    ours = set(render.operator_volumes(spec))
    names: set[str] = set(ours)
    for i, vol in enumerate(spec.extra_volumes):
        name = vol.get("name")
        if not isinstance(name, str) or len(name) > 63 or not RFC1123_LABEL.fullmatch(name):
            out.append((f"extraVolumes[{i}].name", f"{name!r} must be a lower-case DNS label"))
        elif name in names:
            taken = "the operator's own volume" if name in ours else "another extra volume"
            out.append((f"extraVolumes[{i}].name", f"{name!r} is already used by {taken}"))
        names.add(name)
    paths = set(render.operator_volumes(spec).values())
    for i, mount in enumerate(spec.extra_volume_mounts):
        if mount.get("name") not in names:
            out.append((f"extraVolumeMounts[{i}].name", f"{mount.get('name')!r} is not a volume of the pod "
                        "(add it to extraVolumes)"))
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path:
            out.append((f"extraVolumeMounts[{i}].mountPath", "is required"))
        elif path.rstrip("/") in paths:
            out.append((f"extraVolumeMounts[{i}].mountPath", f"{path!r} is already mounted by the operator"))
        else:
            paths.add(path.rstrip("/"))
    return out


def _check_resources(spec: HiCacheDeploymentSpec, rendered: dict[str, dict[str, str]],
                     compare_memory: bool) -> list[tuple[str, str]]:
    out = []
    for which in ("requests", "limits"):
        for name, value in getattr(spec.resources, which).items():
            if not _qualified(name):
                out.append((f"resources.{which}", f"{name!r} is not a valid resource name"))
            q = sizing.quantity(value)
            if q is None:
                out.append((f"resources.{which}.{name}", f"{value!r} is not a quantity"))
            elif q < 0:
                out.append((f"resources.{which}.{name}", f"{value!r} must not be negative"))
    if out:
        return out
    requests, limits = rendered["requests"], rendered["limits"]
    for name, req in requests.items():
        if name == "memory" and not compare_memory:  # memory-request-too-small already says it
            continue
        hugepages = name.startswith("hugepages-")
        extended = hugepages or ("/" in name and not name.split("/")[0].endswith("kubernetes.io"))
        if extended and name not in limits:
            out.append((f"resources.limits.{name}", "is required: requests of this resource need an equal limit"))
        elif extended and sizing.quantity(req) != sizing.quantity(limits[name]):
            out.append((f"resources.requests.{name}", "must equal its limit for this resource"))
        elif name in limits and sizing.quantity(req) > sizing.quantity(limits[name]):
            out.append((f"resources.requests.{name}", f"{req} exceeds the limit {limits[name]}"))
    for name, value in {**requests, **limits}.items():
        page = sizing.quantity(name[len("hugepages-"):]) if name.startswith("hugepages-") else None
        if page and sizing.quantity(value) % page:
            out.append((f"resources.{name}", f"{value} is not a whole number of {name[len('hugepages-'):]} pages"))
        if page is not None and not {"cpu", "memory"} & (set(requests) | set(limits)):
            out.append(("resources", "hugepages need a cpu or memory request or limit"))
    return out


def _check_router_resources(spec: HiCacheDeploymentSpec) -> list[tuple[str, str]]:
    out = []
    res = spec.router.resources
    for which in ("requests", "limits"):
        for name, value in getattr(res, which).items():
            q = sizing.quantity(value)
            if not _qualified(name):
                out.append((f"router.resources.{which}", f"{name!r} is not a valid resource name"))
            elif q is None or q < 0:
                out.append((f"router.resources.{which}.{name}", f"{value!r} is not a quantity >= 0"))
    if not out:
        for name, req in res.requests.items():
            if name in res.limits and sizing.quantity(req) > sizing.quantity(res.limits[name]):
                out.append((f"router.resources.requests.{name}", f"{req} exceeds the limit {res.limits[name]}"))
    return out


def check_pod_fields(spec: HiCacheDeploymentSpec, sizing_record: dict[str, Any] | None, *,
                     compare_memory: bool = True) -> list[Finding]:
    """Fields copied into the pod template, checked with the API server's own rules so that a
    mistake is a ConfigValid=False naming the field instead of a StatefulSet the API server refuses."""
    problems: list[tuple[str, str]] = []
    for key, value in spec.node_selector.items():
        if not _qualified(key):
            problems.append(("nodeSelector", f"{key!r} is not a valid label key"))
        elif not _label_value(value):
            problems.append((f"nodeSelector.{key}", f"{value!r} is not a valid label value"))
    problems += _check_tolerations(spec.tolerations)
    for section, terms, what in (
            ("podAntiAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "placement spread's one pod per node"),
            ("podAffinity", "preferredDuringSchedulingIgnoredDuringExecution", "placement pack's co-location")):
        given = (spec.affinity or {}).get(section, {})
        if not isinstance(given, dict) or not isinstance(given.get(terms, []), list):
            problems.append((f"affinity.{section}", f"must be an object whose {terms} is a list (the operator adds "
                             f"{what} to it)"))
    if not isinstance((spec.affinity or {}).get("nodeAffinity", {}), dict):
        problems.append(("affinity.nodeAffinity", "must be an object"))
    problems += _check_volumes(spec)
    problems += _check_resources(spec, render.resources(spec, sizing_record), compare_memory)
    problems += _check_router_resources(spec)
    return [finding("invalid-pod-field", field=f, problem=p) for f, p in problems]


def normalise(spec: HiCacheDeploymentSpec, name: str | None = None,
              namespace: str = "default") -> tuple[HiCacheDeploymentSpec, list[Finding]]:
    """The effective spec and one finding per rewrite (in SGLang's order of _handle_hicache).

    A managed master's address (and its HTTP metadata server, when it runs one and
    metadataServer is unset) becomes the effective mooncake settings; that needs the
    deployment's ``name``, without which they stay unset."""
    d = spec.dump()
    hc = d["hicache"]
    st = hc["storage"]
    out: list[Finding] = []
    managed = spec.hicache.storage.mooncake.managed if spec.hicache.storage.mooncake else None
    if managed is not None and name is not None and "master_server_address" not in st["extraConfig"]:
        st["mooncake"]["masterAddress"] = render.mooncake_master_address(managed, name, namespace)
        if managed.http_metadata_server is not None and st["mooncake"].get("metadataServer") is None:
            st["mooncake"]["metadataServer"] = render.mooncake_metadata_url(managed, name, namespace)
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
    hostnames = hostname_paths(extra)
    if hostnames:
        extra = without_hostnames(extra)
        out.append(finding("extra-config-local-hostname", paths=", ".join(hostnames)))
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


def check_memory_request(spec: HiCacheDeploymentSpec, record: SizingRecord) -> list[Finding]:
    need = record.pod_memory_bytes
    out = []
    for which in ("requests", "limits"):
        given = getattr(spec.resources, which).get("memory")
        quantity = sizing.quantity(given)  # an unreadable one is reported by check_pod_fields
        if need and quantity is not None and int(quantity) < need:
            out.append(finding("memory-request-too-small", which=which, given=given,
                               needed=sizing.fmt_bytes(need)))
    return out


def validate(raw_spec: dict[str, Any], *, name: str | None = None, namespace: str = "default",
             nodes: list[dict] | None = None, pinned_sizing: Any = None) -> Outcome:
    """Parse, check, normalise and size one spec.

    ``nodes``: the cluster's nodes as API dicts, or None when unknown (then node-dependent rules
    are skipped and fromNodeMemory is not sized). ``pinned_sizing``: the sizing record from the
    last status (as written there); reused while its inputs hash matches so node changes never
    re-size by themselves.
    """
    spec, findings = parse(raw_spec)
    if spec is None:
        return Outcome(None, findings)
    findings += check_static(spec, name)
    effective, notes = normalise(spec, name, namespace)
    findings += notes
    outcome = Outcome(effective, findings)
    if outcome.errors:
        return outcome
    # a pinned record is reused only if it fitted: a fleet no node could hold is sized afresh
    # each time, so a node that arrives later is found
    pinned = SizingRecord.read(pinned_sizing)
    if pinned is not None and pinned.inputs_hash == sizing.inputs_hash(effective) and pinned.ineligible is None:
        outcome.sizing = pinned
    elif nodes is not None or effective.hicache.host_pool.from_node_memory is None:
        try:
            outcome.sizing = sizing.compute(effective, nodes)
        except sizing.SizingError as exc:
            findings.append(finding(exc.rule, **exc.params))
            return outcome
        if outcome.sizing.ineligible is not None:
            findings.append(finding("no-eligible-nodes-yet", gpus=effective.ranks_per_pod,
                                    why=outcome.sizing.ineligible))
    memory = check_memory_request(effective, outcome.sizing) if outcome.sizing else []
    findings += memory
    rec = outcome.sizing
    if rec is not None and rec.pods_per_node is not None and rec.pods_per_node < (rec.pods_per_node_by_gpus or 0):
        findings.append(finding("pods-per-node-memory-bound", node=rec.sizing_node, by_gpus=rec.pods_per_node_by_gpus,
                                by_memory=rec.pods_per_node_by_memory,
                                need=sizing.fmt_bytes((rec.pod_memory_bytes or 0) + (rec.sidecar_bytes or 0)),
                                idle=(rec.pods_per_node_by_gpus - rec.pods_per_node) * rec.ranks_per_pod))
    if rec is not None and rec.pod_memory_bytes and sizing.page_cache_bytes(effective) is None:
        findings.append(finding("engine-page-cache-unknown", version=engine.version(effective), model=effective.model,
                                fixed=engine_versions.FEATURES["host_headroom_page_cache_free"].min_version))
    if outcome.sizing and outcome.sizing.note and "memory" not in effective.resources.requests:
        findings.append(finding("no-memory-request", why=outcome.sizing.note))
    findings += check_page_size(effective, None if nodes is None else sizing.eligible_nodes(effective, nodes)[0])
    findings += check_pod_fields(effective, outcome.sizing, compare_memory=not memory)
    findings += check_env(effective, name)
    return outcome
