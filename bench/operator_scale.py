"""Operator at fleet scale on the local control plane.

Creates N simulated 8-GPU nodes, starts the operator as a real process, applies D
HiCacheDeployments at once (KWOK-simulated pods, no processes) and measures, per
deployment, the time from its creation to all six children being present (StatefulSet,
two Services, ConfigMap, Secret, PodDisruptionBudget). Prints p50/p99, the operator's
peak RSS, and the ratio of p99 to the goal (30 s) and of RSS to its goal (250 MB).

  python bench/operator_scale.py --nodes 2000 --deployments 1000 --json-out bench/results/operator_scale.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster import netns  # noqa: E402
from tests.cluster.localcluster import LocalCluster, NodeSpec  # noqa: E402
from tests.e2e.helpers import OperatorProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KINDS = ("statefulsets", "services", "configmaps", "secrets", "poddisruptionbudgets")
EXPECTED_PER_DEPLOYMENT = 6


def peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def watch_children(api, ns: str, seen: dict[str, dict[str, float]], stop: threading.Event) -> list[threading.Thread]:
    """One watch per kind records when each owner's child first appears."""
    from kubernetes import client, watch
    core, apps, policy = client.CoreV1Api(api), client.AppsV1Api(api), client.PolicyV1Api(api)
    lists = {"statefulsets": apps.list_namespaced_stateful_set, "services": core.list_namespaced_service,
             "configmaps": core.list_namespaced_config_map, "secrets": core.list_namespaced_secret,
             "poddisruptionbudgets": policy.list_namespaced_pod_disruption_budget}
    lock = threading.Lock()

    def run(kind: str) -> None:
        while not stop.is_set():
            try:
                for ev in watch.Watch().stream(lists[kind], ns, timeout_seconds=5):
                    obj = ev["raw_object"]
                    for o in obj["metadata"].get("ownerReferences") or []:
                        key = f"{kind}/{obj['metadata']['name']}"
                        with lock:
                            seen.setdefault(o["name"], {}).setdefault(key, time.monotonic())
                    if stop.is_set():
                        return
            except Exception:
                time.sleep(0.5)
    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in KINDS]
    for t in threads:
        t.start()
    return threads


def measure(c: LocalCluster, a: argparse.Namespace,
            workdir: Path) -> tuple[list[float], float, float, bool, dict[str, float]]:
    """Apply the deployments, wait for their children; (latencies, apply seconds, peak RSS, operator
    alive, CPU seconds per process while measuring: who the 2 cores went to)."""
    from kubernetes import client

    c.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    c.kubectl("wait", "--for=condition=Established", "crd/hicachedeployments.hicache.dev")
    op = OperatorProcess(c, workdir, reconcile_interval=300).start()
    try:
        api = c.api_client()
        ns = "fleet"
        client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
        seen: dict[str, dict[str, float]] = {}
        stop = threading.Event()
        watch_children(api, ns, seen, stop)
        time.sleep(1)

        custom = client.CustomObjectsApi(api)
        created: dict[str, float] = {}
        pids = {**{n: p.pid for n, p in c.procs.items()}, "operator": op.proc.pid, "bench": os.getpid()}
        cpu0 = {n: cpu_seconds(pid) for n, pid in pids.items()}
        t0 = time.monotonic()
        for i in range(a.deployments):
            name = f"d{i:04d}"
            created[name] = time.monotonic()
            custom.create_namespaced_custom_object("hicache.dev", "v1alpha1", ns, "hicachedeployments", {
                "apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
                "metadata": {"name": name}, "spec": {"image": "hicache-runtime:0.1.0", "maxTotalTokens": 4096}})
        apply_s = time.monotonic() - t0
        print(f"applied {a.deployments} deployments in {apply_s:.1f}s", flush=True)

        rss = 0.0
        while time.monotonic() - t0 < a.timeout:
            rss = max(rss, peak_rss_mb(op.proc.pid))
            done = sum(len(seen.get(n, {})) >= EXPECTED_PER_DEPLOYMENT for n in created)
            print(f"  t={time.monotonic() - t0:6.1f}s complete={done}/{a.deployments} operator_rss_peak={rss:.0f}MB",
                  flush=True)
            if done == a.deployments:
                break
            time.sleep(3)
        stop.set()
        latencies = sorted(max(seen[n].values()) - created[n] for n in created
                           if len(seen.get(n, {})) >= EXPECTED_PER_DEPLOYMENT)
        cpu = {n: round(cpu_seconds(pid) - cpu0[n], 1) for n, pid in pids.items()}
        return latencies, apply_s, rss, op.alive(), cpu
    finally:
        op.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--deployments", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cluster is stopped on kill
    netns.enter_private_netns()

    with tempfile.TemporaryDirectory(prefix="hicache-opscale-") as tmp:
        nodes = [NodeSpec(f"gpu-{i:04d}", gpus=8, memory="1Ti") for i in range(a.nodes)]
        c = LocalCluster(Path(tmp) / "cluster", nodes=nodes).start()
        print(f"control plane + {a.nodes} nodes ready in {c.startup_seconds:.1f}s", flush=True)
        try:
            latencies, apply_s, rss, alive, cpu = measure(c, a, Path(tmp))
        finally:
            c.stop()

    def pct(p: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))], 2) if latencies else None
    result = {"nodes": a.nodes, "deployments": a.deployments, "completed": len(latencies),
              "apply_s": round(apply_s, 1), "p50_s": pct(0.50), "p99_s": pct(0.99),
              "mean_s": round(statistics.mean(latencies), 2) if latencies else None,
              "operator_peak_rss_mb": round(rss), "operator_survived": alive,
              "ratio_p99_to_goal_30s": pct(0.99) / 30 if latencies else None,
              "ratio_rss_to_goal_250mb": round(rss / 250, 2), "cpu_seconds_during_run": cpu}
    print(json.dumps(result, indent=2))
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(result, indent=2))
    sys.exit(0 if len(latencies) == a.deployments else 1)


if __name__ == "__main__":
    main()
