"""Health, metrics and information routes: ``/health``, ``/health_generate``, ``/metrics``,
``/server_info``, ``/model_info`` (and their ``get_`` aliases) and ``/v1/models``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kernels
from cache_runtime import __version__
from cache_runtime.args import ServerArgs
from cache_runtime.auth import Level
from cache_runtime.engine.loop import Engine
from cache_runtime.metrics import Metrics
from cache_runtime.models import BUILTIN_CONFIGS
from cache_runtime.sampling import SamplingParams
from cache_runtime.server.handlers import Handlers, error


class InfoRoutes(Handlers):
    def __init__(self, args: ServerArgs, engine: Engine, metrics: Metrics) -> None:
        super().__init__(args, engine)
        self.metrics = metrics
        self.hf_config = _hf_config(args.model_path)

    def register(self, app: FastAPI) -> None:
        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.get("/health_generate")
        async def health_generate():
            tokenizer = self.engine.runner.tokenizer
            ids = tokenizer.encode("hi") or [tokenizer.bos_token_id or 0]
            try:
                req, q = self._submit(ids, SamplingParams(max_new_tokens=1))
                out = await asyncio.wait_for(self._collect(req, q), timeout=20)
            except (asyncio.TimeoutError, ValueError) as exc:
                return error(503, f"generation health check failed: {exc!r}", "ServiceUnavailable")
            if out.error:
                return error(503, out.error, "ServiceUnavailable")
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        async def server_info(request: Request):
            if (denied := self._auth(request, Level.NORMAL)) is not None:
                return denied
            return self._server_info()

        app.get("/server_info")(server_info)
        app.get("/get_server_info")(server_info)

        async def model_info(request: Request):
            if (denied := self._auth(request, Level.NORMAL)) is not None:
                return denied
            return self._model_info()

        app.get("/get_model_info")(model_info)
        app.get("/model_info")(model_info)

        @app.get("/v1/models")
        async def models(request: Request):
            if (denied := self._auth(request, Level.NORMAL)) is not None:
                return denied
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "cache_runtime", "root": self.args.model_path,
                                                "max_model_len": self.engine.runner.context_length}]}

    def _model_info(self) -> dict:
        """SGLang's /model_info keys, each with what this runtime runs: a text-only generation model
        loaded from its checkpoint (random weights for a builtin: SGLang's ``dummy`` load format), no
        parsers, no disaggregation, no weight updates."""
        path = self.args.model_path
        builtin = path in BUILTIN_CONFIGS
        return {
            "model_path": path,
            "served_model_name": self.model_name,
            "tokenizer_path": None if builtin else path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "dummy" if builtin else "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.hf_config.get("model_type"),
            "architectures": self.hf_config.get("architectures"),
        }

    def _server_info(self) -> dict:
        e, cache, runner = self.engine, self.engine.cache, self.engine.runner
        hicache = {
            "enabled": cache.host is not None,
            "layout": self.args.hicache_mem_layout,
            "io_backend": self.args.hicache_io_backend,
            "write_policy": cache.write_policy,
            "device_pool_tokens": runner.device_pool.size,
            "host_pool_tokens": cache.host.size if cache.host else 0,
            "host_pool_pinned": bool(cache.host and cache.host.pinned),
            "storage_backend": cache.storage_backend_name,
            "storage_degraded": e.storage_admin.degraded(),
        }
        # SGLang's /server_info carries its resolved arguments, both keys in clear: in SGLang mode so
        # does this one, so that what reaches a client through a fleet's front door is what would
        # reach it from real SGLang pods
        args = dataclasses.asdict(self.args) if self.args.compat_mode == "sglang" else self.args.public_dict()
        return {
            **args,
            "version": __version__,
            "engine": "bundled",
            "max_total_num_tokens": runner.device_pool.size,
            "device": str(runner.device),
            "dtype_effective": str(runner.dtype).replace("torch.", ""),
            "kv_cache_dtype_effective": str(runner.kv_dtype).replace("torch.", ""),
            "context_length_effective": runner.context_length,
            "hicache": hicache,
            "kernels": kernels.backend_info(),
            "internal_states": [{"num_running_reqs": e.num_running, "num_queue_reqs": e.num_queued}],
        }


def _hf_config(model_path: str) -> dict:
    """The checkpoint's config.json (a builtin's own config), for /model_info's model_type and architectures."""
    if model_path in BUILTIN_CONFIGS:
        return BUILTIN_CONFIGS[model_path]
    try:
        with open(os.path.join(model_path, "config.json"), "rb") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
