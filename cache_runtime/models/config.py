"""A Hugging Face ``config.json`` read into what the runtime needs, with transformers' defaults.

Pure Python (no torch): the operator imports it to size host pools from the same rules the
runtime allocates by (``kv_bytes_per_token``). Every refusal is a ``CheckpointError`` naming the
file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# architecture -> family module; what the bundled runtime serves
LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
DEEPSEEK_FAMILY = ("DeepseekV3ForCausalLM",)
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + DEEPSEEK_FAMILY
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# transformers 5.23's config-class defaults for keys a config.json leaves out (a key present
# with null keeps transformers' null handling: e.g. num_key_value_heads null = num_attention_heads)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "Qwen2ForCausalLM": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "sliding_window": 4096,
                         "max_window_layers": 28},
    "Qwen3ForCausalLM": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
                         "sliding_window": 4096, "max_window_layers": 28},
    "MistralForCausalLM": {"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "DeepseekV3ForCausalLM": {"num_key_value_heads": 128, "max_position_embeddings": 4096, "q_lora_rank": 1536,
                              "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                              "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
                              "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3,
                              "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class CheckpointError(ValueError):
    """A checkpoint the runtime cannot serve; the message names the file and the field or tensor."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn (DeepSeek)
    mscale_all_dim: float = 0.0  # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn
    interleave: bool = False  # DeepSeek's rope_interleave: rotate (x0,x1),(x2,x3)... pairs


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def kv_dim(self) -> int:
        """Width of one token's cache row: the normed latent, then the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False  # q/k/v/o biases (Llama's attention_bias)
    qkv_bias: bool = False  # q/k/v biases without o (Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    rope: RopeConfig = field(default_factory=RopeConfig)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None  # the checkpoint's own dtype, for --dtype auto
    name: str = ""
    source: str = "config.json"  # where it was read from, for messages

    @property
    def family(self) -> str:
        return "deepseek" if self.architecture in DEEPSEEK_FAMILY else "llama"

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (each query sees the last W positions, itself included), or None."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one TP rank holds: split across ranks, replicated when ranks outnumber them (SGLang)."""
        return max(1, self.num_kv_heads // tp)

    def kv_row(self, tp: int = 1) -> tuple[int, int]:
        """(heads, width) of one token's cache row per layer on one rank: K and V each, or MLA's one row."""
        if self.mla is not None:
            return 1, self.mla.kv_dim
        return self.kv_heads_per_rank(tp), self.head_dim


def kv_cell_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                  mla_kv_dim: int | None = None, tp: int = 1, pp: int = 1) -> int:
    """KV bytes one token takes on ONE rank (SGLang's cell size): the operator sizes host pools
    with it and the runtime allocates its pools with it.

    MHA/GQA: 2 (K and V) x layers x KV heads per rank x head_dim x bytes, heads split across TP
    ranks and replicated when ranks outnumber them. MLA: layers x (kv_lora_rank +
    qk_rope_head_dim) x bytes, not split across TP. Layers split over PP stages.
    """
    layers = -(-num_layers // pp)
    if mla_kv_dim is not None:
        return layers * mla_kv_dim * dtype_bytes
    return 2 * layers * max(1, num_kv_heads // tp) * head_dim * dtype_bytes


def kv_bytes_per_token(cfg: ModelConfig, dtype: str, tp: int = 1, pp: int = 1) -> int:
    """``kv_cell_bytes`` of a parsed config.json for a KV dtype name."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    return kv_cell_bytes(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         dtype_bytes=DTYPE_BYTES[dtype], mla_kv_dim=cfg.mla.kv_dim if cfg.mla else None,
                         tp=tp, pp=pp)


# ---------------------------------------------------------------------------------------------- parsing

class _Reader:
    """Typed access to one JSON file's fields, each failure naming the file and the field."""

    def __init__(self, data: dict, source: str) -> None:
        self.data, self.source = data, source

    def fail(self, key: str, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {key}: {msg}")

    def get(self, key: str, kind, default: Any = ..., minimum: float | None = None):
        value = self.data.get(key, None)
        if value is None:
            if default is ...:
                raise self.fail(key, "missing")
            return default
        ok = isinstance(value, kind) and not (kind in (int, float, (int, float)) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise self.fail(key, f"expected {getattr(kind, '__name__', kind)}, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value!r}")
        return value


def _rope(r: _Reader, head_dim: int, max_pos: int, interleave: bool) -> RopeConfig:
    params = r.data.get("rope_parameters") or r.data.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise r.fail("rope_scaling", f"expected an object, got {params!r}")
    pr = _Reader(params, f"{r.source} rope_scaling")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise r.fail("rope_scaling.rope_type", f"{rope_type!r} is not supported by the bundled runtime "
                                               f"(supported: {', '.join(ROPE_TYPES)})")
    theta = pr.get("rope_theta", float, r.get("rope_theta", float, 10000.0, minimum=1e-9), minimum=1e-9)
    if params.get("partial_rotary_factor", r.data.get("partial_rotary_factor", 1.0)) not in (1, 1.0, None):
        raise r.fail("partial_rotary_factor", "partial rotary embeddings are not supported by the bundled runtime")
    kw: dict[str, Any] = {"rope_type": rope_type, "theta": theta, "interleave": interleave}
    if rope_type in ("linear", "llama3", "yarn"):
        kw["factor"] = pr.get("factor", float, minimum=1e-9 if rope_type != "yarn" else 1.0) \
            if rope_type != "yarn" or params.get("factor") is not None else None
    if rope_type in ("llama3", "yarn"):
        kw["original_max_position_embeddings"] = pr.get(
            "original_max_position_embeddings", int,
            r.get("original_max_position_embeddings", int, max_pos), minimum=1)
    if rope_type == "llama3":
        kw["low_freq_factor"] = pr.get("low_freq_factor", float)
        kw["high_freq_factor"] = pr.get("high_freq_factor", float)
        if kw["high_freq_factor"] <= kw["low_freq_factor"]:
            raise r.fail("rope_scaling.high_freq_factor", "must be larger than low_freq_factor")
    if rope_type == "yarn":
        if kw["factor"] is None:
            kw["factor"] = max_pos / kw["original_max_position_embeddings"]
        kw["beta_fast"] = pr.get("beta_fast", float, 0.0) or 32.0
        kw["beta_slow"] = pr.get("beta_slow", float, 0.0) or 1.0
        kw["mscale"] = pr.get("mscale", float, 0.0)
        kw["mscale_all_dim"] = pr.get("mscale_all_dim", float, 0.0)
        kw["attention_factor"] = pr.get("attention_factor", float, None)
        kw["truncate"] = bool(params.get("truncate", True))
    if head_dim % 2:
        raise r.fail("head_dim", f"RoPE needs an even head_dim, got {head_dim}")
    return RopeConfig(**kw)


def _eos(value: Any, r: _Reader, key: str = "eos_token_id") -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items):
        raise r.fail(key, f"expected a token id or a list of them, got {value!r}")
    return tuple(items)


def parse_config(data: dict, source: str = "config.json") -> ModelConfig:
    """``config.json`` contents -> ModelConfig, with each architecture's transformers defaults."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{source}: expected a JSON object")
    r = _Reader(data, source)
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise r.fail("architectures", "missing; expected e.g. [\"LlamaForCausalLM\"]")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise r.fail("architectures", f"{arch} is not supported by the bundled runtime "
                                      f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); use engine: sglang")
    data = {**ARCH_DEFAULTS[arch], **data}
    r = _Reader(data, source)
    if data.get("quantization_config") is not None:
        raise r.fail("quantization_config", "quantized checkpoints are not supported by the bundled runtime")
    hidden = r.get("hidden_size", int, minimum=1)
    heads = r.get("num_attention_heads", int, minimum=1)
    kv_heads = r.get("num_key_value_heads", int, heads, minimum=1)
    if heads % kv_heads:
        raise r.fail("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    layers = r.get("num_hidden_layers", int, minimum=1)
    head_dim = r.get("head_dim", int, hidden // heads, minimum=1)
    max_pos = r.get("max_position_embeddings", int, minimum=1)
    act = r.get("hidden_act", str, "silu")
    if act != "silu":
        raise r.fail("hidden_act", f"{act!r} is not supported by the bundled runtime (silu)")
    mla = moe = None
    if arch in DEEPSEEK_FAMILY:
        mla = MLAConfig(
            q_lora_rank=r.get("q_lora_rank", int, None, minimum=1),
            kv_lora_rank=r.get("kv_lora_rank", int, minimum=1),
            qk_nope_head_dim=r.get("qk_nope_head_dim", int, minimum=1),
            qk_rope_head_dim=r.get("qk_rope_head_dim", int, minimum=2),
            v_head_dim=r.get("v_head_dim", int, minimum=1),
        )
        head_dim = mla.qk_rope_head_dim  # transformers: the config's head_dim is the rope part
        if data.get("scoring_func", "sigmoid") != "sigmoid" or data.get("topk_method", "noaux_tc") != "noaux_tc":
            raise r.fail("scoring_func", "DeepSeek-V3 routing is sigmoid scoring with noaux_tc top-k")
        n_experts = r.get("n_routed_experts", int, None, minimum=1)
        if n_experts is not None:
            n_group = r.get("n_group", int, 1, minimum=1)
            if n_experts % n_group:
                raise r.fail("n_group", f"{n_group} does not divide n_routed_experts {n_experts}")
            moe = MoEConfig(
                n_routed_experts=n_experts,
                num_experts_per_tok=r.get("num_experts_per_tok", int, minimum=1),
                moe_intermediate_size=r.get("moe_intermediate_size", int, minimum=1),
                n_shared_experts=r.get("n_shared_experts", int, 0, minimum=0),
                first_k_dense_replace=r.get("first_k_dense_replace", int, 0, minimum=0),
                n_group=n_group,
                topk_group=r.get("topk_group", int, 1, minimum=1),
                norm_topk_prob=bool(data.get("norm_topk_prob", True)),
                routed_scaling_factor=r.get("routed_scaling_factor", float, 1.0),
            )
            if moe.topk_group > n_group:
                raise r.fail("topk_group", f"{moe.topk_group} exceeds n_group {n_group}")
    sliding, layer_types = None, ()
    if arch == "MistralForCausalLM":
        sliding = r.get("sliding_window", int, None, minimum=1)
        layer_types = ("sliding_attention",) * layers if sliding else ()
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and data.get("use_sliding_window"):
        sliding = r.get("sliding_window", int, 4096, minimum=1)
    elif arch in ("LlamaForCausalLM",) and data.get("sliding_window") is not None:
        raise r.fail("sliding_window", "LlamaForCausalLM has no sliding-window attention; remove the field")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        given = data.get("layer_types")
        if given is not None:
            if not (isinstance(given, list) and len(given) == layers
                    and all(t in ("full_attention", "sliding_attention") for t in given)):
                raise r.fail("layer_types", f"expected {layers} entries of full_attention/sliding_attention")
            layer_types = tuple(given)
        else:
            first = r.get("max_window_layers", int, 28, minimum=0)
            layer_types = tuple("sliding_attention" if sliding is not None and i >= first else "full_attention"
                                for i in range(layers))
        if "sliding_attention" in layer_types and sliding is None:
            raise r.fail("layer_types", "sliding_attention layers need use_sliding_window and sliding_window")
    dtype = data.get("torch_dtype", data.get("dtype"))
    return ModelConfig(
        architecture=arch,
        vocab_size=r.get("vocab_size", int, minimum=1),
        hidden_size=hidden,
        intermediate_size=r.get("intermediate_size", int, minimum=1),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads if mla is None else 1,
        head_dim=head_dim,
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-6, minimum=0.0),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        hidden_act=act,
        attention_bias=bool(data.get("attention_bias", False)) and arch not in ("Qwen2ForCausalLM",
                                                                                "MistralForCausalLM"),
        qkv_bias=arch == "Qwen2ForCausalLM",
        mlp_bias=bool(data.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=sliding,
        layer_types=layer_types,
        rope=_rope(r, head_dim, max_pos, interleave=bool(data.get("rope_interleave", True)) if mla else False),
        mla=mla,
        moe=moe,
        eos_token_ids=_eos(data.get("eos_token_id"), r),
        bos_token_id=data.get("bos_token_id") if isinstance(data.get("bos_token_id"), int) else None,
        torch_dtype=dtype if isinstance(dtype, str) else None,
        name=str(data.get("_name_or_path") or ""),
        source=source,
    )


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    return parse_config(read_json(path), str(path))


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json: extra EOS ids, and sampling defaults for what a request leaves unset.

    As SGLang does, the fields present in the file are the defaults whatever ``do_sample`` says
    (Qwen3 ships temperature 0.6, top_p 0.95, top_k 20); an absent field keeps the server's own.
    """

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None


def load_generation_config(model_dir: str | Path) -> GenerationDefaults:
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return GenerationDefaults()
    data = read_json(path)
    r = _Reader(data, str(path))
    temp = r.get("temperature", float, None, minimum=0.0)
    if temp is not None and not math.isfinite(temp):
        raise r.fail("temperature", "must be finite")
    top_p = r.get("top_p", float, None, minimum=0.0)
    top_k = r.get("top_k", int, None, minimum=-1)
    return GenerationDefaults(
        eos_token_ids=_eos(data.get("eos_token_id"), r),
        temperature=temp,
        top_p=top_p if top_p is None or 0 < top_p <= 1 else 1.0,
        top_k=top_k if top_k is None or top_k > 0 else -1,
        min_p=r.get("min_p", float, None, minimum=0.0),
    )
