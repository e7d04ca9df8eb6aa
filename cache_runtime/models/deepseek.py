"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention and routed experts.

The KV cache holds one row per token and layer: the normed latent (``kv_lora_rank``) followed by
the roped shared key (``qk_rope_head_dim``), as SGLang's MLA pool does. Attention runs in the
absorbed form: ``kv_b_proj``'s key half is folded into the query, so every head attends over
the cached rows directly (one KV head), and its value half is applied to the attended latent.
That is the same function as transformers' expand-then-attend, in a different order of sums.

Experts are a plain loop over the experts a batch routes to (sigmoid scores, group-limited
top-k on score + correction bias, weights from the unbiased scores), as transformers does.

Under tensor parallelism a rank holds its attention heads and its share of every MLP's columns
(dense, each routed expert, the shared experts); the latent cache and the router are replicated,
so every rank routes the same tokens the same way, and partial outputs are all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cache_runtime.cpu_kernels import linear
from cache_runtime.models.base import CausalLM, Shard, WeightSource, rows_of
from cache_runtime.models.config import ModelConfig
from cache_runtime.models.layers import ForwardBatch, paged_attention, rms_norm, write_kv
from cache_runtime.models.rope import Rotary, yarn_softmax_scale

_LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use transformers' default, not rms_norm_eps


class _Mlp:
    """gate/up/down over this rank's columns; the output is a partial sum across ranks."""

    def __init__(self, prefix: str, size: int, w: WeightSource, H: int, dt: torch.dtype, dev: torch.device,
                 sh: Shard) -> None:
        cols = sh.span(size, f"the MLP width of {prefix}")
        self.w_gate_up = torch.cat([w.get(f"{prefix}gate_proj.weight", (size, H), dt, dev, rows=cols),
                                    w.get(f"{prefix}up_proj.weight", (size, H), dt, dev, rows=cols)])
        self.w_down = w.get(f"{prefix}down_proj.weight", (H, size), dt, dev, cols=cols)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.w_gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.w_down)


class _Experts:
    def __init__(self, cfg: ModelConfig, p: str, w: WeightSource, dt: torch.dtype, dev: torch.device,
                 sh: Shard) -> None:
        moe, H = cfg.moe, cfg.hidden_size
        E, mI = moe.n_routed_experts, moe.moe_intermediate_size
        self.moe = moe
        self.gate = w.get(f"{p}mlp.gate.weight", (E, H), torch.float32, dev)
        bias = f"{p}mlp.gate.e_score_correction_bias"
        self.bias = w.get(bias, (E,), torch.float32, dev) if bias in w else torch.zeros(E, device=dev)
        self.experts = [_Mlp(f"{p}mlp.experts.{e}.", mI, w, H, dt, dev, sh) for e in range(E)]
        self.shared = (_Mlp(f"{p}mlp.shared_experts.", mI * moe.n_shared_experts, w, H, dt, dev, sh)
                       if moe.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        scores = linear(x.float(), self.gate).sigmoid()
        choice = scores + self.bias
        E, G = moe.n_routed_experts, moe.n_group
        group_scores = choice.view(-1, G, E // G).topk(min(2, E // G), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        idx = torch.topk(choice, k=moe.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * moe.routed_scaling_factor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, pos = torch.where(idx == e)
            y = self.experts[e](x[tok]) * weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class _Layer:
    def __init__(self, cfg: ModelConfig, i: int, w: WeightSource, dt: torch.dtype, dev: torch.device,
                 sh: Shard) -> None:
        p = f"model.layers.{i}."
        m, H, nh = cfg.mla, cfg.hidden_size, cfg.num_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        heads = sh.span(nh, "num_attention_heads")
        self.num_heads = heads[1] - heads[0]

        def get(name, shape, rows=None, cols=None):
            return w.get(p + name, shape, dt, dev, rows=rows, cols=cols)

        bias = lambda name, n: get(name, (n,)) if cfg.attention_bias else None  # noqa: E731
        self.ln1 = get("input_layernorm.weight", (H,))
        self.ln2 = get("post_attention_layernorm.weight", (H,))
        if m.q_lora_rank is None:
            self.wq = get("self_attn.q_proj.weight", (nh * qk, H), rows=rows_of(heads, qk))
            self.wq_a = None
        else:
            self.wq_a = get("self_attn.q_a_proj.weight", (m.q_lora_rank, H))
            self.bq_a = bias("self_attn.q_a_proj.bias", m.q_lora_rank)
            self.q_a_norm = get("self_attn.q_a_layernorm.weight", (m.q_lora_rank,))
            self.wq = get("self_attn.q_b_proj.weight", (nh * qk, m.q_lora_rank), rows=rows_of(heads, qk))
        self.wkv_a = get("self_attn.kv_a_proj_with_mqa.weight", (m.kv_dim, H))
        self.bkv_a = bias("self_attn.kv_a_proj_with_mqa.bias", m.kv_dim)
        self.kv_a_norm = get("self_attn.kv_a_layernorm.weight", (m.kv_lora_rank,))
        per_head = m.qk_nope_head_dim + m.v_head_dim
        kv_b = get("self_attn.kv_b_proj.weight", (nh * per_head, m.kv_lora_rank), rows=rows_of(heads, per_head))
        kv_b = kv_b.view(self.num_heads, per_head, m.kv_lora_rank)
        self.w_uk = kv_b[:, : m.qk_nope_head_dim].contiguous()  # (nh, dn, kvr)
        self.w_uv = kv_b[:, m.qk_nope_head_dim :].contiguous()  # (nh, dv, kvr)
        self.wo = get("self_attn.o_proj.weight", (H, nh * m.v_head_dim), cols=rows_of(heads, m.v_head_dim))
        self.bo = bias("self_attn.o_proj.bias", H)
        if cfg.moe is not None and cfg.moe.is_moe_layer(i):
            self.mlp = _Experts(cfg, p, w, dt, dev, sh)
        else:
            self.mlp = _Mlp(p + "mlp.", cfg.intermediate_size, w, H, dt, dev, sh)


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, weights: WeightSource, dtype: torch.dtype, device: torch.device,
                 max_positions: int, shard: Shard = Shard()) -> None:
        self.cfg, self.dtype, self.device, self.shard = cfg, dtype, device, shard
        self._load_embeddings(weights)
        self.layers = [_Layer(cfg, i, weights, dtype, device, shard) for i in range(cfg.num_layers)]
        m = cfg.mla
        self.rotary = Rotary(cfg.rope, m.qk_rope_head_dim, max_positions, device)
        self.scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale(cfg.rope)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor] | None
                ) -> torch.Tensor:
        cfg, m, sh = self.cfg, self.cfg.mla, self.shard
        n, nh, eps = batch.input_ids.shape[0], self.layers[0].num_heads, cfg.rms_norm_eps
        dn, dr, kvr = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        h = F.embedding(batch.input_ids, self.embed)
        plan = batch.plan(None)
        rot = self.rotary.table(batch.positions, self.dtype)
        for i, L in enumerate(self.layers):
            x = rms_norm(h, L.ln1, eps)
            if L.wq_a is None:
                q = linear(x, L.wq)
            else:
                q = linear(rms_norm(linear(x, L.wq_a, L.bq_a), L.q_a_norm, _LATENT_EPS), L.wq)
            q = q.view(n, nh, dn + dr)
            q_nope, q_rot = q[..., :dn], self.rotary.apply(q[..., dn:], rot)
            latent, k_rot = linear(x, L.wkv_a, L.bkv_a).split([kvr, dr], dim=-1)
            latent = rms_norm(latent, L.kv_a_norm, _LATENT_EPS)
            k_rot = self.rotary.apply(k_rot.view(n, 1, dr), rot)
            if batch.wait_layer is not None:
                batch.wait_layer(i)
            pool = k_pool[i]
            write_kv(pool, batch.out_slots, torch.cat([latent.view(n, 1, kvr), k_rot], dim=-1))
            q_lat = torch.einsum("nhd,hdk->nhk", q_nope, L.w_uk)
            attn = paged_attention(torch.cat([q_lat, q_rot], dim=-1), pool, pool[..., :kvr], plan, self.scale)
            o = torch.einsum("nhk,hvk->nhv", attn, L.w_uv)
            o = sh.reduce(linear(o.reshape(n, -1), L.wo))
            h = h + (o if L.bo is None else o + L.bo)
            h = h + sh.reduce(L.mlp(rms_norm(h, L.ln2, eps)))
        return self._logits(h, batch)
