"""Serving benchmark of the bundled runtime on a real checkpoint, against transformers in the same run.

The model is the demo checkpoint (``python -m cache_runtime.synth --preset demo``: a random-weight
LlamaForCausalLM, hidden 1024, 16 layers, 16 heads / 8 KV heads of 128, ~247 M parameters, bf16),
the one scripts/setup.sh writes into ``~/.cache/hicache-operator/models/demo`` (``$HICACHE_MODELS_DIR``), written here when absent.

Workload: a seeded request set per concurrency level, prompt lengths log-uniform in
``--prompt-len`` (32..1024 tokens), output lengths uniform in ``--output-len`` (16..256), prompts as
random token ids (or, with ``--prompt-format text``, text decoded from them and re-tokenized by the
checkpoint's tokenizer). Each level N of ``--concurrency`` (1, 4, 16) runs closed loop: N clients each
send their next request when the previous one finishes, streaming (TTFT = request sent -> first
token event; ITL = gaps between token events), ``ignore_eos`` so outputs are as long as drawn.

Baseline, same requests, same thread count, in this process after the runtime (never at the same
time): transformers ``AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16).generate``, greedy,
per request at N=1; at N>1 requests are sorted by output length and cut into batches of N (left
padding with an attention mask, ``min_new_tokens = max_new_tokens`` = the batch's longest output).
Both sides report output tokens/s = requested output tokens / wall time; the baseline's extra tokens
(shorter requests of a batch run to its longest) are wasted work and not counted. The server's
radix cache is flushed before every runtime pass, so repeats do not hit each other's prefixes.

Batch-1 decode: one long generation (``--decode-tokens``) from a short prompt, tokens/s after the
first token, against the memory-bandwidth limit = copy bandwidth (a 1 GiB torch ``copy_`` after
warm-up, same thread count, measured in this run on 4 KiB pages and on huge pages, the higher
taken) / matmul weight bytes read per token (every 2-D weight but the embedding, LM head
included). Both bandwidth conventions are reported: bytes copied
per second, and read+write (STREAM's, twice that); the goal is judged against read+write, since a
decode step only reads weights and a copy's traffic is a read and a write stream.

Goals: runtime/baseline output tokens/s >= 1.0 at concurrency 1 and >= 2.0 at 16; batch-1 decode
>= 0.7 x the bandwidth limit. Everything runs ``--repeats`` times interleaved (runtime, then baseline,
per level); the summary shows medians and [min..max].

    python bench/serve.py [--quick] [--json-out bench/results/serve.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from testbed.bench_report import gemm_calibration, machine_info, no_nan
from testbed.demo_checkpoint import matmul_weight_bytes, resolve_model_path
from testbed.runtime_proc import RuntimeProcess, start_runtime, stream_generate

GOAL_RATIO_C1 = 1.0
GOAL_RATIO_C16 = 2.0
GOAL_DECODE_FRACTION = 0.7


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="checkpoint directory (default: the demo checkpoint)")
    p.add_argument("--cpu-threads", type=int, default=2, help="torch threads of the runtime and of the baseline")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--num-requests", default=None,
                   help="requests per concurrency level, comma-separated in the order of --concurrency "
                        "(default 6,12,32; --quick 2,4,16)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="log-uniform prompt tokens (default 32 1024; --quick 32 256)")
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="uniform output tokens (default 16 256; --quick 16 64)")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    p.add_argument("--decode-tokens", type=int, default=None, help="batch-1 decode length (default 256; --quick 96)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--server-args", default="", help="extra flags for the runtime, e.g. '--chunked-prefill-size 512'")
    p.add_argument("--quick", action="store_true", help="fewer, shorter requests: a couple of minutes")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    default_n = {1: 2, 4: 4, 16: 16} if a.quick else {1: 6, 4: 12, 16: 32}
    if a.num_requests:
        counts = [int(x) for x in a.num_requests.split(",")]
        if len(counts) != len(a.concurrency):
            p.error("--num-requests needs one count per --concurrency level")
    else:
        counts = [default_n.get(c, 2 * c) for c in a.concurrency]
    a.num_requests = dict(zip(a.concurrency, counts))
    a.prompt_len = a.prompt_len or ([32, 256] if a.quick else [32, 1024])
    a.output_len = a.output_len or ([16, 64] if a.quick else [16, 256])
    a.decode_tokens = a.decode_tokens or (96 if a.quick else 256)
    if min(a.concurrency) < 1 or min(counts) < 1 or a.cpu_threads < 1 or a.repeats < 1 or a.decode_tokens < 2:
        p.error("concurrency, request counts, --cpu-threads, --repeats must be >= 1, --decode-tokens >= 2")
    if not (1 <= a.prompt_len[0] <= a.prompt_len[1] and 1 <= a.output_len[0] <= a.output_len[1]):
        p.error("--prompt-len / --output-len: 1 <= MIN <= MAX")
    return a


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# ----------------------------------------------------------------------------- workload
def draw_requests(n: int, seed: int, a, tokenizer, token_hi: int) -> list[dict]:
    """``n`` requests: prompt ids (and text in text mode) and an output length, from ``seed``."""
    rng = random.Random(seed)
    lo, hi = a.prompt_len
    out = []
    for _ in range(n):
        plen = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        olen = rng.randint(*a.output_len)
        ids = [rng.randrange(token_hi) for _ in range(plen)]
        req = {"input_ids": ids, "output_len": olen, "text": None}
        if a.prompt_format == "text":
            # random ids decode to text that re-tokenizes longer: cut to the drawn length, keep what the
            # server's own tokenizer makes of the text (it is the one the server runs)
            text = tokenizer.decode(tokenizer.encode(tokenizer.decode(ids))[:plen])
            req["text"], req["input_ids"] = text, tokenizer.encode(text)
        out.append(req)
    return out


# ----------------------------------------------------------------------------- runtime side
async def stream_one(client: httpx.AsyncClient, req: dict) -> dict:
    params = {"max_new_tokens": req["output_len"], "ignore_eos": True, "temperature": 0}
    body = {"stream": True, "sampling_params": params}
    if req["text"] is not None:
        body["text"] = req["text"]
    else:
        body["input_ids"] = req["input_ids"]
    start = time.perf_counter()
    events: list[tuple[float, int]] = []  # (time, tokens so far)
    last = None
    async for at, ev in stream_generate(client, body):
        n = len(ev.get("output_ids") or ())
        if n and (not events or n > events[-1][1]):
            events.append((at, n))
        last = ev
    end = time.perf_counter()
    if not events:
        raise RuntimeError("no token came back")
    itl = []
    for (t0, n0), (t1, n1) in zip(events, events[1:]):
        itl.extend([(t1 - t0) / (n1 - n0)] * (n1 - n0))  # tokens that arrive together share the gap
    return {"ttft": events[0][0] - start, "itl": itl, "latency": end - start, "first": events[0][0],
            "last": events[-1][0], "output_tokens": events[-1][1],
            "prompt_tokens": last["meta_info"]["prompt_tokens"], "cached_tokens": last["meta_info"]["cached_tokens"]}


async def closed_loop(url: str, reqs: list[dict], concurrency: int) -> tuple[list[dict], float]:
    results: list[dict | None] = [None] * len(reqs)
    todo = iter(range(len(reqs)))
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=1800, trust_env=False, limits=limits) as client:
        async def client_loop() -> None:
            for i in todo:  # the shared iterator hands each request to exactly one client
                results[i] = await stream_one(client, reqs[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def runtime_pass(server: RuntimeProcess, reqs: list[dict], concurrency: int) -> dict:
    r = httpx.post(server.url + "/flush_cache?timeout=60", timeout=90, trust_env=False)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {r.status_code}: {r.text[:200]}")
    results, wall = asyncio.run(closed_loop(server.url, reqs, concurrency))
    out_tokens = sum(x["output_tokens"] for x in results)
    wanted = sum(q["output_len"] for q in reqs)
    if out_tokens != wanted:
        raise RuntimeError(f"runtime returned {out_tokens} output tokens, {wanted} were asked for (ignore_eos)")
    for x, q in zip(results, reqs):  # text mode: the server must tokenize as the baseline's ids say
        if x["prompt_tokens"] != len(q["input_ids"]):
            raise RuntimeError(f"the server counted {x['prompt_tokens']} prompt tokens, the bench "
                               f"{len(q['input_ids'])}: the baseline would run other prompts")
    ttft = [x["ttft"] for x in results]
    itl = [g for x in results for g in x["itl"]]
    return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
            "prompt_tokens": sum(x["prompt_tokens"] for x in results),
            "cached_tokens": sum(x["cached_tokens"] for x in results),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "itl_p50_s": percentile(itl, 0.5), "itl_p90_s": percentile(itl, 0.9),
            "latency_p50_s": percentile([x["latency"] for x in results], 0.5)}


def runtime_decode(server: RuntimeProcess, n: int, token_hi: int) -> dict:
    """One long generation from a 32-token prompt: decode tokens/s after the first token."""
    httpx.post(server.url + "/flush_cache?timeout=60", timeout=90, trust_env=False)
    rng = random.Random(7)
    req = {"input_ids": [rng.randrange(token_hi) for _ in range(32)], "output_len": n, "text": None}
    (res,), _ = asyncio.run(closed_loop(server.url, [req], 1))
    return {"tokens": res["output_tokens"], "ttft_s": res["ttft"],
            "decode_tok_s": (res["output_tokens"] - 1) / (res["last"] - res["first"]),
            "itl_p50_s": percentile(res["itl"], 0.5)}


# ----------------------------------------------------------------------------- baseline side
class Baseline:
    """transformers on the same checkpoint, bf16, greedy, in this process."""

    def __init__(self, model_dir: str, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        gen = self.model.generation_config
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else (gen.eos_token_id or 0)
        if isinstance(self.pad_id, list):
            self.pad_id = self.pad_id[0]
        self.attn = self.model.config._attn_implementation

    def generate(self, prompts: list[list[int]], new_tokens: int) -> int:
        """Left-padded batch, exactly ``new_tokens`` each (min = max new tokens: EOS cannot end it early)."""
        torch = self.torch
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p)
            mask[i, longest - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad_id,
                                      temperature=None, top_p=None, top_k=None)
        made = out.shape[1] - longest
        if made != new_tokens:
            raise RuntimeError(f"transformers generated {made} tokens, {new_tokens} were asked for")
        return made * len(prompts)

    def run(self, reqs: list[dict], concurrency: int) -> dict:
        order = sorted(range(len(reqs)), key=lambda i: reqs[i]["output_len"])
        batches = [order[i : i + concurrency] for i in range(0, len(order), concurrency)]
        generated = 0
        t0 = time.perf_counter()
        for b in batches:
            generated += self.generate([reqs[i]["input_ids"] for i in b], max(reqs[i]["output_len"] for i in b))
        wall = time.perf_counter() - t0
        useful = sum(q["output_len"] for q in reqs)
        return {"wall_s": wall, "output_tokens": useful, "output_tok_s": useful / wall,
                "generated_tokens_incl_batch_padding": generated, "batches": len(batches),
                "padded_prompt_tokens": sum(len(b) * max(len(reqs[i]["input_ids"]) for i in b) for b in batches)}

    def decode(self, n: int, token_hi: int) -> dict:
        rng = random.Random(7)
        prompt = [rng.randrange(token_hi) for _ in range(32)]
        t = time.perf_counter()
        self.generate([prompt], 1)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        self.generate([prompt], n)
        tn = time.perf_counter() - t
        return {"tokens": n, "decode_tok_s": (n - 1) / (tn - t1)}


# ----------------------------------------------------------------------------- bandwidth
def copy_bandwidth(threads: int, nbytes: int = 1 << 30, reps: int = 7) -> dict:
    """STREAM-style copy of a 1 GiB buffer with torch, after a warm-up: median over ``reps``, on 4 KiB
    pages and on transparent huge pages (as the runtime holds its weights); the higher of the two is
    the limit. For context, also a read-only pass over the same bytes (float32 ``sum``) and a bf16
    GEMV (1 x 1024 by the buffer as a (N, 1024) weight) through torch and through the runtime's
    native CPU kernel, on huge pages: the rates at which each can stream weights."""
    import torch
    import torch.nn.functional as F

    from cache_runtime import cpu_kernels
    from cache_runtime.models.hugepages import huge_page_buffer, thp_mode

    torch.set_num_threads(threads)

    def timed(fn) -> list[float]:
        fn()
        fn()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    small = timed(lambda: dst.copy_(src))
    del src, dst
    huge = None
    if thp_mode() not in (None, "never"):
        src, dst = huge_page_buffer(nbytes).fill_(1), huge_page_buffer(nbytes)
        huge = timed(lambda: dst.copy_(src))
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
    f32 = src.view(torch.float32)
    read = timed(lambda: f32.sum())
    w = src.view(torch.bfloat16).view(-1, 1024)
    x = torch.ones(1, 1024, dtype=torch.bfloat16)
    gemv = timed(lambda: F.linear(x, w))
    native = timed(lambda: cpu_kernels.linear(x, w)) if cpu_kernels.variant() else None
    del src, f32, w
    gc.collect()
    best = max(nbytes / statistics.median(t) for t in (small, huge) if t)
    return {"buffer_bytes": nbytes, "copied_bytes_per_s": best, "read_write_bytes_per_s": 2 * best,
            "copied_bytes_per_s_small_pages": nbytes / statistics.median(small),
            "copied_bytes_per_s_huge_pages": nbytes / statistics.median(huge) if huge else None,
            "times_s": {"small_pages": small, "huge_pages": huge},
            "read_only_sum_bytes_per_s": nbytes / statistics.median(read),
            "bf16_gemv_weight_bytes_per_s": nbytes / statistics.median(gemv),
            "native_bf16_gemv_weight_bytes_per_s": nbytes / statistics.median(native) if native else None}


# ----------------------------------------------------------------------------- report
def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def _f(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else f"{x:.{digits}f}"


def main(argv=None) -> int:
    a = parse_args(argv)
    model_dir = resolve_model_path(a.model_path)
    from cache_runtime.tokenization import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    specials = set(tokenizer.eos_token_ids)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("bos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int):
            specials.add(cfg[key])
    # random prompt tokens come from the ordinary vocabulary, below the tokenizer's added (special) tokens
    added = json.loads((Path(model_dir) / "tokenizer.json").read_text()).get("added_tokens", [])
    token_hi = min([t["id"] for t in added] + list(specials) + [cfg["vocab_size"]])
    weights = matmul_weight_bytes(model_dir)
    reqsets = {c: draw_requests(a.num_requests[c], a.seed * 1000 + c, a, tokenizer, token_hi) for c in a.concurrency}
    max_tokens = max(len(q["input_ids"]) + q["output_len"] for rs in reqsets.values() for q in rs)
    pool = max(max(a.concurrency) * max_tokens, 32 + a.decode_tokens) + 64
    flags = ["--model-path", model_dir, "--dtype", "auto", "--cpu-threads", str(a.cpu_threads),
             "--max-running-requests", str(max(a.concurrency)), "--max-total-tokens", str(pool),
             *shlex.split(a.server_args)]
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['mem_bytes'] / 2**30:.0f} GiB, "
          f"{' '.join(info['cpu_flags'])}; CPU kernels {info['cpu_kernels'] or 'off (torch only)'}; load avg "
          f"{info['loadavg_at_start'][0]:.2f}")
    print(f"model {model_dir}: {weights['total_params'] / 1e6:.0f} M params, matmul weights "
          f"{weights['matmul_weight_bytes'] / 2**20:.0f} MiB read per decode step; threads {a.cpu_threads}")
    for c in a.concurrency:
        rs = reqsets[c]
        print(f"  concurrency {c}: {len(rs)} requests, prompt {sum(len(q['input_ids']) for q in rs)} tokens "
              f"(max {max(len(q['input_ids']) for q in rs)}), output {sum(q['output_len'] for q in rs)} tokens")

    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    server = start_runtime(flags, workdir / "runtime.log")
    info["gemm_calibration"] = gemm_calibration(workdir / "runtime.log")
    print(f"runtime: {info['gemm_calibration'] or 'no CPU GEMM calibration (torch only or pinned)'}")
    baseline = None
    runs = {c: {"runtime": [], "baseline": []} for c in a.concurrency}
    decode = {"runtime": [], "baseline": [], "bandwidth": []}
    try:
        asyncio.run(closed_loop(server.url, [{"input_ids": [1, 2, 3], "output_len": 4, "text": None}], 1))  # warm-up
        if not a.skip_baseline:
            baseline = Baseline(model_dir, a.cpu_threads)
            baseline.generate([[1, 2, 3]], 4)  # warm-up
        for rep in range(a.repeats):
            for c in a.concurrency:
                rt = runtime_pass(server, reqsets[c], c)
                runs[c]["runtime"].append(rt)
                line = (f"[#{rep + 1} c={c}] runtime {rt['output_tok_s']:.1f} tok/s ({rt['wall_s']:.1f} s), "
                        f"TTFT p50 {rt['ttft_p50_s']:.3f} s, ITL p50 {rt['itl_p50_s'] * 1e3:.1f} ms")
                if baseline is not None:
                    bl = baseline.run(reqsets[c], c)
                    runs[c]["baseline"].append(bl)
                    line += (f"; transformers {bl['output_tok_s']:.1f} tok/s ({bl['wall_s']:.1f} s); "
                             f"ratio {rt['output_tok_s'] / bl['output_tok_s']:.2f}")
                print(line, flush=True)
            bw = copy_bandwidth(a.cpu_threads)
            decode["bandwidth"].append(bw)
            d = runtime_decode(server, a.decode_tokens, token_hi)
            decode["runtime"].append(d)
            line = (f"[#{rep + 1} decode] copy {bw['copied_bytes_per_s'] / 2**30:.2f} GiB/s copied "
                    f"({bw['read_write_bytes_per_s'] / 2**30:.2f} GiB/s read+write); runtime batch-1 decode "
                    f"{d['decode_tok_s']:.2f} tok/s")
            if baseline is not None:
                hb = baseline.decode(a.decode_tokens, token_hi)
                decode["baseline"].append(hb)
                line += f"; transformers {hb['decode_tok_s']:.2f} tok/s"
            print(line, flush=True)
        peak_rss = server.peak_rss_bytes()
    finally:
        server.stop()

    # ------------------------------------------------------------------ aggregate
    wb = weights["matmul_weight_bytes"]
    per_conc = {}
    for c in a.concurrency:
        rt, bl = runs[c]["runtime"], runs[c]["baseline"]
        entry = {"requests": len(reqsets[c]),
                 "runtime": {k: statistics.median(r[k] for r in rt) for k in rt[0]}, "runtime_repeats": rt}
        if bl:
            entry["baseline"] = {k: statistics.median(r[k] for r in bl) for k in bl[0]}
            entry["baseline_repeats"] = bl
            entry["ratio"] = spread([r["output_tok_s"] / b["output_tok_s"] for r, b in zip(rt, bl)])
        per_conc[c] = entry
    bw_rw = [b["read_write_bytes_per_s"] for b in decode["bandwidth"]]
    bw_copy = [b["copied_bytes_per_s"] for b in decode["bandwidth"]]
    dec = [d["decode_tok_s"] for d in decode["runtime"]]
    frac_rw = [d / (b / wb) for d, b in zip(dec, bw_rw)]
    frac_copy = [d / (b / wb) for d, b in zip(dec, bw_copy)]
    decode_summary = {
        "runtime_decode_tok_s": spread(dec),
        "baseline_decode_tok_s": (spread([d["decode_tok_s"] for d in decode["baseline"]])
                                  if decode["baseline"] else None),
        "copy_bandwidth_copied_bytes_per_s": spread(bw_copy),
        "copy_bandwidth_read_write_bytes_per_s": spread(bw_rw),
        "limit_tok_s_read_write": spread([b / wb for b in bw_rw]),
        "limit_tok_s_copied": spread([b / wb for b in bw_copy]),
        "fraction_of_limit_read_write": spread(frac_rw),
        "fraction_of_limit_copied": spread(frac_copy),
        "read_only_sum_bytes_per_s": spread([b["read_only_sum_bytes_per_s"] for b in decode["bandwidth"]]),
        "bf16_gemv_weight_bytes_per_s": spread([b["bf16_gemv_weight_bytes_per_s"] for b in decode["bandwidth"]]),
        "native_bf16_gemv_weight_bytes_per_s": (
            spread([b["native_bf16_gemv_weight_bytes_per_s"] for b in decode["bandwidth"]])
            if decode["bandwidth"][0]["native_bf16_gemv_weight_bytes_per_s"] else None),
        "runs": decode,
    }
    goals = {"decode_fraction_of_limit_read_write": statistics.median(frac_rw),
             "decode_goal": GOAL_DECODE_FRACTION,
             "decode_goal_met": statistics.median(frac_rw) >= GOAL_DECODE_FRACTION}
    for c, goal in ((1, GOAL_RATIO_C1), (16, GOAL_RATIO_C16)):
        if c in per_conc and "ratio" in per_conc[c]:
            goals[f"ratio_c{c}"] = per_conc[c]["ratio"]["median"]
            goals[f"ratio_c{c}_goal"] = goal
            goals[f"ratio_c{c}_goal_met"] = per_conc[c]["ratio"]["median"] >= goal

    # ------------------------------------------------------------------ print
    print(f"\n{'conc':>4} {'runtime tok/s':>14} {'transformers':>13} {'ratio (min..max)':>22} {'goal':>6} "
          f"{'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'ITL p90':>8}")
    for c, e in per_conc.items():
        r = e["runtime"]
        goal = {1: f">={GOAL_RATIO_C1:g}x", 16: f">={GOAL_RATIO_C16:g}x"}.get(c, "")
        ratio = (f"{e['ratio']['median']:.2f} ({e['ratio']['min']:.2f}..{e['ratio']['max']:.2f})"
                 if "ratio" in e else "-")
        base = _f(e["baseline"]["output_tok_s"], 1) if "baseline" in e else "-"
        print(f"{c:>4} {r['output_tok_s']:>14.1f} {base:>13} {ratio:>22} {goal:>6} {r['ttft_p50_s']:>8.3f}s "
              f"{r['ttft_p90_s']:>8.3f}s {r['itl_p50_s'] * 1e3:>6.1f}ms {r['itl_p90_s'] * 1e3:>6.1f}ms")
    ds = decode_summary
    print(f"\nbatch-1 decode: runtime {ds['runtime_decode_tok_s']['median']:.2f} tok/s"
          + (f", transformers {ds['baseline_decode_tok_s']['median']:.2f} tok/s"
             if ds["baseline_decode_tok_s"] else ""))
    pages = [(b["copied_bytes_per_s_small_pages"], b["copied_bytes_per_s_huge_pages"]) for b in decode["bandwidth"]]
    print("copy on 4 KiB / huge pages: " + ", ".join(
        f"{s4 / 2**30:.2f} / {_f(h and h / 2**30)} GiB/s" for s4, h in pages) + " (the higher is the limit)")
    print(f"copy bandwidth {ds['copy_bandwidth_copied_bytes_per_s']['median'] / 2**30:.2f} GiB/s copied = "
          f"{ds['copy_bandwidth_read_write_bytes_per_s']['median'] / 2**30:.2f} GiB/s read+write; weights "
          f"{wb / 2**20:.0f} MiB/token -> limit {ds['limit_tok_s_read_write']['median']:.1f} tok/s (read+write) / "
          f"{ds['limit_tok_s_copied']['median']:.1f} tok/s (copied)")
    print(f"context: read-only (sum) {ds['read_only_sum_bytes_per_s']['median'] / 2**30:.2f} GiB/s; torch bf16 GEMV "
          f"streams huge-page weights at {ds['bf16_gemv_weight_bytes_per_s']['median'] / 2**30:.2f} GiB/s -> "
          f"{ds['bf16_gemv_weight_bytes_per_s']['median'] / wb:.1f} tok/s if decode were only GEMV")
    if ds["native_bf16_gemv_weight_bytes_per_s"]:
        rate = ds["native_bf16_gemv_weight_bytes_per_s"]["median"]
        print(f"         the runtime's native GEMV ({info['cpu_kernels']}) streams them at {rate / 2**30:.2f} GiB/s -> "
              f"{rate / wb:.1f} tok/s")
    print(f"decode / limit: {ds['fraction_of_limit_read_write']['median']:.2f} (read+write; goal >= "
          f"{GOAL_DECODE_FRACTION}: {'met' if goals['decode_goal_met'] else 'NOT met'}), "
          f"{ds['fraction_of_limit_copied']['median']:.2f} (copied)")
    for c in (1, 16):
        if f"ratio_c{c}" in goals:
            print(f"goal c={c}: ratio {goals[f'ratio_c{c}']:.2f} >= {goals[f'ratio_c{c}_goal']:g}: "
                  f"{'met' if goals[f'ratio_c{c}_goal_met'] else 'NOT met'}")
    if peak_rss:
        print(f"runtime peak RSS {peak_rss / 2**30:.2f} GiB")

    report = {"params": {k: v for k, v in vars(a).items()}, "model_path": model_dir, "machine": info,
              "weights": weights, "server_flags": flags,
              "baseline_attn_implementation": baseline.attn if baseline else None,
              "concurrency": {str(c): e for c, e in per_conc.items()}, "decode": decode_summary, "goals": goals,
              "runtime_peak_rss_bytes": peak_rss}
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(no_nan(report), indent=2, default=str))
        print(f"wrote {a.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
