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
import datetime
import json
import os
import re
import shutil
import socket
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

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


def apiserver_requests(api) -> Counter:
    """The API server's own request counters (``apiserver_request_total``) by verb and resource:
    diffed over the run, they say which calls the 2 cores were spent on."""
    resp = api.call_api(*api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"]))
    resp.read()
    out: Counter = Counter()
    for line in resp.data.decode().splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            sub = f"/{labels['subresource']}" if labels.get("subresource") else ""
            out[f"{labels.get('verb')} {labels.get('resource')}{sub}"] += float(line.rsplit(" ", 1)[1])
    return out


def _ts(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _pct(values: list[float], p: float) -> float | None:
    return round(values[min(len(values) - 1, int(p * len(values)))], 2) if values else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def operator_work(port: int) -> dict[str, dict[str, float]]:
    """Per trigger, from the operator's metrics: reconciles, mean wait in its work queue (a backlog
    shows here) and mean time in the reconcile itself (mostly waiting on the API server)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    sums: dict[tuple[str, str], float] = {}
    for family, metric in (("wait", "hicache_operator_workqueue_wait_seconds"),
                           ("reconcile", "hicache_operator_reconcile_duration_seconds")):
        for kind in ("sum", "count"):
            for trigger, value in re.findall(rf'^{metric}_{kind}{{trigger="([^"]+)"}} (\S+)$', text, re.M):
                sums[(f"{family}_{kind}", trigger)] = float(value)
    return {trigger: {"reconciles": int(count),
                      "mean_queue_wait_s": round(sums.get(("wait_sum", trigger), 0) / count, 3),
                      "mean_reconcile_s": round(sums.get(("reconcile_sum", trigger), 0) / count, 3)}
            for (kind, trigger), count in sums.items() if kind == "wait_count" and count}


def watch_children(api, ns: str, seen: dict[str, dict[str, float]], stamped: dict[str, dict[str, str]],
                   stop: threading.Event) -> list[threading.Thread]:
    """One watch per kind records when each owner's child first appears (``seen``: when this
    process saw it; ``stamped``: its creationTimestamp, the API server's clock)."""
    from kubernetes import client, watch
    core, apps, policy = client.CoreV1Api(api), client.AppsV1Api(api), client.PolicyV1Api(api)
    lists = {"statefulsets": apps.list_namespaced_stateful_set, "services": core.list_namespaced_service,
             "configmaps": core.list_namespaced_config_map, "secrets": core.list_namespaced_secret,
             "poddisruptionbudgets": policy.list_namespaced_pod_disruption_budget}
    lock = threading.Lock()

    def run(kind: str) -> None:
        # Each watch resumes from the last version it saw: restarting without one would have the
        # API server send every existing object again (thousands, every few seconds).
        version = None
        while not stop.is_set():
            try:
                for ev in watch.Watch().stream(lists[kind], ns, timeout_seconds=30, resource_version=version,
                                               allow_watch_bookmarks=True, deserialize=False):
                    obj = ev["object"]  # plain JSON: typed models would cost this process most of a core
                    version = obj["metadata"].get("resourceVersion") or version
                    for o in obj["metadata"].get("ownerReferences") or []:
                        key = f"{kind}/{obj['metadata']['name']}"
                        with lock:
                            seen.setdefault(o["name"], {}).setdefault(key, time.monotonic())
                            stamped.setdefault(o["name"], {}).setdefault(key, obj["metadata"]["creationTimestamp"])
                    if stop.is_set():
                        return
            except Exception:  # e.g. 410 Gone (version too old): start over with a full listing
                version = None
                time.sleep(0.5)
    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in KINDS]
    for t in threads:
        t.start()
    return threads


def measure(c: LocalCluster, a: argparse.Namespace,
            workdir: Path) -> tuple[list[float], float, float, bool, dict[str, Any]]:
    """Apply the deployments, wait for their children; (latencies, apply seconds, peak RSS, operator
    alive, where the work went: CPU seconds per process while measuring, and the API server's
    requests by verb and resource)."""
    from kubernetes import client

    c.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    c.kubectl("wait", "--for=condition=Established", "crd/hicachedeployments.hicache.dev")
    env = {"HICACHE_WORKERS": str(a.operator_workers)} if a.operator_workers else {}
    op = OperatorProcess(c, workdir, reconcile_interval=300, metrics_port=free_port(), extra_env=env).start()
    try:
        api = c.api_client()
        ns = "fleet"
        client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
        seen: dict[str, dict[str, float]] = {}
        stamped: dict[str, dict[str, str]] = {}
        server_created: dict[str, str] = {}
        stop = threading.Event()
        watch_children(api, ns, seen, stamped, stop)
        time.sleep(1)

        custom = client.CustomObjectsApi(api)
        created: dict[str, float] = {}
        pids = {**{n: p.pid for n, p in c.procs.items()}, "operator": op.proc.pid, "bench": os.getpid()}
        cpu0 = {n: cpu_seconds(pid) for n, pid in pids.items()}
        requests0 = apiserver_requests(api)
        t0 = time.monotonic()
        for i in range(a.deployments):
            name = f"d{i:04d}"
            created[name] = time.monotonic()
            obj = custom.create_namespaced_custom_object("hicache.dev", "v1alpha1", ns, "hicachedeployments", {
                "apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
                "metadata": {"name": name}, "spec": {"image": "hicache-runtime:0.1.0", "maxTotalTokens": 4096}})
            server_created[name] = obj["metadata"]["creationTimestamp"]
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
        # The same latency on the API server's clock (whole seconds): what the bench's own watches
        # add (they parse every object into typed models, sharing 2 cores) is not in it.
        server = sorted(max(_ts(t) for t in stamped[n].values()) - _ts(server_created[n]) for n in created
                        if len(stamped.get(n, {})) >= EXPECTED_PER_DEPLOYMENT)
        cpu = {n: round(cpu_seconds(pid) - cpu0[n], 1) for n, pid in pids.items()}
        requests = apiserver_requests(api)
        requests.subtract(requests0)
        work = {"operator_work": operator_work(op.metrics_port), "server_clock_p50_s": _pct(server, 0.50), "server_clock_p99_s": _pct(server, 0.99),
                "cpu_seconds_during_run": cpu,
                "apiserver_requests_during_run": {k: int(v) for k, v in requests.most_common(25) if v >= 1}}
        return latencies, apply_s, rss, op.alive(), work
    finally:
        op.stop()
        if a.operator_log:
            shutil.copyfile(op.log, a.operator_log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--deployments", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--operator-log", type=Path, help="keep the operator's log here")
    ap.add_argument("--operator-workers", type=int, help="the operator's --workers (default: its own default)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cluster is stopped on kill
    netns.enter_private_netns()

    with tempfile.TemporaryDirectory(prefix="hicache-opscale-") as tmp:
        nodes = [NodeSpec(f"gpu-{i:04d}", gpus=8, memory="1Ti") for i in range(a.nodes)]
        c = LocalCluster(Path(tmp) / "cluster", nodes=nodes).start()
        print(f"control plane + {a.nodes} nodes ready in {c.startup_seconds:.1f}s", flush=True)
        try:
            latencies, apply_s, rss, alive, work = measure(c, a, Path(tmp))
        finally:
            c.stop()

    result = {"nodes": a.nodes, "deployments": a.deployments, "operator_workers": a.operator_workers or "default", "completed": len(latencies),
              "apply_s": round(apply_s, 1), "p50_s": _pct(latencies, 0.50), "p99_s": _pct(latencies, 0.99),
              "mean_s": round(statistics.mean(latencies), 2) if latencies else None,
              "operator_peak_rss_mb": round(rss), "operator_survived": alive,
              "ratio_p99_to_goal_30s": _pct(latencies, 0.99) / 30 if latencies else None,
              "ratio_rss_to_goal_250mb": round(rss / 250, 2), **work}
    print(json.dumps(result, indent=2))
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(result, indent=2))
    sys.exit(0 if len(latencies) == a.deployments else 1)


if __name__ == "__main__":
    main()
