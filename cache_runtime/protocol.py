"""Request bodies of the HTTP API (SGLang native and OpenAI), parsed with clear 400 messages."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cache_runtime.models.config import GenerationDefaults
from cache_runtime.sampling import SamplingParams


# torch.Generator.manual_seed takes a 64-bit seed, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class BadRequest(ValueError):
    pass


def parse_json(body: bytes) -> object:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8: {exc}") from exc
    if not text.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    _check_strings(obj)
    return obj


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity, which are not JSON and would slip past range checks.
    raise BadRequest(f"request body is not valid JSON: {name} is not a JSON number")


def _check_strings(obj: object) -> None:
    """Lone UTF-16 surrogate escapes ("\\ud800") decode to strings that cannot be encoded as UTF-8:
    they would fail later, in tokenizing or in writing the response, so refuse them here."""
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, str):
            items = (cur,)
        elif isinstance(cur, dict):
            items = cur.keys()
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)
            continue
        else:
            continue
        for s in items:
            if not s.isascii():
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadRequest("request body has a string with a lone UTF-16 surrogate escape; "
                                     "strings must be valid Unicode") from None


def validate(model: type[BaseModel], obj: object) -> BaseModel:
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err["loc"]) or "body"
            parts.append(f"{loc}: {err['msg']}")
        raise BadRequest("invalid request: " + "; ".join(parts)) from None


def _stop_list(v):
    if v is None:
        return []
    return [v] if isinstance(v, str) else v


def _pick(given, configured, default):
    """A request's value, else generation_config.json's, else the server's own default."""
    if given is not None:
        return given
    return configured if configured is not None else default


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# SGLang/OpenAI options this runtime does not implement, each with the test of its neutral value: a
# request may send the neutral value (clients often do), any other value is refused rather than ignored.
_UNSUPPORTED = {
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "min_tokens": lambda v: v == 0,
    "logit_bias": lambda v: not v,
    "regex": lambda v: v is None,
    "json_schema": lambda v: v is None,
    "ebnf": lambda v: v is None,
    "response_format": lambda v: not v or v == {"type": "text"},
}


class _Sampling(_Lenient):
    """Sampling fields shared by every route. None means unset: the generation_config.json value applies,
    else the server default (greedy). Ranges are checked by ``SamplingParams.validate``, whose messages
    use these same field names."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, neutral in _UNSUPPORTED.items():
                value = data.get(name)
                if value is not None and not neutral(value):
                    raise ValueError(f"{name}={value!r} is not supported by this server")
        return data

    def sampling(self, gen: GenerationDefaults, max_new_tokens: int, seed: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=_pick(self.temperature, gen.temperature, 0.0),
            top_p=_pick(self.top_p, gen.top_p, 1.0),
            top_k=_pick(self.top_k, gen.top_k, -1),
            stop=_stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            seed=seed,
            min_p=_pick(self.min_p, gen.min_p, 0.0),
        )


class _CacheKeys(_Lenient):
    """SGLang's cache-namespace fields (``GenerateReqInput`` and its OpenAI requests): ``extra_key`` and
    ``cache_salt`` each isolate cached prefixes, in L1/L2 and in L3 (where they seed the first page key).
    A single request takes a string; a batch takes one string for every prompt or a list with one per
    prompt. An empty string is the same as none."""

    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None

    def cache_keys(self, batch_size: int | None) -> list[tuple[str | None, str | None]]:
        """(extra_key, cache_salt) for each prompt; ``batch_size`` None for a single request."""
        per_field = []
        for name in ("extra_key", "cache_salt"):
            value = getattr(self, name)
            if batch_size is None:
                if isinstance(value, list):
                    raise BadRequest(f"{name} should be a string for a single request")
                per_field.append([value or None])
            elif isinstance(value, list):
                if len(value) != batch_size:
                    raise BadRequest(f"the length of {name} ({len(value)}) should be equal to the batch size "
                                     f"({batch_size})")
                per_field.append([v or None for v in value])
            else:
                per_field.append([value or None] * batch_size)
        return list(zip(*per_field))


class SamplingParamsIn(_Sampling):
    max_new_tokens: int = Field(default=128, ge=0)
    sampling_seed: int | None = Field(default=None, alias="seed", ge=SEED_MIN, le=SEED_MAX)

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    def to_params(self, gen: GenerationDefaults) -> SamplingParams:
        return self.sampling(gen, self.max_new_tokens, self.sampling_seed)


class GenerateIn(_CacheKeys):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False


class StreamOptions(_Lenient):
    include_usage: bool = False


class _OpenAIRequest(_Sampling, _CacheKeys):
    model: str | None = None
    n: int = 1
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v


class CompletionIn(_OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = None
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs is not supported")
        return v

    def to_params(self, gen: GenerationDefaults) -> SamplingParams:
        return self.sampling(gen, 16 if self.max_tokens is None else self.max_tokens, self.seed)


class ChatMessage(BaseModel):
    """One message; keys other than role and content (name, tool_calls, tool_call_id, reasoning_content)
    go to the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        """A string, null, or a list of text parts, which become one string joined by spaces (as SGLang
        renders list content for string-content templates); other part types are refused."""
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of content parts")
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content[{i}]: part type {kind!r} is not supported (text only)")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content[{i}]: a text part needs a string 'text'")
            texts.append(part["text"])
        return " ".join(texts)


class Function(_Lenient):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: Function


# apply_chat_template's own parameters: chat_template_kwargs may not override them
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")


class ChatCompletionIn(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    chat_template_kwargs: dict | None = None
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs is not supported")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved(cls, v: dict | None) -> dict | None:
        for key in _RESERVED_TEMPLATE_KWARGS:
            if v and key in v:
                raise ValueError(f"{key!r} is set by the request itself, not through chat_template_kwargs")
        return v

    def template_tools(self) -> list[dict] | None:
        """The tools as SGLang hands them to the template: each tool's function object; none when
        tool_choice is "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.function.model_dump(exclude_none=True) for tool in self.tools]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class AttachIn(_Lenient):
    hicache_storage_backend: str
    hicache_storage_backend_extra_config_json: str | None = None

    @field_validator("hicache_storage_backend_extra_config_json")
    @classmethod
    def _inline_only(cls, v: str | None) -> str | None:
        # "@path" is a command-line convenience; over HTTP it would read files of the server's choosing.
        if v is not None and v.lstrip().startswith("@"):
            raise ValueError("must be inline JSON; @file is accepted only on the command line")
        return v
    hicache_storage_prefetch_policy: str | None = None
    hicache_write_policy: str | None = None

