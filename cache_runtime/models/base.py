"""The model interface the engine drives, and where weights come from."""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from cache_runtime.models.config import ModelConfig
from cache_runtime.models.layers import ForwardBatch, rms_norm


class WeightSource(Protocol):
    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...


class RandomWeights:
    """Seeded weights for the builtin toy models: every tensor is present, drawn from its name.

    Matrices are scaled by 1/sqrt(fan-in) so activations stay O(1) and logits are not flat;
    norms are ones. Each tensor depends only on the seed and its name, not on load order.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __contains__(self, name: str) -> bool:
        return not name.endswith(".bias")

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if "norm" in name:
            return torch.ones(shape, dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + sum(map(ord, name)) * 7919 + len(name))
        std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(shape[-1])
        return (torch.randn(shape, generator=gen) * std).to(device=device, dtype=dtype)


class CausalLM:
    """A decoder whose K/V live in the engine's L1 pool; subclasses hold one architecture family."""

    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor

    def _load_embeddings(self, w: WeightSource) -> None:
        cfg, dt, dev = self.cfg, self.dtype, self.device
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.embed = w.get("model.embed_tokens.weight", shape, dt, dev)
        self.norm = w.get("model.norm.weight", (cfg.hidden_size,), dt, dev)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = w.get("lm_head.weight", shape, dt, dev)

    def forward(self, batch: ForwardBatch, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor] | None
                ) -> torch.Tensor:
        """Runs the new tokens, writing their K/V into the pool; float32 last-token logits of seqs that want them."""
        raise NotImplementedError

    def __call__(self, batch: ForwardBatch, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor] | None
                 ) -> torch.Tensor:
        return self.forward(batch, k_pool, v_pool)

    def _logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = batch.logit_rows()
        if not rows:
            return torch.empty(0, self.cfg.vocab_size, device=h.device)
        hl = h[torch.tensor(rows, device=h.device)]
        return F.linear(rms_norm(hl, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()
