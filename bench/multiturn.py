"""Multi-turn chat benchmark of the bundled runtime, in the shape of SGLang's bench_multiturn.

Clients hold conversations of ``--rounds`` turns; each turn appends ``--request-length`` new
tokens to the history and asks for ``--output-length`` tokens. Requests arrive as a Poisson
process (``--request-rate``) with at most ``--max-parallel`` in flight. The same workload runs
against a fresh server per configuration, in one run:

  no_cache (--disable-radix-cache), l1, l1_l2, l1_l2_l3_file, l1_l2_l3_mooncake

with L1 sized below 30% of the working set (and L2 below the working set, so L3 has work to do).
It prints TTFT p50/p90, throughput and per-tier hit rates, each also as a ratio to ``l1``.

    python bench/multiturn.py [--json-out out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runtime_proc import Runtime, free_port  # noqa: E402

CONFIGS = ("no_cache", "l1", "l1_l2", "l1_l2_l3_file", "l1_l2_l3_mooncake")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-clients", type=int, default=8)
    p.add_argument("--num-rounds", type=int, default=4)
    p.add_argument("--request-length", type=int, default=256, help="new tokens per turn")
    p.add_argument("--output-length", type=int, default=16)
    p.add_argument("--max-parallel", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=8.0, help="Poisson arrivals per second")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--l1-fraction", type=float, default=0.25, help="L1 size / working set (must stay < 0.3)")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size / L1 size")
    p.add_argument("--prefetch-policy", default="timeout")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def working_set(a) -> int:
    return a.num_clients * a.num_rounds * (a.request_length + a.output_length)


def l1_tokens(a) -> int:
    final_ctx = a.num_rounds * (a.request_length + a.output_length) + a.output_length + 2 * a.page_size
    return max(int(a.l1_fraction * working_set(a)), final_ctx)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def one_request(client: httpx.AsyncClient, ids: list[int], out_len: int) -> dict:
    start = time.perf_counter()
    ttft, last = None, None
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True}}
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"])
            if ttft is None and ev.get("output_ids"):
                ttft = time.perf_counter() - start
            last = ev
    return {"ttft": ttft, "latency": time.perf_counter() - start, "output_ids": last["output_ids"],
            "meta": last["meta_info"]}


async def run_workload(url: str, a) -> dict:
    rng = random.Random(a.seed)
    questions = [[[rng.randrange(256) for _ in range(a.request_length)] for _ in range(a.num_rounds)]
                 for _ in range(a.num_clients)]
    history = [[] for _ in range(a.num_clients)]
    done_rounds = [0] * a.num_clients
    arrivals = random.Random(a.seed + 1)
    ready: asyncio.Queue = asyncio.Queue()
    for c in range(a.num_clients):
        ready.put_nowait(c)
    sem = asyncio.Semaphore(a.max_parallel)
    results: list[dict] = []
    errors: list[str] = []
    total = a.num_clients * a.num_rounds

    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        async def turn(c: int) -> None:
            try:
                ids = history[c] + questions[c][done_rounds[c]]
                res = await one_request(client, ids, a.output_length)
                history[c] = ids + res["output_ids"]
                results.append(res)
            except Exception as exc:  # counted and reported, the run goes on
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                sem.release()
                done_rounds[c] += 1
                if done_rounds[c] < a.num_rounds:
                    ready.put_nowait(c)

        start = time.perf_counter()
        tasks = []
        for _ in range(total):
            c = await ready.get()
            await asyncio.sleep(arrivals.expovariate(a.request_rate))
            await sem.acquire()
            tasks.append(asyncio.create_task(turn(c)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start

    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    prompt = sum(r["meta"]["prompt_tokens"] for r in results) or 1
    tiers = {t: sum(r["meta"]["cached_tokens_details"][t] for r in results) / prompt
             for t in ("device", "host", "storage")}
    out_tokens = sum(r["meta"]["completion_tokens"] for r in results)
    return {
        "requests": len(results), "errors": len(errors), "error_samples": errors[:3],
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        "latency_mean_s": statistics.fmean(r["latency"] for r in results) if results else float("nan"),
        "throughput_tok_s": out_tokens / wall, "throughput_req_s": len(results) / wall,
        "input_throughput_tok_s": prompt / wall,
        "hit_rate": sum(tiers.values()), "hit_rate_device": tiers["device"], "hit_rate_host": tiers["host"],
        "hit_rate_storage": tiers["storage"], "wall_s": wall,
    }


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
    import socket

    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", rpc)) == 0:
                return (proc, rpc), None
        time.sleep(0.1)
    proc.kill()
    return None, "mooncake_master did not open its RPC port"


def server_flags(name: str, a, workdir: Path, mooncake_rpc: int | None) -> tuple[list[str], dict]:
    flags = ["--page-size", str(a.page_size), "--max-total-tokens", str(l1_tokens(a)),
             "--max-running-requests", str(a.max_parallel)]
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
        shutil.rmtree(store, ignore_errors=True)
        extra["storage_dir"] = str(store)
        backend = "file"
    else:
        extra.update({"master_server_address": f"127.0.0.1:{mooncake_rpc}", "metadata_server": "P2PHANDSHAKE",
                      "protocol": "tcp", "local_hostname": "127.0.0.1", "global_segment_size": 512 << 20})
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
        backend = "mooncake"
    flags += ["--hicache-storage-backend", backend, "--hicache-storage-prefetch-policy", a.prefetch_policy,
              "--hicache-storage-backend-extra-config", json.dumps(extra)]
    return flags, env


def main(argv=None) -> int:
    a = parse_args(argv)
    ws, l1 = working_set(a), l1_tokens(a)
    print(f"working set {ws} tokens; L1 {l1} tokens ({l1 / ws:.0%}); L2 {int(l1 * a.hicache_ratio)} tokens "
          f"({l1 * a.hicache_ratio / ws:.0%}); {a.num_clients} clients x {a.num_rounds} rounds")
    if l1 / ws >= 0.3:
        print("warning: L1 is not below 30% of the working set; raise --num-clients/--num-rounds")
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    workdir = Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    mooncake = None
    try:
        for name in a.configs.split(","):
            if name not in CONFIGS:
                raise SystemExit(f"unknown config {name!r}; choose from {CONFIGS}")
            rpc = None
            if name == "l1_l2_l3_mooncake":
                mooncake, reason = start_mooncake_master(workdir)
                if mooncake is None:
                    skipped[name] = reason
                    print(f"[{name}] skipped: {reason}")
                    continue
                rpc = mooncake[1]
            flags, env = server_flags(name, a, workdir, rpc)
            server = Runtime(flags, workdir / f"{name}.log", env)
            try:
                httpx.post(server.url + "/flush_cache", timeout=30, trust_env=False)
                print(f"[{name}] running ...", flush=True)
                results[name] = asyncio.run(run_workload(server.url, a))
            finally:
                server.stop()
    finally:
        if mooncake is not None:
            mooncake[0].terminate()
            mooncake[0].wait(timeout=10)
    base = results.get("l1")
    cols = ("ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "hit_rate", "hit_rate_device", "hit_rate_host",
            "hit_rate_storage")
    print(f"\n{'config':<20}" + "".join(f"{c:>18}" for c in cols) + f"{'errors':>8}")
    for name, r in results.items():
        print(f"{name:<20}" + "".join(f"{r[c]:>18.4f}" for c in cols) + f"{r['errors']:>8}")
        if base:
            r["ratio_to_l1"] = {c: (r[c] / base[c] if base[c] else None) for c in cols}
    if base:
        print(f"\n{'ratio to l1':<20}" + "".join(f"{c:>18}" for c in cols))
        for name, r in results.items():
            print(f"{name:<20}" + "".join(f"{(v if v is not None else float('nan')):>18.3f}"
                                          for v in r["ratio_to_l1"].values()))
    report = {"params": vars(a), "working_set_tokens": ws, "l1_tokens": l1,
              "l2_tokens": int(l1 * a.hicache_ratio), "results": results, "skipped": skipped}
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=2))
        print(f"\nwrote {a.json_out}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
