"""FastAPI server: SGLang's native and OpenAI routes, the HiCache admin API, and bundled-mode extras."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import kernels
from cache_runtime import __version__
from cache_runtime.args import ServerArgs
from cache_runtime.auth import Level, check
from cache_runtime.metrics import Metrics
from cache_runtime.models import BUILTIN_CONFIGS
from cache_runtime.protocol import (AttachIn, BadRequest, ChatCompletionIn, CompletionIn, GenerateIn,
                                    parse_json, validate)
from cache_runtime.sampling import SamplingParams
from cache_runtime.scheduler import Engine, Output, StorageAttach
from cache_runtime.scheduler import Request as EngineRequest
from cache_runtime.tokenization import ChatTemplateError, Tokenizer

log = logging.getLogger(__name__)


def error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _shown_ids(out: Output) -> list[int]:
    """The output ids whose text the client gets: as in SGLang, a matched stop token (EOS or one of
    stop_token_ids) ends the output without appearing in it; output_ids and usage still count it."""
    ids = out.output_ids
    if out.finished and isinstance((out.finish_reason or {}).get("matched"), int) and ids:
        return ids[:-1]
    return ids


def _cut_at_stop(text: str, out: Output) -> str:
    """The text before the first occurrence of the stop string the request matched (SGLang's trim)."""
    matched = (out.finish_reason or {}).get("matched")
    if isinstance(matched, str) and matched and (pos := text.find(matched)) != -1:
        return text[:pos]
    return text


def _finish(out: Output) -> dict:
    """OpenAI's finish_reason ("stop", "length", SGLang's "abort") and SGLang's matched_stop (the stop
    string or token id that ended the output)."""
    reason = out.finish_reason if out.finished else None
    return {"finish_reason": reason["type"] if reason else None, "matched_stop": (reason or {}).get("matched")}


class TextStream:
    """A request's output text as it grows, for streaming.

    New ids go through the tokenizer's incremental decoder, and a tail that could still grow into a
    stop string is held back, so emitted text is never cut afterwards: the pieces join to the
    non-streamed text of the same output.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool) -> None:
        self._decoder = tokenizer.decoder(skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._fed = 0
        self._decoded = ""
        self.text = ""  # emitted so far

    def update(self, out: Output) -> str:
        """The text to emit for this output (possibly empty)."""
        ids = _shown_ids(out)
        self._decoded += self._decoder.feed(ids[self._fed:])
        self._fed = len(ids)
        if out.finished:
            self._decoded = _cut_at_stop(self._decoded + self._decoder.flush(), out)
            end = len(self._decoded)
        else:
            end = len(self._decoded) - self._held()
        delta = self._decoded[len(self.text):max(end, len(self.text))]
        self.text += delta
        return delta

    def _held(self) -> int:
        """The length of the longest tail of the decoded text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._decoded)), best, -1):
                if self._decoded.endswith(s[:k]):
                    best = k
                    break
        return best


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


_SSE_DONE = b"data: [DONE]\n\n"


class Server:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.engine = Engine(args)
        self.model_name = args.served_name
        self.metrics = Metrics(self.engine)
        self.engine.on_first_token = self.metrics.first_token
        self.engine.on_finish = self.metrics.finished
        self.hf_config = _hf_config(args.model_path)
        self._flush_pending = False  # a /flush_cache?timeout= is waiting for the engine to go idle
        self.app = self._build_app()

    # ------------------------------------------------------------------ plumbing
    def _auth(self, request: Request, level: Level):
        return check(request, level, self.args.api_key, self.args.admin_api_key)

    async def _body(self, request: Request) -> bytes:
        limit = self.args.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _TooLarge()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _TooLarge()
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

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app):
            self.engine.start()
            yield
            await asyncio.to_thread(self.engine.shutdown)

        app = FastAPI(title="cache_runtime", version=__version__, lifespan=lifespan, docs_url=None,
                      redoc_url=None, openapi_url=None)

        @app.exception_handler(BadRequest)
        async def _bad(_r, exc):
            return error(400, str(exc))

        @app.exception_handler(_TooLarge)
        async def _large(_r, _exc):
            return error(413, f"request body exceeds {self.args.max_request_bytes} bytes", "RequestTooLarge")

        @app.exception_handler(ClientDisconnect)
        async def _gone(_r, _exc):
            # the client left while its body was arriving: there is no one to answer
            return Response(status_code=499)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_r, exc):
            return error(400, f"invalid request: {exc.errors()[:3]}")

        @app.exception_handler(StarletteHTTPException)
        async def _http(_r, exc):
            return error(exc.status_code, str(exc.detail), "NotFound" if exc.status_code == 404 else "HTTPError")

        @app.exception_handler(Exception)
        async def _internal(_r, exc):
            log.exception("unhandled error")
            return error(500, f"internal error: {type(exc).__name__}", "InternalServerError")

        self._routes_inference(app)
        self._routes_info(app)
        self._routes_admin(app)
        return app

    # ------------------------------------------------------------------ inference
    def _submit_all(self, prompts: list[list[int]], params: SamplingParams, cache_keys: list[tuple],
                    rid: str | None = None, stream: bool = False) -> list[tuple[EngineRequest, asyncio.Queue]]:
        """Validates every prompt before submitting any, so a bad one in a batch leaves none running.
        ``cache_keys``: each prompt's (extra_key, cache_salt)."""
        try:
            for ids in prompts:
                self.engine.validate(ids, params)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return [self._submit(ids, params, rid, cache_keys=keys, stream=stream)
                for ids, keys in zip(prompts, cache_keys)]

    def _room(self, prompt_tokens: int) -> int:
        """The default output budget of a chat request: what the context and the KV pool leave."""
        ctx, pool = self.engine.context_length, self.engine.device_pool.size
        room = min(ctx, pool) - prompt_tokens
        if room < 1:
            raise BadRequest(f"the prompt ({prompt_tokens} tokens) leaves no room to generate within the context "
                             f"length ({ctx}) and the KV pool (--max-total-tokens {pool})")
        return room

    def _text_stream(self, params: SamplingParams, skip_special_tokens: bool) -> TextStream:
        return TextStream(self.engine.tokenizer, params.stop, skip_special_tokens)

    def _routes_inference(self, app: FastAPI) -> None:
        @app.post("/generate")
        async def generate(request: Request):
            if (denied := self._auth(request, Level.NORMAL)) is not None:
                return denied
            body: GenerateIn = await self._parse(request, GenerateIn)
            if (body.text is None) == (body.input_ids is None):
                raise BadRequest("exactly one of text or input_ids is required")
            prompts = body.text if body.text is not None else body.input_ids
            batch = isinstance(prompts, list) and (body.text is not None or (prompts and isinstance(prompts[0], list)))
            if not batch:
                prompts = [prompts]
            if not prompts:
                raise BadRequest("the batch is empty")
            if body.stream and batch:
                raise BadRequest("streaming a batch of prompts is not supported")
            ids = [self.engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
            sp = body.sampling_params
            params = sp.to_params(self.engine.generation)
            cache_keys = body.cache_keys(len(ids) if batch else None)
            submitted = self._submit_all(ids, params, cache_keys, body.rid if not batch else None, stream=body.stream)
            if body.stream:
                text = self._text_stream(params, sp.skip_special_tokens)

                def render(out: Output) -> list[dict]:
                    text.update(out)
                    return [{"text": text.text, "output_ids": out.output_ids,
                             "meta_info": self._meta(out, body.return_logprob)}]

                return self._sse_response(*submitted[0], render)
            outs = await asyncio.gather(*(self._collect(r, q) for r, q in submitted))
            results = []
            for out in outs:
                if out.error:
                    return error(500, out.error, "InternalServerError")
                results.append({"text": self._final_text(out, sp.skip_special_tokens), "output_ids": out.output_ids,
                                "meta_info": self._meta(out, body.return_logprob)})
            return results if batch else results[0]

        @app.post("/v1/completions")
        async def completions(request: Request):
            if (denied := self._auth(request, Level.NORMAL)) is not None:
                return denied
            body: CompletionIn = await self._parse(request, CompletionIn)
            prompt, encode = body.prompt, self.engine.tokenizer.encode
            if isinstance(prompt, str):
                prompts = [encode(prompt)]
            elif prompt and isinstance(prompt[0], str):
                prompts = [encode(p) for p in prompt]
            elif prompt and isinstance(prompt[0], list):
                prompts = list(prompt)
            else:
                prompts = [prompt]
            if body.stream and len(prompts) != 1:
                raise BadRequest("streaming a batch of prompts is not supported")
            params = body.to_params(self.engine.generation)
            batch = bool(prompt) and isinstance(prompt, list) and isinstance(prompt[0], (str, list))
            submitted = self._submit_all(prompts, params, body.cache_keys(len(prompts) if batch else None),
                                         stream=body.stream)
            cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

            def head(obj: str) -> dict:
                return {"id": cid, "object": obj, "created": created, "model": self.model_name}

            if body.stream:
                text = self._text_stream(params, body.skip_special_tokens)
                include_usage = bool(body.stream_options and body.stream_options.include_usage)

                def render(out: Output) -> list[dict]:
                    delta = text.update(out)
                    if not delta and not out.finished:
                        return []
                    events = [{**head("text_completion"),
                               "choices": [{"index": 0, "text": delta, "logprobs": None, **_finish(out)}], "usage": None}]
                    if out.finished and include_usage:
                        events.append({**head("text_completion"), "choices": [], "usage": self._usage([out])})
                    return events

                return self._sse_response(*submitted[0], render)
            outs = await asyncio.gather(*(self._collect(r, q) for r, q in submitted))
            choices = []
            for i, out in enumerate(outs):
                if out.error:
                    return error(500, out.error, "InternalServerError")
                choices.append({"index": i, "text": self._final_text(out, body.skip_special_tokens), "logprobs": None,
                                **_finish(out)})
            return {**head("text_completion"), "choices": choices, "usage": self._usage(outs)}

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            if (denied := self._auth(request, Level.NORMAL)) is not None:
                return denied
            body: ChatCompletionIn = await self._parse(request, ChatCompletionIn)
            tokenizer = self.engine.tokenizer
            if not tokenizer.has_chat_template:
                raise BadRequest(f"model {self.model_name!r} has no chat template; send a prompt to "
                                 "/v1/completions or /generate instead")
            try:
                prompt = tokenizer.apply_chat_template([m.model_dump() for m in body.messages],
                                                       add_generation_prompt=True, tools=body.template_tools(),
                                                       **(body.chat_template_kwargs or {}))
            except ChatTemplateError as exc:
                raise BadRequest(f"messages: the chat template refused them: {exc}") from None
            ids = tokenizer.encode(prompt, add_special_tokens=False)  # the template wrote the control tokens
            max_tokens = body.requested_max_tokens()
            params = body.sampling(self.engine.generation, self._room(len(ids)) if max_tokens is None else max_tokens,
                                   body.seed)
            [(req, q)] = self._submit_all([ids], params, body.cache_keys(None), stream=body.stream)
            cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

            if body.stream:
                text = self._text_stream(params, body.skip_special_tokens)
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                first = True

                def chunk(delta: dict, finish: dict | None = None) -> dict:
                    finish = finish or {"finish_reason": None, "matched_stop": None}
                    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                            "choices": [{"index": 0, "delta": delta, "logprobs": None, **finish}], "usage": None}

                def render(out: Output) -> list[dict]:
                    nonlocal first
                    events = []
                    if first:
                        events.append(chunk({"role": "assistant", "content": ""}))
                        first = False
                    if delta := text.update(out):
                        events.append(chunk({"content": delta}))
                    if out.finished:
                        events.append(chunk({}, _finish(out)))
                        if include_usage:
                            events.append({**chunk({}), "choices": [], "usage": self._usage([out])})
                    return events

                return self._sse_response(req, q, render)
            out = await self._collect(req, q)
            if out.error:
                return error(500, out.error, "InternalServerError")
            message = {"role": "assistant", "content": self._final_text(out, body.skip_special_tokens)}
            return {"id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "message": message, "logprobs": None, **_finish(out)}],
                    "usage": self._usage([out])}

    def _final_text(self, out: Output, skip_special_tokens: bool) -> str:
        return _cut_at_stop(self.engine.tokenizer.decode(_shown_ids(out), skip_special_tokens=skip_special_tokens), out)

    def _usage(self, outs: list[Output]) -> dict:
        prompt = sum(o.meta["prompt_tokens"] for o in outs)
        completion = sum(o.meta["completion_tokens"] for o in outs)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": None}
        if self.args.enable_cache_report:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(o.meta["cached_tokens"] for o in outs)}
        return usage

    def _sse_response(self, req: EngineRequest, q: asyncio.Queue,
                      render: Callable[[Output], list[dict]]) -> StreamingResponse:
        return StreamingResponse(self._sse(req, q, render), media_type="text/event-stream")

    async def _sse(self, req: EngineRequest, q: asyncio.Queue,
                   render: Callable[[Output], list[dict]]) -> AsyncIterator[bytes]:
        """The events ``render`` makes of each output, an error event if the request fails, then [DONE].
        A client that goes away mid-stream aborts its request."""
        finished = False
        try:
            while not finished:
                out: Output = await q.get()
                finished = out.finished
                if out.error:
                    yield _sse({"error": {"message": out.error, "type": "InternalServerError", "code": 500}})
                    break
                for obj in render(out):
                    yield _sse(obj)
            yield _SSE_DONE
        finally:
            if not finished:
                self.engine.abort(req)

    # ------------------------------------------------------------------ info
    def _routes_info(self, app: FastAPI) -> None:
        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.get("/health_generate")
        async def health_generate():
            tokenizer = self.engine.tokenizer
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
                                                "max_model_len": self.engine.context_length}]}

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
        e, cache = self.engine, self.engine.cache
        storage = cache.storage
        hicache = {
            "enabled": cache.host is not None,
            "layout": self.args.hicache_mem_layout,
            "io_backend": self.args.hicache_io_backend,
            "write_policy": cache.write_policy,
            "device_pool_tokens": e.device_pool.size,
            "host_pool_tokens": cache.host.size if cache.host else 0,
            "host_pool_pinned": bool(cache.host and cache.host.pinned),
            "storage_backend": cache.storage_backend_name,
            "storage_degraded": (storage.degraded if storage else None) or e.storage_status_reason,
        }
        # SGLang's /server_info carries its resolved arguments, both keys in clear: in SGLang mode so
        # does this one, so that what reaches a client through a fleet's front door is what would
        # reach it from real SGLang pods
        args = dataclasses.asdict(self.args) if self.args.compat_mode == "sglang" else self.args.public_dict()
        return {
            **args,
            "version": __version__,
            "engine": "bundled",
            "max_total_num_tokens": e.device_pool.size,
            "device": str(e.device),
            "dtype_effective": str(e.dtype).replace("torch.", ""),
            "kv_cache_dtype_effective": str(e.kv_dtype).replace("torch.", ""),
            "context_length_effective": e.context_length,
            "hicache": hicache,
            "kernels": kernels.backend_info(),
            "internal_states": [{"num_running_reqs": e.num_running, "num_queue_reqs": e.num_queued}],
        }

    # ------------------------------------------------------------------ admin
    def _routes_admin(self, app: FastAPI) -> None:
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

        @app.put("/hicache/storage-backend")
        async def attach(request: Request):
            if (denied := self._auth(request, Level.ADMIN_REQUIRED)) is not None:
                return denied
            try:
                body: AttachIn = await self._parse(request, AttachIn)
                return await self._attach(body)
            except (BadRequest, ValueError) as exc:
                return PlainTextResponse(f"Failed to attach HiCache storage backend.\n{exc}\n", status_code=400)

        @app.delete("/hicache/storage-backend")
        async def detach(request: Request):
            if (denied := self._auth(request, Level.ADMIN_REQUIRED)) is not None:
                return denied

            def run():
                if not self.engine.is_idle():
                    return self._not_idle("detach")
                self.engine.cache.detach_storage()
                self.args.hicache_storage_backend = None
                self.args.hicache_storage_backend_extra_config = None
                self.engine.storage_status_reason = None
                return None

            refused = await asyncio.wrap_future(self.engine.call(run))
            if refused:
                return PlainTextResponse(f"Failed to detach HiCache storage backend.\n{refused}\n", status_code=400)
            return PlainTextResponse("HiCache storage backend detached.\n")

        @app.get("/hicache/storage-backend")
        async def status(request: Request):
            if (denied := self._auth(request, Level.ADMIN_REQUIRED)) is not None:
                return denied
            cache = self.engine.cache
            out = {
                "hicache_storage_backend": cache.storage_backend_name,
                "hicache_storage_backend_extra_config": (json.dumps(cache.storage_extra_config)
                                                         if cache.storage is not None else None),
                "hicache_storage_prefetch_policy": self.args.hicache_storage_prefetch_policy,
                "hicache_write_policy": cache.write_policy,
            }
            if self.args.compat_mode == "bundled":
                storage = cache.storage
                out["hicache_storage_degraded"] = (storage.degraded if storage else None) or \
                    self.engine.storage_status_reason
            return out

        async def clear(request: Request):
            if (denied := self._auth(request, Level.ADMIN_OPTIONAL)) is not None:
                return denied
            storage = self.engine.cache.storage
            if storage is None:
                return PlainTextResponse("Failed to clear HiCache storage backend.\nNo storage backend attached.\n",
                                         status_code=400)
            try:
                await asyncio.to_thread(storage.ranks.clear)
            except Exception as exc:
                return PlainTextResponse(f"Failed to clear HiCache storage backend.\n{type(exc).__name__}: {exc}\n",
                                         status_code=400)
            return PlainTextResponse("HiCache storage backend cleared.\n")

        app.post("/hicache/storage-backend/clear")(clear)
        app.get("/clear_hicache_storage_backend")(clear)  # deprecated SGLang alias
        app.post("/clear_hicache_storage_backend")(clear)

    async def _flush(self) -> bool:
        return await asyncio.wrap_future(self.engine.call(self.engine.flush))

    def _not_idle(self, what: str) -> str:
        return (f"Reject {what}: scheduler is not idle. #queue-req={self.engine.num_queued} "
                f"#running-req={self.engine.num_running}")

    async def _attach(self, body: AttachIn):
        engine = self.engine
        want = StorageAttach.parse(body.hicache_storage_backend, body.hicache_storage_backend_extra_config_json,
                                   body.hicache_storage_prefetch_policy or self.args.hicache_storage_prefetch_policy,
                                   body.hicache_write_policy or engine.cache.write_policy)
        name = want.name

        def precheck():
            if engine.cache.host is None:
                return "HiCache storage needs --enable-hierarchical-cache (no host pool on this server)."
            if not engine.is_idle():
                return self._not_idle("attach")
            current = engine.cache.storage_backend_name
            if current is not None and current != name:
                return f"HiCache storage backend '{current}' is attached. Cannot attach different backend '{name}'. Detach first."
            if current == name:  # same backend: only the policies change
                engine.set_storage_policies(want)
                return "same"
            return None

        verdict = await asyncio.wrap_future(engine.call(precheck))
        if verdict == "same":
            return PlainTextResponse("HiCache storage backend already enabled with same backend; policies updated.\n")
        if verdict:
            return PlainTextResponse(f"Failed to attach HiCache storage backend.\n{verdict}\n", status_code=400)
        try:
            backend = await asyncio.to_thread(engine.open_storage, want)
        except Exception as exc:
            return PlainTextResponse(f"Failed to attach HiCache storage backend.\n{type(exc).__name__}: {exc}\n",
                                     status_code=400)

        def install():
            if engine.cache.storage is not None:  # another attach won the race
                return f"HiCache storage backend '{engine.cache.storage_backend_name}' is attached. Detach first."
            engine.install_storage(want, backend)
            return None

        refused = await asyncio.wrap_future(engine.call(install))
        if refused:
            await asyncio.to_thread(backend.close)
            return PlainTextResponse(f"Failed to attach HiCache storage backend.\n{refused}\n", status_code=400)
        return PlainTextResponse("HiCache storage backend attached.\n")


class _TooLarge(Exception):
    pass


def _flush_timeout(raw: str) -> float:
    """``/flush_cache?timeout=``: seconds to wait for the engine to go fully idle (SGLang: a float >= 0)."""
    try:
        timeout = float(raw)
    except ValueError:
        timeout = float("nan")
    if not timeout >= 0:
        raise BadRequest(f"timeout must be a number of seconds >= 0, got {raw!r}")
    return timeout


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


# How long an idle client connection stays open. Clients and gateways must close idle
# connections before the server does: uvicorn's default (5 s) equals httpx's keep-alive expiry,
# so a request sent on a connection idle for ~5 s could cross the server's close and fail with no
# response (seen once under the swap bench, where pods sit out of serving for seconds). Longer
# than common proxy idle timeouts (nginx upstream 60 s), as nginx's and aiohttp's own 75 s.
KEEP_ALIVE_SECONDS = 75


def run(args: ServerArgs) -> None:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = Server(args)
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_SECONDS)
