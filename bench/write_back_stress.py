"""Soak test of the write_back policy under concurrency (SGLang's write_back crashes under load; ours must not).

Starts a reference server without a cache and a write_back server whose L1 and L2 are far smaller
than the prompt set (so every request evicts, writes back, loads back, and hits L3), then runs
``--concurrency`` clients for ``--duration`` seconds. Every answer is compared with the reference
(greedy decoding is deterministic); HTTP errors, mismatches and engine errors are reported.

    python bench/write_back_stress.py --duration 600 [--json-out out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

from testbed.runtime_proc import start_runtime


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 10 minutes)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--prefix-groups", type=int, default=6, help="prompts share one of this many prefixes")
    p.add_argument("--prompt-length", type=int, default=320)
    p.add_argument("--output-length", type=int, default=8)
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=1536)
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--no-l3", action="store_true", help="do not attach the file L3 backend")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def make_prompts(a) -> list[list[int]]:
    rng = random.Random(a.seed)
    prefixes = [[rng.randrange(256) for _ in range(a.prompt_length // 2)] for _ in range(a.prefix_groups)]
    return [prefixes[i % a.prefix_groups] + [rng.randrange(256) for _ in range(a.prompt_length // 2)]
            for i in range(a.num_prompts)]


async def generate(client: httpx.AsyncClient, ids: list[int], n: int) -> dict:
    r = await client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": n}})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return r.json()


async def stress(url: str, prompts, reference, a) -> dict:
    stats = {"requests": 0, "http_errors": 0, "mismatches": 0, "cached_tokens": 0, "prompt_tokens": 0,
             "error_samples": []}
    deadline = time.monotonic() + a.duration
    rng = random.Random(a.seed + 1)

    async with httpx.AsyncClient(base_url=url, timeout=300, trust_env=False) as client:
        async def worker() -> None:
            while time.monotonic() < deadline:
                i = rng.randrange(len(prompts))
                try:
                    out = await generate(client, prompts[i], a.output_length)
                except Exception as exc:
                    stats["http_errors"] += 1
                    if len(stats["error_samples"]) < 5:
                        stats["error_samples"].append(f"{type(exc).__name__}: {exc}")
                    continue
                stats["requests"] += 1
                stats["cached_tokens"] += out["meta_info"]["cached_tokens"]
                stats["prompt_tokens"] += out["meta_info"]["prompt_tokens"]
                if out["output_ids"] != reference[i]:
                    stats["mismatches"] += 1
                    if len(stats["error_samples"]) < 5:
                        stats["error_samples"].append(f"prompt {i}: {out['output_ids']} != {reference[i]}")

        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/health")).status_code
    stats["engine_errors"] = int(float(m.group(1))) if (
        m := re.search(r"^hicache_request_errors_total (\S+)", metrics, re.M)) else None
    stats["health_after"] = health
    for name in ("hicache_l2_backup_tokens_total", "sglang:load_back_tokens_total", "sglang:evicted_tokens_total",
                 "sglang:backuped_tokens_total", "sglang:prefetched_tokens_total"):
        m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)", metrics, re.M)
        stats[name] = float(m.group(1)) if m else None
    return stats


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="wb-stress-"))
    prompts = make_prompts(a)
    ref_server = start_runtime(["--disable-radix-cache", "--max-total-tokens", str(4 * a.prompt_length)], work / "ref.log")
    try:
        async def refs():
            async with httpx.AsyncClient(base_url=ref_server.url, timeout=300, trust_env=False) as c:
                return [(await generate(c, p, a.output_length))["output_ids"] for p in prompts]
        reference = asyncio.run(refs())
    finally:
        ref_server.stop()
    flags = ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back", "--page-size", str(a.page_size),
             "--max-total-tokens", str(a.max_total_tokens), "--hicache-ratio", str(a.hicache_ratio),
             "--max-running-requests", str(a.concurrency)]
    if not a.no_l3:
        flags += ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "timeout",
                  "--hicache-storage-backend-extra-config",
                  json.dumps({"file_storage_path": str(work / "l3"), "prefetch_threshold": 16})]
    server = start_runtime(flags, work / "write_back.log")
    print(f"write_back stress: {a.concurrency} clients, {a.duration:.0f}s, {len(prompts)} prompts, "
          f"L1 {a.max_total_tokens} tokens, log {work / 'write_back.log'}", flush=True)
    try:
        stats = asyncio.run(stress(server.url, prompts, reference, a))
        stats["server_alive"] = server.proc.poll() is None
    finally:
        server.stop()
    stats["hit_rate"] = stats["cached_tokens"] / max(1, stats["prompt_tokens"])
    stats["errors"] = stats["http_errors"] + stats["mismatches"] + (stats["engine_errors"] or 0) + \
        (0 if stats["server_alive"] and stats["health_after"] == 200 else 1)
    print(json.dumps({k: v for k, v in stats.items()}, indent=2))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"params": vars(a), "results": stats}, indent=2))
    return 1 if stats["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
