"""What every architecture shares: the forward batch, RMSNorm, and attention over the paged KV pool.

Attention always reads K/V back from the L1 pool, also for tokens computed in the same step, so
a prefix served from L1, L2 or L3 feeds attention exactly the bytes a cold prefill writes.
Decoding queries attend in one native call that reads K/V straight from the pool through each
sequence's slots (``cache_runtime.cpu_kernels``, on CPU); elsewhere each sequence attends over its
own gathered context: a decoding query in two small matmuls, a prefill chunk through SDPA, causal
within the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from cache_runtime import cpu_kernels
from cache_runtime.models.rope import Rotary


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
    """Per sequence: prefill chunks with their mask (None = plainly causal), decode rows with the
    context slots their query attends (the last ``window`` positions under a sliding window)."""

    def __init__(self, seqs: list[SeqSpan], window: int | None, device: torch.device) -> None:
        self.prefill: list[tuple[SeqSpan, torch.Tensor | None]] = []
        self.decode: list[tuple[int, torch.Tensor]] = []
        for s in seqs:
            ctx = s.ctx_slots.shape[0]
            if s.num_new == 1:
                slots = s.ctx_slots if window is None or window >= ctx else s.ctx_slots[ctx - window:]
                self.decode.append((s.start, slots))
                continue
            mask = None
            if ctx != s.num_new or window is not None and window < ctx:
                q_pos = torch.arange(ctx - s.num_new, ctx, device=device)
                mask = _allowed(q_pos, torch.arange(ctx, device=device), window)
            self.prefill.append((s, mask))
        self._decode_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def decode_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode rows as the native kernel takes them: (rows, offsets into slots, all slots), int64."""
        if self._decode_index is None:
            lens = [0] + [slots.shape[0] for _, slots in self.decode]
            self._decode_index = (torch.tensor([row for row, _ in self.decode], dtype=torch.int64),
                                  torch.tensor(lens, dtype=torch.int64).cumsum_(0),
                                  torch.cat([slots for _, slots in self.decode]).to(torch.int64))
        return self._decode_index


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm of it): the residual stream and the next sublayer's input. Natively the
    sum is written into ``h``, which must then be the caller's own tensor."""
    if h.dim() == 2 and cpu_kernels.rows_supported(h, delta, weight):
        return h, cpu_kernels.add_rms_norm(h, delta, weight, eps)
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused [gate | up] projection."""
    if gate_up.dim() == 2 and cpu_kernels.rows_supported(gate_up):
        return cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan,
                    scale: float) -> torch.Tensor:
    """q (N, Hq, Dk) over pool rows (slots, Hkv, Dk) / (slots, Hkv, Dv) -> (N, Hq, Dv).

    Hq must be a multiple of Hkv (GQA/MQA). ``v_pool`` may be a leading slice of ``k_pool``'s rows
    (MLA's latent): it is then cut from the gathered keys instead of gathered again. Rows are
    gathered with index_select (several times faster than advanced indexing on CPU).
    """
    n, hq, _ = q.shape
    out = q.new_empty(n, hq, v_pool.shape[-1])
    dt = q.dtype
    v_in_k = v_pool.data_ptr() == k_pool.data_ptr() and v_pool.shape[-1] < k_pool.shape[-1]

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = k_pool.index_select(0, slots).to(dt)
        v = k[..., : v_pool.shape[-1]] if v_in_k else v_pool.index_select(0, slots).to(dt)
        return k, v

    for s, mask in plan.prefill:
        k, v = gather(s.ctx_slots)
        qs = q[s.start : s.start + s.num_new].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                           attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        out[s.start : s.start + s.num_new] = o[0].transpose(0, 1)
    if plan.decode and cpu_kernels.decode_attention_supported(q, k_pool, v_pool):
        cpu_kernels.decode_attention(q, k_pool, v_pool, *plan.decode_index(), scale, out)
        return out
    for row, slots in plan.decode:
        k, v = gather(slots)
        out[row] = _one_query(q[row], k, v, scale)
    return out


# Up to this many KV heads a decoding query runs one matmul pair per head, each reading its
# keys and values in place (strided rows of the gathered context); with more heads the per-call
# cost outweighs the copy a single batched matmul over all heads makes of them.
_PER_HEAD_MAX_KV_HEADS = 8


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (Hq, D) over k (L, Hkv, D), v (L, Hkv, Dv) -> (Hq, Dv), softmax in float32: each KV
    head's query group against that head's keys (on CPU several times faster than SDPA's
    kernel for a single query)."""
    hq, d = q.shape
    hkv = k.shape[1]
    groups = q.view(hkv, hq // hkv, d)
    if hkv > _PER_HEAD_MAX_KV_HEADS:
        scores = torch.matmul(groups, k.permute(1, 2, 0)).float() * scale  # (Hkv, g, L)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v.transpose(0, 1)).reshape(hq, v.shape[-1])
    out = q.new_empty(hkv, hq // hkv, v.shape[-1])
    for h in range(hkv):
        probs = torch.softmax(torch.mm(groups[h], k[:, h].t()).float() * scale, dim=-1).to(v.dtype)
        torch.mm(probs, v[:, h], out=out[h])
    return out.view(hq, v.shape[-1])


def write_kv(pool: torch.Tensor, slots: torch.Tensor, value: torch.Tensor) -> None:
    pool.index_copy_(0, slots, value.to(pool.dtype))


def rotate_and_store(rotary: Rotary, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     table: tuple[torch.Tensor, torch.Tensor], k_pool: torch.Tensor, v_pool: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on q and k, k and v written to their pool rows; returns the rotated q
    (natively rotated in place, so q and k must be the caller's own tensors)."""
    cos, sin = table
    if (not rotary.interleave and v_pool.dtype == k_pool.dtype and v.stride(-1) == 1 and v_pool.stride(-1) == 1
            and slots.dtype == torch.int64 and slots.is_contiguous()
            and cpu_kernels.rope_store_supported(q, k, cos, k_pool)):
        cpu_kernels.rope_store(q, k, v, cos, sin, k_pool, v_pool, slots)
        return q
    q, k = rotary.apply(q, table), rotary.apply(k, table)
    write_kv(k_pool, slots, k)
    write_kv(v_pool, slots, v)
    return q
