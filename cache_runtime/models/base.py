"""The model interface the engine drives, and where weights come from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from cache_runtime.cpu_kernels import linear
from cache_runtime.models.config import CheckpointError, ModelConfig

Span = tuple[int, int]
from cache_runtime.models.layers import ForwardBatch, rms_norm


class WeightSource(Protocol):
    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            rows: Span | None = None, cols: Span | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard:
    """This process's tensor-parallel rank: attention heads and MLP columns split evenly across
    ranks (KV heads replicated when ranks outnumber them, as SGLang does), partial outputs summed."""

    rank: int = 0
    world: int = 1

    def span(self, n: int, what: str) -> Span:
        if n % self.world:
            raise CheckpointError(f"--tp-size {self.world} does not divide {what} {n} (config.json)")
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per

    def kv_span(self, num_kv_heads: int) -> Span:
        """KV heads this rank holds: its share, or the one head its query heads use when replicated."""
        if num_kv_heads >= self.world:
            return self.span(num_kv_heads, "num_key_value_heads")
        if self.world % num_kv_heads:
            raise CheckpointError(f"--tp-size {self.world} is neither a divisor nor a multiple of "
                                  f"num_key_value_heads {num_kv_heads} (config.json)")
        head = self.rank // (self.world // num_kv_heads)
        return head, head + 1

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(partial)
        return partial


def rows_of(span: Span, width: int) -> Span:
    """Rows of a weight whose output is ``width`` wide per head, for heads ``span``."""
    return span[0] * width, span[1] * width


class RandomWeights:
    """Seeded weights for the builtin toy models: every tensor is present, drawn from its name.

    Matrices are scaled by 1/sqrt(fan-in) so activations stay O(1) and logits are not flat;
    norms are ones. Each tensor depends only on the seed and its name, not on load order.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __contains__(self, name: str) -> bool:
        return not name.endswith(".bias")

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            rows: Span | None = None, cols: Span | None = None) -> torch.Tensor:
        if "norm" in name:
            t = torch.ones(shape)
        else:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + sum(map(ord, name)) * 7919 + len(name))
            std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(shape[-1])
            t = torch.randn(shape, generator=gen) * std
        if rows is not None:
            t = t[rows[0] : rows[1]]
        if cols is not None:
            t = t[:, cols[0] : cols[1]]
        return t.to(device=device, dtype=dtype).contiguous()


class CausalLM:
    """A decoder whose K/V live in the engine's L1 pool; subclasses hold one architecture family."""

    cfg: ModelConfig
    shard: Shard
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

    def layer_matrices(self) -> list[torch.Tensor]:
        """One decoder layer's 2-D weights: the GEMM shapes of a step, for ``cpu_kernels.calibrate``."""
        return [t for t in vars(self.layers[0]).values() if isinstance(t, torch.Tensor) and t.dim() == 2]

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
        return linear(rms_norm(hl, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()
