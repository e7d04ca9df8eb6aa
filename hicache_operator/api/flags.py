"""The one table of HiCache settings.

Every setting a HiCacheDeployment can carry to the serving process is declared here once: the
spec models take their enums, defaults and help text from it (and so does the generated CRD), the
validation layer takes the known extra-config keys from it, and both command-line renderers walk
it. The bundled runtime accepts SGLang's own flag names, so one ``cli`` column serves both engines;
``engines`` says where a flag does not exist on one of them.
"""

from __future__ import annotations

import json

from dataclasses import dataclass
from typing import Any

BOTH = frozenset({"bundled", "sglang"})

ENGINES = ("bundled", "sglang")
STORAGE_BACKENDS = ("none", "file", "mooncake", "dynamic")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
IO_BACKENDS = ("kernel", "direct")
MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")

RUNTIME_PORT = 30000
ROUTER_API_PORT = 30001  # sglang-router behind its client gate (which takes RUNTIME_PORT): the operator's alone
STORAGE_CONFIG_DIR = "/etc/hicache/storage"
STORAGE_CONFIG_FILE = "extra_config.json"
ADMIN_KEY_ENV = "HICACHE_ADMIN_API_KEY"
API_KEY_ENV = "HICACHE_API_KEY"


@dataclass(frozen=True)
class Flag:
    key: str  # dotted path inside .spec, camelCase as the user writes it
    cli: str  # SGLang's flag name; the bundled runtime accepts the same
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    engines: frozenset[str] = BOTH
    # Part of the L3 storage configuration: changed live by detach/attach, so it is left out of
    # the pod restart hash and never restarts a pod by itself.
    storage: bool = False


FLAGS: tuple[Flag, ...] = (
    Flag("model", "--model-path", str, "builtin:tiny",
         "Model served: a checkpoint directory in the pod (bundled and sglang), a Hugging Face id (sglang "
         "downloads it itself), or builtin:tiny/builtin:small (bundled test models). With modelSource: the "
         "model's name (its Hugging Face id), served as --served-model-name; the source gives --model-path."),
    Flag("parallelism.tp", "--tp-size", int, 1, "Tensor-parallel ranks inside each pod (one GPU each)."),
    Flag("parallelism.dp", "--attn-dp-size", int, 1,
         "Attention data-parallel groups inside the TP group (must divide tp; uses no extra GPUs). Not SGLang's "
         "--dp-size, which runs that many whole replicas in one pod; rendered as --attn-dp-size or, on SGLang "
         "releases without it, --enable-dp-attention --dp-size.", engines=frozenset({"sglang"})),
    Flag("parallelism.pp", "--pp-size", int, 1, "Pipeline-parallel stages inside each pod (tp x pp GPUs)."),
    Flag("pageSize", "--page-size", int, 1, "Tokens per KV page (the unit of L2/L3 transfers and hashing)."),
    Flag("maxTotalTokens", "--max-total-tokens", int, None,
         "L1 device pool size in tokens; unset lets the engine derive it from GPU memory."),
    Flag("hicache.hostPool.ratio", "--hicache-ratio", float, 2.0,
         "Host (L2) pool size as a multiple of the device pool; must be > 1."),
    Flag("hicache.hostPool.sizeGBPerRank", "--hicache-size", int, 0,
         "Host (L2) pool size per rank in GB (1e9 bytes); overrides the ratio."),
    Flag("hicache.writePolicy", "--hicache-write-policy", str, "write_through",
         "When device pages are backed up to host memory.", WRITE_POLICIES),
    Flag("hicache.ioBackend", "--hicache-io-backend", str, "kernel",
         "Host<->device copy path: transfer kernels or direct copies.", IO_BACKENDS),
    Flag("hicache.memLayout", "--hicache-mem-layout", str, "layer_first",
         "Host pool memory layout.", MEM_LAYOUTS),
    Flag("hicache.storage.backend", "--hicache-storage-backend", str, "none",
         "L3 storage backend; none keeps the cache in L1+L2.", STORAGE_BACKENDS, storage=True),
    Flag("hicache.storage.prefetchPolicy", "--hicache-storage-prefetch-policy", str, "best_effort",
         "When an L3 prefetch stops.", PREFETCH_POLICIES, storage=True),
    Flag("hicache.storage.extraConfig", "--hicache-storage-backend-extra-config", dict, None,
         "Backend keys and prefetch knobs, passed as a JSON file from the storage ConfigMap.", storage=True),
    Flag("enableCacheReport", "--enable-cache-report", bool, False,
         "Report cached prompt tokens in OpenAI usage."),
)

FLAGS_BY_KEY = {f.key: f for f in FLAGS}

# Flags every pod gets regardless of the spec.
FIXED_ARGS: dict[str, tuple[str, ...]] = {
    "bundled": ("--enable-hierarchical-cache",),
    # SGLang only serves /metrics with --enable-metrics; the rollout reads in-flight counts there.
    "sglang": ("--enable-hierarchical-cache", "--enable-metrics"),
}

# Extra-config keys each backend understands (SGLang's names); the engine pops the prefetch knobs
# before the backend sees the rest.
PREFETCH_KNOBS = frozenset({
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max", "hicache_storage_pass_prefix_keys",
})
KNOWN_EXTRA_CONFIG_KEYS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "file": frozenset({"file_storage_path", "max_size", "min_free_space", "eviction_ratio",
                       "enable_metadata_cache", "metadata_ttl"}),
    "mooncake": frozenset({"local_hostname", "metadata_server", "master_server_address", "protocol",
                           "device_name", "global_segment_size", "local_buffer_size",
                           "master_metrics_port", "check_server", "extra_backend_tag"}),
    "dynamic": frozenset({"backend_name", "module_path", "class_name", "interface_v1"}),
}

# spec.hicache.storage.mooncake field -> (extra-config key, pod env var). The env copy lets a pod
# started before a swap reach the store; the extra-config copy makes the attach payload complete.
MOONCAKE_SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("masterAddress", "master_server_address", "MOONCAKE_MASTER"),
    ("protocol", "protocol", "MOONCAKE_PROTOCOL"),
    ("metadataServer", "metadata_server", "MOONCAKE_TE_META_DATA_SERVER"),
    ("globalSegmentSize", "global_segment_size", "MOONCAKE_GLOBAL_SEGMENT_SIZE"),
    ("deviceName", "device_name", "MOONCAKE_DEVICE"),
    ("localBufferSize", "local_buffer_size", None),
)


# Flags rendered from something other than a FLAGS row.
HOST_FLAG, PORT_FLAG, ADMIN_KEY_FLAG, API_KEY_FLAG = "--host", "--port", "--admin-api-key", "--api-key"
LEGACY_DP_FLAGS = ("--enable-dp-attention", "--dp-size")  # SGLang releases without --attn-dp-size


def _from(field: str) -> str:
    return f"is rendered from {field}: set that instead"


def owned_flags(engine: str) -> dict[str, str]:
    """Each flag the operator renders for ``engine`` (whether or not this spec renders it) -> why
    ``spec.extraArgs`` may not name it (what sets it)."""
    out = {HOST_FLAG: "is set by the operator (the pod's own address)",
           PORT_FLAG: f"is set by the operator (port {RUNTIME_PORT}, which the probes and Services use)",
           ADMIN_KEY_FLAG: _from("spec.adminKeySecretRef"), API_KEY_FLAG: _from("spec.apiKeySecretRef")}
    out.update({cli: "is always set by the operator" for cli in FIXED_ARGS[engine]})
    for f in FLAGS:
        if engine in f.engines:
            out[f.cli] = _from("spec.hicache.hostPool" if f.key.startswith("hicache.hostPool.") else f"spec.{f.key}")
    out.update({cli: _from("spec.parallelism.dp") for cli in LEGACY_DP_FLAGS})
    if engine == "sglang":
        out["--config"] = "would let a file set flags the operator renders: put the file's flags in extraArgs"
    return out


def flag(key: str) -> Flag:
    return FLAGS_BY_KEY[key]


def lookup(obj: dict, dotted: str) -> Any:
    """Value at a dotted camelCase path of a spec dict (by-alias dump), None when absent."""
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def render_args(spec: dict, engine: str, *, host_pool: tuple[str, Any], include_storage: bool = True,
                api_key: bool = False, legacy_dp_attention: bool = False,
                model_path: str | None = None, served_name: str | None = None) -> list[str]:
    """Command-line arguments for one engine from an effective spec (a by-alias dict).

    ``host_pool`` is the already-decided pool flag: ("ratio", 2.0) or ("sizeGBPerRank", 37);
    sizing from node memory resolves to the latter before rendering. With ``include_storage``
    False the L3 settings are left out, which is how the restart hash ignores them.
    ``api_key``: clients authenticate with the key in $HICACHE_API_KEY. ``legacy_dp_attention``:
    the SGLang release spells attention DP ``--enable-dp-attention --dp-size N``. ``model_path``
    and ``served_name``: where a modelSource puts the checkpoint, and the name it is served as.
    """
    args: list[str] = [HOST_FLAG, "$(POD_IP)", PORT_FLAG, str(RUNTIME_PORT)]
    args += FIXED_ARGS[engine]
    backend = lookup(spec, "hicache.storage.backend") or "none"
    for f in FLAGS:
        if engine not in f.engines or (f.storage and not include_storage):
            continue
        if f.key.startswith("hicache.hostPool."):
            if f.key.rsplit(".", 1)[1] == host_pool[0]:
                args += [f.cli, _fmt(host_pool[1])]
            continue
        if f.key.startswith("hicache.storage.") and backend == "none":
            continue
        if f.key == "hicache.storage.extraConfig":
            # SGLang reports this flag back verbatim from GET /hicache/storage-backend, so it gets
            # the JSON itself (a path would never compare equal to a swap target); the bundled
            # runtime resolves the mounted ConfigMap and reports the parsed config.
            if engine == "sglang":
                args += [f.cli, escape(json.dumps(lookup(spec, f.key) or {}, sort_keys=True, separators=(",", ":")))]
            else:
                args += [f.cli, f"@{STORAGE_CONFIG_DIR}/{STORAGE_CONFIG_FILE}"]
            continue
        value = lookup(spec, f.key)
        if value is None:
            value = f.default
        if f.key == "model" and model_path is not None:
            args += [f.cli, escape(model_path)] + (["--served-model-name", escape(served_name)] if served_name else [])
            continue
        if f.key == "parallelism.dp":
            if value > 1:
                args += [LEGACY_DP_FLAGS[0], LEGACY_DP_FLAGS[1], str(value)] if legacy_dp_attention else [f.cli, str(value)]
            continue
        if f.kind is bool:
            if value:
                args.append(f.cli)
        elif value is not None:
            args += [f.cli, _fmt(value)]
    # Kubernetes expands $(VAR) from the container env, so keys never appear in the spec; the
    # bundled runtime reads its admin key from the env itself, keeping it out of its argv.
    if engine == "sglang":
        args += [ADMIN_KEY_FLAG, f"$({ADMIN_KEY_ENV})"]
    if api_key:
        args += [API_KEY_FLAG, f"$({API_KEY_ENV})"]
    return args


def command(engine: str) -> list[str]:
    if engine == "sglang":
        return ["python", "-m", "sglang.launch_server"]
    return ["python", "-m", "cache_runtime", "serve"]


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return f"{value:.1f}"
    return escape(str(value))


def escape(value: str) -> str:
    """Kubernetes expands `$(VAR)` in args from the container env; a user's value must never
    reach one (e.g. `$(HICACHE_ADMIN_API_KEY)` in a model name), so `$(` becomes `$$(`."""
    return value.replace("$(", "$$(")
