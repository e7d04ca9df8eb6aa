"""Random-weight Hugging Face checkpoints, written without transformers (torch, json and the tokenizer).

Tensor names and shapes are the ones transformers' modeling code loads; DeepSeek-V3 experts are stored
per expert (``mlp.experts.{e}.gate_proj.weight``), the Hub layout that ``save_pretrained`` writes and
transformers packs on load. Every tensor is drawn from its own generator seeded by (seed, name), so its
bytes depend on neither order nor sharding, and is streamed to its safetensors file as it is drawn: a
checkpoint is never held in memory, let alone twice.

Scales keep activations O(1) like a trained model's: linears N(0, 1/fan_in), norms 1 + N(0, 0.05),
biases N(0, 0.02), embeddings N(0, 0.25/hidden), and logits spread with std ~LOGIT_STD: from an LM head
N(0, LOGIT_STD^2/hidden), or, when the head is tied to the small embeddings, from a final norm around
2 * LOGIT_STD (large tied embeddings would dominate the residual stream and echo the input token).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from cache_runtime.models.config import parse_config
from cache_runtime.synth.tokenizer import write_tokenizer

LOGIT_STD = 3.0

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}

PRESETS: dict[str, dict] = {
    # ~247M parameters, 64 KiB of bf16 KV per token: Llama-3 geometry at a size a laptop serves. The llama3
    # scaling stretches a 1024-token original context by 8 to max_position_embeddings (transformers wants
    # the original below the maximum).
    "demo": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 4096, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 1024},
    },
    # llama3 scaling with a small original context, so tiny head dims cross both wavelength thresholds.
    "tiny-llama": {
        **_TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    },
    "tiny-qwen2": {
        **_TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2,
    },
    "tiny-qwen3": {
        **_TINY, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1000000.0,
        "head_dim": 32, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 2,
    },
    "tiny-mistral": {
        **_TINY, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16,
    },
    # MLA with a q LoRA, YaRN as in DeepSeek-V3, one dense layer then MoE layers with a shared expert.
    # MLA attention expands the latent to every head, so transformers needs num_key_value_heads == heads.
    "tiny-deepseek-v3": {
        **_TINY, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "num_hidden_layers": 3, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
STAMP = ".synth-stamp.json"
# Bumped whenever the same arguments would write different files, so stale stamps stop matching.
_FORMAT = 1


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    mean: float
    std: float
    fp32: bool = False  # stored float32 whatever the checkpoint dtype (transformers keeps it so)

    def nbytes(self, dtype: torch.dtype) -> int:
        item = 4 if self.fp32 else torch.empty(0, dtype=dtype).element_size()
        return math.prod(self.shape) * item


def _linear(name: str, out_dim: int, in_dim: int, bias: bool = False) -> list[TensorSpec]:
    specs = [TensorSpec(f"{name}.weight", (out_dim, in_dim), 0.0, in_dim ** -0.5)]
    if bias:
        specs.append(TensorSpec(f"{name}.bias", (out_dim,), 0.0, 0.02))
    return specs


def _norm(name: str, dim: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (dim,), 1.0, 0.05)


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> list[TensorSpec]:
    return (_linear(f"{prefix}.gate_proj", inter, hidden, bias) + _linear(f"{prefix}.up_proj", inter, hidden, bias)
            + _linear(f"{prefix}.down_proj", hidden, inter, bias))


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Every tensor transformers loads for ``config`` (a config.json dict), in state-dict order."""
    cfg = parse_config(config)
    hidden, heads = cfg.hidden_size, cfg.num_heads
    # Mistral ignores attention_bias; Qwen2 has q/k/v biases and no o bias whatever the config says.
    attn_bias = cfg.attention_bias and cfg.architecture != "MistralForCausalLM"
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, hidden), 0.0, 0.5 / math.sqrt(hidden))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        if cfg.mla is not None:
            m = cfg.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank is None:
                specs += _linear(f"{p}.self_attn.q_proj", heads * qk, hidden)
            else:
                specs += _linear(f"{p}.self_attn.q_a_proj", m.q_lora_rank, hidden, attn_bias)
                specs += [_norm(f"{p}.self_attn.q_a_layernorm", m.q_lora_rank)]
                specs += _linear(f"{p}.self_attn.q_b_proj", heads * qk, m.q_lora_rank)
            specs += _linear(f"{p}.self_attn.kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, hidden,
                             attn_bias)
            specs += [_norm(f"{p}.self_attn.kv_a_layernorm", m.kv_lora_rank)]
            specs += _linear(f"{p}.self_attn.kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim),
                             m.kv_lora_rank)
            specs += _linear(f"{p}.self_attn.o_proj", hidden, heads * m.v_head_dim, attn_bias)
        else:
            q_dim, kv_dim = heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            qkv_bias = attn_bias or cfg.qkv_bias
            specs += _linear(f"{p}.self_attn.q_proj", q_dim, hidden, qkv_bias)
            specs += _linear(f"{p}.self_attn.k_proj", kv_dim, hidden, qkv_bias)
            specs += _linear(f"{p}.self_attn.v_proj", kv_dim, hidden, qkv_bias)
            specs += _linear(f"{p}.self_attn.o_proj", hidden, q_dim, attn_bias)
            if cfg.qk_norm:
                specs += [_norm(f"{p}.self_attn.q_norm", cfg.head_dim), _norm(f"{p}.self_attn.k_norm", cfg.head_dim)]
        moe = cfg.moe
        if moe is not None and moe.is_moe_layer(i):
            specs += [TensorSpec(f"{p}.mlp.gate.weight", (moe.n_routed_experts, hidden), 0.0, hidden ** -0.5),
                      TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (moe.n_routed_experts,), 0.0, 0.01,
                                 fp32=True)]
            for e in range(moe.n_routed_experts):
                specs += _mlp(f"{p}.mlp.experts.{e}", hidden, moe.moe_intermediate_size)
            specs += _mlp(f"{p}.mlp.shared_experts", hidden, moe.moe_intermediate_size * moe.n_shared_experts)
        else:
            specs += _mlp(f"{p}.mlp", hidden, cfg.intermediate_size, cfg.mlp_bias)
        specs += [_norm(f"{p}.input_layernorm", hidden), _norm(f"{p}.post_attention_layernorm", hidden)]
    if cfg.tie_word_embeddings:
        specs.append(TensorSpec("model.norm.weight", (hidden,), 2 * LOGIT_STD, 0.05))
    else:
        specs += [_norm("model.norm", hidden),
                  TensorSpec("lm_head.weight", (cfg.vocab_size, hidden), 0.0, LOGIT_STD / math.sqrt(hidden))]
    return specs


def draw(spec: TensorSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``spec`` names, from a generator seeded by (seed, name) alone."""
    digest = hashlib.sha256(f"{seed}/{spec.name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    x = torch.randn(spec.shape, generator=g).mul_(spec.std).add_(spec.mean)
    return x if spec.fp32 else x.to(dtype)


def _write_safetensors(path: Path, specs: list[TensorSpec], seed: int, dtype: torch.dtype) -> None:
    """A safetensors file whose header is laid out from the specs, then each tensor drawn and written in turn."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        n = s.nbytes(dtype)
        header[s.name] = {"dtype": _SAFETENSORS_DTYPE[torch.float32 if s.fp32 else dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for s in specs:
            f.write(draw(s, seed, dtype).reshape(-1).view(torch.uint8).numpy())
    tmp.replace(path)


def _shards(specs: list[TensorSpec], dtype: torch.dtype, max_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most ``max_bytes`` each; a larger tensor gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        n = s.nbytes(dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += n
    return shards


def _write_weights(out_dir: Path, specs: list[TensorSpec], seed: int, dtype: torch.dtype,
                   max_shard_bytes: int | None) -> None:
    if max_shard_bytes is None:
        _write_safetensors(out_dir / "model.safetensors", specs, seed, dtype)
        return
    shards = _shards(specs, dtype, max_shard_bytes)
    weight_map = {}
    for k, group in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out_dir / name, group, seed, dtype)
        weight_map.update((s.name, name) for s in group)
    index = {"metadata": {"total_size": sum(s.nbytes(dtype) for s in specs)},
             "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _preset(preset: str | dict) -> dict:
    if isinstance(preset, dict):
        return copy.deepcopy(preset)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[preset])


def is_complete(out_dir: Path, stamp: dict) -> bool:
    """Whether ``out_dir`` holds every file a write with ``stamp``'s arguments left, at its recorded size."""
    try:
        old = json.loads((out_dir / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = old.pop("files", {})
    return old == stamp and all((out_dir / name).is_file() and (out_dir / name).stat().st_size == size
                                for name, size in files.items())


def checkpoint_stamp(preset: str | dict, *, seed: int = 0, dtype: str = "bfloat16", max_shard_bytes: int | None = None,
                     tokenizer_template: str = "chatml", vocab_size: int | None = None) -> dict:
    """The arguments of a write as its stamp records them (a named preset recorded by its contents)."""
    return {"format": _FORMAT, "config": _preset(preset), "seed": seed, "dtype": dtype,
            "max_shard_bytes": max_shard_bytes, "tokenizer_template": tokenizer_template, "vocab_size": vocab_size}


def write_checkpoint(out_dir: Path, preset: str | dict, *, seed: int = 0, dtype: str = "bfloat16",
                     max_shard_bytes: int | None = None, tokenizer_template: str = "chatml",
                     vocab_size: int | None = None) -> Path:
    """Writes a loadable checkpoint of ``preset`` (a PRESETS name or a config.json dict) into ``out_dir``.

    The tokenizer fixes the vocabulary and the BOS/EOS ids of config.json. A stamp written last records the
    arguments and the files; a second call with the same arguments finds them complete and writes nothing.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    stamp = checkpoint_stamp(preset, seed=seed, dtype=dtype, max_shard_bytes=max_shard_bytes,
                             tokenizer_template=tokenizer_template, vocab_size=vocab_size)
    if is_complete(out_dir, stamp):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / STAMP).unlink(missing_ok=True)
    for old in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # weights of an earlier write with other sharding must not linger

    config = dict(stamp["config"])
    ids = write_tokenizer(out_dir, vocab_size=vocab_size or config["vocab_size"], template=tokenizer_template,
                          seed=seed)
    config.update(vocab_size=ids["vocab_size"], bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                  torch_dtype=dtype)
    _write_weights(out_dir, tensor_specs(config), seed, DTYPES[dtype], max_shard_bytes)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
                 "pad_token_id": ids["pad_token_id"]})
    stamp["files"] = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != STAMP}
    _write_json(out_dir / STAMP, stamp)
    return out_dir
