"""What every route group shares: auth, bounded body reading and parsing, error bodies, and
submitting a request to the engine with an asyncio queue for its outputs.

Handlers run on the server's event loop; they reach the engine only through ``Engine.submit``,
``abort`` and ``call``, never touching its state, which the engine thread owns.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from cache_runtime.args import ServerArgs
from cache_runtime.auth import Level, check
from cache_runtime.engine.loop import Engine
from cache_runtime.engine.requests import Output
from cache_runtime.engine.requests import Request as EngineRequest
from cache_runtime.protocol import parse_json, validate
from cache_runtime.sampling import SamplingParams


def error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class TooLarge(Exception):
    """A request body over --max-request-bytes (answered 413)."""


class Handlers:
    """Base of the route groups: the server's args and engine, and the plumbing they share."""

    def __init__(self, args: ServerArgs, engine: Engine) -> None:
        self.args = args
        self.engine = engine
        self.model_name = args.served_name

    def _auth(self, request: Request, level: Level):
        return check(request, level, self.args.api_key, self.args.admin_api_key)

    async def _body(self, request: Request) -> bytes:
        limit = self.args.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise TooLarge()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge()
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(self, request: Request, model):
        return validate(model, parse_json(await self._body(request)))

    def _submit(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                cache_keys: tuple[str | None, str | None] = (None, None),
                stream: bool = False) -> tuple[EngineRequest, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        extra_key, cache_salt = cache_keys
        req = EngineRequest(input_ids, params, lambda out: loop.call_soon_threadsafe(q.put_nowait, out), rid,
                            extra_key=extra_key, cache_salt=cache_salt, stream=stream)
        self.engine.submit(req)
        return req, q

    async def _collect(self, req: EngineRequest, q: asyncio.Queue) -> Output:
        try:
            while True:
                out = await q.get()
                if out.finished:
                    return out
        except asyncio.CancelledError:
            self.engine.abort(req)
            raise

    def _meta(self, out: Output, return_logprob: bool) -> dict:
        meta = dict(out.meta)
        meta["finish_reason"] = out.finish_reason
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(out.logprobs, out.output_ids)]
        return meta
