"""Admin routes: ``/flush_cache`` and the HiCache storage-backend API, whose attach, detach,
status and clear are ``engine.storage_admin``'s (the same code attaches the command line's
backend at boot)."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from cache_runtime.args import ServerArgs
from cache_runtime.auth import Level
from cache_runtime.engine.loop import Engine
from cache_runtime.protocol import AttachIn, BadRequest
from cache_runtime.server.handlers import Handlers


class AdminRoutes(Handlers):
    def __init__(self, args: ServerArgs, engine: Engine) -> None:
        super().__init__(args, engine)
        self._flush_pending = False  # a /flush_cache?timeout= is waiting for the engine to go idle

    def register(self, app: FastAPI) -> None:
        async def flush_cache(request: Request):
            if (denied := self._auth(request, Level.ADMIN_OPTIONAL)) is not None:
                return denied
            timeout = _flush_timeout(request.query_params.get("timeout", "0"))
            if self._flush_pending:
                return PlainTextResponse("Another flush_cache is already in progress.", status_code=400)
            ok = await self._flush()
            if not ok and timeout > 0:  # SGLang defers the flush until the engine is fully idle
                self._flush_pending = True
                try:
                    deadline = time.monotonic() + timeout
                    while not ok and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                        ok = await self._flush()
                finally:
                    self._flush_pending = False
                if not ok:
                    return PlainTextResponse("Timed out waiting for idle state.", status_code=400)
            if ok:
                return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                         "(When there are running or waiting requests, the operation will not be performed.)\n")
            return PlainTextResponse("Flush cache failed.\n", status_code=400)

        app.get("/flush_cache")(flush_cache)
        app.post("/flush_cache")(flush_cache)

        def answer(result: tuple[bool, str]) -> PlainTextResponse:
            ok, text = result
            return PlainTextResponse(text, status_code=200 if ok else 400)

        @app.put("/hicache/storage-backend")
        async def attach(request: Request):
            if (denied := self._auth(request, Level.ADMIN_REQUIRED)) is not None:
                return denied
            try:
                body: AttachIn = await self._parse(request, AttachIn)
            except (BadRequest, ValueError) as exc:
                return PlainTextResponse(f"Failed to attach HiCache storage backend.\n{exc}\n", status_code=400)
            return answer(await self.engine.storage_admin.attach(
                body.hicache_storage_backend, body.hicache_storage_backend_extra_config_json,
                body.hicache_storage_prefetch_policy, body.hicache_write_policy))

        @app.delete("/hicache/storage-backend")
        async def detach(request: Request):
            if (denied := self._auth(request, Level.ADMIN_REQUIRED)) is not None:
                return denied
            return answer(await self.engine.storage_admin.detach())

        @app.get("/hicache/storage-backend")
        async def status(request: Request):
            if (denied := self._auth(request, Level.ADMIN_REQUIRED)) is not None:
                return denied
            return self.engine.storage_admin.status()

        async def clear(request: Request):
            if (denied := self._auth(request, Level.ADMIN_OPTIONAL)) is not None:
                return denied
            return answer(await self.engine.storage_admin.clear())

        app.post("/hicache/storage-backend/clear")(clear)
        app.get("/clear_hicache_storage_backend")(clear)  # deprecated SGLang alias
        app.post("/clear_hicache_storage_backend")(clear)

    async def _flush(self) -> bool:
        return await asyncio.wrap_future(self.engine.call(self.engine.flush))


def _flush_timeout(raw: str) -> float:
    """``/flush_cache?timeout=``: seconds to wait for the engine to go fully idle (SGLang: a float >= 0)."""
    try:
        timeout = float(raw)
    except ValueError:
        timeout = float("nan")
    if not timeout >= 0:
        raise BadRequest(f"timeout must be a number of seconds >= 0, got {raw!r}")
    return timeout
