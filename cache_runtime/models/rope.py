"""Rotary position embeddings with transformers' frequency rules (default, linear, llama3, yarn).

Tables are computed in float32 once for the whole context and applied in the activations' dtype.
Llama, Qwen and Mistral rotate split halves; DeepSeek (``rope_interleave``) rotates interleaved
pairs and writes the result in split-halves order, as transformers does.
"""

from __future__ import annotations

import math

import torch

from cache_runtime.models.config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scale(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim/2,), factor applied to cos and sin)."""
    base = rope.theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope.rope_type == "default":
        return inv, 1.0
    if rope.rope_type == "linear":
        return inv / rope.factor, 1.0
    if rope.rope_type == "llama3":
        orig = rope.original_max_position_embeddings
        low_wavelen = orig / rope.low_freq_factor
        high_wavelen = orig / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        factor = rope.factor
        attn = rope.attention_factor
        if attn is None:
            if rope.mscale and rope.mscale_all_dim:
                attn = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
            else:
                attn = _yarn_mscale(factor)
        orig = rope.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, float(attn)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def yarn_softmax_scale(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax-scale factor: mscale(factor, mscale_all_dim) squared under yarn."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return m * m


class Rotary:
    """cos/sin tables (positions, dim/2) and their application to (tokens, heads, dim) tensors."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int, device: torch.device) -> None:
        inv, scale = inv_freq_and_scale(rope, dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        self.cos = (angles.cos() * scale).to(device)
        self.sin = (angles.sin() * scale).to(device)
        self.interleave = rope.interleave
        self.max_positions = max_positions

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of ``positions`` as (tokens, 1, dim/2) in ``dtype``: gathered once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def apply(self, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = table
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
