"""Operator at fleet scale on the local control plane.

Creates N simulated 8-GPU nodes, starts the operator as a real process, applies D
HiCacheDeployments at once (KWOK-simulated pods, no processes) and measures, per
deployment, the time from its creation to all six children being present (StatefulSet,
two Services, ConfigMap, Secret, PodDisruptionBudget). Prints p50/p99, the operator's
peak RSS, and the ratio of p99 to the goal (30 s) and of RSS to its goal (250 MB).

Then, in the same run, the baseline: the operator is stopped and the same fleet is created in
another namespace while a plain client applies each deployment's children (rendered by the
operator's code, applied the same way) the moment it exists. Its p99 is what this control plane
on this machine can do for these objects; ratio_p99_to_baseline is the operator's p99 over it.

On 2 cores the run is CPU-bound, and who gets the CPU decides the result: --favour gives the
named control-plane processes' scheduling groups about 9x the weight of the others (the operator,
KWOK's 2000 simulated kubelets, the bench's clients), as a stand-in for a control plane with
cores of its own. `none` (default) shares the cores equally among all processes.

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

from localcluster import netns
from localcluster.cluster import LocalCluster
from localcluster.nodes import NodeSpec
from testbed.operator_proc import OperatorProcess

REPO = Path(__file__).resolve().parents[1]
KINDS = ("statefulsets", "services", "configmaps", "secrets", "poddisruptionbudgets")
EXPECTED_PER_DEPLOYMENT = 6
FAVOUR = {"none": (), "apiserver": ("etcd", "kube-apiserver"),
          "control-plane": ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")}


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


def profile_apiserver(api, out: Path, seconds: int) -> None:
    """The API server's own CPU profile (Go pprof) while the fleet is created: which of its
    work (decoding, admission, server-side apply, watch fan-out, etcd) the run pays for."""
    resp = api.call_api(*api.param_serialize("GET", "/debug/pprof/profile", query_params=[("seconds", seconds)],
                                             auth_settings=["BearerToken"]), _request_timeout=seconds + 60)
    resp.read()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(resp.data)
    print(f"API server CPU profile ({seconds}s) written to {out}", flush=True)


def _ts(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _pct(values: list[float], p: float) -> float | None:
    return round(values[min(len(values) - 1, int(p * len(values)))], 2) if values else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def operator_work(port: int) -> dict[str, Any]:
    return parse_operator_work(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)


def parse_operator_work(text: str) -> dict[str, Any]:
    """Per trigger, from the operator's metrics: reconciles, mean wait in its work queue (a backlog
    shows here) and mean time in the reconcile itself (mostly waiting on the API server)."""
    sums: dict[tuple[str, str], float] = {}
    for family, metric in (("wait", "hicache_operator_workqueue_wait_seconds"),
                           ("reconcile", "hicache_operator_reconcile_duration_seconds")):
        for kind in ("sum", "count"):
            for trigger, value in re.findall(rf'^{metric}_{kind}{{trigger="([^"]+)"}} (\S+)$', text, re.M):
                sums[(f"{family}_{kind}", trigger)] = float(value)
    out: dict[str, Any] = {
        trigger: {"reconciles": int(count),
                  "mean_queue_wait_s": round(sums.get(("wait_sum", trigger), 0) / count, 3),
                  "mean_reconcile_s": round(sums.get(("reconcile_sum", trigger), 0) / count, 3)}
        for (kind, trigger), count in sums.items() if kind == "wait_count" and count}
    # Inside those reconciles: each API request as the operator waited for it, and the wait for
    # a thread of its pool of concurrent calls.
    calls: dict[str, dict[str, float]] = {}
    for agg, kind, verb, value in re.findall(
            r'^hicache_operator_api_request_duration_seconds_(sum|count)\{kind="([^"]+)",verb="([^"]+)"\} (\S+)$',
            text, re.M):
        calls.setdefault(f"{verb} {kind}", {})[agg] = float(value)
    out["api_requests"] = {k: {"count": int(v["count"]), "mean_s": round(v["sum"] / v["count"], 3)}
                           for k, v in calls.items() if v.get("count")}
    pool = dict(re.findall(r'^hicache_operator_api_pool_wait_seconds_(sum|count) (\S+)$', text, re.M))
    if float(pool.get("count", 0)):
        out["api_pool_wait"] = {"count": int(float(pool["count"])),
                                "mean_s": round(float(pool["sum"]) / float(pool["count"]), 3)}
    return out


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


SPEC = {"image": "hicache-runtime:0.1.0", "maxTotalTokens": 4096}


def create_fleet(api, ns: str, count: int, created: dict[str, float], server_created: dict[str, str],
                 on_created=None, schedule: list[float] | None = None) -> float:
    """Create the HiCacheDeployments one after another, as fast as the API server takes them or,
    with ``schedule``, the i-th no earlier than schedule[i] seconds after the first (to replay
    another phase's arrivals); returns the seconds that took. ``on_created(body)`` gets each as
    stored."""
    from kubernetes import client
    custom = client.CustomObjectsApi(api)
    t0 = time.monotonic()
    for i in range(count):
        name = f"d{i:04d}"
        if schedule is not None and i < len(schedule):
            time.sleep(max(0.0, t0 + schedule[i] - time.monotonic()))
        created[name] = time.monotonic()
        obj = custom.create_namespaced_custom_object("hicache.dev", "v1alpha1", ns, "hicachedeployments", {
            "apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
            "metadata": {"name": name}, "spec": SPEC})
        server_created[name] = obj["metadata"]["creationTimestamp"]
        if on_created:
            on_created(obj)
    return time.monotonic() - t0


def wait_complete(seen: dict, created: dict[str, float], t0: float, timeout: float, label: str,
                  rss_pid: int | None = None) -> float:
    """Progress every few seconds until every deployment has all its children; the peak RSS of
    ``rss_pid`` meanwhile."""
    rss = 0.0
    while time.monotonic() - t0 < timeout:
        rss = max(rss, peak_rss_mb(rss_pid)) if rss_pid else 0.0
        done = sum(len(seen.get(n, {})) >= EXPECTED_PER_DEPLOYMENT for n in created)
        print(f"  [{label}] t={time.monotonic() - t0:6.1f}s complete={done}/{len(created)}"
              + (f" operator_rss_peak={rss:.0f}MB" if rss_pid else ""), flush=True)
        if done == len(created):
            break
        time.sleep(3)
    return rss


def latencies(seen: dict, stamped: dict, created: dict[str, float], server_created: dict[str, str]):
    """Creation -> last child seen, per complete deployment: on this process's clock, and on the
    API server's (whole seconds: what the bench's own watches add is not in it)."""
    local = sorted(max(seen[n].values()) - created[n] for n in created
                   if len(seen.get(n, {})) >= EXPECTED_PER_DEPLOYMENT)
    server = sorted(max(_ts(t) for t in stamped[n].values()) - _ts(server_created[n]) for n in created
                    if len(stamped.get(n, {})) >= EXPECTED_PER_DEPLOYMENT)
    return local, server


def measure(c: LocalCluster, a: argparse.Namespace,
            workdir: Path) -> tuple[list[float], float, float, bool, dict[str, Any]]:
    """Apply the deployments, wait for their children; (latencies, apply seconds, peak RSS, operator
    alive, where the work went: CPU seconds per process while measuring, and the API server's
    requests by verb and resource)."""
    from kubernetes import client

    c.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    c.wait_established("hicachedeployments.hicache.dev")
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

        created: dict[str, float] = {}
        pids = {**{n: p.pid for n, p in c.procs.items()}, "operator": op.proc.pid, "bench": os.getpid()}
        cpu0 = {n: cpu_seconds(pid) for n, pid in pids.items()}
        requests0 = apiserver_requests(api)
        if a.apiserver_profile:
            threading.Thread(target=profile_apiserver, args=(c.api_client(), a.apiserver_profile, 60), daemon=True).start()
        t0 = time.monotonic()
        apply_s = create_fleet(api, ns, a.deployments, created, server_created)
        print(f"applied {a.deployments} deployments in {apply_s:.1f}s", flush=True)
        rss = wait_complete(seen, created, t0, a.timeout, "operator", rss_pid=op.proc.pid)
        stop.set()
        local, server = latencies(seen, stamped, created, server_created)
        cpu = {n: round(cpu_seconds(pid) - cpu0[n], 1) for n, pid in pids.items()}
        requests = apiserver_requests(api)
        requests.subtract(requests0)
        work = {"operator_work": operator_work(op.metrics_port), "server_clock_p50_s": _pct(server, 0.50), "server_clock_p99_s": _pct(server, 0.99),
                "cpu_seconds_during_run": cpu,
                "apiserver_requests_during_run": {k: int(v) for k, v in requests.most_common(25) if v >= 1}}
        work["arrivals"] = sorted(t - t0 for t in created.values())
        return local, apply_s, rss, op.alive(), work
    finally:
        op.stop()
        if a.operator_log:
            shutil.copyfile(op.log, a.operator_log)


def baseline_applier(kubeconfig: str, todo, ready, workers: int) -> None:
    """The baseline's plain client, in a process of its own (so the bench's creating thread keeps
    its schedule): renders each deployment's children with the operator's code and applies them
    the way the operator does, ``workers`` at a time, until it reads None."""
    import secrets

    from kubernetes import client, config

    from hicache_operator.io.kube import Kube
    from hicache_operator.control.pipeline import apply_children, plan

    cfg = client.Configuration()
    config.load_kube_config(kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = 100
    api = client.ApiClient(cfg)
    nodes = json.loads(client.CoreV1Api(api).list_node(_preload_content=False).data)["items"]
    kube = Kube(api, parallel_calls=2 * workers)
    ready.set()

    def work() -> None:
        while (body := todo.get()) is not None:
            apply_children(kube, plan(body, nodes), lambda: secrets.token_urlsafe(32))
    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure_baseline(c: LocalCluster, a: argparse.Namespace, arrivals: list[float]) -> dict[str, Any]:
    """The same fleet with no operator, created on the same schedule as the operator's phase
    (``arrivals``): a plain client renders each deployment's children with the operator's own code
    the moment it is created and applies them exactly as the operator does (the same concurrent
    wave, then the StatefulSet, as many workers), but without watching, queueing, writing status,
    posting Events or admitting pods. What it achieves is what this control plane on this machine
    does for these objects when nothing else is asked of it: the figure the operator's is compared
    with."""
    import multiprocessing

    from kubernetes import client

    api = c.api_client()
    ns = "baseline"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
    seen: dict[str, dict[str, float]] = {}
    stamped: dict[str, dict[str, str]] = {}
    stop = threading.Event()
    watch_children(api, ns, seen, stamped, stop)
    ctx = multiprocessing.get_context("spawn")
    todo, ready = ctx.Queue(), ctx.Event()
    workers = a.operator_workers or 16
    proc = ctx.Process(target=baseline_applier, args=(str(c.kubeconfig), todo, ready, workers), daemon=True)
    proc.start()
    assert ready.wait(120), "the baseline's client did not start"
    time.sleep(1)
    created: dict[str, float] = {}
    server_created: dict[str, str] = {}
    t0 = time.monotonic()
    apply_s = create_fleet(api, ns, a.deployments, created, server_created, on_created=todo.put, schedule=arrivals)
    print(f"[baseline] applied {a.deployments} deployments in {apply_s:.1f}s", flush=True)
    for _ in range(workers):
        todo.put(None)
    wait_complete(seen, created, t0, a.timeout, "baseline")
    stop.set()
    proc.join(timeout=30)
    local, server = latencies(seen, stamped, created, server_created)
    return {"completed": len(local), "apply_s": round(apply_s, 1), "p50_s": _pct(local, 0.50),
            "p99_s": _pct(local, 0.99), "server_clock_p99_s": _pct(server, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--deployments", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--operator-log", type=Path, help="keep the operator's log here")
    ap.add_argument("--operator-workers", type=int, help="the operator's --workers (default: its own default)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the second phase (the same fleet applied by a plain client, no operator)")
    ap.add_argument("--apiserver-profile", type=Path, metavar="FILE",
                    help="write a CPU profile of the API server over the first 60 s of the run here "
                         "(read it with `go tool pprof -top FILE`)")
    ap.add_argument("--favour", choices=FAVOUR, default="none",
                    help="control-plane processes given more CPU weight than the rest (see above)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cluster is stopped on kill
    netns.enter_private_netns()

    with tempfile.TemporaryDirectory(prefix="hicache-opscale-") as tmp:
        nodes = [NodeSpec(f"gpu-{i:04d}", gpus=8, memory="1Ti") for i in range(a.nodes)]
        c = LocalCluster(Path(tmp) / "cluster", nodes=nodes, profiling=a.apiserver_profile is not None,
                         favoured=FAVOUR[a.favour]).start()
        if c.favour_failures:
            print(f"warning: --favour {a.favour} not applied: {c.favour_failures}", file=sys.stderr, flush=True)
        print(f"control plane + {a.nodes} nodes ready in {c.startup_seconds:.1f}s", flush=True)
        try:
            latencies, apply_s, rss, alive, work = measure(c, a, Path(tmp))
            arrivals = work.pop("arrivals")
            baseline = None if a.no_baseline else measure_baseline(c, a, arrivals)
        finally:
            c.stop()

    result = {"nodes": a.nodes, "deployments": a.deployments, "operator_workers": a.operator_workers or "default",
              "favour": a.favour if not c.favour_failures else f"{a.favour} (not applied)", "completed": len(latencies),
              "apply_s": round(apply_s, 1), "p50_s": _pct(latencies, 0.50), "p99_s": _pct(latencies, 0.99),
              "mean_s": round(statistics.mean(latencies), 2) if latencies else None,
              "operator_peak_rss_mb": round(rss), "operator_survived": alive,
              "ratio_p99_to_goal_30s": _pct(latencies, 0.99) / 30 if latencies else None,
              "ratio_rss_to_goal_250mb": round(rss / 250, 2),
              "baseline_no_operator": baseline,
              "ratio_p99_to_baseline": round(_pct(latencies, 0.99) / baseline["p99_s"], 2)
              if latencies and baseline and baseline["p99_s"] else None, **work}
    print(json.dumps(result, indent=2))
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(result, indent=2))
    sys.exit(0 if len(latencies) == a.deployments else 1)


if __name__ == "__main__":
    main()
