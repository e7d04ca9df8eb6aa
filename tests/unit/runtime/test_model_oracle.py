"""Every supported architecture against transformers, the oracle: logits, greedy continuations
alone and batched, through the model alone and through the engine."""

from __future__ import annotations

import copy
import queue

import pytest
import torch

from cache_runtime.engine.requests import Request
from cache_runtime.memory import DevicePool
from cache_runtime.models import load_model
from cache_runtime.models.layers import ForwardBatch, SeqSpan
from cache_runtime.sampling import SamplingParams
from testbed.checkpoints import ORACLE_KINDS
from tests.unit.runtime.conftest import generate

CPU = torch.device("cpu")


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def _reference_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_prefill_logits_match_transformers(oracles, kind):
    """Every position's logits, with the prompt run as two chunks (the second reads the first's K/V
    back from the pool, as a cached prefix would)."""
    path, ref = oracles(kind)
    loaded = load_model(str(path), torch.float32, CPU, max_positions=512)
    cfg = loaded.cfg
    heads, width = cfg.kv_row()
    pool = DevicePool(256, 1, cfg.num_layers, heads, width, torch.float32, CPU, mla=cfg.is_mla)
    ids = _prompt(1, 40, cfg.vocab_size)  # longer than every oracle's sliding window
    want = _reference_logits(ref, ids)
    slots = torch.arange(100, 140)
    got = []
    for a, b in ((0, 23), (23, 40)):
        # one logits row per position: a sequence per token, each over its own context
        seqs = [SeqSpan(0, b - a, slots[:b], False)]
        batch = ForwardBatch(torch.tensor(ids[a:b]), torch.arange(a, b), slots[a:b], seqs)
        loaded.model(batch, pool.k, pool.v)
        for pos in range(a, b):
            one = ForwardBatch(torch.tensor([ids[pos]]), torch.tensor([pos]), slots[pos:pos + 1],
                               [SeqSpan(0, 1, slots[: pos + 1], True)])
            got.append(loaded.model(one, pool.k, pool.v)[0])
    err = (torch.stack(got) - want).abs().max().item()
    assert err < 1e-4, f"{kind}: max |logit difference| {err}"


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_bfloat16_prefill_tracks_float32(oracles, kind):
    """bf16 weights and KV: as close to the float32 reference as transformers' own bf16 run is."""
    path, ref = oracles(kind)
    loaded = load_model(str(path), torch.bfloat16, CPU, max_positions=512)
    cfg = loaded.cfg
    heads, width = cfg.kv_row()
    pool = DevicePool(64, 1, cfg.num_layers, heads, width, torch.bfloat16, CPU, mla=cfg.is_mla)
    ids = _prompt(2, 24, cfg.vocab_size)
    want = _reference_logits(ref, ids)[-1]
    slots = torch.arange(24)
    got = loaded.model(ForwardBatch(torch.tensor(ids), torch.arange(24), slots, [SeqSpan(0, 24, slots, True)]),
                       pool.k, pool.v)[0]
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    theirs = _reference_logits(ref16, ids)[-1].float()
    rel = ((got - want).norm() / want.norm()).item()
    rel_theirs = ((theirs - want).norm() / want.norm()).item()
    assert rel < 2 * rel_theirs + 0.01, f"{kind}: relative logit error {rel}, transformers' bf16: {rel_theirs}"


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_greedy_continuations_equal_transformers_alone_and_batched(oracles, engines, kind):
    path, ref = oracles(kind)
    engine = engines(model_path=str(path), dtype="float32", page_size=4, max_total_tokens=4096,
                     enable_hierarchical_cache=True)
    vocab = engine.runner.cfg.vocab_size
    prompts = [_prompt(10 + i, n, vocab) for i, n in enumerate((5, 37, 18, 64))]
    want = [_reference_greedy(ref, p, 32) for p in prompts]
    alone = generate(engine, prompts[1], n=32, ignore_eos=True)
    assert alone.output_ids == want[1]
    outs: list[queue.Queue] = []
    for p in prompts:  # submitted together: prefilled and decoded in shared batches
        q: queue.Queue = queue.Queue()
        engine.submit(Request(list(p), SamplingParams(max_new_tokens=32, ignore_eos=True), q.put))
        outs.append(q)
    for q, w in zip(outs, want):
        while (out := q.get(timeout=120)) and not out.finished:
            pass
        assert out.error is None and out.output_ids == w
