"""Scale of the local control plane: many simulated GPU nodes and pods.

Creates N fake GPU nodes and M simulated pods (Deployments requesting a GPU; KWOK
plays the kubelet, no processes), and measures, in one run:
  - create time: how long the pod objects take to exist (the API write path, the baseline),
  - running time: until every pod is scheduled and Running (scheduler + KWOK),
  - ratio running/create: how much the control loop adds on top of the write path,
  - kube-apiserver and etcd peak RSS.

  python bench/cluster_scale.py --nodes 1000 --pods 5000 --json-out bench/results/cluster_scale.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from localcluster import netns
from localcluster.cluster import LocalCluster
from localcluster.nodes import NodeSpec


def rss_mb(pid: int) -> dict[str, float]:
    fields = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            fields[k] = int(v.split()[0]) / 1024
    return fields


def count_pods(core, ns: str) -> tuple[int, int]:
    total = running = 0
    cont = None
    while True:
        lst = core.list_namespaced_pod(ns, limit=2000, _continue=cont)
        for p in lst.items:
            total += 1
            running += p.status.phase == "Running"
        cont = lst.metadata._continue
        if not cont:
            return total, running


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", type=int, default=5000)
    ap.add_argument("--pods-per-deployment", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    netns.enter_private_netns()

    from kubernetes import client
    with tempfile.TemporaryDirectory(prefix="hicache-scale-") as tmp:
        nodes = [NodeSpec(f"gpu-{i:04d}", gpus=8, memory="1Ti") for i in range(a.nodes)]
        t0 = time.monotonic()
        c = LocalCluster(Path(tmp), nodes=nodes).start()
        startup = time.monotonic() - t0
        print(f"control plane + {a.nodes} nodes ready in {startup:.1f}s", flush=True)
        api = c.api_client()
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        ns = "scale"
        core.create_namespace({"metadata": {"name": ns}})
        while True:
            try:
                core.read_namespaced_service_account("default", ns)
                break
            except client.ApiException:
                time.sleep(0.2)

        n_dep = -(-a.pods // a.pods_per_deployment)
        t_start = time.monotonic()
        for d in range(n_dep):
            replicas = min(a.pods_per_deployment, a.pods - d * a.pods_per_deployment)
            labels = {"app": f"s{d}"}
            apps.create_namespaced_deployment(ns, {
                "metadata": {"name": f"s{d}"},
                "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                         "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
                             "name": "c", "image": "fake", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}})
        t_created = t_running = None
        peak = {"kube-apiserver": 0.0, "etcd": 0.0}
        while time.monotonic() - t_start < a.timeout:
            total, running = count_pods(core, ns)
            for name in peak:
                peak[name] = max(peak[name], rss_mb(c.procs[name].pid).get("VmHWM", 0))
            now = time.monotonic() - t_start
            if t_created is None and total >= a.pods:
                t_created = now
            print(f"  t={now:6.1f}s pods={total}/{a.pods} running={running}", flush=True)
            if running >= a.pods:
                t_running = now
                break
            time.sleep(2)
        c.stop()

    result = {"nodes": a.nodes, "pods": a.pods, "startup_s": round(startup, 1),
              "pods_created_s": t_created and round(t_created, 1),
              "all_running_s": t_running and round(t_running, 1),
              "ratio_running_to_created": (t_running / t_created) if t_running and t_created else None,
              "apiserver_peak_rss_mb": round(peak["kube-apiserver"]), "etcd_peak_rss_mb": round(peak["etcd"]),
              "completed": t_running is not None}
    print(json.dumps(result, indent=2))
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(result, indent=2))
    sys.exit(0 if t_running is not None else 1)


if __name__ == "__main__":
    main()
