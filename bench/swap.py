"""Rolling backend swap across a fleet of process-backed pods, under load.

For each (pods, maxUnavailable) it starts a fleet of small bundled runtimes on the local
control plane, runs a gateway-style load client (routes only to ready endpoints, retries
nothing), swaps the L3 backend none -> file, and measures in the same run:
  - wall time of the swap (patch -> every pod on the target and serving),
  - per-pod time: the mean duration of one pod's swap procedure as the issue defines it, from
    taking it out of serving (the operator sends its gate-False patch) until its endpoint is
    ready again (also reported from the gate seen False by this process's watch, which leaves
    the patch's own time on the API server out of the pod's procedure: ``ratio_from_gate_seen``),
  - ratio = wall / (steps x per-pod time), steps = ceil(pods / maxUnavailable): with the mean,
    steps x per-pod time is the wall a rollout would take if it kept maxUnavailable pods in
    their procedures at every moment, so 1.0 means it adds nothing between and around them,
  - failed requests (goal: 0).

  python bench/swap.py --pods 16,64 --max-unavailable 1,8 --json-out bench/results/swap.json

Runs on a small machine differ by more than the goal's margin (16 pods, maxUnavailable 8: ratios
1.09-1.30 with the same code), so ``--repeat N`` runs each size N times on the same cluster
and adds, per size, the median, mean and spread of the ratios and how many runs met the goal
(``summary`` in the JSON); every run is still printed and kept.

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
import tempfile
import threading
import time
from pathlib import Path

from localcluster import netns
from localcluster.cluster import LocalCluster
from localcluster.nodes import NodeSpec
from localcluster.zygote import ZYGOTE_ENV
from testbed.gateway import Gateway
from testbed.kube import kget, wait_for
from testbed.operator_proc import OperatorProcess

REPO = Path(__file__).resolve().parents[1]


class Timeline:
    """Wall-clock transitions seen by watches: each pod's serving gate and Ready condition, and
    its endpoint's ``ready`` in the Service's EndpointSlices. A pod's procedure runs from gate
    False to its endpoint ready again; the rest tells where a step's time goes (``--timeline``)."""

    def __init__(self, cluster, ns: str, name: str):
        self.cluster, self.ns, self.name = cluster, ns, name
        self.events: list[tuple[float, str, str]] = []  # (time, pod, what)
        self.last: dict[tuple[str, str], str] = {}
        self.ip_pod: dict[str, str] = {}
        self.slice_addrs: dict[str, set[str]] = {}  # client Service slice -> the addresses it listed last
        self.stop_event = threading.Event()
        self.lock = threading.Lock()

    def _note(self, pod: str, kind: str, value: str | None, t: float) -> None:
        with self.lock:
            if value is None or self.last.get((pod, kind)) == value:
                return
            if (pod, kind) in self.last:
                self.events.append((t, pod, f"{kind}={value}"))
            self.last[(pod, kind)] = value

    def _stream(self, list_call, selector: str, on_object) -> None:
        """Watch from the last version seen, so no transition is lost between two watch
        requests (a fresh listing would only show each object's state at that moment)."""
        from kubernetes import watch
        version = None
        while not self.stop_event.is_set():
            try:
                for ev in watch.Watch().stream(list_call, self.ns, label_selector=selector, timeout_seconds=30,
                                               resource_version=version, allow_watch_bookmarks=True,
                                               deserialize=False):
                    obj = ev["object"]
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        on_object(time.time(), obj)
                    if self.stop_event.is_set():
                        return
            except Exception:  # e.g. 410 Gone: start over from a listing
                version = None
                time.sleep(0.2)

    def _pod(self, t: float, pod: dict) -> None:
        status = pod.get("status") or {}
        conds = {c["type"]: c["status"] for c in status.get("conditions") or []}
        if status.get("podIP"):
            self.ip_pod[status["podIP"]] = pod["metadata"]["name"]
        serving = (pod["metadata"].get("labels") or {}).get("hicache.dev/serving")
        self._note(pod["metadata"]["name"], "gate", None if serving is None else str(serving == "true"), t)
        self._note(pod["metadata"]["name"], "ready", conds.get("Ready"), t)

    def _slice(self, t: float, endpoint_slice: dict) -> None:
        """An endpoint that leaves the client Service's slice (its pod left serving) is noted
        not ready."""
        name = endpoint_slice["metadata"].get("name", "")
        listed: set[str] = set()
        for e in endpoint_slice.get("endpoints") or []:
            ready = "True" if (e.get("conditions") or {}).get("ready") else "False"
            for addr in e.get("addresses") or []:
                listed.add(addr)
                if addr in self.ip_pod:
                    self._note(self.ip_pod[addr], "endpoint", ready, t)
        for addr in self.slice_addrs.get(name, set()) - listed:
            if addr in self.ip_pod:
                self._note(self.ip_pod[addr], "endpoint", "False", t)
        self.slice_addrs[name] = listed

    def start(self, pods: int) -> "Timeline":
        """Both watches running and every pod's gate, Ready and endpoint seen once."""
        from kubernetes import client
        api = self.cluster.api_client()
        threading.Thread(target=self._stream, daemon=True, args=(
            client.CoreV1Api(api).list_namespaced_pod, f"app.kubernetes.io/instance={self.name}", self._pod)).start()
        wait_for(lambda: len(self.ip_pod) == pods, timeout=60, interval=0.1, what="pod watch synced")
        threading.Thread(target=self._stream, daemon=True, args=(
            client.DiscoveryV1Api(api).list_namespaced_endpoint_slice, f"kubernetes.io/service-name={self.name}",
            self._slice)).start()
        wait_for(lambda: len(self.last) == 3 * pods, timeout=60, interval=0.1, what="endpoint watch synced")
        return self

    def stop(self) -> None:
        self.stop_event.set()

    def spans(self, until: str) -> dict[str, tuple[float, float]]:
        """Pod -> (gate False, the first ``until`` event after it), e.g. ``endpoint=True``."""
        out: dict[str, tuple[float, float]] = {}
        start: dict[str, float] = {}
        for t, pod, what in sorted(self.events):
            if what == "gate=False" and pod not in out:
                start.setdefault(pod, t)
            elif what == until and pod in start and pod not in out:
                out[pod] = (start[pod], t)
        return out

    def endpoint_lags(self) -> list[float]:
        """For every Ready flip, the time until the EndpointSlice shows it: the EndpointSlice
        controller's share of each procedure, which the operator waits on but cannot shorten."""
        lags, pending = [], {}
        for t, pod, what in sorted(self.events):
            kind, value = what.split("=")
            if kind == "ready":
                pending[pod] = (value, t)
            elif kind == "endpoint" and pending.get(pod, ("",))[0] == value:
                lags.append(t - pending.pop(pod)[1])
        return lags


STALE_RETRY = re.compile(r'^I(\d{4} \d\d:\d\d:\d\d\.\d+) .*"Error syncing endpoint slices for service, retrying" '
                         r'.*key="([^"]+)" err="EndpointSlice informer cache is out of date"')


def stale_retries(kcm_log: Path, key: str, since: float, until: float) -> int:
    """The EndpointSlice controller's syncs of the Service refused because its own last write
    was not yet in its cache; each is retried only on the next pod change or after a backoff
    of 1 s, doubling while they repeat (klog's timestamps are local time, without the year)."""
    year, count = time.localtime(since).tm_year, 0
    for line in kcm_log.read_text(errors="replace").splitlines():
        m = STALE_RETRY.match(line)
        if m and m.group(2) == key:
            t = time.mktime(time.strptime(f"{year}{m.group(1)[:13]}", "%Y%m%d %H:%M:%S")) + float(m.group(1)[13:])
            count += since <= t <= until
    return count


def operator_steps(log: Path, offset: int, ns: str) -> list[tuple[float, str]]:
    """The operator's own ``swap step`` log lines for this namespace: (start time, line)."""
    steps = []
    for line in log.read_text(errors="replace")[offset:].splitlines():
        m = re.search(rf"swap step {re.escape(ns)}/\S+ at=([0-9.]+) (.*)", line)
        if m:
            steps.append((float(m.group(1)), m.group(2)))
    return steps


def take_outs(steps: list[tuple[float, str]]) -> dict[str, float]:
    """Pod -> when the operator sent its first take-out (gate False) patch, from its step lines
    (``SetServingGate:POD:False@OFFSET``, the offset from the step's start)."""
    out: dict[str, float] = {}
    for at, text in sorted(steps):
        for pod, offset in re.findall(r"SetServingGate:([^:,\s]+):False@([0-9.]+)", text):
            out.setdefault(pod, at + float(offset))
    return out


def operator_service_touches(log: Path, offset: int, ns: str) -> list[tuple[float, str]]:
    """The operator's touches of the client Service (``hicache_operator.endpoint_lag``): (log
    time, the pods whose flips the EndpointSlice sat on)."""
    touches = []
    for line in log.read_text(errors="replace")[offset:].splitlines():
        m = re.match(rf"\[([\d-]+ [\d:]+),(\d+)\].*{re.escape(ns)}/\S+: EndpointSlice of Service \S+ still shows (.*?) as ", line)
        if m:
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            touches.append((at, m.group(3)))
    return touches


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


GOAL = {"ratio_max": 1.2, "failed_requests": 0}


def summarize(results: list[dict]) -> list[dict]:
    """Per (pods, maxUnavailable): the spread of its runs' ratios and how many met the goal."""
    sizes: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        sizes.setdefault((r["pods"], r["max_unavailable"]), []).append(r)
    out = []
    for (pods, mu), runs in sizes.items():
        ratios = [r["ratio"] for r in runs if r["ratio"] is not None and not math.isnan(r["ratio"])]
        failed = sum(r["failed_requests"] for r in runs)
        out.append({"pods": pods, "max_unavailable": mu, "runs": len(runs),
                    "ratio_median": round(statistics.median(ratios), 3) if ratios else None,
                    "ratio_mean": round(statistics.mean(ratios), 3) if ratios else None,
                    "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
                    "runs_meeting_goal": sum(r["ratio"] is not None and r["ratio"] <= GOAL["ratio_max"]
                                             and r["failed_requests"] <= GOAL["failed_requests"] for r in runs),
                    "failed_requests": failed, "requests": sum(r["requests"] for r in runs)})
    return out


def run_one(cluster, workdir: Path, op, pods: int, max_unavailable: int, timeline_dir: Path | None,
            request_tokens: int = 8, run: int = 0) -> dict:
    ns, name = f"bench-{pods}-{max_unavailable}" + (f"-{run}" if run else ""), "fleet"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl_apply([{
        "apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
        "metadata": {"name": name, "namespace": ns, "annotations": {"hicache.dev/process-backed": "true"}},
        "spec": {"image": "hicache-runtime:bench", "replicas": pods, "maxTotalTokens": 2048, "pageSize": 4,
                 "rollout": {"maxUnavailable": max_unavailable, "drainTimeoutSeconds": 120},
                 "hicache": {"memLayout": "page_first", "storage": {"backend": "none"}}}}])
    wait_for(lambda: kget(cluster, "hcd", name, "-n", ns).get("status", {}).get("readyReplicas") == pods,
             timeout=900, interval=2, what=f"{pods} runtime pods ready")
    memory = fleet_memory()
    gw = Gateway(cluster.api_client(), ns, name, concurrency=4, max_new_tokens=request_tokens).start()
    time.sleep(5)
    timeline = Timeline(cluster, ns, name).start(pods)
    log_offset = op.log.stat().st_size
    from kubernetes import client
    custom = client.CustomObjectsApi(cluster.api_client())
    # The clock starts at the API call (a kubectl process would add its own start-up, ~0.2 s here).
    t0 = time.time()
    custom.patch_namespaced_custom_object(
        "hicache.dev", "v1alpha1", ns, "hicachedeployments", name,
        {"spec": {"hicache": {"storage": {"backend": "file", "extraConfig": {"file_storage_path": str(workdir / ns)}}}}})

    def done():
        # in process: a kubectl process every poll took CPU from the control plane being measured
        st = custom.get_namespaced_custom_object("hicache.dev", "v1alpha1", ns, "hicachedeployments", name).get(
            "status", {})
        bs = st.get("backendSwap") or {}
        return bs.get("phase") == "Complete" and not bs.get("pods") and bs.get("targetBackend") == "file" \
            and st.get("readyReplicas") == pods
    wait_for(done, timeout=1800, interval=0.5, what="swap complete")
    wall_status = time.time() - t0
    timeline.stop()
    report = gw.stop()
    spans = timeline.spans("endpoint=True")
    not_ready = [end - start for start, end in timeline.spans("ready=True").values()]
    # The swap is over when the last pod's endpoint is ready again (the completion poll above
    # lags by up to its interval plus an API call).
    wall = max(end for _, end in spans.values()) - t0 if len(spans) == pods else float("nan")
    step_lines = operator_steps(op.log, log_offset, ns)
    sent = take_outs(step_lines)
    # A pod's procedure starts when the operator takes it out (sends its gate patch), the
    # procedure's first act: the patch's own time on the API server is that pod's, not the
    # rollout's. From the gate seen False by this process's watch as well, as before.
    per_pod = [end - sent[pod] for pod, (_, end) in spans.items() if pod in sent]
    per_pod_gate_seen = [end - start for start, end in spans.values()]
    per_pod_mean = statistics.mean(per_pod) if len(per_pod) == len(spans) and per_pod else float("nan")
    per_pod_gate_seen_mean = statistics.mean(per_pod_gate_seen) if per_pod_gate_seen else float("nan")
    take_out_lag = sorted(start - sent[pod] for pod, (start, _) in spans.items() if pod in sent)
    steps = math.ceil(pods / max_unavailable)
    lags = sorted(timeline.endpoint_lags())
    touches = operator_service_touches(op.log, log_offset, ns)
    if timeline_dir is not None:
        timeline_dir.mkdir(parents=True, exist_ok=True)
        lines = [(t, f"{pod} {what}") for t, pod, what in timeline.events]
        lines += [(t, f"operator step {text}") for t, text in step_lines]
        lines += [(t, f"{pod} take-out sent") for pod, t in sent.items()]
        lines += [(t, f"operator touched the Service for {names}") for t, names in touches]
        (timeline_dir / f"{ns}.txt").write_text("".join(f"{t - t0:9.3f} {text}\n" for t, text in sorted(lines)))
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    latencies = sorted(o.latency_s for o in report.outcomes)
    return {"pods": pods, "max_unavailable": max_unavailable, "run": run, "started_at_unix": round(t0, 3), "wall_s": round(wall, 2),
            "wall_until_status_complete_s": round(wall_status, 2),
            "per_pod_procedure_s_mean": round(per_pod_mean, 3),
            "per_pod_procedure_s_median": round(statistics.median(per_pod), 3) if per_pod else None,
            "per_pod_procedure_s_max": round(max(per_pod), 2) if per_pod else None,
            "per_pod_from_gate_seen_s_mean": round(per_pod_gate_seen_mean, 3),
            "take_out_patch_to_gate_seen_s": {"p50": round(statistics.median(take_out_lag), 3),
                                              "max": round(take_out_lag[-1], 3)} if take_out_lag else None,
            "per_pod_not_ready_s_median": round(statistics.median(not_ready), 2) if not_ready else None,
            "endpoint_lag_s": {"p50": round(statistics.median(lags), 3), "p90": round(lags[int(0.9 * (len(lags) - 1))], 3),
                               "max": round(lags[-1], 3)} if lags else None,
            "endpointslice_stale_retries": stale_retries(cluster.logdir / "kube-controller-manager.log", f"{ns}/{name}",
                                                         t0, t0 + wall_status),
            "operator_service_touches": sum(t0 <= t <= t0 + wall_status for t, _ in touches),
            "pods_swapped": len(spans), "steps": steps,
            "ratio": round(wall / (steps * per_pod_mean), 3) if per_pod else None,
            "ratio_from_gate_seen": round(wall / (steps * per_pod_gate_seen_mean), 3) if per_pod_gate_seen else None,
            "requests": len(report.outcomes), "failed_requests": len(report.failures),
            "request_tokens": request_tokens,
            "request_latency_s": {"p50": round(statistics.median(latencies), 3),
                                  "max": round(latencies[-1], 3)} if latencies else None,
            "failures": [f"t={o.at - t0:.3f}s {timeline.ip_pod.get(o.endpoint, o.endpoint)}: {o.status} {o.error}"
                         for o in report.failures[:10]], "memory": memory}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", default="16,64", help="fleet sizes, comma-separated")
    ap.add_argument("--max-unavailable", default="1,8", help="rollout.maxUnavailable values, comma-separated")
    ap.add_argument("--request-tokens", type=int, default=8,
                    help="max_new_tokens of each load request (longer requests: longer drains)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run each size N times and summarise the ratios (median, spread, runs meeting the goal)")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--timeline", type=Path, metavar="DIR",
                    help="write each run's timeline (pod, endpoint and operator-step events) "
                         "and the operator's log here")
    a = ap.parse_args()
    sizes = [int(x) for x in a.pods.split(",")]
    budgets = [int(x) for x in a.max_unavailable.split(",")]
    netns.enter_private_netns()
    os.environ[ZYGOTE_ENV] = "1"  # the podrunner (started below) forks runtimes from a zygote: 64 fit in memory
    results = []
    with tempfile.TemporaryDirectory(prefix="hicache-swapbench-") as tmp:
        nodes = [NodeSpec(f"gpu-{i}", gpus=8, memory="1Ti") for i in range(max(sizes))]
        cluster = LocalCluster(Path(tmp) / "cluster", nodes=nodes).start()
        op = None
        try:
            cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
            cluster.wait_established("hicachedeployments.hicache.dev")
            op = OperatorProcess(cluster, Path(tmp), reconcile_interval=10).start()
            for n, mu, k in [(n, mu, k) for n in sizes for mu in budgets for k in range(a.repeat)]:
                r = run_one(cluster, Path(tmp), op, n, mu, a.timeline, a.request_tokens, k)
                print(json.dumps(r), flush=True)
                results.append(r)
                wait_for(lambda: not kget(cluster, "pods", "-A", "-l", "app.kubernetes.io/instance=fleet")["items"],
                         timeout=300, interval=2, what="previous fleet gone")
            op.stop()
        finally:
            cluster.stop()
            if a.timeline is not None and op is not None and op.log.exists():
                a.timeline.mkdir(parents=True, exist_ok=True)
                (a.timeline / "operator.log").write_bytes(op.log.read_bytes())
                kcm_log = cluster.logdir / "kube-controller-manager.log"  # the EndpointSlice controller's retries
                if kcm_log.exists():
                    (a.timeline / kcm_log.name).write_bytes(kcm_log.read_bytes())
    out = {"results": results, "summary": summarize(results), "goal": GOAL}
    print(json.dumps(out, indent=2))
    for row in out["summary"]:
        print(f"{row['pods']} pods, maxUnavailable {row['max_unavailable']}: ratio median {row['ratio_median']} "
              f"(min {row['ratio_min']}, max {row['ratio_max']}, {row['runs_meeting_goal']}/{row['runs']} runs "
              f"meeting the goal), failed requests {row['failed_requests']} of {row['requests']}", flush=True)
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
