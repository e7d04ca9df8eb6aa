"""The local demo: a HiCache fleet on a local control plane, end to end.

  1. start the local control plane (etcd, kube-apiserver, controllers, KWOK) with simulated
     GPU nodes, in its own network namespace;
  2. helm install the operator chart (the operator pod runs as a real process);
  3. kubectl apply a bundled-runtime HiCacheDeployment (2 pods, each a real runtime process);
  4. send multi-turn traffic to the client Service (SGLang's cache-aware router in front of the
     pods) and print per-tier cache hits;
  5. swap the L3 backend live (none -> file) under that traffic, with progress;
  6. show per-tier hits after the swap, the failed-request count (0) and `kubectl get` output.

Run through scripts/demo.sh (which sets up first); `scripts/demo.sh down` removes it all.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORKDIR = Path(os.environ.get("HICACHE_DEMO_DIR", "/tmp/hicache-demo"))
NS, NAME = "demo", "tiny"


def say(msg: str) -> None:
    print(f"\n\033[1m==> {msg}\033[0m", flush=True)


def sh(*argv: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, text=True, capture_output=capture)


def kubectl(*args: str, check: bool = True) -> str:
    return sh("kubectl", *args, check=check, capture=True).stdout


def outside() -> int:
    """Start (or reuse) the cluster, then run the rest inside its network namespace."""
    state = WORKDIR / "cluster.json"
    if not state.exists():
        say("starting the local control plane with 3 simulated 8-GPU nodes")
        rc = subprocess.call([sys.executable, "-m", "tests.cluster", "up", "--workdir", str(WORKDIR),
                              "--gpu-nodes", "3", "--cpu-nodes", "1"], cwd=REPO)
        if rc:
            return rc
    else:
        say(f"reusing the local control plane in {WORKDIR}")
    return subprocess.call([sys.executable, "-m", "tests.cluster", "exec", "--workdir", str(WORKDIR), "--",
                            sys.executable, str(Path(__file__).resolve()), "--inside"], cwd=REPO)


def wait(cond, what: str, timeout: float = 300, every: float = 1.0, show=None):
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        ok = cond()
        if show:
            line = show()
            if line != last:
                print(f"   [{time.monotonic() - t0:5.1f}s] {line}", flush=True)
                last = line
        if ok:
            return
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def hcd() -> dict:
    out = kubectl("get", "hcd", NAME, "-n", NS, "-o", "json", check=False)
    return json.loads(out) if out else {}


def columns() -> str:
    s = hcd().get("status", {})
    return (f"READY {s.get('ready', '-')}  BACKEND {s.get('currentBackend', '-')}  "
            f"TARGET {s.get('targetBackend', '-')}  SWAP {s.get('swapProgress', '-')}  "
            f"phase {(s.get('backendSwap') or {}).get('phase', '-')}")


def traffic(seconds: float, label: str) -> dict:
    from kubernetes import config
    from tests.e2e.gateway import Gateway
    api = config.new_client_from_config()
    gw = Gateway(api, NS, NAME, concurrency=3, turns=4).start()
    time.sleep(seconds)
    summary = gw.stop().summary()
    tiers = summary["cached_tokens_by_tier"]
    print(f"   {label}: {summary['requests']} requests, {summary['failed']} failed, through "
          f"{summary['endpoints']} endpoint(s) of the client Service; cached tokens by tier: device(L1)={tiers.get('device', 0)} "
          f"host(L2)={tiers.get('host', 0)} storage(L3)={tiers.get('storage', 0)}", flush=True)
    return summary


def inside() -> int:
    say("installing the operator with helm (its pod runs as a real local process)")
    kubectl("create", "namespace", "hicache-system", check=False)
    sh("helm", "upgrade", "--install", "hicache-operator", str(REPO / "charts" / "hicache-operator"),
       "-n", "hicache-system", "--set", "processBacked=true", "--set", "reconcileInterval=5", "--wait",
       "--timeout", "5m")
    print(kubectl("get", "pods", "-n", "hicache-system", "-o", "wide"))

    say("applying a bundled-runtime HiCacheDeployment (2 pods, L1 + L2)")
    print("   model: the embedded default checkpoint, a LlamaForCausalLM with real KV geometry (16 layers,\n"
          "   8 KV heads x 128, ~247 M parameters, bfloat16) and RANDOM weights with a locally trained\n"
          "   tokenizer: it runs like a real model and its text is meaningless. Point spec.model at a\n"
          "   Hugging Face checkpoint directory to serve a real one.", flush=True)
    kubectl("create", "namespace", NS, check=False)
    import yaml
    doc = yaml.safe_load((REPO / "manifests" / "samples" / "bundled-minimal.yaml").read_text())
    doc["metadata"]["namespace"] = NS
    doc["spec"].update(replicas=2, pageSize=4)
    doc["spec"].setdefault("hicache", {})["memLayout"] = "page_first"
    subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump(doc), text=True, check=True)
    wait(lambda: hcd().get("status", {}).get("readyReplicas") == 2, "2 pods ready", timeout=600, show=columns)

    say("multi-turn traffic to the client Service, i.e. through the router (only ready endpoints, no retries)")
    before = traffic(20, "L1+L2")

    say("live backend swap: none -> file (prefetch wait_complete), while traffic keeps flowing")
    l3 = WORKDIR / "l3-file"
    kubectl("patch", "hcd", NAME, "-n", NS, "--type=merge", "-p", json.dumps(
        {"spec": {"hicache": {"storage": {"backend": "file", "prefetchPolicy": "wait_complete",
                                          "extraConfig": {"file_storage_path": str(l3),
                                                          # the demo's prompts are ~100 tokens: fetch from 16 up
                                                          "prefetch_threshold": 16}}}}}))
    from kubernetes import config
    from tests.e2e.gateway import Gateway
    gw = Gateway(config.new_client_from_config(), NS, NAME, concurrency=3).start()

    def swapped() -> bool:
        bs = hcd().get("status", {}).get("backendSwap") or {}
        return bs.get("phase") == "Complete" and not bs.get("pods") and bs.get("targetBackend") == "file"
    wait(swapped, "swap complete", timeout=600, every=0.5, show=columns)
    during = gw.stop().summary()
    print(f"   during the swap: {during['requests']} requests, {during['failed']} failed", flush=True)

    say("traffic after the swap: L1+L2 on each pod, L3 (file) behind them; the router keeps each "
        "conversation on the pod that holds its prefix")
    after = traffic(25, "L1+L2+L3(file)")

    say("kubectl get")
    print(kubectl("get", "hicachedeployments", "-A"))
    print(kubectl("get", "pods,svc,endpointslices", "-n", NS, "-o", "wide"))
    print(kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={NAME}",
                  "--sort-by=.lastTimestamp"))
    failed = before["failed"] + during["failed"] + after["failed"]
    say(f"done: {failed} failed requests. `scripts/demo.sh down` removes the cluster.")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    return inside() if a.inside else outside()


if __name__ == "__main__":
    sys.exit(main())
