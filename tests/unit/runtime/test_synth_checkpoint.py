"""Synthesized checkpoints load in transformers with every key in place, parse in the runtime the way
transformers reads them, shard consistently, are deterministic from the seed, and the CLI's stamp makes
it idempotent. Also the test-support oracle and defective checkpoints the runtime tests build on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from cache_runtime.models.config import CheckpointError, load_config, parse_config
from cache_runtime.synth.__main__ import main as synth_main
from cache_runtime.synth.checkpoint import PRESETS, STAMP, tensor_specs, write_checkpoint
from testbed.checkpoints import DEFECTS, ORACLE_KINDS, build_oracle_checkpoint, write_bad_checkpoint

REPO = Path(__file__).resolve().parents[3]
SHARD = 150_000
# The demo at full depth is ~0.5 GB; one layer keeps its real widths and vocabulary.
CASES = {name: {**PRESETS[name], "num_hidden_layers": 1} if name == "demo" else PRESETS[name] for name in PRESETS}
PROMPT = [5, 17, 99, 300, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> dict[str, Path]:
    """Every preset written once; tiny-llama sharded."""
    root = tmp_path_factory.mktemp("synth")
    return {name: write_checkpoint(root / name, config, max_shard_bytes=SHARD if name == "tiny-llama" else None)
            for name, config in CASES.items()}


def _tensors(model_dir: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (file, tensor) over every safetensors file in ``model_dir``."""
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                assert name not in out, f"{name} in two shards"
                out[name] = (path.name, f.get_tensor(name))
    return out


def _window(tcfg, layer: int) -> int | None:
    """The sliding window transformers applies to ``layer``."""
    if tcfg.model_type == "mistral":
        return tcfg.sliding_window
    types = getattr(tcfg, "layer_types", None)
    return tcfg.sliding_window if types and types[layer] == "sliding_attention" else None


def assert_runtime_config_agrees(model_dir: Path) -> None:
    """parse_config reads config.json as transformers' own config class does."""
    cfg = load_config(model_dir)
    t = transformers.AutoConfig.from_pretrained(model_dir)
    assert cfg.architecture == t.architectures[0]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads) == \
        (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads)
    assert cfg.intermediate_size == t.intermediate_size
    assert cfg.rms_norm_eps == t.rms_norm_eps and cfg.tie_word_embeddings == t.tie_word_embeddings
    eos = t.eos_token_id if isinstance(t.eos_token_id, list) else [t.eos_token_id]
    assert cfg.eos_token_ids == tuple(eos) and cfg.bos_token_id == t.bos_token_id
    rope = t.rope_parameters
    assert (cfg.rope.rope_type, cfg.rope.theta) == (rope["rope_type"], rope["rope_theta"])
    for field in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                  "mscale", "mscale_all_dim"):
        if rope.get(field) is not None:
            assert getattr(cfg.rope, field) == rope[field], field
    assert [cfg.window(i) for i in range(cfg.num_layers)] == [_window(t, i) for i in range(t.num_hidden_layers)]
    if cfg.mla is None:
        head_dim = getattr(t, "head_dim", t.hidden_size // t.num_attention_heads)  # as the attention modules do
        assert (cfg.num_kv_heads, cfg.head_dim) == (t.num_key_value_heads, head_dim)
        assert cfg.qk_norm == (t.model_type == "qwen3")
        return
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == \
        (t.q_lora_rank, t.kv_lora_rank, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim)
    assert cfg.rope.interleave == t.rope_interleave
    moe = cfg.moe
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.n_shared_experts,
            moe.first_k_dense_replace, moe.n_group, moe.topk_group, moe.norm_topk_prob,
            moe.routed_scaling_factor) == \
        (t.n_routed_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.n_shared_experts,
         t.first_k_dense_replace, t.n_group, t.topk_group, t.norm_topk_prob, t.routed_scaling_factor)


def _load(model_dir: Path, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    return model.eval()


@pytest.mark.parametrize("name", list(CASES))
def test_preset_loads_in_transformers_with_every_key(synth, name):
    model = _load(synth[name])
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits.float()[0]
    assert torch.isfinite(logits).all()
    assert 2.0 < logits.std(-1).mean() < 4.5  # spread like a trained model's, not flat, not saturated
    assert len(set(logits.argmax(-1).tolist())) > len(PROMPT) // 2  # predictions follow the input


@pytest.mark.parametrize("name", list(CASES))
def test_preset_config_parses_as_transformers_reads_it(synth, name):
    assert_runtime_config_agrees(synth[name])
    config = json.loads((synth[name] / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    tok = json.loads((synth[name] / "tokenizer.json").read_text())
    assert config["vocab_size"] == len(tok["model"]["vocab"]) + len(tok["added_tokens"])


def test_files_hold_exactly_the_specified_tensors(synth):
    for name, model_dir in synth.items():
        config = json.loads((model_dir / "config.json").read_text())
        found = {n: (tuple(t.shape), t.dtype) for n, (_, t) in _tensors(model_dir).items()}
        assert found == {s.name: (s.shape, torch.float32 if s.fp32 else torch.bfloat16)
                         for s in tensor_specs(config)}, name


def test_demo_preset_has_the_promised_geometry():
    specs = tensor_specs(PRESETS["demo"])
    params = sum(torch.Size(s.shape).numel() for s in specs)
    assert 150e6 < params < 250e6
    cfg = parse_config(PRESETS["demo"])
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 16, 8, 128)
    assert cfg.rope.rope_type == "llama3" and not cfg.tie_word_embeddings


def test_sharded_index_names_every_tensor_once(synth):
    model_dir = synth["tiny-llama"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors = _tensors(model_dir)
    assert not (model_dir / "model.safetensors").exists()
    shards = sorted({f for f, _ in tensors.values()})
    assert len(shards) >= 2
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert index["weight_map"] == {n: f for n, (f, _) in tensors.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in tensors.values())
    for shard in shards:
        sizes = [t.numel() * t.element_size() for f, t in tensors.values() if f == shard]
        assert sum(sizes) <= SHARD or len(sizes) == 1


def test_same_seed_same_bytes_whatever_the_sharding(tmp_path, synth):
    sharded = _tensors(synth["tiny-llama"])
    single = _tensors(write_checkpoint(tmp_path / "single", "tiny-llama"))
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[n][1], single[n][1]) for n in single)
    again = write_checkpoint(tmp_path / "again", "tiny-llama")
    assert (again / "model.safetensors").read_bytes() == (tmp_path / "single" / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tmp_path / "single" / "tokenizer.json").read_bytes()
    other = _tensors(write_checkpoint(tmp_path / "seed1", "tiny-llama", seed=1))
    assert not any(torch.equal(other[n][1], single[n][1]) for n in single if "norm" not in n)


def test_dtypes_and_fp32_router_bias(tmp_path):
    model_dir = write_checkpoint(tmp_path / "f16", "tiny-deepseek-v3", dtype="float16")
    dtypes = {n: t.dtype for n, (_, t) in _tensors(model_dir).items()}
    assert dtypes.pop("model.layers.1.mlp.gate.e_score_correction_bias") == torch.float32
    assert dtypes.pop("model.layers.2.mlp.gate.e_score_correction_bias") == torch.float32
    assert set(dtypes.values()) == {torch.float16}
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == "float16"
    with pytest.raises(ValueError, match="unknown dtype"):
        write_checkpoint(tmp_path / "bad", "tiny-llama", dtype="int8")
    with pytest.raises(ValueError, match="unknown preset"):
        write_checkpoint(tmp_path / "bad", "gpt2")


def test_cli_writes_once_then_leaves_a_complete_checkpoint_alone(tmp_path, capsys):
    out = tmp_path / "ckpt"
    args = ["--preset", "tiny-qwen3", "--out", str(out), "--max-shard-mb", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "cache_runtime.synth", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout
    assert (out / STAMP).exists() and (out / "model-00001-of-00001.safetensors").exists()
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    assert synth_main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes

    (out / "tokenizer.json").unlink()  # incomplete: written again
    assert synth_main(args) == 0 and "wrote" in capsys.readouterr().out
    assert (out / "tokenizer.json").exists()

    assert synth_main(args[:-2]) == 0 and "wrote" in capsys.readouterr().out  # other arguments: unsharded
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


@pytest.fixture(scope="module")
def oracles(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle")
    return {kind: build_oracle_checkpoint(kind, root) for kind in ORACLE_KINDS}


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_oracle_checkpoint_reloads_parses_and_separates_greedy_choices(oracles, kind):
    model_dir, model = oracles[kind]
    reloaded = _load(model_dir, attn_implementation="eager")
    assert_runtime_config_agrees(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        logits = torch.cat([model(torch.tensor([PROMPT])).logits[0], *out.logits])
        torch.testing.assert_close(reloaded(out.sequences).logits, model(out.sequences).logits)
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # far beyond fp32 rounding of any attention order
    assert logits.std(-1).mean() > 2.0


def test_oracles_cover_sharding_ties_biases_and_gqa(oracles):
    dirs = {kind: d for kind, (d, _) in oracles.items()}
    assert (dirs["llama-gqa"] / "model.safetensors.index.json").exists()
    configs = {kind: json.loads((d / "config.json").read_text()) for kind, d in dirs.items()}
    assert any(c["tie_word_embeddings"] for c in configs.values())
    assert any(not c["tie_word_embeddings"] for c in configs.values())
    assert configs["llama-mha-bias-tied"]["attention_bias"] and configs["llama-mha-bias-tied"]["mlp_bias"]
    mha = [c["num_key_value_heads"] == c["num_attention_heads"] for c in configs.values()]
    assert any(mha) and not all(mha)


@pytest.fixture(scope="module")
def bad_root(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


@pytest.mark.parametrize("defect", DEFECTS)
def test_bad_checkpoint_has_its_one_defect(bad_root, defect):
    model_dir = write_bad_checkpoint(bad_root, defect)
    victim = "model.layers.1.self_attn.k_proj.weight"
    if defect == "bad-config-json":
        with pytest.raises(CheckpointError, match="unreadable"):
            load_config(model_dir)
        return
    if defect == "unsupported-architecture":
        with pytest.raises(CheckpointError, match="not supported"):
            load_config(model_dir)
        return
    cfg = load_config(model_dir)
    tensors = _tensors(model_dir)
    expected = {s.name: s.shape for s in tensor_specs(json.loads((model_dir / "config.json").read_text()))}
    if defect == "missing-shard":
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        missing = {f for f in index["weight_map"].values() if not (model_dir / f).exists()}
        assert missing == {index["weight_map"][victim]}
        return
    if defect == "missing-tensor":
        assert set(expected) - set(tensors) == {victim}
    elif defect == "misshaped-tensor":
        assert [n for n, (_, t) in tensors.items() if tuple(t.shape) != expected[n]] == [victim]
    elif defect == "unknown-dtype":
        assert cfg.torch_dtype == "float8_e4m3fn"
    elif defect == "unusable-tensor-dtype":
        assert [n for n, (_, t) in tensors.items() if t.dtype != torch.float32] == [victim]
    elif defect == "missing-tokenizer":
        assert not list(model_dir.glob("tokenizer*"))
        return
    assert (model_dir / "tokenizer.json").exists()
