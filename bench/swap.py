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

Each runtime is a real process. Started on its own, one costs ~350 MiB (PSS, 16 pods), most
of it libtorch's initialised state; the podrunner forks runtimes from a zygote that imported
torch once, so that state is shared (see the JSON's "memory": PSS summed over the fleet).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster import netns  # noqa: E402
from tests.cluster.localcluster import LocalCluster, NodeSpec  # noqa: E402
from tests.cluster.podrunner import ZYGOTE_ENV  # noqa: E402
from tests.e2e.gateway import Gateway  # noqa: E402
from tests.e2e.helpers import OperatorProcess, kget, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class Timeline:
    """Wall-clock transitions seen by watches: each pod's serving gate and Ready condition, and
    its endpoint's ``ready`` in the Service's EndpointSlices. Per-pod out-of-serving time is
    gate False -> Ready again; the rest tells where a step's time goes (``--timeline``)."""

    def __init__(self, cluster, ns: str, name: str):
        self.cluster, self.ns, self.name = cluster, ns, name
        self.events: list[tuple[float, str, str]] = []  # (time, pod, what)
        self.last: dict[tuple[str, str], str] = {}
        self.ip_pod: dict[str, str] = {}
        self.stop_event = threading.Event()
        self.lock = threading.Lock()

    def _note(self, pod: str, kind: str, value: str | None, t: float) -> None:
        with self.lock:
            if value is None or self.last.get((pod, kind)) == value:
                return
            if (pod, kind) in self.last:
                self.events.append((t, pod, f"{kind}={value}"))
            self.last[(pod, kind)] = value

    def _pods(self) -> None:
        from kubernetes import client, watch
        core = client.CoreV1Api(self.cluster.api_client())
        while not self.stop_event.is_set():
            try:
                for ev in watch.Watch().stream(core.list_namespaced_pod, self.ns, timeout_seconds=5,
                                               label_selector=f"app.kubernetes.io/instance={self.name}"):
                    t, p = time.time(), ev["object"]
                    conds = {c.type: c.status for c in (p.status.conditions or [])}
                    if p.status.pod_ip:
                        self.ip_pod[p.status.pod_ip] = p.metadata.name
                    self._note(p.metadata.name, "gate", conds.get("hicache.dev/serving"), t)
                    self._note(p.metadata.name, "ready", conds.get("Ready"), t)
                    if self.stop_event.is_set():
                        return
            except Exception:
                time.sleep(0.2)

    def _slices(self) -> None:
        from kubernetes import client, watch
        disc = client.DiscoveryV1Api(self.cluster.api_client())
        while not self.stop_event.is_set():
            try:
                for ev in watch.Watch().stream(disc.list_namespaced_endpoint_slice, self.ns, timeout_seconds=5,
                                               label_selector=f"kubernetes.io/service-name={self.name}"):
                    t = time.time()
                    for e in ev["object"].endpoints or []:
                        ready = "True" if e.conditions and e.conditions.ready else "False"
                        for addr in e.addresses or []:
                            if addr in self.ip_pod:
                                self._note(self.ip_pod[addr], "endpoint", ready, t)
                    if self.stop_event.is_set():
                        return
            except Exception:
                time.sleep(0.2)

    def start(self, pods: int) -> "Timeline":
        """Both watches running and every pod's gate, Ready and endpoint seen once."""
        threading.Thread(target=self._pods, daemon=True).start()
        wait_for(lambda: len(self.ip_pod) == pods, timeout=60, interval=0.1, what="pod watch synced")
        threading.Thread(target=self._slices, daemon=True).start()
        wait_for(lambda: len(self.last) == 3 * pods, timeout=60, interval=0.1, what="endpoint watch synced")
        return self

    def stop(self) -> None:
        self.stop_event.set()

    def out_of_serving(self) -> dict[str, tuple[float, float]]:
        """Pod -> (gate False, Ready True after it)."""
        out: dict[str, tuple[float, float]] = {}
        start: dict[str, float] = {}
        for t, pod, what in sorted(self.events):
            if what == "gate=False" and pod not in out:
                start.setdefault(pod, t)
            elif what == "ready=True" and pod in start and pod not in out:
                out[pod] = (start[pod], t)
        return out


def operator_steps(log: Path, offset: int, ns: str) -> list[tuple[float, str]]:
    """The operator's own ``swap step`` log lines for this namespace: (start time, line)."""
    steps = []
    for line in log.read_text(errors="replace")[offset:].splitlines():
        m = re.search(rf"swap step {re.escape(ns)}/\S+ at=([0-9.]+) (.*)", line)
        if m:
            steps.append((float(m.group(1)), m.group(2)))
    return steps


def fleet_memory() -> dict:
    """Real memory of the runtime processes (and the podrunner's zygote they are forked from):
    summed PSS (pages shared between processes split among them) next to summed RSS (which
    counts shared pages once per process), and the machine's used memory as ``free`` has it."""
    pss = rss = count = 0
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            cmdline, comm = (proc / "cmdline").read_bytes(), (proc / "comm").read_text().strip()
            if b"cache_runtime" not in cmdline and b"--zygote" not in cmdline and comm != "cache_runtime":
                continue
            fields = dict(line.split(":", 1) for line in (proc / "smaps_rollup").read_text().splitlines()[1:])
        except (OSError, ValueError):
            continue
        pss += int(fields["Pss"].split()[0])
        rss += int(fields["Rss"].split()[0])
        count += comm == "cache_runtime" or b"--zygote" not in cmdline
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    used = int(meminfo["MemTotal"].split()[0]) - int(meminfo["MemAvailable"].split()[0])
    return {"runtimes": count, "pss_mib": round(pss / 1024), "rss_mib": round(rss / 1024),
            "pss_per_runtime_mib": round(pss / 1024 / max(count, 1)), "machine_used_mib": round(used / 1024)}


def run_one(cluster, workdir: Path, op, pods: int, max_unavailable: int, timeline_dir: Path | None) -> dict:
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
    memory = fleet_memory()
    gw = Gateway(cluster.api_client(), ns, name, concurrency=4).start()
    time.sleep(5)
    timeline = Timeline(cluster, ns, name).start(pods)
    log_offset = op.log.stat().st_size
    t0 = time.time()
    cluster.kubectl("patch", "hcd", name, "-n", ns, "--type=merge", "-p", json.dumps(
        {"spec": {"hicache": {"storage": {"backend": "file", "extraConfig": {"storage_dir": str(workdir / ns)}}}}}))

    def done():
        st = kget(cluster, "hcd", name, "-n", ns).get("status", {})
        bs = st.get("backendSwap") or {}
        return bs.get("phase") == "Complete" and not bs.get("pods") and bs.get("targetBackend") == "file" \
            and st.get("readyReplicas") == pods
    wait_for(done, timeout=1800, interval=0.5, what="swap complete")
    wall_status = time.time() - t0
    timeline.stop()
    report = gw.stop()
    spans = timeline.out_of_serving()
    # The swap is over when the last pod is Ready again (the completion poll above lags by up to
    # its interval plus a kubectl call).
    wall = max(end for _, end in spans.values()) - t0 if len(spans) == pods else float("nan")
    per_pod = [end - start for start, end in spans.values()]
    per_pod_median = statistics.median(per_pod) if per_pod else float("nan")
    steps = math.ceil(pods / max_unavailable)
    if timeline_dir is not None:
        timeline_dir.mkdir(parents=True, exist_ok=True)
        lines = [(t, f"{pod} {what}") for t, pod, what in timeline.events]
        lines += [(t, f"operator step {text}") for t, text in operator_steps(op.log, log_offset, ns)]
        (timeline_dir / f"{ns}.txt").write_text("".join(f"{t - t0:9.3f} {text}\n" for t, text in sorted(lines)))
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    return {"pods": pods, "max_unavailable": max_unavailable, "wall_s": round(wall, 2),
            "wall_until_status_complete_s": round(wall_status, 2),
            "per_pod_out_of_serving_s_median": round(per_pod_median, 2),
            "per_pod_out_of_serving_s_max": round(max(per_pod), 2) if per_pod else None,
            "pods_swapped": len(spans), "steps": steps,
            "ratio": round(wall / (steps * per_pod_median), 3) if per_pod else None,
            "requests": len(report.outcomes), "failed_requests": len(report.failures), "memory": memory}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", default="16,64", help="fleet sizes, comma-separated")
    ap.add_argument("--max-unavailable", default="1,8", help="rollout.maxUnavailable values, comma-separated")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--timeline", type=Path, metavar="DIR",
                    help="write each run's timeline (pod, endpoint and operator-step events) here")
    a = ap.parse_args()
    sizes = [int(x) for x in a.pods.split(",")]
    budgets = [int(x) for x in a.max_unavailable.split(",")]
    netns.enter_private_netns()
    os.environ[ZYGOTE_ENV] = "1"  # the podrunner (started below) forks runtimes from a zygote: 64 fit in memory
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
                    r = run_one(cluster, Path(tmp), op, n, mu, a.timeline)
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
