"""Rolling backend swap across a fleet of process-backed pods, under load.

For each (pods, maxUnavailable) it starts a fleet of small bundled runtimes on the local
control plane, runs a gateway-style load client (routes only to ready endpoints, retries
nothing), swaps the L3 backend none -> file, and measures in the same run:
  - wall time of the swap (patch -> every pod on the target and serving),
  - per-pod drain time: median time a pod spends out of serving (gate False -> Ready again),
  - ratio = wall / (steps x per-pod time), steps = ceil(pods / maxUnavailable): 1.0 means the
    rollout adds nothing on top of the pods' own swap procedure,
  - failed requests (goal: 0).

  python bench/swap.py --pods 16,64 --max-unavailable 1,8 --json-out bench/results/swap.json

Each runtime is a real process (~300 MB resident with torch), so the fleet size is bounded by
memory: 64 pods need about 20 GiB.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster import netns  # noqa: E402
from tests.cluster.localcluster import LocalCluster, NodeSpec  # noqa: E402
from tests.e2e.gateway import Gateway  # noqa: E402
from tests.e2e.helpers import OperatorProcess, kget, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def pod_out_times(cluster, ns: str, name: str, stop: threading.Event, out: dict) -> None:
    """Record, per pod, when its serving gate went False and when it was Ready again."""
    from kubernetes import client, watch
    core = client.CoreV1Api(cluster.api_client())
    while not stop.is_set():
        try:
            for ev in watch.Watch().stream(core.list_namespaced_pod, ns, timeout_seconds=5,
                                           label_selector=f"app.kubernetes.io/instance={name}"):
                p = ev["object"]
                conds = {c.type: c.status for c in (p.status.conditions or [])}
                rec = out.setdefault(p.metadata.name, {})
                t = time.monotonic()
                if conds.get("hicache.dev/serving") == "False" and "out" not in rec:
                    rec["out"] = t
                elif "out" in rec and "in" not in rec and conds.get("Ready") == "True":
                    rec["in"] = t
                if stop.is_set():
                    return
        except Exception:
            time.sleep(0.2)


def run_one(cluster, workdir: Path, pods: int, max_unavailable: int) -> dict:
    ns, name = f"bench-{pods}-{max_unavailable}", "fleet"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl_apply([{
        "apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"image": "hicache-runtime:bench", "replicas": pods, "maxTotalTokens": 2048, "pageSize": 4,
                 "testing": {"processBacked": True},
                 "rollout": {"maxUnavailable": max_unavailable, "drainTimeoutSeconds": 120},
                 "hicache": {"memLayout": "page_first", "storage": {"backend": "none"}}}}])
    wait_for(lambda: kget(cluster, "hcd", name, "-n", ns).get("status", {}).get("readyReplicas") == pods,
             timeout=900, interval=2, what=f"{pods} runtime pods ready")
    gw = Gateway(cluster.api_client(), ns, name, concurrency=4).start()
    time.sleep(5)
    times: dict[str, dict] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=pod_out_times, args=(cluster, ns, name, stop, times), daemon=True)
    watcher.start()
    t0 = time.monotonic()
    cluster.kubectl("patch", "hcd", name, "-n", ns, "--type=merge", "-p", json.dumps(
        {"spec": {"hicache": {"storage": {"backend": "file", "extraConfig": {"storage_dir": str(workdir / ns)}}}}}))

    def done():
        st = kget(cluster, "hcd", name, "-n", ns).get("status", {})
        bs = st.get("backendSwap") or {}
        return bs.get("phase") == "Complete" and not bs.get("pods") and bs.get("targetBackend") == "file" \
            and st.get("readyReplicas") == pods
    wait_for(done, timeout=1800, interval=0.5, what="swap complete")
    wall = time.monotonic() - t0
    stop.set()
    report = gw.stop()
    per_pod = [r["in"] - r["out"] for r in times.values() if "in" in r and "out" in r]
    per_pod_median = statistics.median(per_pod) if per_pod else float("nan")
    steps = math.ceil(pods / max_unavailable)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    return {"pods": pods, "max_unavailable": max_unavailable, "wall_s": round(wall, 2),
            "per_pod_drain_s_median": round(per_pod_median, 2), "steps": steps,
            "ratio": round(wall / (steps * per_pod_median), 3) if per_pod else None,
            "requests": len(report.outcomes), "failed_requests": len(report.failures)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", default="16,64", help="fleet sizes, comma-separated")
    ap.add_argument("--max-unavailable", default="1,8", help="rollout.maxUnavailable values, comma-separated")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    sizes = [int(x) for x in a.pods.split(",")]
    budgets = [int(x) for x in a.max_unavailable.split(",")]
    netns.enter_private_netns()
    results = []
    with tempfile.TemporaryDirectory(prefix="hicache-swapbench-") as tmp:
        nodes = [NodeSpec(f"gpu-{i}", gpus=8, memory="1Ti") for i in range(max(sizes))]
        cluster = LocalCluster(Path(tmp) / "cluster", nodes=nodes).start()
        try:
            cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
            cluster.kubectl("wait", "--for=condition=Established", "crd/hicachedeployments.hicache.dev")
            op = OperatorProcess(cluster, Path(tmp), reconcile_interval=10).start()
            for n in sizes:
                for mu in budgets:
                    r = run_one(cluster, Path(tmp), n, mu)
                    print(json.dumps(r), flush=True)
                    results.append(r)
                    wait_for(lambda: not kget(cluster, "pods", "-A", "-l", "app.kubernetes.io/instance=fleet")["items"],
                             timeout=300, interval=2, what="previous fleet gone")
            op.stop()
        finally:
            cluster.stop()
    out = {"results": results, "goal": {"ratio_max": 1.2, "failed_requests": 0}}
    print(json.dumps(out, indent=2))
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
