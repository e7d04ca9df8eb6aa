"""Runs inside a child process with one real SGLang release on its path (testbed/sglang_oracle).

Request: {"cases": [{"argv": [...], "pool_bytes": int|None, "limit": int|None, "usage": int|None}]}.
For each argv: SGLang's own ``prepare_server_args`` parses it and its resolution pipeline
resolves it; the answer carries the resolved fields the operator renders, the GPUs the
server would use, what SGLang's file backend makes of the extra config, whether SGLang's auth
lets an anonymous client read /server_info, and SGLang's own host-memory headroom check for
each rank of the pod. A parse or resolution error is answered as {"error": ...}.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

FIELDS = ("tp_size", "pp_size", "dp_size", "attn_dp_size", "enable_dp_attention", "page_size", "hicache_ratio",
          "hicache_size", "hicache_write_policy", "hicache_io_backend", "hicache_mem_layout",
          "hicache_storage_backend", "hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config",
          "enable_cache_report", "max_total_tokens", "api_key", "admin_api_key", "enable_metrics",
          "enable_hierarchical_cache", "host", "port", "served_model_name")


def resolve_args(argv: list[str]):
    """(ServerArgs, resolved values) as the release's launcher gets them: 0.5.2x resolve in
    ``resolve_once``; older releases in ``ServerArgs.__post_init__``."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    if hasattr(args, "resolve_once"):
        args.resolve_once()
        return args, args.resolved_dict()
    return args, dict(vars(args))


def stand_in_transfer_kernels() -> None:
    """Older releases import sgl_kernel's CUDA transfer kernels with their host pools and storage
    modules; on CPU a stand-in module takes their place, and calling one of them raises."""
    import types

    try:
        import sgl_kernel.kvcacheio  # noqa: F401
        return
    except ImportError:
        pass

    def absent(name):
        if name.startswith("__"):  # module protocol lookups (inspect, pickle) must see a plain module
            raise AttributeError(name)

        def call(*args, **kwargs):
            raise RuntimeError(f"sgl_kernel.kvcacheio.{name} is not available on CPU")
        return call

    stub = types.ModuleType("sgl_kernel.kvcacheio")
    stub.__getattr__ = absent
    pkg = types.ModuleType("sgl_kernel")
    pkg.__path__ = []
    pkg.kvcacheio = stub
    sys.modules.update({"sgl_kernel": pkg, "sgl_kernel.kvcacheio": stub})


def resolve(argv: list[str]) -> dict:
    values = resolve_args(argv)[1]
    return {k: values.get(k) for k in FIELDS if k in values}


def world_size(r: dict) -> int:
    """GPUs the server runs on: dp_size counts whole replicas, except in the deprecated
    --enable-dp-attention spelling where it counts attention groups inside the TP group."""
    replicas = 1 if r.get("enable_dp_attention") else (r.get("dp_size") or 1)
    return replicas * r["tp_size"] * r["pp_size"]


def file_path(extra: dict | None) -> str:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    cfg = HiCacheStorageConfig(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="m", extra_config=extra)
    import os
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    return HiCacheFile(cfg).file_path  # rank 1: never creates the directory


def server_info_open(r: dict) -> bool:
    from sglang.srt.utils import auth

    decide = getattr(auth, "decide_request_auth", None)
    if decide is None:  # older releases: NORMAL routes are open exactly when no --api-key is set
        return not r.get("api_key")
    return decide(method="GET", path="/server_info", authorization_header=None, api_key=r.get("api_key"),
                  admin_api_key=r.get("admin_api_key"), auth_level=auth.AuthLevel.NORMAL).allowed


def headroom(ranks: int, pool: int, limit: int, usage: int) -> list[bool]:
    """SGLang's check for each rank, the k-th seeing k peers' pools already allocated."""
    from sglang.srt.mem_cache import host_memory
    from sglang.srt.mem_cache.pool_host import base

    ok = []
    for k in range(ranks):
        seen = limit - usage - k * pool
        host_memory.available_host_memory_bytes = lambda seen=seen, **_: seen
        base.available_host_memory_bytes = lambda seen=seen, **_: seen
        base.ranks_per_host = lambda: ranks
        ok.append(pool <= base.host_memory_budget_bytes(pool))
    return ok


def main() -> None:
    request = json.loads(sys.stdin.read())
    out = []
    for case in request["cases"]:
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                r = resolve(case["argv"])
        except BaseException as exc:  # SystemExit from argparse included: its message went to stderr
            said = [ln for ln in err.getvalue().splitlines() if "error:" in ln] if isinstance(exc, SystemExit) else []
            out.append({"error": said[-1].strip() if said else f"{type(exc).__name__}: {exc}"})
            continue
        answer = {"resolved": r, "world_size": world_size(r), "server_info_open": server_info_open(r)}
        extra = r.get("hicache_storage_backend_extra_config")
        if r.get("hicache_storage_backend") == "file":
            answer["file_path"] = file_path(json.loads(extra) if isinstance(extra, str) else extra)
        if case.get("pool_bytes"):
            answer["headroom"] = headroom(r["tp_size"] * r["pp_size"], case["pool_bytes"], case["limit"],
                                          case["usage"])
        out.append(answer)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
