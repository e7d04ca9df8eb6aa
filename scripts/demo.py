"""The local demo: a HiCache fleet on a local control plane, end to end.

  1. start the local control plane (etcd, kube-apiserver, controllers, KWOK) with simulated
     GPU nodes, in its own network namespace;
  2. helm install the operator chart (the operator pod runs as a real process);
  3. kubectl apply a bundled-runtime HiCacheDeployment (2 pods, each a real runtime process)
     whose L1 is smaller than the conversations' working set and whose L2 holds it, with a
     ReadWriteMany claim mounted for L3 (testbed/tiers.py);
  4. returning conversations through the client Service (SGLang's cache-aware router in front of
     the pods): the first round is cold, later rounds are served from L2 (and L1);
  5. swap the L3 backend live (none -> file on the shared claim) under traffic, with progress;
  6. a second pod served from L3 with prompts only the first pod has seen; the failed-request
     count (0) and `kubectl get` output. It exits non-zero if a request failed or L2 or L3 served
     nothing.

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
        rc = subprocess.call([sys.executable, "-m", "localcluster", "up", "--workdir", str(WORKDIR),
                              "--gpu-nodes", "3", "--cpu-nodes", "1"], cwd=REPO)
        if rc:
            return rc
    else:
        say(f"reusing the local control plane in {WORKDIR}")
    return subprocess.call([sys.executable, "-m", "localcluster", "exec", "--workdir", str(WORKDIR), "--",
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


def ready_ips(kind: str, selector: str) -> list[str]:
    """Ready endpoint addresses of a Service (kind "svc": ``selector`` is its name) or pod IPs."""
    if kind == "svc":
        slices = json.loads(kubectl("get", "endpointslices", "-n", NS, "-l",
                                    f"kubernetes.io/service-name={selector}", "-o", "json"))["items"]
        return sorted({a for s in slices for e in s.get("endpoints") or []
                       if (e.get("conditions") or {}).get("ready") for a in e.get("addresses") or []})
    pods = json.loads(kubectl("get", "pods", "-n", NS, "-l", selector, "-o", "json"))["items"]
    return [p["status"]["podIP"] for p in sorted(pods, key=lambda p: p["metadata"]["name"])]


def inside() -> int:
    from testbed import tiers

    say("installing the operator with helm (its pod runs as a real local process)")
    kubectl("create", "namespace", "hicache-system", check=False)
    sh("helm", "upgrade", "--install", "hicache-operator", str(REPO / "charts" / "hicache-operator"),
       "-n", "hicache-system", "--set", "processBacked=true", "--set", "reconcileInterval=5", "--wait",
       "--timeout", "5m")
    print(kubectl("get", "pods", "-n", "hicache-system", "-o", "wide"))

    say("applying a bundled-runtime HiCacheDeployment: 2 pods, L1 768 tokens, L2 4x that, a shared claim for L3")
    print("   model: the embedded default checkpoint, a LlamaForCausalLM with real KV geometry (16 layers,\n"
          "   8 KV heads x 128, ~247 M parameters, bfloat16) and RANDOM weights with a locally trained\n"
          "   tokenizer: it runs like a real model and its text is meaningless. Point spec.model at a\n"
          "   Hugging Face checkpoint directory to serve a real one.", flush=True)
    kubectl("create", "namespace", NS, check=False)
    import yaml
    l3 = WORKDIR / "l3"
    docs = [*tiers.shared_volume(NS, "l3", l3), tiers.fleet(NAME, NS, "l3", l3)]
    subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump_all(docs), text=True, check=True)
    wait(lambda: hcd().get("status", {}).get("readyReplicas") == 2, "2 pods ready", timeout=600, show=columns)
    router = ready_ips("svc", NAME)[0]

    say("returning conversations through the client Service (the router): 6 documents of ~220 tokens, "
        "3 rounds; L1 holds about 3 of them, L2 all")
    rounds = tiers.returning_conversations(router)
    for r, t in enumerate(rounds):
        print(f"   round {r + 1}{' (cold)' if r == 0 else ''}: {t.line()}", flush=True)

    say("live backend swap: none -> file on the shared claim (prefetch wait_complete), under traffic")
    kubectl("patch", "hcd", NAME, "-n", NS, "--type=merge", "-p", json.dumps(tiers.file_l3(l3)))
    from kubernetes import config
    from testbed.gateway import Gateway
    gw = Gateway(config.new_client_from_config(), NS, NAME, concurrency=3).start()

    def swapped() -> bool:
        bs = hcd().get("status", {}).get("backendSwap") or {}
        return bs.get("phase") == "Complete" and not bs.get("pods") and bs.get("targetBackend") == "file"
    wait(swapped, "swap complete", timeout=600, every=0.5, show=columns)
    during = gw.stop().summary()
    print(f"   during the swap: {during['requests']} requests, {during['failed']} failed", flush=True)

    first, second = ready_ips("pod", f"app.kubernetes.io/instance={NAME},app.kubernetes.io/name=hicache")[:2]
    say(f"L3 shared by the pods: 4 new prompts to one pod ({first}), then to the other ({second}), which never saw them")
    a, b = tiers.second_pod(first, second)
    print(f"   first pod:  {a.line()}\n   second pod: {b.line()}", flush=True)

    say("kubectl get")
    print(kubectl("get", "hicachedeployments", "-A", "-o", "wide"))
    print(kubectl("get", "pods,svc,endpointslices", "-n", NS, "-o", "wide"))
    print(kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={NAME}",
                  "--sort-by=.lastTimestamp"))
    failed = sum(t.failed for t in rounds) + during["failed"] + a.failed + b.failed
    host = sum(t.tokens.get("host", 0) for t in rounds[1:])
    storage = b.tokens.get("storage", 0)
    say(f"done: {failed} failed requests; L2 served {host} tokens to returning conversations, L3 served "
        f"{storage} tokens to the second pod. `scripts/demo.sh down` removes the cluster.")
    return 1 if failed or not host or not storage else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    return inside() if a.inside else outside()


if __name__ == "__main__":
    sys.exit(main())
