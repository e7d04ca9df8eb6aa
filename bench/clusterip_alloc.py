"""How fast the API server creates ClusterIP Services, against headless ones, by concurrency.

Why this exists: in ``bench/operator_scale.py`` the client Service's create is the long pole
of a new deployment's reconcile (1.55-2.0 s under load, 0.15 s for every other child). A
goroutine dump of kube-apiserver 1.34 under concurrent creates shows why: every ClusterIP
allocation takes one mutex (``ipallocator.MetaAllocator.AllocateNextService``) and holds it
across a loopback create of an IPAddress object, so ClusterIP allocations in a cluster happen
one at a time whatever the clients do. This bench measures that on an otherwise idle local
control plane, in one run: creates/s of ClusterIP and of headless Services (no IP to
allocate), one client at a time and ``--concurrency`` at once. Printed ratios:

- ``clusterip_scaling``: ClusterIP creates/s at N clients over 1 client (near 1: serialised);
- ``headless_scaling``: the same for headless Services (what the rest of the path allows);
- ``clusterip_vs_headless``: ClusterIP over headless creates/s at N clients.

  python bench/clusterip_alloc.py --json-out bench/results/clusterip_alloc.json
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import tempfile
import time
from pathlib import Path

from localcluster import netns
from localcluster.cluster import LocalCluster
from localcluster.nodes import default_nodes


def create_rate(core, ns: str, prefix: str, count: int, concurrency: int, headless: bool) -> dict:
    """Create ``count`` Services with ``concurrency`` clients; creates/s and latency."""
    def one(i: int) -> float:
        spec = {"selector": {"app": prefix}, "ports": [{"port": 80}], **({"clusterIP": "None"} if headless else {})}
        t = time.monotonic()
        core.create_namespaced_service(ns, {"metadata": {"name": f"{prefix}-{i}"}, "spec": spec})
        return time.monotonic() - t
    with cf.ThreadPoolExecutor(concurrency) as pool:
        t0 = time.monotonic()
        lat = sorted(pool.map(one, range(count)))
        wall = time.monotonic() - t0
    return {"creates_per_s": round(count / wall, 1), "p50_ms": round(lat[len(lat) // 2] * 1000, 1),
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=300, help="Services per measurement")
    ap.add_argument("--concurrency", type=int, default=16, help="clients at once (the operator's workers)")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    netns.enter_private_netns()
    from kubernetes import client

    with tempfile.TemporaryDirectory(prefix="hicache-clusterip-") as tmp:
        c = LocalCluster(Path(tmp) / "cluster", nodes=default_nodes()[:1]).start()
        try:
            api = c.api_client()
            api.configuration.connection_pool_maxsize = a.concurrency * 2
            core = client.CoreV1Api(api)
            core.create_namespace({"metadata": {"name": "svc"}})
            runs: dict[str, dict] = {}
            # interleaved, each twice, so a drift of the machine hits both kinds alike
            for rnd in range(2):
                for kind in ("headless", "clusterip"):
                    for conc in (1, a.concurrency):
                        r = create_rate(core, "svc", f"{kind}-{conc}-{rnd}", a.count, conc, kind == "headless")
                        print(f"  {kind:9s} clients={conc:3d} round={rnd}: {r}", flush=True)
                        key = f"{kind}_c{conc}"
                        best = runs.get(key)
                        if best is None or r["creates_per_s"] > best["creates_per_s"]:
                            runs[key] = r
        finally:
            c.stop()

    n = a.concurrency
    rate = {k: v["creates_per_s"] for k, v in runs.items()}
    result = {"count": a.count, "concurrency": n, "runs_best_of_2": runs,
              "clusterip_scaling": round(rate[f"clusterip_c{n}"] / rate["clusterip_c1"], 2),
              "headless_scaling": round(rate[f"headless_c{n}"] / rate["headless_c1"], 2),
              "clusterip_vs_headless": round(rate[f"clusterip_c{n}"] / rate[f"headless_c{n}"], 2)}
    print(json.dumps(result, indent=2))
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
