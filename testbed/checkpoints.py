"""Oracle checkpoints: tiny models built and saved by transformers itself, and defective checkpoints.

``build_oracle_checkpoint(kind, root)`` writes ``root/kind`` with ``save_pretrained`` (the reference for
names, shapes, config fields and sharding) plus the synthesized tokenizer, and returns the in-memory
float32 model for reference logits. transformers' own init (std 0.02) leaves logits nearly equal, so
greedy decoding would hinge on rounding; every tensor is re-drawn from a seeded generator at a scale
where logits spread with std ~LOGIT_STD and top-1 / top-2 are well apart.

``write_bad_checkpoint(root, defect)`` copies a valid tiny checkpoint and breaks one thing.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cache_runtime.synth.checkpoint import write_checkpoint
from cache_runtime.synth.tokenizer import write_tokenizer

VOCAB = 1024
# Logits spread with about this std. A tied head takes it from the final norm, not the embedding: large
# embeddings would dominate the residual stream and make every model echo its input token.
LOGIT_STD = 4.0
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, rms_norm_eps=1e-6)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
_YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
            num_mtp_layers=0)

# kind -> (config class name, config kwargs, save_pretrained max_shard_size or None)
_KINDS: dict[str, tuple[str, dict, int | None]] = {
    # GQA, llama3 RoPE scaling, untied; sharded so the index path is exercised
    "llama-gqa": ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=_LLAMA3_ROPE, rms_norm_eps=1e-5), 200_000),
    # MHA with q/k/v/o and MLP biases, tied embeddings
    "llama-mha-bias-tied": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                                                tie_word_embeddings=True), None),
    # q/k/v biases, no o bias, tied (as Qwen2.5-0.5B)
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), None),
    # sliding window on layers from max_window_layers on: layer 0 full, layer 1 sliding
    "qwen2-sliding": ("Qwen2Config", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                                          max_window_layers=1), None),
    # per-head q/k RMSNorm, head_dim 32 != hidden / heads
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32), None),
    # every layer sliding, window 16
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=16), 300_000),
    # MLA with q LoRA, YaRN with mscale, interleaved rope; dense layer 0, grouped top-k MoE after
    "deepseek-v3": ("DeepseekV3Config", dict(
        _MLA, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, rope_parameters=_YARN_ROPE,
        rms_norm_eps=1e-5), None),  # != the latent norms' fixed 1e-6, so mixing them up shows
    # plain q_proj, non-interleaved default RoPE, MoE from layer 0, two shared experts, unnormalised top-k
    "deepseek-v3-q-proj": ("DeepseekV3Config", dict(
        _MLA, num_key_value_heads=4, q_lora_rank=None, n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=0, n_shared_experts=2, norm_topk_prob=False,
        routed_scaling_factor=1.0, rope_interleave=False), None),
}
ORACLE_KINDS = list(_KINDS)

DEFECTS = ["unsupported-architecture", "missing-shard", "missing-tensor", "misshaped-tensor", "unknown-dtype",
           "unusable-tensor-dtype", "missing-tokenizer", "bad-config-json"]


@torch.no_grad()
def _rescale(model: torch.nn.Module, seed: int) -> None:
    """Re-draws every weight (and the router's correction bias) at a scale that separates greedy choices."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    tied = model.config.tie_word_embeddings
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name, t in tensors.items():
        x = torch.randn(t.shape, generator=g)
        if name == "model.norm.weight":  # a tied head gets its logit scale here
            t.copy_((2 * LOGIT_STD if tied else 1.0) + 0.1 * x)
        elif name.endswith("norm.weight"):
            t.copy_(1.0 + 0.1 * x)
        elif name == "model.embed_tokens.weight":
            t.copy_(x * (0.5 / math.sqrt(hidden)))
        elif name == "lm_head.weight":
            t.copy_(x * (LOGIT_STD / math.sqrt(hidden)))
        elif name.endswith("bias"):  # linear biases and e_score_correction_bias
            t.copy_(x * 0.1)
        else:  # linears and stacked experts: N(0, 1/fan_in), fan-in last
            t.copy_(x / math.sqrt(t.shape[-1]))


def _tokenizer(out: Path, root: Path, seed: int) -> dict:
    """Copies the tokenizer files into ``out``, training them once per ``root`` and seed; returns their ids."""
    src = root / f"_tokenizer-{seed}"
    ids_path = src / "ids.json"
    if not ids_path.exists():
        ids = write_tokenizer(src, vocab_size=VOCAB, seed=seed)
        ids_path.write_text(json.dumps(ids))
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f != ids_path:
            shutil.copy(f, out / f.name)
    return json.loads(ids_path.read_text())


def build_oracle_checkpoint(kind: str, root: Path, seed: int = 0):
    """Writes ``root/kind`` with transformers' ``save_pretrained``; returns (dir, the float32 eager model)."""
    import transformers

    cls_name, kwargs, shard = _KINDS[kind]
    out = Path(root) / kind
    if out.exists():
        shutil.rmtree(out)
    ids = _tokenizer(out, Path(root), seed)
    config = getattr(transformers, cls_name)(**{**_COMMON, **kwargs}, vocab_size=ids["vocab_size"],
                                             bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                                             pad_token_id=ids["pad_token_id"])
    transformers.set_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    _rescale(model, seed)
    model.eval()
    model.save_pretrained(out, **({} if shard is None else {"max_shard_size": shard}))
    return out, model


def _valid(root: Path, sharded: bool) -> Path:
    name = "_valid-sharded" if sharded else "_valid"
    return write_checkpoint(Path(root) / name, "tiny-llama", dtype="float32",
                            max_shard_bytes=200_000 if sharded else None)


def _rewrite(path: Path, change) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def write_bad_checkpoint(root: Path, defect: str) -> Path:
    """``root/defect``: a copy of a valid tiny-llama checkpoint with the one defect ``defect`` names.

    unknown-dtype: config.json says float8_e4m3fn; unusable-tensor-dtype: one weight stored as F8_E4M3.
    """
    if defect not in DEFECTS:
        raise ValueError(f"unknown defect {defect!r}; choose from {DEFECTS}")
    valid = _valid(root, sharded=defect == "missing-shard")
    out = Path(root) / defect
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(valid, out, ignore=shutil.ignore_patterns(".synth-stamp.json"))
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    weights = out / "model.safetensors"
    victim = "model.layers.1.self_attn.k_proj.weight"
    if defect == "unsupported-architecture":
        config["architectures"] = ["Gemma2ForCausalLM"]
        config_path.write_text(json.dumps(config, indent=2))
    elif defect == "missing-shard":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        (out / index["weight_map"][victim]).unlink()
    elif defect == "missing-tensor":
        _rewrite(weights, lambda t: t.pop(victim))
    elif defect == "misshaped-tensor":
        _rewrite(weights, lambda t: t.update({victim: t[victim][:-1].clone()}))
    elif defect == "unknown-dtype":
        config["torch_dtype"] = "float8_e4m3fn"
        config_path.write_text(json.dumps(config, indent=2))
    elif defect == "unusable-tensor-dtype":
        _rewrite(weights, lambda t: t.update({victim: t[victim].to(torch.float8_e4m3fn)}))
    elif defect == "missing-tokenizer":
        keep = {"config.json", "generation_config.json", "model.safetensors"}
        for p in out.iterdir():
            if p.name not in keep:
                p.unlink()
    elif defect == "bad-config-json":
        text = config_path.read_text()
        config_path.write_text(text[: len(text) // 2])
    return out
