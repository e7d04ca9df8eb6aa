"""Request bodies of the HTTP API (SGLang native and OpenAI), parsed with clear 400 messages."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from cache_runtime.sampling import SamplingParams


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
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


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


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingParamsIn(_Lenient):
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = Field(default=None, alias="seed")

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    def to_params(self) -> SamplingParams:
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p, self.top_k, _stop_list(self.stop),
                              list(self.stop_token_ids or []), self.ignore_eos, self.sampling_seed)


class GenerateIn(_Lenient):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False


class StreamOptions(_Lenient):
    include_usage: bool = False


class CompletionIn(_Lenient):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    seed: int | None = None
    echo: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def to_params(self) -> SamplingParams:
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, _stop_list(self.stop),
                              [], False, self.seed)


class AttachIn(_Lenient):
    hicache_storage_backend: str
    hicache_storage_backend_extra_config_json: str | None = None
    hicache_storage_prefetch_policy: str | None = None
    hicache_write_policy: str | None = None


class DrainIn(_Lenient):
    drain: StrictBool
