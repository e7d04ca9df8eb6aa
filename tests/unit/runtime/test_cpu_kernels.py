"""The native CPU kernels against torch, every variant this CPU runs (``avx2_w16`` runs the AVX-512
variant's 16-wide code on AVX2), every dtype, odd shapes; and the torch fallback."""

from __future__ import annotations

import itertools
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from cache_runtime import cpu_kernels
from cache_runtime.cpu_kernels import build as kbuild
from cache_runtime.memory import DevicePool
from cache_runtime.models import load_model
from cache_runtime.models.config import RopeConfig
from cache_runtime.models.layers import ForwardBatch, SeqSpan, rms_norm, write_kv
from cache_runtime.models.rope import Rotary
from testbed.checkpoints import ORACLE_KINDS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VARIANTS = cpu_kernels.variants()
CPU = torch.device("cpu")


def _runs_here() -> bool:
    if platform.machine() != "x86_64" or shutil.which("g++") is None:
        return False
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return all(f" {x}" in flags for x in ("avx2", "fma", "f16c"))


@pytest.fixture(params=VARIANTS or ["none"])
def variant(request):
    if request.param == "none":
        pytest.skip("no native CPU kernel variant runs on this machine")
    before = cpu_kernels.variant()
    cpu_kernels.select(request.param)
    yield request.param
    cpu_kernels.select(before)


def _pin_rows(monkeypatch, rows: int) -> None:
    """Pins the native row limit of every dtype: what a test checks must not hang on this CPU's calibration."""
    monkeypatch.setattr(cpu_kernels, "_max_rows", {dt: rows for dt in DTYPES})


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def test_library_is_built_and_active_where_the_cpu_runs_it():
    """scripts/setup.sh builds the library; on an x86-64 CPU with AVX2+FMA+F16C the runtime uses it."""
    if not _runs_here():
        pytest.skip("not an x86-64 machine with g++ and AVX2+FMA+F16C")
    assert kbuild.LIBRARY.exists(), "run scripts/setup.sh (python cache_runtime/cpu_kernels/build.py)"
    assert cpu_kernels.variant() in ("avx512", "avx2")
    assert "avx2" in VARIANTS and "avx2_w16" in VARIANTS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 13, 7), (2, 64, 4), (3, 100, 33), (5, 37, 9), (16, 1000, 5),
                                   (7, 8, 130), (37, 70, 19),  # 37 rows: three blocks of x
                                   (1, 1030, 701), (2, 517, 1203)])  # many chunks, each R streams and a rest
def test_linear_matches_float64(variant, monkeypatch, dtype, m, k, n):
    _pin_rows(monkeypatch, cpu_kernels.UNBOUNDED)  # native for every m here
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    wide = torch.randn(m, k + 3, generator=g).to(dtype)
    x = wide[:, 2 : 2 + k]  # rows with a stride wider than k
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    for bias in (None, torch.randn(n, generator=g).to(dtype)):
        want = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
        got = cpu_kernels.linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 2 * _eps(dtype) * want.abs().max().item() + 1e-5
        assert (got.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_leaves_batches_above_the_row_limit_to_torch(variant, monkeypatch, dtype):
    _pin_rows(monkeypatch, 4)
    w = torch.randn(8, 32).to(dtype)
    x = torch.randn(5, 32).to(dtype)
    assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
    monkeypatch.setattr(cpu_kernels, "F", None)  # rows within the limit never reach torch
    assert cpu_kernels.linear(x[:4], w).shape == (4, 8)


def test_the_row_limit_is_the_largest_batch_where_native_keeps_up():
    choose = cpu_kernels.choose_max_rows
    torch_s = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    assert choose({1: 0.5, 2: 0.9, 4: 1.5, 8: 3.0}, torch_s) == 2  # torch wins from 4 rows
    assert choose({1: 0.5, 2: 1.04, 4: 0.9, 8: 3.0}, torch_s) == 4  # a near-tie at 2 rows does not end it
    assert choose({1: 0.5, 2: 0.5, 4: 0.5, 8: 0.5}, torch_s) == cpu_kernels.UNBOUNDED  # native at every size
    assert choose({1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0}, torch_s) == 0  # torch for every batch
    assert choose({1: 1.2, 2: 0.5, 4: 2.0, 8: 2.0}, torch_s) == 2  # a loss at one row, made up at two
    assert choose({1: 0.5, 2: 2.0, 4: 0.5, 8: 0.5}, torch_s) == cpu_kernels.UNBOUNDED  # one noisy size
    assert choose({1: 0.9, 2: 0.9, 4: 0.5, 8: 4.0}, torch_s) == 4  # the gain peaks at 4 rows


def test_calibrate_measures_this_cpu_and_sets_the_limit(variant, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_max_rows", dict(cpu_kernels.DEFAULT_MAX_ROWS))
    monkeypatch.delenv("HICACHE_CPU_LINEAR_MAX_ROWS", raising=False)
    timed = []
    real = cpu_kernels.choose_max_rows
    monkeypatch.setattr(cpu_kernels, "choose_max_rows", lambda n, t: timed.append((n, t)) or real(n, t))
    weights = [torch.randn(96, 64).to(torch.bfloat16), torch.randn(64, 96).to(torch.bfloat16), torch.randn(64)]
    limits = cpu_kernels.calibrate(weights, rows=(1, 2, 4), repeats=1)
    (native_s, torch_s), = timed
    assert sorted(native_s) == sorted(torch_s) == [1, 2, 4] and all(v > 0 for v in native_s.values())
    assert limits[torch.bfloat16] == cpu_kernels.linear_max_rows(torch.bfloat16) == real(native_s, torch_s)
    assert limits[torch.float32] == cpu_kernels.DEFAULT_MAX_ROWS[torch.float32]  # only the weights' dtype
    monkeypatch.setenv("HICACHE_CPU_LINEAR_MAX_ROWS", "3")
    assert set(cpu_kernels.calibrate(weights).values()) == {3} and len(timed) == 1
    monkeypatch.setenv("HICACHE_CPU_LINEAR_MAX_ROWS", "default")
    assert cpu_kernels.calibrate(weights) == cpu_kernels.DEFAULT_MAX_ROWS and len(timed) == 1


def test_calibrate_without_native_ops_measures_nothing(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_max_rows", dict(cpu_kernels.DEFAULT_MAX_ROWS))
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.delenv("HICACHE_CPU_LINEAR_MAX_ROWS", raising=False)
    assert cpu_kernels.calibrate([torch.randn(8, 8)]) == cpu_kernels.DEFAULT_MAX_ROWS


def _attention_reference(q, k_pool, v_pool, rows, seqs, scale):
    out = {}
    hq, hkv = q.shape[1], k_pool.shape[1]
    for row, slots in zip(rows, seqs):
        k, v = k_pool[slots].double(), v_pool[slots].double()
        qq = q[row].double().view(hkv, hq // hkv, -1)
        p = (torch.einsum("hgd,lhd->hgl", qq, k) * scale).softmax(-1)
        out[row] = torch.einsum("hgl,lhd->hgd", p, v).reshape(hq, -1)
    return out


# (query heads, KV heads, key dim, value dim, values are the keys' leading columns as in MLA)
ATTENTION_SHAPES = [(16, 8, 128, 128, False), (6, 2, 13, 13, False), (5, 5, 19, 19, False), (12, 4, 24, 24, False),
                    (24, 3, 8, 8, False), (16, 2, 33, 33, False), (16, 1, 37, 29, True), (3, 1, 20, 16, True)]


@pytest.mark.parametrize("kv_dtype,io_dtype", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("hq,hkv,dk,dv,mla", ATTENTION_SHAPES)
def test_decode_attention_matches_float64(variant, kv_dtype, io_dtype, hq, hkv, dk, dv, mla):
    g = torch.Generator().manual_seed(hq * 100 + dk)
    page, pages = 4, 96
    k_pool = torch.randn(page * pages, hkv, dk, generator=g).to(kv_dtype)
    v_pool = k_pool[..., :dv] if mla else torch.randn(page * pages, hkv, dv, generator=g).to(kv_dtype)
    order = torch.randperm(pages, generator=g)
    lens = [1, 4, 5, 39, 130]  # one token, exactly a page, a page and one, several pages
    seqs, used = [], 0
    for n in lens:  # each sequence on its own shuffled pages, the last one partly filled
        own = order[used : used + (n + page - 1) // page]
        used += own.shape[0]
        seqs.append((own[:, None] * page + torch.arange(page)).reshape(-1)[:n])
    rows = [6, 0, 3, 2, 5]  # rows 1 and 4 are prefill rows: left alone
    q = torch.randn(7, hq, dk, generator=g).to(io_dtype)
    out = torch.full((7, hq, dv), 7.0, dtype=io_dtype)
    offsets = torch.tensor([0, *itertools.accumulate(lens)])
    cpu_kernels.decode_attention(q, k_pool, v_pool, torch.tensor(rows), offsets, torch.cat(seqs), 0.3, out)
    want = _attention_reference(q, k_pool, v_pool, rows, seqs, 0.3)
    tol = 4 * _eps(io_dtype) + 1e-5  # outputs are convex combinations of values of magnitude ~3
    for row in rows:
        assert (out[row].double() - want[row]).abs().max().item() <= 4 * tol
    assert (out[[1, 4]] == 7).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 1024), (3, 13), (70, 1000)])  # 70 x 1000: split across threads
def test_add_rms_norm_matches_torch(variant, dtype, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    h = torch.randn(rows, dim, generator=g).to(dtype)
    delta = torch.randn(rows, dim, generator=g).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    want_h = h + delta
    want = rms_norm(want_h, w, 1e-5)
    got_h = h.clone()
    got = cpu_kernels.add_rms_norm(got_h, delta, w, 1e-5)
    assert torch.equal(got_h, want_h)
    # the sum of squares is accumulated in another order than torch's: one rounding step apart at most
    assert torch.allclose(got.float(), want.float(), rtol=2 * _eps(dtype), atol=1e-6)
    assert torch.allclose(cpu_kernels.add_rms_norm(h.clone(), None, w, 1e-5).float(), rms_norm(h, w, 1e-5).float(),
                          rtol=2 * _eps(dtype), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 2816), (2, 13), (40, 2000)])
def test_silu_mul_matches_torch(variant, dtype, rows, inter):
    x = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = cpu_kernels.silu_mul(x)
    assert torch.allclose(got.float(), want.float(), rtol=2 * _eps(dtype), atol=1e-6)


@pytest.mark.parametrize("dtype,kv_dtype", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("n,hq,hkv,dim", [(1, 16, 8, 128), (5, 6, 2, 14), (3, 4, 4, 2)])
def test_rope_store_matches_torch(variant, dtype, kv_dtype, n, hq, hkv, dim):
    g = torch.Generator().manual_seed(n * hq + dim)
    rope = RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
    rotary = Rotary(rope, dim, 512, CPU)
    qkv = torch.randn(n, (hq + 2 * hkv) * dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (n,), generator=g)
    slots = torch.randperm(64, generator=g)[:n]
    table = rotary.table(positions, dtype)

    def split(t):
        q, k, v = t.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
        return q.view(n, hq, dim), k.view(n, hkv, dim), v.view(n, hkv, dim)

    q, k, v = split(qkv.clone())
    want_k, want_v = torch.zeros(64, hkv, dim, dtype=kv_dtype), torch.zeros(64, hkv, dim, dtype=kv_dtype)
    want_q = rotary.apply(q, table)
    write_kv(want_k, slots, rotary.apply(k, table))
    write_kv(want_v, slots, v)
    q, k, v = split(qkv.clone())
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    cpu_kernels.rope_store(q, k, v, *table, got_k, got_v, slots)
    assert torch.equal(q, want_q)
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)


def _forward_tokens(loaded, ids, steps, force=None):
    """A prefill then ``steps`` decode steps through the model alone, feeding the greedy token (or
    ``force``'s): (logits of every step, the greedy tokens)."""
    cfg = loaded.cfg
    heads, width = cfg.kv_row()
    pool = DevicePool(128, 1, cfg.num_layers, heads, width, loaded.model.dtype, CPU, mla=cfg.is_mla)
    slots = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    n = len(ids)
    logits = loaded.model(ForwardBatch(torch.tensor(ids), torch.arange(n), slots[:n], [SeqSpan(0, n, slots[:n], True)]),
                          pool.k, pool.v)[0]
    every, tokens = [logits], []
    for pos in range(n, n + steps):
        tokens.append(int(logits.argmax()))
        feed = force[pos - n] if force is not None else tokens[-1]
        one = ForwardBatch(torch.tensor([feed]), torch.tensor([pos]), slots[pos : pos + 1],
                           [SeqSpan(0, 1, slots[: pos + 1], True)])
        logits = loaded.model(one, pool.k, pool.v)[0]
        every.append(logits)
    return torch.stack(every), tokens


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_model_with_native_kernels_matches_the_torch_fallback(oracles, kind):
    """The same model with the native ops and with torch alone (the fallback when the library is
    unavailable), over a prefill and 12 decode steps fed the same tokens: float32 logits agree and
    greedy tokens are equal; in bfloat16 the native path is as close to float32 as torch's is."""
    if not VARIANTS:
        pytest.skip("no native CPU kernel variant runs on this machine")
    path, _ = oracles(kind)
    f32 = load_model(str(path), torch.float32, CPU, max_positions=512)
    bf16 = load_model(str(path), torch.bfloat16, CPU, max_positions=512)
    ids = torch.randint(3, f32.cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    before = cpu_kernels.variant()
    try:
        cpu_kernels.select(None)
        want, tokens = _forward_tokens(f32, ids, 12)
        torch_bf16, _ = _forward_tokens(bf16, ids, 12, force=tokens)
    finally:
        cpu_kernels.select(before)
    got, got_tokens = _forward_tokens(f32, ids, 12)
    assert got_tokens == tokens
    assert _rel(got, want) < 1e-5
    native_bf16, _ = _forward_tokens(bf16, ids, 12, force=tokens)
    assert _rel(native_bf16.float(), want) <= 1.5 * _rel(torch_bf16.float(), want) + 1e-3


def _batched_decode(loaded, prompts, steps, force=None):
    """Each prompt prefilled alone, then ``steps`` decode steps of all of them in one batch (one row
    each), feeding the greedy tokens (or ``force``'s): (logits of every decode step, the tokens)."""
    cfg = loaded.cfg
    heads, width = cfg.kv_row()
    pool = DevicePool(256, 1, cfg.num_layers, heads, width, loaded.model.dtype, CPU, mla=cfg.is_mla)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    slots, lens, feed = [], [], []
    for i, ids in enumerate(prompts):
        own = order[i * 64 : (i + 1) * 64]
        n = len(ids)
        logits = loaded.model(ForwardBatch(torch.tensor(ids), torch.arange(n), own[:n], [SeqSpan(0, n, own[:n], True)]),
                              pool.k, pool.v)
        slots.append(own)
        lens.append(n)
        feed.append(int(logits[0].argmax()))
    every, tokens = [], []
    for step in range(steps):
        if force is not None:
            feed = force[step]
        tokens.append(list(feed))
        batch = ForwardBatch(torch.tensor(feed), torch.tensor(lens), torch.stack([s[n] for s, n in zip(slots, lens)]),
                             [SeqSpan(i, 1, s[: n + 1], True) for i, (s, n) in enumerate(zip(slots, lens))])
        logits = loaded.model(batch, pool.k, pool.v)
        every.append(logits)
        lens = [n + 1 for n in lens]
        feed = logits.argmax(dim=-1).tolist()
    return torch.stack(every), tokens


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha-bias-tied", "qwen2", "qwen3"])
def test_decoder_stack_matches_the_op_by_op_path(oracles, kind, monkeypatch):
    """A batch of decoding rows through the native decoder stack (one call for every layer) and
    through the model's op-by-op path: float32 logits agree and greedy tokens are equal; in
    bfloat16 both are as close to float32 (the o/down biases round once inside their matmul in
    the stack, once more after it op by op)."""
    if not VARIANTS:
        pytest.skip("no native CPU kernel variant runs on this machine")
    path, _ = oracles(kind)
    _pin_rows(monkeypatch, 16)
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 14)]
    f32 = load_model(str(path), torch.float32, CPU, max_positions=512)
    bf16 = load_model(str(path), torch.bfloat16, CPU, max_positions=512)
    used = []
    real = type(f32.model)._native_stack

    def spy(self, h, batch, *pools):
        stack = real(self, h, batch, *pools)
        if all(s.num_new == 1 for s in batch.seqs):
            used.append(stack is not None)
        return stack

    monkeypatch.setattr(type(f32.model), "_native_stack", spy)
    stack_f32, tokens = _batched_decode(f32, prompts, 10)
    stack_bf16, _ = _batched_decode(bf16, prompts, 10, force=tokens)
    assert used and all(used), "the decode steps did not run through the native stack"
    monkeypatch.setattr(type(f32.model), "_native_stack", lambda self, *args: None)
    ops_f32, ops_tokens = _batched_decode(f32, prompts, 10)
    ops_bf16, _ = _batched_decode(bf16, prompts, 10, force=tokens)
    assert ops_tokens == tokens
    assert _rel(stack_f32, ops_f32) < 1e-5
    assert _rel(stack_bf16.float(), ops_f32) <= 1.5 * _rel(ops_bf16.float(), ops_f32) + 1e-3


def test_decode_batches_above_the_row_limit_leave_the_native_stack(oracles, monkeypatch):
    """The decoder stack runs only batches the native GEMM takes (one call decides both paths)."""
    if not VARIANTS:
        pytest.skip("no native CPU kernel variant runs on this machine")
    path, _ = oracles("llama-gqa")
    loaded = load_model(str(path), torch.bfloat16, CPU, max_positions=512)
    used = {}
    real = type(loaded.model)._native_stack

    def spy(self, h, batch, *pools):
        stack = real(self, h, batch, *pools)
        if all(s.num_new == 1 for s in batch.seqs):
            used.setdefault(h.shape[0], set()).add(stack is not None)
        return stack

    monkeypatch.setattr(type(loaded.model), "_native_stack", spy)
    _pin_rows(monkeypatch, 2)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    _batched_decode(loaded, prompts, 2)
    _batched_decode(loaded, prompts + [[12, 13]], 2)
    assert used == {2: {True}, 3: {False}}


@pytest.mark.parametrize("name", VARIANTS or ["none"])
def test_a_variant_can_be_forced_for_the_whole_process(name):
    """HICACHE_CPU_KERNELS_VARIANT runs a narrower variant everywhere (the benches' AVX2 runs)."""
    if name == "none":
        pytest.skip("no native CPU kernel variant runs on this machine")
    code = "from cache_runtime import cpu_kernels as c; print(c.variant())"
    env = {**os.environ, "HICACHE_CPU_KERNELS_VARIANT": name}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == name, out.stderr


def test_disabled_or_stale_library_falls_back_to_torch(monkeypatch):
    """HICACHE_CPU_KERNELS=0, or a library built from other sources, leaves every op to torch."""
    code = ("from cache_runtime import cpu_kernels as c; import torch; "
            "x = torch.randn(2, 8); w = torch.randn(3, 8); "
            "assert c.variant() is None and c.variants() == []; "
            "assert torch.equal(c.linear(x, w), torch.nn.functional.linear(x, w)); print('torch')")
    env = {**os.environ, "HICACHE_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "torch", out.stderr
    if kbuild.LIBRARY.exists():
        monkeypatch.setattr(cpu_kernels, "sources_digest", lambda: "0" * 64)
        assert cpu_kernels._load() is None
