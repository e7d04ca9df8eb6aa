"""A small seeded decoder-only transformer whose per-layer K/V live in the runtime's L1 pool.

The model exists so the cache hierarchy has real KV to move: attention always reads K/V back
from the pool (even for tokens computed in the same step), so a prefix served from L1, L2 or L3
feeds attention exactly the bytes a cold prefill would have written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from cache_runtime import tokenizer


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    d_model: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int = tokenizer.VOCAB_SIZE
    rope_theta: float = 10000.0
    max_context: int = 32768
    seed: int = 0


BUILTIN_MODELS = {
    "builtin:tiny": ModelConfig("builtin:tiny", num_layers=4, d_model=128, num_heads=4, head_dim=32, ffn_dim=512),
    "builtin:small": ModelConfig("builtin:small", num_layers=8, d_model=256, num_heads=8, head_dim=32, ffn_dim=1024),
}


def resolve_model(model_path: str) -> ModelConfig:
    if model_path not in BUILTIN_MODELS:
        raise ValueError(
            f"unknown model {model_path!r}: the bundled runtime ships {sorted(BUILTIN_MODELS)}; "
            "real checkpoints need the sglang engine"
        )
    return BUILTIN_MODELS[model_path]


@dataclass
class SeqSpan:
    """One sequence's share of a flat forward batch."""

    start: int  # offset of its new tokens in the flat batch
    num_new: int
    ctx_slots: torch.Tensor  # L1 slot of every context token, new ones last
    want_logits: bool


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    out_slots: torch.Tensor  # (N,) int64: where each new token's K/V is written
    seqs: list[SeqSpan]
    wait_layer: Callable[[int], None] | None = None  # blocks until a layer's pending L2->L1 loads landed


class _RMSNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inner = cfg.num_heads * cfg.head_dim
        self.attn_norm = _RMSNorm(cfg.d_model)
        self.qkv = torch.nn.Linear(cfg.d_model, 3 * inner, bias=False)
        self.out = torch.nn.Linear(inner, cfg.d_model, bias=False)
        self.mlp_norm = _RMSNorm(cfg.d_model)
        self.up = torch.nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down = torch.nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)


class TinyTransformer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = torch.nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = _RMSNorm(cfg.d_model)
        self.lm_head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied: keeps logits soft
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("weight") and p.dim() == 2:
                    std = 1.0 if name.startswith("embed") else 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_context, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.to(device)
        self.eval()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor]) -> torch.Tensor:
        """Runs the new tokens, writing their K/V into the pool; returns last-token logits of seqs that want them."""
        cfg = self.cfg
        n = batch.input_ids.shape[0]
        h = self.embed(batch.input_ids)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        for layer, blk in enumerate(self.blocks):
            q, k, v = blk.qkv(blk.attn_norm(h)).view(n, 3, cfg.num_heads, cfg.head_dim).unbind(1)
            q = self._rope(q, batch.positions)
            k = self._rope(k, batch.positions)
            pool_k, pool_v = k_pool[layer], v_pool[layer]
            if batch.wait_layer is not None:
                batch.wait_layer(layer)
            pool_k[batch.out_slots] = k.to(pool_k.dtype)
            pool_v[batch.out_slots] = v.to(pool_v.dtype)
            attn = torch.empty_like(q)
            for seq in batch.seqs:
                ctx = seq.ctx_slots.shape[0]
                qs = q[seq.start : seq.start + seq.num_new].transpose(0, 1)
                ks = pool_k[seq.ctx_slots].float().transpose(0, 1)
                vs = pool_v[seq.ctx_slots].float().transpose(0, 1)
                mask = None
                if seq.num_new > 1:
                    mask = torch.ones(seq.num_new, ctx, dtype=torch.bool, device=q.device).tril(ctx - seq.num_new)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
                attn[seq.start : seq.start + seq.num_new] = o.transpose(0, 1)
            h = h + blk.out(attn.reshape(n, -1))
            h = h + blk.down(F.gelu(blk.up(blk.mlp_norm(h))))
        last = [seq.start + seq.num_new - 1 for seq in batch.seqs if seq.want_logits]
        if not last:
            return torch.empty(0, cfg.vocab_size, device=h.device)
        hl = self.final_norm(h[torch.tensor(last, device=h.device)])
        return self.lm_head(hl) * 2.0
