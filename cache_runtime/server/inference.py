"""Generation routes: SGLang's native ``/generate`` and OpenAI's ``/v1/completions`` and
``/v1/chat/completions``, whole answers or server-sent event streams."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from cache_runtime.auth import Level
from cache_runtime.engine.requests import Output
from cache_runtime.engine.requests import Request as EngineRequest
from cache_runtime.protocol import BadRequest, ChatCompletionIn, CompletionIn, GenerateIn
from cache_runtime.sampling import SamplingParams
from cache_runtime.server.handlers import Handlers, error
from cache_runtime.server.text import TextStream, final_text, finish_fields
from cache_runtime.tokenization import ChatTemplateError


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


_SSE_DONE = b"data: [DONE]\n\n"


class InferenceRoutes(Handlers):
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
        ctx, pool = self.engine.runner.context_length, self.engine.runner.device_pool.size
        room = min(ctx, pool) - prompt_tokens
        if room < 1:
            raise BadRequest(f"the prompt ({prompt_tokens} tokens) leaves no room to generate within the context "
                             f"length ({ctx}) and the KV pool (--max-total-tokens {pool})")
        return room

    def _text_stream(self, params: SamplingParams, skip_special_tokens: bool) -> TextStream:
        return TextStream(self.engine.runner.tokenizer, params.stop, skip_special_tokens)

    def register(self, app: FastAPI) -> None:
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
            ids = [self.engine.runner.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
            sp = body.sampling_params
            params = sp.to_params(self.engine.runner.generation)
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
            prompt, encode = body.prompt, self.engine.runner.tokenizer.encode
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
            params = body.to_params(self.engine.runner.generation)
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
                               "choices": [{"index": 0, "text": delta, "logprobs": None, **finish_fields(out)}], "usage": None}]
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
                                **finish_fields(out)})
            return {**head("text_completion"), "choices": choices, "usage": self._usage(outs)}

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            if (denied := self._auth(request, Level.NORMAL)) is not None:
                return denied
            body: ChatCompletionIn = await self._parse(request, ChatCompletionIn)
            tokenizer = self.engine.runner.tokenizer
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
            params = body.sampling(self.engine.runner.generation, self._room(len(ids)) if max_tokens is None else max_tokens,
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
                        events.append(chunk({}, finish_fields(out)))
                        if include_usage:
                            events.append({**chunk({}), "choices": [], "usage": self._usage([out])})
                    return events

                return self._sse_response(req, q, render)
            out = await self._collect(req, q)
            if out.error:
                return error(500, out.error, "InternalServerError")
            message = {"role": "assistant", "content": self._final_text(out, body.skip_special_tokens)}
            return {"id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "message": message, "logprobs": None, **finish_fields(out)}],
                    "usage": self._usage([out])}

    def _final_text(self, out: Output, skip_special_tokens: bool) -> str:
        return final_text(self.engine.runner.tokenizer, out, skip_special_tokens)

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
