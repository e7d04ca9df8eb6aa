"""Soak: multi-turn load on a small fleet for a bounded time, with periodic live backend swaps
and (optionally) the operator SIGKILLed at random points.

Prints, from one run: requests, errors (goal 0), request latency p99 in the first and last
fifth of the run and their ratio (drift), RSS growth of every runtime process and of the
operator, swaps completed and operator kills survived; JSON out.

  python bench/soak.py --duration 600 --pods 3 --swap-every 60 --kills 20 --json-out bench/results/soak.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from localcluster import netns
from localcluster.cluster import LocalCluster
from localcluster.nodes import NodeSpec
from testbed.gateway import Gateway
from testbed.kube import kget, wait_for
from testbed.operator_proc import OperatorProcess

REPO = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def runtime_pids() -> dict[str, int]:
    """Pod IP -> pid of each `cache_runtime serve` process (found by its --host argument)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"cache_runtime" in argv and b"serve" in argv and b"--host" in argv:
            out[argv[argv.index(b"--host") + 1].decode()] = int(proc.name)
    return out


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default %(default)s)")
    ap.add_argument("--pods", type=int, default=3)
    ap.add_argument("--swap-every", type=float, default=60, help="seconds between backend swaps")
    ap.add_argument("--kills", type=int, default=0, help="SIGKILL the operator this many times, spread over the run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    netns.enter_private_netns()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp:
        c = LocalCluster(Path(tmp) / "cluster", nodes=[NodeSpec(f"gpu-{i}") for i in range(a.pods)]).start()
        try:
            c.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
            c.wait_established("hicachedeployments.hicache.dev")
            op = OperatorProcess(c, Path(tmp), reconcile_interval=10).start()
            ns, name = "soak", "soak"
            c.kubectl("create", "namespace", ns)
            c.kubectl_apply([{"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
                              "metadata": {"name": name, "namespace": ns, "annotations": {"hicache.dev/process-backed": "true"}},
                              "spec": {"image": "hicache-runtime:soak", "replicas": a.pods, "pageSize": 4,
                                       "maxTotalTokens": 4096,
                                       "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 60},
                                       "hicache": {"memLayout": "page_first", "storage": {"backend": "none"}}}}])
            wait_for(lambda: kget(c, "hcd", name, "-n", ns).get("status", {}).get("readyReplicas") == a.pods,
                     timeout=600, interval=2, what="fleet ready")
            time.sleep(3)
            pod_ips = {p["status"]["podIP"] for p in kget(c, "pods", "-n", ns)["items"]}
            rss0 = {ip: rss_mb(pid) for ip, pid in runtime_pids().items() if ip in pod_ips}
            op_rss0 = rss_mb(op.proc.pid)
            gw = Gateway(c.api_client(), ns, name, concurrency=3).start()
            t0 = time.monotonic()
            kill_at = sorted(rng.uniform(0.05, 0.95) * a.duration for _ in range(a.kills))
            targets = [{"backend": "file", "extraConfig": {"file_storage_path": f"{tmp}/l3"}}, {"backend": "none"}]
            swaps = kills = 0
            next_swap = a.swap_every
            while (now := time.monotonic() - t0) < a.duration:
                if now >= next_swap:
                    st = targets[swaps % len(targets)]
                    c.kubectl("patch", "hcd", name, "-n", ns, "--type=merge", "-p",
                              json.dumps({"spec": {"hicache": {"storage": st}}}))
                    swaps += 1
                    next_swap += a.swap_every
                    print(f"  t={now:6.1f}s swap #{swaps} -> {st['backend']}", flush=True)
                if kill_at and now >= kill_at[0]:
                    kill_at.pop(0)
                    op.kill()
                    kills += 1
                    time.sleep(rng.uniform(0, 1))
                    op.start()
                time.sleep(0.5)
            report = gw.stop()
            end = time.monotonic() - t0

            def swapped():
                bs = kget(c, "hcd", name, "-n", ns).get("status", {}).get("backendSwap") or {}
                return bs.get("phase") == "Complete" and not bs.get("pods")
            wait_for(swapped, timeout=300, interval=1, what="last swap complete")
            rss1 = {ip: rss_mb(pid) for ip, pid in runtime_pids().items()}
            op_rss1 = rss_mb(op.proc.pid)
            op.stop()
        finally:
            c.stop()
    # Outcomes are appended in completion order; split the run into fifths by position.
    lat = [o.latency_s for o in report.outcomes if o.ok]
    fifth = max(1, len(lat) // 5)
    first, last = p99(lat[:fifth]), p99(lat[-fifth:])
    result = {"duration_s": round(end), "pods": a.pods, "requests": len(report.outcomes),
              "errors": len(report.failures), "error_examples": [o.error for o in report.failures[:3]],
              "latency_p99_first_fifth_s": first and round(first, 3), "latency_p99_last_fifth_s": last and round(last, 3),
              "p99_drift_ratio": round(last / first, 3) if first and last else None,
              "swaps": swaps, "operator_kills": kills,
              "runtime_rss_growth_mb": {ip: round(rss1.get(ip, 0) - v, 1) for ip, v in rss0.items()},
              "operator_rss_mb": {"start": round(op_rss0), "end": round(op_rss1)},
              "cached_tokens_by_tier": report.summary()["cached_tokens_by_tier"]}
    print(json.dumps(result, indent=2))
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(result, indent=2))
    sys.exit(0 if not report.failures else 1)


if __name__ == "__main__":
    main()
