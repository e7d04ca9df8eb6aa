"""The page size SGLang really serves, per GPU kind and attention backend, against SGLang itself.

For every oracle release, rendered commands (``reconcile.plan``, expanded as the kubelet does) with
each page size and attention backend go through SGLang's own ``prepare_server_args`` and
resolution with ``--device cuda`` on a GPU kind faked through SGLang's own platform facts
(``runtime_context.override_platform`` from 0.5.21; the capability checks ``server_args`` imports
before). The page size it resolves must be what ``engine.page_outcomes`` says for that GPU kind,
the function validation refuses rewrites with (so status, sizing and L3 keys, which use
``pageSize``, name what SGLang serves). The demo checkpoint stands for an MHA model (Llama), a
config-only DeepseekV3 checkpoint for an MLA one: SGLang reads only config.json while resolving.
Where the operator cannot tell SGLang's choice (an MLA model on SM100: DeepSeek-V3 gets trtllm_mla,
other MLA models flashinfer), what SGLang serves must be one of the sizes it warns about.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hicache_operator.plan.engine import features as engine, versions as engine_versions
from hicache_operator.plan import validation
from testbed import sglang_oracle
from tests.unit.sglang.test_rendered_commands import base, rendered

CHILD = r'''
import contextlib, io, json, sys
from testbed.sglang_child import resolve_args


def faked(gpu):
    facts = {"is_sm100": gpu == 10, "is_blackwell": gpu in (10, 12), "is_hopper_with_cuda_12_3": gpu == 9}
    try:
        from sglang.srt.runtime_context import override_platform
    except ImportError:  # 0.5.9: server_args calls the capability checks it imported
        import sglang.srt.server_args as sa
        sa.is_sm100_supported = lambda *a, **k: facts["is_sm100"]
        sa.is_blackwell_supported = lambda *a, **k: facts["is_blackwell"]
        sa.is_hopper_with_cuda_12_3 = lambda *a, **k: facts["is_hopper_with_cuda_12_3"]
        sa.is_flashinfer_available = lambda *a, **k: True
        return contextlib.nullcontext()
    return override_platform(is_cuda=True, is_hip=False, has_flashinfer=True, **facts)


out = []
for case in json.loads(sys.stdin.read())["cases"]:
    try:
        quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
        with quiet[0], quiet[1], faked(case["gpu"]):
            r = resolve_args(case["argv"])[1]
        out.append({"page_size": r["page_size"], "attention_backend": r.get("attention_backend")})
    except BaseException as exc:
        out.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(out))
'''

BACKENDS = ([], ["--attention-backend", "flashmla"], ["--attention-backend", "trtllm_mha"],
            ["--attention-backend", "fa4"], ["--prefill-attention-backend", "fa4"], ["--attention-backend", "fa3"],
            ["--attention-backend", "flashinfer"], ["--attention-backend", "cutlass_mla"],
            ["--attention-backend", "hpc_ops"], ["--decode-attention-backend", "flashmla"])
PAGES = (1, 16, 64, 128)
GPUS = (8, engine.HOPPER, engine.SM100)
# How SGLang refuses a backend the GPU kind or the release lacks (the GPU checks, argparse's choices).
REFUSALS = ("supported", "requires", "invalid choice", "SystemExit")


MLA_BACKENDS = ([], ["--attention-backend", "flashmla"], ["--attention-backend", "trtllm_mla"],
                ["--attention-backend", "cutlass_mla"], ["--decode-attention-backend", "flashmla"])
# DeepSeek-V3's attention geometry, at toy width: what SGLang's model-specific choices read.
MLA_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 1024,
              "intermediate_size": 2816, "moe_intermediate_size": 256, "num_hidden_layers": 4,
              "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 8, "n_shared_experts": 1,
              "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
              "q_lora_rank": 384, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_group": 1,
              "topk_group": 1, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
              "norm_topk_prob": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 10000,
              "vocab_size": 4096, "torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False}


def mla_checkpoint(where: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(sglang_oracle.demo_checkpoint() / name, where / name)
    (where / "config.json").write_text(json.dumps(MLA_CONFIG))
    return where


def on_gpu(argv: list[str], model: Path | None = None) -> list[str]:
    out = sglang_oracle.for_cpu(argv)
    if model is not None:
        out[out.index("--model-path") + 1] = str(model)
    return out[:-1] + ["cuda"]


@pytest.mark.slow
@pytest.mark.parametrize("version", engine_versions.ORACLE_VERSIONS)
def test_the_page_size_sglang_serves_is_what_validation_reads(version, tmp_path):
    if not sglang_oracle.installed(version):
        pytest.fail(f"sglang {version} is not installed: run scripts/setup.sh (scripts/install-sglang.sh)")
    mla = mla_checkpoint(tmp_path)
    combos, cases = [], []
    for model, backends, checkpoint in (("Qwen/Qwen3-8B", BACKENDS, None),
                                        ("deepseek-ai/DeepSeek-V3", MLA_BACKENDS, mla)):
        for page in PAGES:
            _effective, _sizing, argv, _env = rendered({**base(version), "model": model, "pageSize": page})
            for extra in backends:
                for gpu in GPUS:
                    combos.append((model, page, extra, gpu))
                    cases.append({"argv": on_gpu(argv + extra, checkpoint), "gpu": gpu})
    answers = sglang_oracle.run(version, CHILD, {"cases": cases}, timeout=900)
    disagree, checked = [], 0
    for (model, page, extra, gpu), answer in zip(combos, answers):
        if "error" in answer:  # a backend this GPU or release does not offer: SGLang refuses it at start
            assert extra and any(w in answer["error"] for w in REFUSALS), answer
            continue
        checked += 1
        spec, _ = validation.parse({**base(version), "model": model, "pageSize": page, "extraArgs": extra})
        ours = {o.size for o in engine.page_outcomes(spec, gpu)}
        undecided = model.startswith("deepseek") and gpu == engine.SM100  # the MLA model's backend by architecture
        if answer["page_size"] not in ours or (len(ours) > 1 and not undecided):
            disagree.append(f"{model} pageSize {page} {extra} on GPU kind {gpu}: SGLang serves {answer['page_size']} "
                            f"({answer['attention_backend']}), the operator says {sorted(ours)}")
    assert checked > len(combos) // 2 and not disagree, "\n".join(disagree)
