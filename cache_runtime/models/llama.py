"""The Llama family: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM.

One decoder with the family's switches from config.json: q/k/v(/o) biases (Llama's
``attention_bias``, Qwen2 always on q/k/v), MLP biases (Llama's ``mlp_bias``), per-head q/k
RMSNorm before RoPE (Qwen3), sliding-window layers (Mistral, Qwen2/3 ``use_sliding_window``),
GQA, tied embeddings. q/k/v and gate/up are fused into one matmul each at load. Under tensor
parallelism a rank holds its query heads, their KV heads and its share of the MLP; the o_proj
and down_proj partial sums are all-reduced and their biases added once, after the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cache_runtime import cpu_kernels
from cache_runtime.cpu_kernels import linear
from cache_runtime.models.base import CausalLM, Shard, WeightSource, rows_of
from cache_runtime.models.config import ModelConfig
from cache_runtime.models.layers import (ForwardBatch, add_rms_norm, paged_attention, rms_norm, rotate_and_store,
                                         silu_mul)
from cache_runtime.models.rope import Rotary


class _Layer:
    def __init__(self, cfg: ModelConfig, i: int, w: WeightSource, dt: torch.dtype, dev: torch.device,
                 sh: Shard) -> None:
        p = f"model.layers.{i}."
        H, D, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

        def get(name, shape, rows=None, cols=None):
            return w.get(p + name, shape, dt, dev, rows=rows, cols=cols)

        q_rows, kv_rows = rows_of(sh.span(nq, "num_attention_heads"), D), rows_of(sh.kv_span(nkv), D)
        shapes = {"q": ((nq * D, H), q_rows), "k": ((nkv * D, H), kv_rows), "v": ((nkv * D, H), kv_rows)}
        self.ln1 = get("input_layernorm.weight", (H,))
        self.ln2 = get("post_attention_layernorm.weight", (H,))
        self.wqkv = torch.cat([get(f"self_attn.{x}_proj.weight", s, rows=r) for x, (s, r) in shapes.items()])
        self.bqkv = None
        if cfg.attention_bias or cfg.qkv_bias:
            self.bqkv = torch.cat([get(f"self_attn.{x}_proj.bias", (s[0],), rows=r) for x, (s, r) in shapes.items()])
        self.wo = get("self_attn.o_proj.weight", (H, nq * D), cols=q_rows)
        self.bo = get("self_attn.o_proj.bias", (H,)) if cfg.attention_bias else None
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = get("self_attn.q_norm.weight", (D,))
            self.k_norm = get("self_attn.k_norm.weight", (D,))
        I = cfg.intermediate_size  # noqa: E741
        cols = sh.span(I, "intermediate_size")
        self.w_gate_up = torch.cat([get("mlp.gate_proj.weight", (I, H), rows=cols),
                                    get("mlp.up_proj.weight", (I, H), rows=cols)])
        self.w_down = get("mlp.down_proj.weight", (H, I), cols=cols)
        self.b_gate_up = self.b_down = None
        if cfg.mlp_bias:
            self.b_gate_up = torch.cat([get("mlp.gate_proj.bias", (I,), rows=cols),
                                        get("mlp.up_proj.bias", (I,), rows=cols)])
            self.b_down = get("mlp.down_proj.bias", (H,))
        self.window = cfg.window(i)
        self.heads = ((q_rows[1] - q_rows[0]) // D, (kv_rows[1] - kv_rows[0]) // D)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, weights: WeightSource, dtype: torch.dtype, device: torch.device,
                 max_positions: int, shard: Shard = Shard()) -> None:
        self.cfg, self.dtype, self.device, self.shard = cfg, dtype, device, shard
        self._load_embeddings(weights)
        self.layers = [_Layer(cfg, i, weights, dtype, device, shard) for i in range(cfg.num_layers)]
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_positions, device)
        self.scale = cfg.head_dim ** -0.5
        self._stack: tuple | None = None  # (pool pointers, native decode_stack arguments)

    def _native_stack(self, h: torch.Tensor, batch: ForwardBatch, k_pool: list[torch.Tensor],
                      v_pool: list[torch.Tensor]):
        """The native decoder stack's arguments when this batch can run through it: every row
        decoding, one rank, no sliding window, no layer-by-layer KV loads; else None."""
        if (self.shard.world > 1 or batch.wait_layer is not None or self.rotary.interleave
                or any(L.window is not None for L in self.layers) or len(batch.seqs) != h.shape[0]
                or any(s.num_new != 1 for s in batch.seqs) or batch.out_slots.dtype != torch.int64
                or not batch.out_slots.is_contiguous()
                or not cpu_kernels.decode_stack_supported(h, k_pool[0], v_pool[0])):
            return None
        pointers = tuple(t.data_ptr() for t in k_pool) + tuple(t.data_ptr() for t in v_pool)
        if self._stack is None or self._stack[0] != pointers:
            cfg = self.cfg
            nq, nkv = self.layers[0].heads
            layers = [dict(ln1=L.ln1, wqkv=L.wqkv, bqkv=L.bqkv, q_norm=L.q_norm, k_norm=L.k_norm, wo=L.wo, bo=L.bo,
                           ln2=L.ln2, w_gate_up=L.w_gate_up, b_gate_up=L.b_gate_up, w_down=L.w_down, b_down=L.b_down)
                      for L in self.layers]
            self._stack = pointers, cpu_kernels.decoder_stack(
                layers, cfg.hidden_size, nq, nkv, cfg.head_dim, self.layers[0].w_down.shape[1], cfg.rms_norm_eps,
                self.scale, k_pool, v_pool)
        return self._stack[1]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor] | None
                ) -> torch.Tensor:
        cfg, sh = self.cfg, self.shard
        n = batch.input_ids.shape[0]
        D, eps = cfg.head_dim, cfg.rms_norm_eps
        nq, nkv = self.layers[0].heads
        h = F.embedding(batch.input_ids, self.embed)
        rot = self.rotary.table(batch.positions, self.dtype)
        stack = self._native_stack(h, batch, k_pool, v_pool)
        if stack is not None:
            cos, sin = (t.reshape(n, D // 2) for t in rot)
            cpu_kernels.decode_stack(stack, h, cos, sin, batch.out_slots, *batch.plan(None).decode_index())
            return self._logits(h, batch)
        delta = None  # the last sublayer's output, added to h by the next norm
        for i, L in enumerate(self.layers):
            h, x = add_rms_norm(h, delta, L.ln1, eps)
            q, k, v = linear(x, L.wqkv, L.bqkv).split([nq * D, nkv * D, nkv * D], dim=-1)
            q, k, v = q.view(n, nq, D), k.view(n, nkv, D), v.view(n, nkv, D)
            if L.q_norm is not None:
                q, k = rms_norm(q, L.q_norm, eps), rms_norm(k, L.k_norm, eps)
            if batch.wait_layer is not None:
                batch.wait_layer(i)
            q = rotate_and_store(self.rotary, q, k, v, rot, k_pool[i], v_pool[i], batch.out_slots)
            attn = paged_attention(q, k_pool[i], v_pool[i], batch.plan(L.window), self.scale)
            o = sh.reduce(linear(attn.reshape(n, nq * D), L.wo))
            h, x = add_rms_norm(h, o if L.bo is None else o + L.bo, L.ln2, eps)
            down = sh.reduce(linear(silu_mul(linear(x, L.w_gate_up, L.b_gate_up)), L.w_down))
            delta = down if L.b_down is None else down + L.b_down
        return self._logits(h + delta, batch)
