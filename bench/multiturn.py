"""Multi-turn chat benchmark of the bundled runtime, in the shape of SGLang's bench_multiturn.

Model: the demo checkpoint by default (``--model-path demo``: ``python -m cache_runtime.synth --preset
demo``, a random-weight LlamaForCausalLM with Llama-3 KV geometry, 64 KiB of bf16 KV per token, written
into ``~/.cache/hicache-operator/models/demo`` when absent, as scripts/setup.sh does); ``--model-path builtin:tiny`` or any checkpoint directory
also works. The defaults are sized for a 2-core CPU machine (~6 minutes for 3 repeats there): 8
clients, 3 rounds, a 512-token document each, one request in flight, so each TTFT is the server's
prefill of what it does not hold and not queueing.

Why this shape: a KV cache pays off when re-reading KV is cheaper than recomputing it, i.e. when
the time to first token is dominated by prefilling a long shared context. So each of
``--num-clients`` conversations starts from a system prompt shared by all clients plus a
per-client document (``--context-length`` tokens), then asks ``--num-rounds`` short questions
(``--request-length`` new tokens each) with short answers (``--output-length``, default 4, so TTFT
is prefill, not decode). Concurrency is low (``--max-parallel`` 1) so that server-side queueing
does not drown the prefill cost. Each
client's next turn joins a ready queue when its previous one returns (FIFO, as SGLang's
default, or random); turns start as a Poisson process (``--request-rate``) with at most
``--max-parallel`` in flight. The same workload runs against a fresh server per configuration
(``--configs``, default l1,l1_l2,l1_l2_l3_file), any of:

  no_cache (--disable-radix-cache), l1, l1_l2, l1_l2_l3_file, l1_l2_l3_mooncake

with L1 below 30% of the working set (``--l1-fraction`` 0.25 by default). Goal: L1+L2 TTFT p50
<= 0.3 x L1-only. By default L2 (``--hicache-ratio`` 4) holds the whole working
set, which isolates how well L1+L2 keeps what fits; L3 then adds no hits, only its backup cost.
``--hicache-ratio 2 --ready-queue-policy random`` makes L2 too small, so L3 hits show. Every
config runs ``--repeats`` times (new prompts each time, so L3 contents of one repeat never help
the next; L1+L2 flushed before each), interleaved, and the tables show medians.

Shared L3 (``--configs`` with l1_l2_l3_file, unless ``--no-l3-share``): after each repeat of
l1_l2_l3_file, once its L3 writes have settled, a second runtime process (fresh: L1/L2 cold) on the same
L3 directory replays that repeat's requests (same prompts, same order, one at a time), and so does a
fresh process with no L3 (l1_l2) for the cold reference. Goal: shared-L3 TTFT p50 <= 0.5 x cold.

Memory: each runtime's peak RSS (VmHWM from /proc) against weights + its L1 and L2 pools + 1 GiB.

TTFT is measured client-side with streaming (request sent -> first token event). Hit rates
come from each response's ``cached_tokens_details``.

Next to the measured hit rate of rounds >= 2 the bench reports offline LRU bounds computed on
the exact request sequence of that run (send and completion times as observed): an LRU cache of
radix pages (chained page keys, so a page only counts when its whole prefix is cached), sized
L1+L2 tokens, and sized L2 alone. HiCache's L2 is inclusive (write_through keeps a copy of every
L1 page in L2), so L2 alone is the capacity it can actually hold distinct pages in.

    python bench/multiturn.py [--model-path demo|builtin:tiny|DIR] [--json-out bench/results/multiturn.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testbed.bench_report import machine_info, no_nan
from testbed.demo_checkpoint import matmul_weight_bytes, resolve_model_path
from testbed.runtime_proc import RuntimeProcess, free_port, start_runtime, stream_generate

CONFIGS = ("no_cache", "l1", "l1_l2", "l1_l2_l3_file", "l1_l2_l3_mooncake")
DEFAULT_CONFIGS = ("l1", "l1_l2", "l1_l2_l3_file")
GOAL_L1_L2_TTFT_RATIO = 0.3
GOAL_SHARED_L3_TTFT_RATIO = 0.5
RSS_SLACK_BYTES = 1 << 30
DIAG_METRICS = ("sglang:evicted_tokens", "sglang:load_back_tokens", "hicache_l2_backup_tokens",
                "hicache_l2_evicted_tokens", "sglang:prefetched_tokens", "sglang:backuped_tokens")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="demo", help="demo (the synthesized demo checkpoint), builtin:tiny, or a "
                                                       "checkpoint directory")
    p.add_argument("--num-clients", type=int, default=8)
    p.add_argument("--num-rounds", type=int, default=3)
    p.add_argument("--system-prompt-length", type=int, default=256, help="tokens shared by every client")
    p.add_argument("--context-length", type=int, default=512, help="per-client document in the first turn")
    p.add_argument("--request-length", type=int, default=64, help="new tokens per turn")
    p.add_argument("--output-length", type=int, default=4)
    p.add_argument("--max-parallel", type=int, default=1)
    p.add_argument("--request-rate", type=float, default=16.0, help="Poisson turn starts per second")
    p.add_argument("--ready-queue-policy", choices=("fifo", "random"), default="fifo")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--l1-fraction", type=float, default=0.25, help="L1 size / working set (must stay < 0.3)")
    p.add_argument("--hicache-ratio", type=float, default=4.0, help="L2 size / L1 size")
    p.add_argument("--prefetch-policy", default="timeout")
    p.add_argument("--cpu-threads", type=int, default=2)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    p.add_argument("--no-l3-share", action="store_true",
                   help="skip the second-process shared-L3 replay after each l1_l2_l3_file repeat")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of every config (new prompts each, caches flushed between); the report shows medians")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    for name in a.configs.split(","):
        if name not in CONFIGS:
            p.error(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
    for name in ("num_clients", "num_rounds", "context_length", "request_length", "output_length", "max_parallel",
                 "page_size", "cpu_threads", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.request_rate <= 0 or not 0 < a.l1_fraction < 1 or a.hicache_ratio <= 1:
        p.error("--request-rate must be > 0, --l1-fraction in (0, 1), --hicache-ratio > 1")
    return a


def working_set(a) -> int:
    """Distinct tokens the workload ever holds in KV."""
    return a.system_prompt_length + a.num_clients * (a.context_length
                                                     + a.num_rounds * (a.request_length + a.output_length))


def final_request_tokens(a) -> int:
    return (a.system_prompt_length + a.context_length + a.num_rounds * (a.request_length + a.output_length)
            + a.page_size)


def l1_tokens(a) -> int:
    # a running request reserves prompt + output in L1, so L1 must at least hold the largest one
    return max(int(a.l1_fraction * working_set(a)), final_request_tokens(a))


def l2_tokens(a) -> int:
    return int(l1_tokens(a) * a.hicache_ratio)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# ----------------------------------------------------------------------------- offline LRU bound
def _page_keys(tokens: list[int], page_size: int) -> list[int]:
    """Chained keys of whole pages: page i's key stands for the entire prefix up to it, as in a radix tree."""
    keys, prior = [], 0
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = hash((prior, tuple(tokens[i : i + page_size])))
        keys.append(prior)
    return keys


def lru_hits(requests: list[dict], capacity_tokens: int, page_size: int) -> list[int]:
    """Cached prompt tokens each request would get from an LRU page cache of ``capacity_tokens``.

    Replays the run as observed: a request looks up its cache key when it is sent, and its KV
    (prompt + output except the last token, which is never fed back) is inserted when it returns.
    The key excludes the last prompt token, as the engine's does (its logits start generation).
    Pages are touched deepest first so that LRU evicts the tail of a prefix before its head.
    """
    cap = capacity_tokens // page_size
    cache: OrderedDict[int, None] = OrderedDict()
    events = []
    for i, r in enumerate(requests):
        events.append((r["t_send"], 0, i))
        events.append((r["t_done"], 1, i))
    hits = [0] * len(requests)

    def touch(keys: list[int]) -> None:
        for k in reversed(keys):
            cache[k] = None
            cache.move_to_end(k)
        while len(cache) > cap:
            cache.popitem(last=False)

    for _, kind, i in sorted(events):
        r = requests[i]
        if kind == 0:
            ids = r["input_ids"]
            keys = _page_keys(ids[: len(ids) - 1], page_size)
            n = 0
            while n < len(keys) and keys[n] in cache:
                n += 1
            touch(keys[:n])
            hits[i] = n * page_size
        else:
            kv = r["input_ids"] + r["output_ids"]
            touch(_page_keys(kv[: len(r["input_ids"]) + max(len(r["output_ids"]) - 1, 0)], page_size))
    return hits


# ----------------------------------------------------------------------------- workload
def build_prompts(a, seed: int) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    system = toks(a.system_prompt_length)
    docs = [toks(a.context_length) for _ in range(a.num_clients)]
    questions = [[toks(a.request_length) for _ in range(a.num_rounds)] for _ in range(a.num_clients)]
    return system, docs, questions


async def one_request(client: httpx.AsyncClient, ids: list[int], out_len: int, t0: float) -> dict:
    start = time.perf_counter()
    ttft, last = None, None
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True}}
    async for at, ev in stream_generate(client, body):
        if ttft is None and ev.get("output_ids"):
            ttft = at - start
        last = ev
    end = time.perf_counter()
    return {"ttft": ttft, "latency": end - start, "t_send": start - t0, "t_done": end - t0,
            "output_ids": last["output_ids"], "meta": last["meta_info"]}


async def run_workload(url: str | list[str], a, seed: int) -> tuple[list[dict], list[str], float]:
    """The multi-turn workload against ``url``; a list of base URLs spreads the turns over them,
    each turn to one drawn uniformly at random (seeded), whichever server holds its prefix."""
    system, docs, questions = build_prompts(a, seed)
    urls = [url] if isinstance(url, str) else list(url)
    spread = random.Random(seed + 3)
    history = [system + docs[c] for c in range(a.num_clients)]
    done_rounds = [0] * a.num_clients
    arrivals = random.Random(seed + 1)
    order = random.Random(seed + 2)
    ready: list[int] = list(range(a.num_clients))
    ready_event = asyncio.Event()
    ready_event.set()
    sem = asyncio.Semaphore(a.max_parallel)
    results: list[dict] = []
    errors: list[str] = []
    total = a.num_clients * a.num_rounds

    clients = [httpx.AsyncClient(base_url=u, timeout=600, trust_env=False) for u in urls]
    try:
        t0 = time.perf_counter()

        async def turn(c: int) -> None:
            rnd = done_rounds[c]
            server = spread.randrange(len(clients))
            try:
                ids = history[c] + questions[c][rnd]
                res = await one_request(clients[server], ids, a.output_length, t0)
                history[c] = ids + res["output_ids"]
                results.append({**res, "client": c, "round": rnd + 1, "input_ids": ids, "server": server})
            except Exception as exc:  # counted and reported, the run goes on
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                sem.release()
                done_rounds[c] += 1
                if done_rounds[c] < a.num_rounds:
                    ready.append(c)
                    ready_event.set()

        tasks = []
        for _ in range(total):
            while not ready:
                ready_event.clear()
                await ready_event.wait()
            c = ready.pop(order.randrange(len(ready)) if a.ready_queue_policy == "random" else 0)
            await asyncio.sleep(arrivals.expovariate(a.request_rate))
            await sem.acquire()
            tasks.append(asyncio.create_task(turn(c)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    finally:
        for client in clients:
            await client.aclose()
    return results, errors, wall


def summarise(results: list[dict], errors: list[str], wall: float, a, bounds: dict[str, int]) -> dict:
    def hit(rs, tier=None) -> float:
        prompt = sum(r["meta"]["prompt_tokens"] for r in rs)
        if not prompt:
            return float("nan")
        d = (lambda r: r["meta"]["cached_tokens_details"][tier]) if tier else (lambda r: r["meta"]["cached_tokens"])
        return sum(d(r) for r in rs) / prompt

    later = [r for r in results if r["round"] >= 2]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    ttfts_later = [r["ttft"] for r in later if r["ttft"] is not None]
    prompt_later = sum(r["meta"]["prompt_tokens"] for r in later) or 1
    out = {
        "requests": len(results), "errors": len(errors), "error_samples": errors[:3],
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        "ttft_p50_rounds2plus_s": percentile(ttfts_later, 0.5),
        "latency_mean_s": statistics.fmean(r["latency"] for r in results) if results else float("nan"),
        "throughput_tok_s": sum(r["meta"]["completion_tokens"] for r in results) / wall,
        "throughput_req_s": len(results) / wall,
        "input_throughput_tok_s": sum(r["meta"]["prompt_tokens"] for r in results) / wall,
        "hit_rate": hit(results), "hit_rate_device": hit(results, "device"), "hit_rate_host": hit(results, "host"),
        "hit_rate_storage": hit(results, "storage"),
        "hit_rate_rounds2plus": hit(later),
        "per_round": {rnd: {"hit_rate": hit([r for r in results if r["round"] == rnd]),
                            "ttft_p50_s": percentile([r["ttft"] for r in results
                                                      if r["round"] == rnd and r["ttft"] is not None], 0.5)}
                      for rnd in range(1, a.num_rounds + 1)},
        "wall_s": wall,
    }
    if later:
        order = sorted(range(len(results)), key=lambda i: results[i]["t_send"])
        replay = [results[i] for i in order]
        for name, cap in bounds.items():
            hits = lru_hits(replay, cap, a.page_size)
            out[f"lru_bound_{name}_rounds2plus"] = sum(h for h, r in zip(hits, replay) if r["round"] >= 2) / prompt_later
    return out


def aggregate(runs: list[dict]) -> dict:
    """Median of every scalar over the repeats; the repeats themselves are kept alongside."""
    out = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out["errors"] = sum(r["errors"] for r in runs)
    out["error_samples"] = [e for r in runs for e in r["error_samples"]][:3]
    out["repeats"] = runs
    return out


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    found = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.removesuffix("_total") in DIAG_METRICS and not s.name.endswith("_created"):
                found[s.name.removesuffix("_total")] = s.value
    return found


# ----------------------------------------------------------------------------- servers
def start_mooncake_master(workdir: Path):
    """A loopback mooncake_master from the pip wheel, or (None, reason) when Mooncake is not installed."""
    try:
        import mooncake  # noqa: F401
    except ImportError as exc:
        return None, f"mooncake is not installed ({exc}); pip install mooncake-transfer-engine-non-cuda"
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not binary.exists():
        return None, f"mooncake_master not found next to {mooncake.__file__}"
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = open(workdir / "mooncake_master.log", "wb")
    proc = subprocess.Popen([str(binary), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                             "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
                            stdout=log, stderr=subprocess.STDOUT)
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", rpc)) == 0:
                return (proc, rpc), None
        time.sleep(0.1)
    proc.kill()
    return None, "mooncake_master did not open its RPC port"


def server_flags(name: str, a, workdir: Path, mooncake_rpc: int | None, fresh_store: bool = True
                 ) -> tuple[list[str], dict]:
    """Flags of config ``name``; l1_l2_l3_file keeps its pages in ``workdir/l3-file``, emptied unless
    ``fresh_store`` is False (a second process that shares the first one's L3)."""
    flags = ["--model-path", a.model_path, "--page-size", str(a.page_size), "--max-total-tokens", str(l1_tokens(a)),
             "--max-running-requests", str(a.max_parallel), "--cpu-threads", str(a.cpu_threads)]
    env: dict = {}
    if name == "no_cache":
        return flags + ["--disable-radix-cache"], env
    if name == "l1":
        return flags, env
    flags += ["--enable-hierarchical-cache", "--hicache-ratio", str(a.hicache_ratio)]
    if name == "l1_l2":
        return flags, env
    extra = {"prefetch_threshold": 2 * a.page_size}
    if name == "l1_l2_l3_file":
        store = workdir / "l3-file"
        if fresh_store:
            shutil.rmtree(store, ignore_errors=True)
        extra["file_storage_path"] = str(store)
        backend = "file"
    else:
        extra.update({"master_server_address": f"127.0.0.1:{mooncake_rpc}", "metadata_server": "P2PHANDSHAKE",
                      "protocol": "tcp", "local_hostname": "127.0.0.1", "global_segment_size": 512 << 20})
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
        backend = "mooncake"
    flags += ["--hicache-storage-backend", backend, "--hicache-storage-prefetch-policy", a.prefetch_policy,
              "--hicache-storage-backend-extra-config", json.dumps(extra)]
    return flags, env


def wait_storage_settled(url: str, timeout: float = 120.0, quiet_s: float = 2.0) -> float:
    """Waits until the L2 -> L3 writes of a server stop (sglang:backuped_tokens unchanged for ``quiet_s``
    while idle); returns the tokens written. /flush_cache refuses while they are in flight."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = scrape(url).get("sglang:backuped_tokens", 0.0)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.25)
    return last or 0.0


async def replay(url: str, requests: list[dict], out_len: int) -> list[dict]:
    """The recorded requests again, in send order, one at a time: each TTFT is that server's own work."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        t0 = time.perf_counter()
        for r in sorted(requests, key=lambda r: r["t_send"]):
            res = await one_request(client, r["input_ids"], out_len, t0)
            out.append({**res, "client": r["client"], "round": r["round"], "input_ids": r["input_ids"]})
    return out


def replay_summary(results: list[dict], num_rounds: int) -> dict:
    prompt = sum(r["meta"]["prompt_tokens"] for r in results) or 1
    return {
        "requests": len(results),
        "ttft_p50_s": percentile([r["ttft"] for r in results], 0.5),
        "ttft_p90_s": percentile([r["ttft"] for r in results], 0.9),
        "ttft_p50_by_round_s": {rnd: percentile([r["ttft"] for r in results if r["round"] == rnd], 0.5)
                                for rnd in range(1, num_rounds + 1)},
        "hit_rate": sum(r["meta"]["cached_tokens"] for r in results) / prompt,
        "hit_rate_storage": sum(r["meta"]["cached_tokens_details"]["storage"] for r in results) / prompt,
        "hit_rate_host": sum(r["meta"]["cached_tokens_details"]["host"] for r in results) / prompt,
    }


def process_memory(server: RuntimeProcess) -> dict:
    """Peak and current RSS of a live runtime (VmHWM, VmRSS, RssAnon, RssFile from /proc/<pid>/status)."""
    out = {}
    try:
        with open(f"/proc/{server.pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def memory_budget(url: str, model_path: str) -> dict:
    """Weights + the L1 and L2 pools this server allocated (from /server_info) + 1 GiB."""
    info = httpx.get(url + "/server_info", timeout=10, trust_env=False).json()
    from cache_runtime.models import resolve_config
    from cache_runtime.models.config import kv_bytes_per_token

    cfg = resolve_config(model_path)
    kv_token = kv_bytes_per_token(cfg, info["kv_cache_dtype_effective"])
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}[info["dtype_effective"]]
    if Path(model_path).is_dir():
        params = matmul_weight_bytes(model_path)["total_params"]
    else:  # a builtin Llama toy: its tensors from the config
        H, D, I, L = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_layers
        per_layer = H * (cfg.num_heads + 2 * cfg.num_kv_heads) * D + cfg.num_heads * D * H + 3 * H * I + 2 * H
        params = L * per_layer + cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2) + H
    weights = params * dtype_bytes
    l1 = info["hicache"]["device_pool_tokens"] * kv_token
    l2 = info["hicache"]["host_pool_tokens"] * kv_token
    return {"weights_bytes": weights, "l1_pool_bytes": l1, "l2_pool_bytes": l2, "slack_bytes": RSS_SLACK_BYTES,
            "budget_bytes": weights + l1 + l2 + RSS_SLACK_BYTES}


def capacity_bounds(name: str, a) -> dict[str, int]:
    l1, l2 = l1_tokens(a), l2_tokens(a)
    if name == "no_cache":
        return {}
    if name == "l1":
        return {"l1": l1}
    bounds = {"l1_plus_l2": l1 + l2, "l2": l2}
    if name.startswith("l1_l2_l3"):
        bounds["unbounded"] = 1 << 40
    return bounds


# ----------------------------------------------------------------------------- shared L3
def shared_l3_phase(first: RuntimeProcess, reqs: list[dict], a, workdir: Path, rep: int, memory: dict) -> dict:
    """A second process on the first one's L3 directory replays the first one's requests (its L1/L2 cold),
    then a fresh process with no L3 does the same (the cold reference). Each is started and stopped here."""
    written = wait_storage_settled(first.url)
    out: dict = {"repeat": rep + 1, "backuped_tokens_settled": written, "errors": 0}
    for role, name, fresh in (("shared_l3", "l1_l2_l3_file", False), ("cold", "l1_l2", True)):
        flags, env = server_flags(name, a, workdir, None, fresh_store=fresh)
        server = start_runtime(flags, workdir / f"share-{role}-{rep}.log", env)
        try:
            try:
                res = asyncio.run(replay(server.url, reqs, a.output_length))
            except Exception as exc:
                out["errors"] += 1
                out[f"{role}_error"] = f"{type(exc).__name__}: {exc}"
                print(f"[{role} #{rep + 1}] failed: {exc}", flush=True)
                continue
            out[role] = replay_summary(res, a.num_rounds)
            memory[f"share_{role}"] = {**process_memory(server), **memory_budget(server.url, a.model_path)}
        finally:
            server.stop()
        r = out[role]
        print(f"[{role} #{rep + 1}] ttft p50 {r['ttft_p50_s']:.3f} s (round 1 {r['ttft_p50_by_round_s'][1]:.3f} s), "
              f"hit rate {r['hit_rate']:.3f} (storage {r['hit_rate_storage']:.3f})", flush=True)
    if "shared_l3" in out and "cold" in out:
        out["ratio_ttft_p50"] = out["shared_l3"]["ttft_p50_s"] / out["cold"]["ttft_p50_s"]
        out["ratio_ttft_p50_round1"] = (out["shared_l3"]["ttft_p50_by_round_s"][1]
                                        / out["cold"]["ttft_p50_by_round_s"][1])
    return out


def summarise_share(runs: list[dict]) -> dict | None:
    ok = [r for r in runs if "ratio_ttft_p50" in r]
    if not ok:
        return {"runs": runs}

    def spread(vals):
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}

    return {"ratio_ttft_p50": spread([r["ratio_ttft_p50"] for r in ok]),
            "ratio_ttft_p50_round1": spread([r["ratio_ttft_p50_round1"] for r in ok]),
            "shared_l3_ttft_p50_s": statistics.median(r["shared_l3"]["ttft_p50_s"] for r in ok),
            "cold_ttft_p50_s": statistics.median(r["cold"]["ttft_p50_s"] for r in ok),
            "shared_l3_hit_rate_storage": statistics.median(r["shared_l3"]["hit_rate_storage"] for r in ok),
            "runs": runs}


def print_share_and_memory(share: dict | None, memory: dict) -> None:
    if share and "ratio_ttft_p50" in share:
        r, r1 = share["ratio_ttft_p50"], share["ratio_ttft_p50_round1"]
        print(f"\nshared L3: second process TTFT p50 {share['shared_l3_ttft_p50_s']:.3f} s vs cold "
              f"{share['cold_ttft_p50_s']:.3f} s = {r['median']:.3f} x (min {r['min']:.3f}, max {r['max']:.3f}; "
              f"goal <= {GOAL_SHARED_L3_TTFT_RATIO}: {r['median'] <= GOAL_SHARED_L3_TTFT_RATIO}); round 1 only "
              f"{r1['median']:.3f} x; storage hit rate {share['shared_l3_hit_rate_storage']:.3f}")
    if memory:
        print(f"\n{'process':<24}{'peak RSS':>10}{'RSS now':>10}{'anon':>9}{'file':>9}{'budget':>10}"
              f"  (weights + L1 + L2 + 1 GiB, GiB)")
        g = 2 ** 30
        for name, m in memory.items():
            if "VmHWM" not in m:
                continue
            print(f"{name:<24}{m['VmHWM'] / g:>10.2f}{m['VmRSS'] / g:>10.2f}{m.get('RssAnon', 0) / g:>9.2f}"
                  f"{m.get('RssFile', 0) / g:>9.2f}{m['budget_bytes'] / g:>10.2f}  "
                  f"(= {m['weights_bytes'] / g:.2f} + {m['l1_pool_bytes'] / g:.2f} + {m['l2_pool_bytes'] / g:.2f} + 1) "
                  f"{'ok' if m['VmHWM'] <= m['budget_bytes'] else 'OVER'}")


# ----------------------------------------------------------------------------- report
COLS = ("ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "hit_rate", "hit_rate_device", "hit_rate_host",
        "hit_rate_storage")


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))


def print_tables(results: dict[str, dict]) -> None:
    print(f"\n{'config':<20}" + "".join(f"{c:>18}" for c in COLS) + f"{'errors':>8}")
    for name, r in results.items():
        print(f"{name:<20}" + "".join(f"{_fmt(r[c]):>18}" for c in COLS) + f"{r['errors']:>8}")
    if "l1" in results:
        print(f"\n{'ratio to l1':<20}" + "".join(f"{c:>18}" for c in COLS))
        for name, r in results.items():
            print(f"{name:<20}" + "".join(f"{_fmt(r['ratio_to_l1'][c]):>18}" for c in COLS))
    print(f"\n{'rounds >= 2':<20}{'ttft_p50_s':>14}{'hit_rate':>12}  offline LRU bounds (same request sequence)")
    for name, r in results.items():
        bounds = "  ".join(f"{k.removeprefix('lru_bound_').removesuffix('_rounds2plus')}={v:.4f}"
                           for k, v in r.items() if k.startswith("lru_bound_"))
        print(f"{name:<20}{_fmt(r['ttft_p50_rounds2plus_s']):>14}{_fmt(r['hit_rate_rounds2plus']):>12}  {bounds}")


def goals(results: dict[str, dict]) -> dict:
    base, hier = results.get("l1"), results.get("l1_l2")
    if not base or not hier:
        return {}
    bound = hier.get("lru_bound_l1_plus_l2_rounds2plus")
    gaps = [r["hit_rate_rounds2plus"] - r["lru_bound_l1_plus_l2_rounds2plus"] for r in hier["repeats"]
            if "lru_bound_l1_plus_l2_rounds2plus" in r]
    return {
        "l1_l2_hit_rate_minus_lru_bound_per_repeat": gaps,
        "l1_l2_ttft_p50_ratio_to_l1": hier["ratio_to_l1"]["ttft_p50_s"],
        "ttft_goal": GOAL_L1_L2_TTFT_RATIO,
        "ttft_goal_met": hier["ttft_p50_s"] <= GOAL_L1_L2_TTFT_RATIO * base["ttft_p50_s"],
        "l1_l2_hit_rate_rounds2plus": hier["hit_rate_rounds2plus"],
        "lru_bound_l1_plus_l2_rounds2plus": bound,
        "hit_rate_goal_met": bool(gaps) and statistics.median(gaps) >= -0.02,
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    a.model_path = resolve_model_path(a.model_path)
    ws, l1, l2 = working_set(a), l1_tokens(a), l2_tokens(a)
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['mem_bytes'] / 2**30:.0f} GiB, "
          f"{' '.join(info['cpu_flags'])}; CPU kernels {info['cpu_kernels'] or 'off (torch only)'}; load avg "
          f"{info['loadavg_at_start'][0]:.2f}")
    print(f"working set {ws} tokens; L1 {l1} tokens ({l1 / ws:.0%}); L2 {l2} tokens ({l2 / ws:.0%}); "
          f"{a.num_clients} clients x {a.num_rounds} rounds; model {a.model_path}")
    if l1 / ws >= 0.3:
        print("warning: L1 is not below 30% of the working set; raise --num-clients/--context-length")
    runs: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    servers: dict[str, RuntimeProcess] = {}
    memory: dict[str, dict] = {}
    share_runs: list[dict] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    mooncake = None
    try:
        for rep in range(a.repeats):  # configs interleaved per repeat, so machine noise spreads over all
            seed = a.seed + 1000 * rep  # new prompts: nothing one repeat stored in L3 helps the next
            for name in a.configs.split(","):
                if name in skipped:
                    continue
                if name not in servers:  # one server per config, flushed (L1+L2) before every repeat
                    rpc = None
                    if name == "l1_l2_l3_mooncake":
                        mooncake, reason = start_mooncake_master(workdir)
                        if mooncake is None:
                            skipped[name] = reason
                            print(f"[{name}] skipped: {reason}")
                            continue
                        rpc = mooncake[1]
                    flags, env = server_flags(name, a, workdir, rpc)
                    servers[name] = start_runtime(flags, workdir / f"{name}.log", env)
                url = servers[name].url
                flushed = httpx.post(url + "/flush_cache?timeout=60", timeout=90, trust_env=False)
                if flushed.status_code != 200:
                    raise RuntimeError(f"[{name}] /flush_cache answered {flushed.status_code}: {flushed.text[:200]}")
                before = scrape(url)
                reqs, errors, wall = asyncio.run(run_workload(url, a, seed))
                r = summarise(reqs, errors, wall, a, capacity_bounds(name, a))
                r["server_counters"] = {k: v - before.get(k, 0) for k, v in scrape(url).items()}
                runs.setdefault(name, []).append(r)
                print(f"[{name} #{rep + 1}] {wall:.1f} s, ttft p50 {r['ttft_p50_s']:.3f} s, "
                      f"hit rate {r['hit_rate']:.3f}, errors {r['errors']}", flush=True)
                if name == "l1_l2_l3_file" and not a.no_l3_share and not errors:
                    share_runs.append(shared_l3_phase(servers[name], reqs, a, workdir, rep, memory))
        for name, server in servers.items():
            memory[name] = {**process_memory(server), **memory_budget(server.url, a.model_path)}
    finally:
        for server in servers.values():
            server.stop()
        if mooncake is not None:
            mooncake[0].terminate()
            mooncake[0].wait(timeout=10)
    results = {name: aggregate(rs) for name, rs in runs.items()}
    base = results.get("l1")
    if base:
        for r in results.values():
            r["ratio_to_l1"] = {c: (r[c] / base[c] if base[c] else None) for c in COLS}
    print_tables(results)
    verdict = goals(results)
    share = summarise_share(share_runs) if share_runs else None
    if share:
        verdict["shared_l3_ttft_p50_ratio_to_cold"] = share["ratio_ttft_p50"]["median"]
        verdict["shared_l3_goal"] = GOAL_SHARED_L3_TTFT_RATIO
        verdict["shared_l3_goal_met"] = share["ratio_ttft_p50"]["median"] <= GOAL_SHARED_L3_TTFT_RATIO
    mem_ok = {name: m["VmHWM"] <= m["budget_bytes"] for name, m in memory.items() if "VmHWM" in m}
    if mem_ok:
        verdict["peak_rss_within_budget"] = mem_ok
    if verdict:
        print(f"\ngoals: L1+L2 TTFT p50 = {verdict['l1_l2_ttft_p50_ratio_to_l1']:.3f} x L1-only "
              f"(<= {GOAL_L1_L2_TTFT_RATIO}: {verdict['ttft_goal_met']}); L1+L2 hit rate rounds >= 2 "
              f"{verdict['l1_l2_hit_rate_rounds2plus']:.4f} vs LRU(L1+L2) bound "
              f"{verdict['lru_bound_l1_plus_l2_rounds2plus']:.4f} (within 2 points: {verdict['hit_rate_goal_met']})")
    print_share_and_memory(share, memory)
    report = {"params": vars(a), "machine": info, "working_set_tokens": ws, "l1_tokens": l1, "l2_tokens": l2,
              "results": results, "shared_l3": share, "memory": memory, "goals": verdict, "skipped": skipped}
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(no_nan(report), indent=2))
        print(f"\nwrote {a.json_out}")
    shutil.rmtree(workdir, ignore_errors=True)
    failed = any(r["errors"] for r in results.values()) or any(s.get("errors") for s in share_runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
