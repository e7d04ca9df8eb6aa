"""Rules decidable from the spec alone: the CEL ones, those needing extraConfig, the model
source, Mooncake and RDMA, extraArgs and the SGLang release's features."""

from __future__ import annotations

import re

from hicache_operator.api.rules import OPERATOR_KEY_PREFIX, OPERATOR_LABEL_KEYS
from hicache_operator.api.spec import HiCacheDeploymentSpec, resolve_max_unavailable
from hicache_operator.plan.engine import cli as engine_cli, features as engine, versions as engine_versions
from hicache_operator.plan.model import source as model_source
from hicache_operator.plan.validation.file_storage import check_file_storage
from hicache_operator.plan.validation.findings import Finding, finding

DYNAMIC_REQUIRED = ("backend_name", "module_path", "class_name")
BUNDLED_BUILTINS = ("builtin:tiny", "builtin:small")
HUB_REPO_ID = re.compile(r"[A-Za-z0-9][-._A-Za-z0-9]*(/[A-Za-z0-9][-._A-Za-z0-9]*)?")
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
RDMA_RESOURCE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
                           r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # rule rdma-resource (also its CEL)
KUBERNETES_DOMAIN = re.compile(r"([^/]*\.)?kubernetes\.io/")


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
