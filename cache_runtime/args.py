"""Command line of ``python -m cache_runtime serve``: SGLang's flag names, defaults and boot-time rewrites."""

from __future__ import annotations

import argparse
import json
import logging
import os
import tomllib
from dataclasses import asdict, dataclass, field

import yaml

from cache_runtime.memory import LAYOUTS
from cache_runtime.policies import IO_BACKENDS, PREFETCH_POLICIES, WRITE_POLICIES

log = logging.getLogger(__name__)

STORAGE_BACKENDS = ("file", "mooncake", "dynamic")
ADMIN_KEY_ENV = "HICACHE_ADMIN_API_KEY"


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str = "builtin:tiny"
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    max_total_tokens: int = 16384
    context_length: int | None = None
    max_running_requests: int = 32
    chunked_prefill_size: int = 2048
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_mem_layout: str = "layer_first"
    hicache_storage_backend: str | None = None
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_backend_extra_config: str | None = None
    enable_cache_report: bool = False
    api_key: str | None = None
    admin_api_key: str | None = None
    compat_mode: str = "bundled"
    cpu_threads: int = 1
    max_request_bytes: int = 16 << 20
    log_level: str = "info"
    normalisations: list[str] = field(default_factory=list)

    @property
    def served_name(self) -> str:
        """The name the server answers under (SGLang: --served-model-name, defaulting to the model path)."""
        return self.served_model_name or self.model_path

    def public_dict(self) -> dict:
        """Server args for /server_info, with secrets redacted."""
        d = asdict(self)
        for k in ("api_key", "admin_api_key"):
            d[k] = "<redacted>" if d[k] else None
        return d


def parse_extra_config(raw: str | None) -> dict:
    """--hicache-storage-backend-extra-config: a JSON object, or @path to .json/.toml/.yaml."""
    if not raw:
        return {}
    if raw.startswith("@"):
        path = raw[1:]
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read extra-config file {path}: {exc}") from exc
        if path.endswith(".toml"):
            obj = tomllib.loads(data.decode())
        elif path.endswith((".yaml", ".yml")):
            obj = yaml.safe_load(data)
        else:
            obj = json.loads(data)
    else:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hicache-storage-backend-extra-config is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
    return obj


def _positive(name: str, value, minimum=1) -> None:
    if value < minimum:
        raise ValueError(f"--{name} must be >= {minimum}, got {value}")


def normalise(args: ServerArgs) -> ServerArgs:
    """Validates and applies SGLang's boot-time rewrites, recording each in ``args.normalisations``."""
    _positive("page-size", args.page_size)
    _positive("max-total-tokens", args.max_total_tokens, args.page_size)
    _positive("max-running-requests", args.max_running_requests)
    _positive("chunked-prefill-size", args.chunked_prefill_size)
    _positive("cpu-threads", args.cpu_threads)
    for name in ("tp_size", "dp_size", "pp_size"):
        _positive(name.replace("_", "-"), getattr(args, name))
    for name in ("dp_size", "pp_size"):
        if getattr(args, name) > 1:
            flag = name.replace("_", "-")
            raise ValueError(f"--{flag} {getattr(args, name)}: the bundled runtime runs tensor parallelism only "
                             f"(--tp-size); use sglang for data or pipeline parallelism")
    if args.radix_eviction_policy != "lru":
        raise ValueError(f"--radix-eviction-policy {args.radix_eviction_policy!r} is not supported by the bundled runtime (lru)")
    if args.hicache_write_policy not in WRITE_POLICIES:
        raise ValueError(f"--hicache-write-policy must be one of {WRITE_POLICIES}")
    if args.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
        raise ValueError(f"--hicache-storage-prefetch-policy must be one of {PREFETCH_POLICIES}")
    if args.hicache_mem_layout not in LAYOUTS:
        raise ValueError(f"--hicache-mem-layout {args.hicache_mem_layout!r} is not supported by the bundled runtime; use one of {LAYOUTS}")
    if args.hicache_io_backend not in IO_BACKENDS:
        raise ValueError(f"--hicache-io-backend {args.hicache_io_backend!r} is not supported; use one of {IO_BACKENDS}")
    if args.hicache_storage_backend is not None and args.hicache_storage_backend not in STORAGE_BACKENDS:
        raise ValueError(f"--hicache-storage-backend must be one of {STORAGE_BACKENDS}")
    if args.hicache_size < 0:
        raise ValueError("--hicache-size must be >= 0")
    if args.enable_hierarchical_cache and args.hicache_size == 0 and args.hicache_ratio <= 1:
        raise ValueError(f"--hicache-ratio must be > 1, got {args.hicache_ratio}")
    if args.hicache_storage_backend and not args.enable_hierarchical_cache:
        raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
    if args.enable_hierarchical_cache and args.disable_radix_cache:
        raise ValueError("--enable-hierarchical-cache cannot be combined with --disable-radix-cache")
    if args.compat_mode not in ("bundled", "sglang"):
        raise ValueError("--compat-mode must be bundled or sglang")
    parse_extra_config(args.hicache_storage_backend_extra_config)  # fail at boot, not at first use

    def rewrite(msg: str) -> None:
        args.normalisations.append(msg)
        log.warning(msg)

    if args.hicache_mem_layout == "page_first_direct" and args.hicache_io_backend == "kernel":
        args.hicache_io_backend = "direct"
        rewrite("Kernel io backend does not support page first direct layout; using hicache_io_backend=direct")
    if args.hicache_storage_backend == "mooncake" and args.hicache_mem_layout == "layer_first":
        layout = "page_first_direct" if args.hicache_io_backend == "direct" else "page_first"
        args.hicache_mem_layout = layout
        rewrite(f"Mooncake storage backend does not support layer_first layout, switching to {layout} "
                f"layout for {args.hicache_io_backend} io backend")
    if args.admin_api_key is None:
        args.admin_api_key = os.environ.get(ADMIN_KEY_ENV) or None
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cache_runtime")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the HTTP server")
    d = ServerArgs()
    s.add_argument("--host", default=d.host)
    s.add_argument("--port", type=int, default=d.port)
    s.add_argument("--model-path", "--model", default=d.model_path)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    s.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and activations; auto = the checkpoint's torch_dtype")
    s.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "float32", "float16", "bfloat16"],
                   help="L1/L2/L3 KV; auto = --dtype")
    s.add_argument("--page-size", type=int, default=d.page_size)
    s.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens, help="L1 pool size in tokens")
    s.add_argument("--context-length", type=int, default=None)
    s.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    s.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    s.add_argument("--tp-size", "--tp", type=int, default=1)
    s.add_argument("--dp-size", "--dp", type=int, default=1)
    s.add_argument("--pp-size", "--pp", type=int, default=1)
    s.add_argument("--disable-radix-cache", action="store_true")
    s.add_argument("--radix-eviction-policy", default=d.radix_eviction_policy)
    s.add_argument("--enable-hierarchical-cache", action="store_true")
    s.add_argument("--hicache-ratio", type=float, default=d.hicache_ratio)
    s.add_argument("--hicache-size", type=float, default=d.hicache_size, help="L2 GB (1e9 bytes) per rank")
    s.add_argument("--hicache-write-policy", default=d.hicache_write_policy)
    s.add_argument("--hicache-io-backend", default=d.hicache_io_backend)
    s.add_argument("--hicache-mem-layout", default=d.hicache_mem_layout)
    s.add_argument("--hicache-storage-backend", default=None)
    s.add_argument("--hicache-storage-prefetch-policy", default=d.hicache_storage_prefetch_policy)
    s.add_argument("--hicache-storage-backend-extra-config", default=None)
    s.add_argument("--enable-cache-report", action="store_true")
    s.add_argument("--api-key", default=None)
    s.add_argument("--admin-api-key", default=None, help=f"falls back to ${ADMIN_KEY_ENV}")
    s.add_argument("--compat-mode", default=d.compat_mode, choices=["bundled", "sglang"])
    s.add_argument("--cpu-threads", type=int, default=d.cpu_threads)
    s.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes)
    s.add_argument("--log-level", default=d.log_level)
    return p


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    fields = ServerArgs.__dataclass_fields__
    return normalise(ServerArgs(**{k: v for k, v in vars(ns).items() if k in fields}))
