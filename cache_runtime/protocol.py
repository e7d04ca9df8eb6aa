"""Request bodies of the HTTP API (SGLang native and OpenAI), parsed with clear 400 messages."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

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
    sampling_seed: int | None = Field(default=None, alias="seed", ge=SEED_MIN, le=SEED_MAX)

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
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
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

    @field_validator("hicache_storage_backend_extra_config_json")
    @classmethod
    def _inline_only(cls, v: str | None) -> str | None:
        # "@path" is a command-line convenience; over HTTP it would read files of the server's choosing.
        if v is not None and v.lstrip().startswith("@"):
            raise ValueError("must be inline JSON; @file is accepted only on the command line")
        return v
    hicache_storage_prefetch_policy: str | None = None
    hicache_write_policy: str | None = None


class DrainIn(_Lenient):
    drain: StrictBool
