"""KV-cache geometry of a few models, for the host pool's bytes per token.

Sizing a host pool in whole pages needs the bytes one token's KV takes on one rank. The table
covers the bundled runtime's builtin models and some common Hugging Face models; anything else
is given with ``spec.modelShape``. Values are from the models' config.json files.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache_runtime.models.config import DTYPE_BYTES, ModelConfig, kv_cell_bytes


@dataclass(frozen=True)
class Shape:
    num_layers: int
    num_kv_heads: int = 1
    head_dim: int = 1
    dtype_bytes: int = 2
    mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0


# builtin:* mirror cache_runtime/models/__init__.py; they are counted at 4 bytes (float32 on CPU), the
# larger of the runtime's dtypes, so a pool sized from them never overshoots.
KNOWN: dict[str, Shape] = {
    "builtin:tiny": Shape(num_layers=4, num_kv_heads=4, head_dim=32, dtype_bytes=4),
    "builtin:small": Shape(num_layers=8, num_kv_heads=8, head_dim=32, dtype_bytes=4),
    "meta-llama/Llama-3.1-8B-Instruct": Shape(num_layers=32, num_kv_heads=8, head_dim=128),
    "meta-llama/Llama-3.1-70B-Instruct": Shape(num_layers=80, num_kv_heads=8, head_dim=128),
    "Qwen/Qwen2.5-7B-Instruct": Shape(num_layers=28, num_kv_heads=4, head_dim=128),
    "Qwen/Qwen3-8B": Shape(num_layers=36, num_kv_heads=8, head_dim=128),
    "Qwen/Qwen3-32B": Shape(num_layers=64, num_kv_heads=8, head_dim=128),
    "mistralai/Mistral-7B-Instruct-v0.3": Shape(num_layers=32, num_kv_heads=8, head_dim=128),
    "deepseek-ai/DeepSeek-V3": Shape(num_layers=61, mla=True, kv_lora_rank=512, qk_rope_head_dim=64),
}


def lookup(model: str, override: Shape | None = None) -> Shape | None:
    return override or KNOWN.get(model)


def from_config(cfg: ModelConfig, dtype: str = "bfloat16") -> Shape:
    """The KV geometry of a parsed config.json (``cache_runtime.models.config.parse_config``)."""
    if cfg.mla is not None:
        return Shape(num_layers=cfg.num_layers, dtype_bytes=DTYPE_BYTES[dtype], mla=True,
                     kv_lora_rank=cfg.mla.kv_lora_rank, qk_rope_head_dim=cfg.mla.qk_rope_head_dim)
    return Shape(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                 dtype_bytes=DTYPE_BYTES[dtype])


def bytes_per_token(shape: Shape, tp: int, pp: int) -> int:
    """KV bytes one token takes in ONE rank's host pool: the runtime's own formula (kv_cell_bytes)."""
    return kv_cell_bytes(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         dtype_bytes=shape.dtype_bytes,
                         mla_kv_dim=shape.kv_lora_rank + shape.qk_rope_head_dim if shape.mla else None, tp=tp, pp=pp)
