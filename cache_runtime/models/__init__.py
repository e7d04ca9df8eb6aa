"""Model loading: a Hugging Face checkpoint directory (or a builtin toy) -> a model the engine runs.

``config`` is importable without torch (the operator sizes host pools with it); everything
else loads lazily through ``load_model``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cache_runtime.models.config import (CheckpointError, GenerationDefaults, ModelConfig, load_config,
                                         load_generation_config, parse_config)

if TYPE_CHECKING:
    import torch

    from cache_runtime.models.base import CausalLM, Shard
    from cache_runtime.tokenization import Tokenizer

DTYPES = ("auto", "bfloat16", "float16", "float32")

# Seeded random-weight Llama-family toys with a byte tokenizer (vocab 256): fast test models.
BUILTIN_CONFIGS: dict[str, dict] = {
    "builtin:tiny": {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
                     "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                     "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 32768,
                     "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "builtin:small": {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 256,
                      "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
                      "num_key_value_heads": 8, "head_dim": 32, "max_position_embeddings": 32768,
                      "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
}


def resolve_config(model_path: str) -> ModelConfig:
    """config.json of a checkpoint directory, or a builtin's; CheckpointError naming what is wrong."""
    if model_path in BUILTIN_CONFIGS:
        return parse_config(BUILTIN_CONFIGS[model_path], model_path)
    if model_path.startswith("builtin:"):
        raise CheckpointError(f"unknown builtin model {model_path!r}; the bundled runtime ships "
                              f"{', '.join(sorted(BUILTIN_CONFIGS))}")
    path = Path(model_path)
    if not path.is_dir():
        raise CheckpointError(f"{model_path}: not a checkpoint directory (the bundled runtime loads a local "
                              "Hugging Face checkpoint: config.json, *.safetensors, tokenizer.json)")
    return load_config(path)


def resolve_dtype(name: str, cfg: ModelConfig, device: "torch.device") -> "torch.dtype":
    """--dtype: ``auto`` is the checkpoint's own dtype (float32 for a builtin on CPU, bfloat16 on CUDA)."""
    import torch

    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name == "auto":
        if cfg.torch_dtype is not None and cfg.torch_dtype not in table:
            raise CheckpointError(f"{cfg.source}: torch_dtype: {cfg.torch_dtype!r} is not a dtype the bundled runtime "
                                  f"computes in ({', '.join(table)}); quantized checkpoints need engine: sglang")
        name = cfg.torch_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if name not in table:
        raise CheckpointError(f"--dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return table[name]


@dataclass
class LoadedModel:
    cfg: ModelConfig
    model: "CausalLM"
    tokenizer: "Tokenizer"
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


def load_model(model_path: str, dtype: "torch.dtype", device: "torch.device", max_positions: int,
               seed: int = 0, shard: "Shard | None" = None) -> LoadedModel:
    """The model (this rank's shard of it under tensor parallelism), its tokenizer and generation defaults."""
    from cache_runtime.models.base import RandomWeights, Shard
    from cache_runtime.models.deepseek import DeepseekV3ForCausalLM
    from cache_runtime.models.hugepages import move_weights
    from cache_runtime.models.llama import LlamaForCausalLM
    from cache_runtime.tokenization import ByteTokenizer, load_tokenizer

    cfg = resolve_config(model_path)
    family = DeepseekV3ForCausalLM if cfg.family == "deepseek" else LlamaForCausalLM
    if model_path in BUILTIN_CONFIGS:
        model = family(cfg, RandomWeights(seed), dtype, device, max_positions, shard or Shard())
        return LoadedModel(cfg, model, ByteTokenizer())
    from cache_runtime.models.weights import CheckpointWeights

    generation = load_generation_config(model_path)
    tokenizer = load_tokenizer(model_path, extra_eos_ids=cfg.eos_token_ids + generation.eos_token_ids)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{Path(model_path) / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than "
                              f"config.json vocab_size {cfg.vocab_size}")
    weights = CheckpointWeights(model_path)
    try:
        model = family(cfg, weights, dtype, device, max_positions, shard or Shard())
    finally:
        weights.close()
    if device.type == "cpu":
        move_weights(model)
    return LoadedModel(cfg, model, tokenizer, generation)
