"""Cache-aware routing in front of a fleet: SGLang's router vs a ClusterIP Service, on one trace.

Four runtime processes (``python -m cache_runtime serve``, L1+L2, on loopback ports) stand for a
fleet's four pods. The same multi-turn workload as ``bench/multiturn.py`` (many conversations,
each a shared system prompt plus its own document, then several short turns; the next turn
carries the whole history) runs three times, every pod's L1+L2 flushed before each:

  single     every turn to pod 0 alone: the hit rate one pod reaches on this trace
  router     through SGLang's router (the ``sglang-router`` wheel's binary, started with
             ``python -m sglang_router.launch_router --policy cache_aware --worker-urls`` and the
             four loopback URLs: what ``spec.router`` runs in front of a fleet, without its
             Kubernetes discovery)
  clusterip  each turn to one of the four pods drawn uniformly at random (seeded). This models
             a ClusterIP Service: kube-proxy picks an endpoint per connection at random and knows
             nothing of prefixes, so a conversation's next turn lands on the pod holding its
             history one time in four. No Service or kube-proxy is involved here.

For each: cache hit rate (all turns, and turns >= 2) by tier (device = L1, host = L2, storage
= L3, which is off here) from each response's ``cached_tokens_details``, and client-side TTFT
p50/p99 (streamed ``/generate``, request sent -> first token). Goals, printed side by side with
the measured ratios: router hit rate >= 0.9 x single, and router TTFT p50 <= 0.6 x clusterip.

Each pod's pools are sized as in ``bench/multiturn.py`` from the whole trace's working set
(L1 ``--l1-fraction`` of it, L2 ``--hicache-ratio`` x L1), so one pod alone can hold the trace
in L1+L2 and the router's four pods more than that. With ``--max-parallel`` low, a TTFT is
mostly the prefill of what the chosen pod does not hold, so it shows where a turn landed.

The router's cache-aware policy matches each request's text (for ``input_ids``, the ids as
text) against a prefix tree per worker; ``--cache-threshold``/``--balance-*`` keep SGLang's
defaults unless given.

    python bench/routing.py [--model-path demo|builtin:tiny|DIR] [--json-out bench/results/routing.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

import httpx

from testbed.bench_report import machine_info, no_nan
from testbed.demo_checkpoint import resolve_model_path
from testbed.router_proc import Router
from testbed.runtime_proc import RuntimeProcess, start_runtime
from multiturn import l1_tokens, l2_tokens, percentile, run_workload, server_flags, summarise, working_set

PODS = 4
GOAL_HIT_RATE_VS_SINGLE = 0.9
GOAL_TTFT_P50_VS_CLUSTERIP = 0.6
CONFIGS = ("single", "router", "clusterip")
TIERS = ("device", "host", "storage")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="demo", help="demo (the synthesized demo checkpoint), builtin:tiny, or a "
                                                       "checkpoint directory")
    p.add_argument("--num-clients", type=int, default=16, help="conversations")
    p.add_argument("--num-rounds", type=int, default=4, help="turns per conversation")
    p.add_argument("--system-prompt-length", type=int, default=128, help="tokens shared by every conversation")
    p.add_argument("--context-length", type=int, default=384, help="per-conversation document in the first turn")
    p.add_argument("--request-length", type=int, default=32, help="new tokens per turn")
    p.add_argument("--output-length", type=int, default=4)
    p.add_argument("--max-parallel", type=int, default=2, help="turns in flight at once")
    p.add_argument("--request-rate", type=float, default=16.0, help="Poisson turn starts per second")
    p.add_argument("--ready-queue-policy", choices=("fifo", "random"), default="random")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--l1-fraction", type=float, default=0.25, help="each pod's L1 / the trace's working set")
    p.add_argument("--hicache-ratio", type=float, default=4.0, help="each pod's L2 / its L1")
    p.add_argument("--cpu-threads", type=int, default=1, help="per runtime process")
    p.add_argument("--policy", default="cache_aware", help="the router's --policy")
    p.add_argument("--router-arg", action="append", default=[], help="more router flags (repeatable)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    for name in ("num_clients", "num_rounds", "context_length", "request_length", "output_length", "max_parallel",
                 "page_size", "cpu_threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.num_rounds < 2:
        p.error("--num-rounds must be >= 2: routing matters from a conversation's second turn")
    if a.request_rate <= 0 or not 0 < a.l1_fraction < 1 or a.hicache_ratio <= 1:
        p.error("--request-rate must be > 0, --l1-fraction in (0, 1), --hicache-ratio > 1")
    return a


def flush(urls: list[str]) -> None:
    for url in urls:
        r = httpx.post(url + "/flush_cache?timeout=60", timeout=90, trust_env=False)
        if r.status_code != 200:
            raise RuntimeError(f"{url}/flush_cache answered {r.status_code}: {r.text[:200]}")


def describe(reqs: list[dict], errors: list[str], wall: float, a) -> dict:
    """``multiturn.summarise`` plus TTFT p99 and the hit rate by tier of turns >= 2."""
    out = summarise(reqs, errors, wall, a, {})
    ttfts = [r["ttft"] for r in reqs if r["ttft"] is not None]
    out["ttft_p99_s"] = percentile(ttfts, 0.99)
    later = [r for r in reqs if r["round"] >= 2]
    prompt = sum(r["meta"]["prompt_tokens"] for r in later) or 1
    for tier in TIERS:
        out[f"hit_rate_{tier}_rounds2plus"] = sum(r["meta"]["cached_tokens_details"][tier] for r in later) / prompt
    out.pop("per_round", None)
    out["ttft_p50_by_round_s"] = {rnd: percentile([r["ttft"] for r in reqs if r["round"] == rnd
                                                   and r["ttft"] is not None], 0.5)
                                  for rnd in range(1, a.num_rounds + 1)}
    return out


def goals(results: dict[str, dict]) -> dict:
    single, router, clusterip = (results.get(k) for k in CONFIGS)
    out: dict = {}
    if single and router:
        ratio = router["hit_rate"] / single["hit_rate"] if single["hit_rate"] else None
        out.update(router_hit_rate_vs_single=ratio, hit_rate_goal=GOAL_HIT_RATE_VS_SINGLE,
                   hit_rate_goal_met=ratio is not None and ratio >= GOAL_HIT_RATE_VS_SINGLE)
    if router and clusterip:
        ratio = router["ttft_p50_s"] / clusterip["ttft_p50_s"] if clusterip["ttft_p50_s"] else None
        out.update(router_ttft_p50_vs_clusterip=ratio, ttft_goal=GOAL_TTFT_P50_VS_CLUSTERIP,
                   ttft_goal_met=ratio is not None and ratio <= GOAL_TTFT_P50_VS_CLUSTERIP,
                   clusterip_hit_rate_vs_single=(clusterip["hit_rate"] / single["hit_rate"]
                                                 if single and single["hit_rate"] else None))
    return out


COLS = ("hit_rate", "hit_rate_device", "hit_rate_host", "hit_rate_rounds2plus", "ttft_p50_s", "ttft_p99_s")


def print_table(results: dict[str, dict]) -> None:
    print(f"\n{'':<12}" + "".join(f"{c:>22}" for c in COLS) + f"{'errors':>8}")
    for name, r in results.items():
        print(f"{name:<12}" + "".join(f"{r[c]:>22.4f}" for c in COLS) + f"{r['errors']:>8}")


def main(argv=None) -> int:
    a = parse_args(argv)
    a.model_path = resolve_model_path(a.model_path)
    info = machine_info()
    ws = working_set(a)
    print(f"machine: {info['cpu']}, {info['cores']} cores; load avg {info['loadavg_at_start'][0]:.2f}")
    print(f"{PODS} pods, each L1 {l1_tokens(a)} + L2 {l2_tokens(a)} tokens; working set {ws} tokens; "
          f"{a.num_clients} conversations x {a.num_rounds} turns; model {a.model_path}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    pods: list[RuntimeProcess] = []
    router: Router | None = None
    results: dict[str, dict] = {}
    try:
        flags, env = server_flags("l1_l2", a, workdir, None)
        for i in range(PODS):
            pods.append(start_runtime(flags, workdir / f"pod-{i}.log", env))
        urls = [p.url for p in pods]
        router = Router(urls, a.policy, a.router_arg, workdir / "router.log").start()
        targets = {"single": urls[0], "router": router.url, "clusterip": urls}
        for name in CONFIGS:
            flush(urls)
            reqs, errors, wall = asyncio.run(run_workload(targets[name], a, a.seed))
            results[name] = r = describe(reqs, errors, wall, a)
            print(f"[{name}] {wall:.1f} s, hit rate {r['hit_rate']:.3f} (turns >= 2: {r['hit_rate_rounds2plus']:.3f}), "
                  f"ttft p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, errors {r['errors']}", flush=True)
    finally:
        if router is not None:
            router.stop()
        for pod in pods:
            pod.stop()
    print_table(results)
    verdict = goals(results)
    if "router_hit_rate_vs_single" in verdict and "router_ttft_p50_vs_clusterip" in verdict:
        print(f"\ngoals: router hit rate = {verdict['router_hit_rate_vs_single']:.3f} x one pod alone "
              f"(>= {GOAL_HIT_RATE_VS_SINGLE}: {verdict['hit_rate_goal_met']}); router TTFT p50 = "
              f"{verdict['router_ttft_p50_vs_clusterip']:.3f} x ClusterIP (<= {GOAL_TTFT_P50_VS_CLUSTERIP}: "
              f"{verdict['ttft_goal_met']}); ClusterIP hit rate = {verdict['clusterip_hit_rate_vs_single']:.3f} x "
              "one pod alone")
    report = {"params": vars(a), "machine": info, "pods": PODS, "working_set_tokens": ws,
              "l1_tokens_per_pod": l1_tokens(a), "l2_tokens_per_pod": l2_tokens(a), "results": results,
              "goals": verdict}
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(no_nan(report), indent=2))
        print(f"\nwrote {a.json_out}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r["errors"] for r in results.values()) or len(results) < len(CONFIGS) else 0


if __name__ == "__main__":
    sys.exit(main())
