"""What every architecture shares: the forward batch, RMSNorm, and attention over the paged KV pool.

Attention always reads K/V back from the L1 pool, also for tokens computed in the same step, so
a prefix served from L1, L2 or L3 feeds attention exactly the bytes a cold prefill writes.
Decoding sequences are attended together (padded to the longest context, one SDPA call);
prefill chunks one sequence at a time, causal within the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class SeqSpan:
    """One sequence's share of a flat forward batch."""

    start: int  # offset of its new tokens in the flat batch
    num_new: int
    ctx_slots: torch.Tensor  # L1 slot of every context token (positions 0..ctx-1), new ones last
    want_logits: bool


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    out_slots: torch.Tensor  # (N,) int64: where each new token's K/V is written
    seqs: list[SeqSpan]
    wait_layer: Callable[[int], None] | None = None  # blocks until a layer's pending L2->L1 loads landed
    _plans: dict = field(default_factory=dict, repr=False)

    def plan(self, window: int | None) -> "AttentionPlan":
        """Index and mask tensors for one window size, built once per forward and shared by its layers."""
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = AttentionPlan(self.seqs, window, self.input_ids.device)
        return plan

    def logit_rows(self) -> list[int]:
        return [s.start + s.num_new - 1 for s in self.seqs if s.want_logits]


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(q, k) mask: causal, and within the last ``window`` positions (the query's own included)."""
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


class AttentionPlan:
    def __init__(self, seqs: list[SeqSpan], window: int | None, device: torch.device) -> None:
        decode = [s for s in seqs if s.num_new == 1]
        self.prefill: list[tuple[SeqSpan, torch.Tensor | None]] = []
        for s in seqs:
            if s.num_new == 1:
                continue
            ctx = s.ctx_slots.shape[0]
            mask = None
            if ctx != s.num_new or window is not None and window < ctx:
                q_pos = torch.arange(ctx - s.num_new, ctx, device=device)
                mask = _allowed(q_pos, torch.arange(ctx, device=device), window)
            self.prefill.append((s, mask))
        self.decode_rows = None
        if decode:
            lens = [s.ctx_slots.shape[0] for s in decode]
            longest = max(lens)
            self.decode_rows = torch.tensor([s.start for s in decode], device=device)
            slots = torch.zeros(len(decode), longest, dtype=torch.int64, device=device)
            for i, s in enumerate(decode):
                slots[i, : lens[i]] = s.ctx_slots
            self.decode_slots = slots
            k_pos = torch.arange(longest, device=device)
            lens_t = torch.tensor(lens, device=device)
            mask = k_pos[None, :] < lens_t[:, None]
            if window is not None:
                mask &= k_pos[None, :] > (lens_t[:, None] - 1) - window
            uniform = len(set(lens)) == 1 and (window is None or window >= longest)
            self.decode_mask = None if uniform else mask[:, None, None, :]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan,
                    scale: float) -> torch.Tensor:
    """q (N, Hq, Dk) over pool rows (slots, Hkv, Dk) / (slots, Hkv, Dv) -> (N, Hq, Dv).

    Hq must be a multiple of Hkv (GQA/MQA). ``v_pool`` may be a view of ``k_pool`` (MLA's latent).
    """
    n, hq, _ = q.shape
    out = q.new_empty(n, hq, v_pool.shape[-1])
    dt = q.dtype
    for s, mask in plan.prefill:
        qs = q[s.start : s.start + s.num_new].transpose(0, 1).unsqueeze(0)
        ks = k_pool[s.ctx_slots].to(dt).transpose(0, 1).unsqueeze(0)
        vs = v_pool[s.ctx_slots].to(dt).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
        out[s.start : s.start + s.num_new] = o[0].transpose(0, 1)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = _decode_attention(q[plan.decode_rows], k_pool[plan.decode_slots].to(dt),
                                                  v_pool[plan.decode_slots].to(dt), plan.decode_mask, scale)
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """One query per sequence: q (B, Hq, D), k (B, L, Hkv, D), v (B, L, Hkv, Dv) -> (B, Hq, Dv).

    Plain matmuls with each KV head's query group stacked, softmax in float32: for a single query
    this is several times faster on CPU than SDPA's flash kernel.
    """
    B, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    scores = torch.matmul(q.view(B, Hkv, Hq // Hkv, D), k.permute(0, 2, 3, 1)).float() * scale  # (B, Hkv, g, L)
    if mask is not None:
        scores.masked_fill_(~mask.view(B, 1, 1, L), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).reshape(B, Hq, v.shape[-1])


def write_kv(pool: torch.Tensor, slots: torch.Tensor, value: torch.Tensor) -> None:
    pool[slots] = value.to(pool.dtype)
