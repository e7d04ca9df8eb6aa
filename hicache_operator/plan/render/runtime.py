"""The runtime container's configuration: the engine's arguments, its env and its resources, and
the storage config they carry (the live-swappable part, and the page namespace that keeps pods of
another page format out of a fleet's L3 pages)."""

from __future__ import annotations

from typing import Any

from hicache_operator.api import flags
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.api.status import SizingRecord
from hicache_operator.fleet.storage_config import StorageConfig, page_namespace as format_namespace, storage_fingerprint, with_page_namespace
from hicache_operator.plan.engine import features as engine
from hicache_operator.plan.model import source as model_source
from hicache_operator.plan.render.common import Owner, field_env, resources_of, secret_env
from hicache_operator.plan.render.mooncake_master import managed_master, mooncake_cluster_id
from hicache_operator.plan.render.secrets import pods_key, secret_ref, uses_api_key
from hicache_operator.plan.sizing import memory_quantity


def _extra_arg(spec: HiCacheDeploymentSpec, flag: str) -> str | None:
    """The value ``spec.extraArgs`` gives ``flag`` (``--flag v`` or ``--flag=v``; the last one wins)."""
    value = None
    extra = list(spec.extra_args)
    for i, arg in enumerate(extra):
        if arg == flag and i + 1 < len(extra):
            value = extra[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def kv_dtype(spec: HiCacheDeploymentSpec) -> str:
    """The KV dtype as the command states it: ``--kv-cache-dtype``, else ``--dtype``, else ``auto``
    (the checkpoint's, which the model name already pins)."""
    kv = _extra_arg(spec, "--kv-cache-dtype")
    if kv and kv != "auto":
        return kv
    return _extra_arg(spec, "--dtype") or "auto"


def page_namespace(spec: HiCacheDeploymentSpec) -> str:
    """The L3 namespace of this fleet's page format (``storage_config.page_namespace``)."""
    par = spec.parallelism
    return format_namespace(spec.hicache.mem_layout, kv_dtype(spec), spec.page_size, par.tp, par.pp,
                            par.dp if spec.engine == "sglang" else 1)


def effective_extra_config(spec: HiCacheDeploymentSpec) -> dict[str, Any]:
    """``hicache.storage.extraConfig`` as both engines get it: with the page namespace applied, so pods
    of another layout, dtype, page size or split never read these pages."""
    st = spec.hicache.storage
    return with_page_namespace(st.backend, st.extra_config, page_namespace(spec))


def storage_config(spec: HiCacheDeploymentSpec) -> StorageConfig:
    """The live-swappable part of the config: what an attach carries and a swap converges to."""
    st = spec.hicache.storage
    return StorageConfig(backend=st.backend, prefetch_policy=st.prefetch_policy,
                         extra_config=effective_extra_config(spec), write_policy=spec.hicache.write_policy)


def storage_hash(spec: HiCacheDeploymentSpec) -> str:
    """The pods' storage annotation and the swap's target: ``storage_fingerprint`` of the config."""
    return storage_fingerprint(storage_config(spec))


def host_pool_flag(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None) -> tuple[str, Any]:
    pool = spec.hicache.host_pool
    if pool.from_node_memory is not None:
        if sizing is None or not sizing.hicache_size_gb:
            raise ValueError("hostPool.fromNodeMemory needs a sizing record (nodes were not known)")
        return "sizeGBPerRank", sizing.hicache_size_gb
    if pool.size_gb_per_rank is not None:
        return "sizeGBPerRank", pool.size_gb_per_rank
    return "ratio", pool.ratio


def host_pool_text(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None) -> str:
    mode, value = host_pool_flag(spec, sizing)
    if mode == "ratio":
        return f"ratio {value}"
    suffix = " (node)" if spec.hicache.host_pool.from_node_memory is not None else ""
    return f"{value}GB/rank{suffix}"


def args(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None, *, include_storage: bool = True) -> list[str]:
    """The engine's arguments: the operator's, then ``spec.extraArgs`` as written (``$(VAR)`` expands)."""
    dumped = spec.dump()
    dumped["hicache"]["storage"]["extraConfig"] = effective_extra_config(spec)
    return flags.render_args(dumped, spec.engine, host_pool=host_pool_flag(spec, sizing),
                             include_storage=include_storage, api_key=uses_api_key(spec),
                             legacy_dp_attention=engine.lacks(spec, "attn_dp_size_flag"),
                             model_path=model_source.model_path(spec),
                             served_name=model_source.served_name(spec)) + list(spec.extra_args)


def mooncake_env(spec: HiCacheDeploymentSpec, owner: Owner) -> list[dict[str, Any]]:
    """MOONCAKE_* settings as env; from the effective extra config when mooncake is the backend."""
    st = spec.hicache.storage
    if st.backend != "mooncake" and st.mooncake is None:
        return []
    settings = st.mooncake.model_dump(by_alias=True) if st.mooncake else {}
    env = []
    for fld, key, var in flags.MOONCAKE_SETTINGS:
        value = st.extra_config.get(key) if st.backend == "mooncake" else settings.get(fld)
        if value is None and fld in ("protocol", "metadataServer"):
            value = {"protocol": "tcp", "metadataServer": "P2PHANDSHAKE"}[fld]
        if var and value is not None:
            env.append({"name": var, "value": str(value)})
    managed = managed_master(spec)
    if managed is not None and managed.ha is not None:
        env.append({"name": "MC_STORE_CLUSTER_ID", "value": mooncake_cluster_id(owner)})
    return env


def operator_env(spec: HiCacheDeploymentSpec, owner: Owner, include_storage: bool = True) -> list[dict[str, Any]]:
    """The env vars the operator sets (``spec.env`` comes after them and may not repeat a name)."""
    secret_name, secret_key = secret_ref(spec, owner.name, "admin")
    env = [
        field_env("POD_IP", "status.podIP"),
        field_env("POD_NAME", "metadata.name"),
        # Each pod's own address: never a hostname shared through a config (sglang#23457).
        field_env("MOONCAKE_LOCAL_HOSTNAME", "status.hostIP" if spec.host_network else "status.podIP"),
        {"name": flags.ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": secret_key}}},
        {"name": "HOME", "value": "/tmp"},
        *model_source.engine_env(spec),
    ]
    if engine.version(spec):
        # the release the flags were rendered for (the local test cluster's SGLang stand-in checks them with it)
        env.append({"name": "HICACHE_ENGINE_VERSION", "value": engine.version(spec)})
    if uses_api_key(spec):
        env.append(secret_env(flags.API_KEY_ENV, *secret_ref(spec, owner.name, pods_key(spec))))
    if include_storage:
        env += mooncake_env(spec, owner)
    return env


def env(spec: HiCacheDeploymentSpec, owner: Owner, include_storage: bool = True) -> list[dict[str, Any]]:
    """The runtime container's env: the operator's, then ``spec.env``."""
    return operator_env(spec, owner, include_storage) + [e.model_dump(by_alias=True, exclude_none=True)
                                                         for e in spec.env]


def resources(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None, *,
              include_storage: bool = True) -> dict[str, Any]:
    """Requests and limits; without ``include_storage`` (the restart hash) the Mooncake segment is
    left out of the memory, so a live swap to or from Mooncake restarts no pod. A pod running
    through such a swap keeps its limit until it restarts; the segment then comes out of its
    margin (SGLang's: r - 1 pools and the 10 GiB reserve)."""
    gpus = str(spec.ranks_per_pod)
    given = resources_of(spec.resources)
    requests, limits = given["requests"], given["limits"]
    memory = sizing.pod_memory if sizing is not None else None
    if memory and not include_storage and sizing.storage_bytes and sizing.pod_memory_bytes:
        memory = memory_quantity(sizing.pod_memory_bytes - sizing.storage_bytes)
    if memory:
        requests.setdefault("memory", memory)
        # A user's larger request raises the limit with it (a request above its limit is refused).
        limits.setdefault("memory", requests["memory"])
    requests["nvidia.com/gpu"] = gpus
    limits["nvidia.com/gpu"] = gpus
    if spec.rdma is not None:  # an extended resource: request = limit
        requests[spec.rdma.resource] = limits[spec.rdma.resource] = str(spec.rdma.count)
    return {"requests": requests, "limits": limits}
