"""Drain-aware rolling L3 backend swaps on a live fleet, end to end.

Real control plane, real runtime processes (one per pod, at the pod's IP), a real Mooncake
master, and a load client that routes like a gateway (only to endpoints the EndpointSlices
mark ready) and retries nothing: every request must succeed through every swap.
"""
from __future__ import annotations

import base64
import json
import random
import time

import httpx
import pytest

from hicache_operator.plan.engine import versions as engine_versions
from testbed import gate_probes
from testbed.gateway import Gateway
from testbed.kube import condition, kget, wait_for
from testbed.mooncake import free_port, start_master
from testbed.operator_proc import start_operator
from tests.e2e.helpers import l3_hit_across_pods, skip_without_pod_network_or_mooncake

pytestmark = pytest.mark.e2e
REPLICAS = 4
NAME = "swap"


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    skip_without_pod_network_or_mooncake(cluster)
    workdir = tmp_path_factory.mktemp("swap")
    op = start_operator(cluster, workdir, reconcile_interval=5)
    master = start_master()
    ns = "swap-e2e"
    cluster.kubectl("create", "namespace", ns)
    yield {"cluster": cluster, "op": op, "master": master, "ns": ns, "dir": workdir}
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    op.stop()
    master.stop()


def storage(env, kind: str, **kw) -> dict:
    if kind == "none":
        return {"backend": "none"}
    if kind == "file":
        return {"backend": "file", "extraConfig": {"file_storage_path": str(env["dir"] / "l3-file")}, **kw}
    master = kw.pop("master", env["master"].address)
    return {"backend": "mooncake", "mooncake": {"masterAddress": master, "protocol": "tcp",
                                                "metadataServer": "P2PHANDSHAKE", "globalSegmentSize": 268435456},
            **kw}


def deployment(env, name: str = NAME, replicas: int = REPLICAS, st: dict | None = None) -> dict:
    return {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
            "metadata": {"name": name, "namespace": env["ns"], "annotations": {"hicache.dev/process-backed": "true"}},
            "spec": {"image": "hicache-runtime:test", "replicas": replicas, "pageSize": 4, "maxTotalTokens": 4096,
                     "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 60},
                     # the gateway routes by the client Service's EndpointSlices (test_router.py: through
                     # the router), except for the sglang engine's fleet below
                     "router": {"enabled": False},
                     # page_first from the start: mooncake needs it, and layer_first would be
                     # normalised to it, a pod-template change that restarts pods (not a live swap)
                     "hicache": {"memLayout": "page_first", "storage": st or {"backend": "none"}}}}


def hcd(env, name: str = NAME) -> dict:
    return kget(env["cluster"], "hcd", name, "-n", env["ns"])


def admin_key(env, name: str = NAME) -> str:
    sec = kget(env["cluster"], "secret", f"{name}-admin", "-n", env["ns"])
    return base64.b64decode(sec["data"]["admin-api-key"]).decode()


def pods(env, name: str = NAME) -> list[dict]:
    return kget(env["cluster"], "pods", "-n", env["ns"], "-l", f"app.kubernetes.io/instance={name}")["items"]


def reported(env, name: str = NAME) -> dict[str, dict]:
    key = admin_key(env, name)
    out = {}
    for p in pods(env, name):
        ip = p["status"].get("podIP")
        r = httpx.get(f"http://{ip}:30000/hicache/storage-backend", headers={"Authorization": f"Bearer {key}"},
                      timeout=5)
        out[p["metadata"]["name"]] = r.json()
    return out


def gates(env, name: str = NAME) -> dict[str, str | None]:
    """Pod -> its serving membership: "True", "False", or None without the label."""
    out = {}
    for p in pods(env, name):
        value = (p["metadata"].get("labels") or {}).get("hicache.dev/serving")
        out[p["metadata"]["name"]] = None if value is None else str(value == "true")
    return out


def fleet_ready(env, name: str = NAME) -> bool:
    o = hcd(env, name)
    return o.get("status", {}).get("readyReplicas") == o["spec"]["replicas"] and \
        all(g == "True" for g in gates(env, name).values())


def patch_storage(env, st: dict, name: str = NAME) -> None:
    env["cluster"].kubectl("patch", "hcd", name, "-n", env["ns"], "--type=merge",
                           "-p", json.dumps({"spec": {"hicache": {"storage": st}}}))


def swap_done(env, backend: str, policy: str | None = None, name: str = NAME) -> bool:
    o = hcd(env, name)
    bs = o.get("status", {}).get("backendSwap") or {}
    if bs.get("phase") != "Complete" or bs.get("pods"):
        return False
    rep = reported(env, name)
    want = None if backend == "none" else backend
    if any(r.get("hicache_storage_backend") != want for r in rep.values()):
        return False
    if policy and any(r.get("hicache_storage_prefetch_policy") != policy for r in rep.values()):
        return False
    return fleet_ready(env, name)


def test_live_swaps_under_load_with_zero_failed_requests(env):
    c = env["cluster"]
    c.kubectl_apply([deployment(env)])
    wait_for(lambda: fleet_ready(env), timeout=180, what="4 runtime pods ready")
    gw = Gateway(c.api_client(), env["ns"], NAME, concurrency=3).start()
    try:
        wait_for(lambda: len(gw.report.outcomes) > 10, timeout=60, what="load flowing")
        for st, backend, policy in [
            (storage(env, "file", prefetchPolicy="wait_complete"), "file", "wait_complete"),
            (storage(env, "mooncake", prefetchPolicy="wait_complete"), "mooncake", "wait_complete"),
            (storage(env, "mooncake", prefetchPolicy="timeout"), "mooncake", "timeout"),
            (storage(env, "none"), "none", None),
        ]:
            patch_storage(env, st)
            wait_for(lambda: swap_done(env, backend, policy), timeout=240, interval=1,
                     what=f"swap to {backend} {policy or ''} complete")
            assert not gw.report.failures, gw.report.failures[:3]
            if backend != "none":
                assert l3_hit_across_pods(c, env["ns"], NAME) > 0
            table = c.kubectl("get", "hcd", NAME, "-n", env["ns"]).stdout
            assert f"{REPLICAS}/{REPLICAS}" in table, table
    finally:
        report = gw.stop()
    print("load during swaps:", report.summary())
    assert not report.failures, report.failures[:3]
    assert len(report.outcomes) > 50
    assert len({o.endpoint for o in report.outcomes}) == REPLICAS
    events = kget(c, "events", "-n", env["ns"], "--field-selector", f"involvedObject.name={NAME}")["items"]
    reasons = {e["reason"] for e in events}
    assert {"PodDraining", "PodSwapped", "BackendSwapComplete"} <= reasons, reasons
    # Pods out of serving for their swap are not a degraded fleet (the spec's own validation warns:
    # process-backed pods write the file L3 to a host directory, not a mounted shared volume)
    warnings = [(e["reason"], e["message"]) for e in events if e["type"] == "Warning"]
    assert {reason for reason, _ in warnings} <= {"ExtraConfigUnknownKey", "FileStorageNotShared"}, warnings


def test_operator_sigkilled_mid_swap_resumes_without_stranding_pods(env):
    c = env["cluster"]
    c.kubectl_apply([deployment(env)])  # idempotent: the fleet of the previous test (or a new one)
    patch_storage(env, storage(env, "none"))
    wait_for(lambda: swap_done(env, "none"), timeout=240, interval=1, what="fleet on none")
    gw = Gateway(c.api_client(), env["ns"], NAME, concurrency=2).start()
    rng = random.Random(7)
    kills = swaps = 0
    try:
        # At least three swaps, and more until the operator has been killed mid-swap five times
        # (a swap of four small pods can finish between two kills).
        while swaps < 3 or kills < 5 and swaps < 12:
            backend = "file" if swaps % 2 == 0 else "none"
            patch_storage(env, storage(env, backend))
            for _ in range(4):  # kill it at random points while the swap runs
                time.sleep(rng.uniform(0.05, 1.0))
                if swap_done(env, backend):
                    break
                env["op"].kill()
                kills += 1
                time.sleep(rng.uniform(0.0, 1.0))
                env["op"].start()
            wait_for(lambda: swap_done(env, backend), timeout=240, interval=1, what=f"swap to {backend} after kills")
            assert set(gates(env).values()) == {"True"}, gates(env)
            swaps += 1
    finally:
        report = gw.stop()
    print(f"operator SIGKILLed {kills} times over {swaps} swaps; load: {report.summary()}")
    assert kills >= 5
    assert not report.failures, report.failures[:3]


def test_unreachable_mooncake_master_rolls_back_and_stops(env):
    c = env["cluster"]
    c.kubectl_apply([deployment(env)])
    patch_storage(env, storage(env, "file"))
    wait_for(lambda: swap_done(env, "file"), timeout=240, interval=1, what="fleet on file")
    gw = Gateway(c.api_client(), env["ns"], NAME, concurrency=2).start()
    try:
        dead = f"127.0.0.1:{free_port()}"
        patch_storage(env, storage(env, "mooncake", master=dead))
        obj = wait_for(lambda: (lambda o: o if condition(o, "BackendSwapFailed") == "True" else None)(hcd(env)),
                       timeout=240, interval=1, what="BackendSwapFailed")
        cond = next(x for x in obj["status"]["conditions"] if x["type"] == "BackendSwapFailed")
        failed_pod = obj["status"]["backendSwap"].get("failure", {}).get("pod") or ""
        assert failed_pod and failed_pod in cond["message"], cond
        wait_for(lambda: fleet_ready(env), timeout=120, what="every pod back in serving")
        time.sleep(3)  # the rollout stays stopped: no pod is taken out again
        assert all(r["hicache_storage_backend"] == "file" for r in reported(env).values()), reported(env)
        assert fleet_ready(env)
    finally:
        report = gw.stop()
    assert not report.failures, report.failures[:3]
    events = kget(c, "events", "-n", env["ns"], "--field-selector", f"involvedObject.name={NAME}")["items"]
    assert any(e["type"] == "Warning" and failed_pod in e["message"] for e in events)


def test_sglang_engine_swap_through_sglang_api_only(env):
    """engine: sglang pods run `python -m sglang.launch_server` (in the local cluster: the bundled
    runtime in SGLang-compatibility mode, after real SGLang parsed its arguments), so the swap must
    work through SGLang's own routes, auth header and metrics alone; clients go through the
    router, which gives the pods their API key."""
    c, name = env["cluster"], "sgl"
    doc = deployment(env, name=name, replicas=2)
    doc["spec"].update(engine="sglang", model="test-org/tiny-sglang", engineVersion=engine_versions.NEWEST_CHECKED,
                       modelShape={"numLayers": 4, "numKvHeads": 4, "headDim": 32, "dtypeBytes": 4})
    del doc["spec"]["router"]  # on (two replicas): clients reach SGLang's pods through SGLang's router
    c.kubectl_apply([doc])
    wait_for(lambda: fleet_ready(env, name), timeout=240, what="sglang-engine pods ready")
    pod = pods(env, name)[0]
    assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "sglang.launch_server"]
    ip = pod["status"]["podIP"]
    # clients hold the generated clients' key, which only the router's gate takes: SGLang answers
    # /server_info (admin key included) to any holder of the pods' key
    secret = kget(c, "secret", f"{name}-api", "-n", env["ns"])
    api_key = base64.b64decode(secret["data"]["api-key"]).decode()
    for key in (None, api_key):
        r = httpx.get(f"http://{ip}:30000/server_info", timeout=5,
                      headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 401, (key is not None, r.status_code)
    wait_for(lambda: (hcd(env, name).get("status") or {}).get("routerReady") == "1/1", timeout=120,
             what="the router ready")
    admin = admin_key(env, name)
    front = sorted({a for s in kget(c, "endpointslices", "-n", env["ns"], "-l",
                                    f"kubernetes.io/service-name={name}")["items"]
                    for e in s.get("endpoints") or [] for a in e.get("addresses") or []})
    assert front, "the client Service has no endpoint"
    for method, path in gate_probes.PROBES:  # every route through the client Service, with the clients' key
        r = gate_probes.send(f"http://{front[0]}:30000", method, path, api_key)
        assert admin not in r.text, (method, path, r.status_code)
    gw = Gateway(c.api_client(), env["ns"], name, concurrency=2, api_key=api_key).start()
    try:
        for st, backend in [(storage(env, "file"), "file"), (storage(env, "none"), "none")]:
            patch_storage(env, st, name=name)
            wait_for(lambda: swap_done(env, backend, name=name), timeout=240, interval=1,
                     what=f"sglang-engine swap to {backend}")
    finally:
        report = gw.stop()
    assert not report.failures, report.failures[:3]
    assert len(report.outcomes) > 20
    routers = {p["status"]["podIP"] for p in kget(c, "pods", "-n", env["ns"], "-l",
                                                   f"app.kubernetes.io/instance={name}-router")["items"]}
    assert {o.endpoint for o in report.outcomes} <= routers  # every request went through the router
    c.kubectl("delete", "hcd", name, "-n", env["ns"])


@pytest.mark.parametrize("max_unavailable,count", [("1%", 1), ("100%", 2), (5, 5)])
def test_swap_completes_with_edge_max_unavailable(env, max_unavailable, count):
    """Every accepted maxUnavailable lets a swap finish (a percentage never rounds to 0); the
    PodDisruptionBudget carries the count restarts and swaps use. 0 and '0%' are refused at apply
    (manifests/samples/invalid/max-unavailable.yaml)."""
    c, name = env["cluster"], f"mu-{str(max_unavailable).rstrip('%')}"
    doc = deployment(env, name=name, replicas=2)
    doc["spec"]["rollout"]["maxUnavailable"] = max_unavailable
    c.kubectl_apply([doc])
    wait_for(lambda: fleet_ready(env, name), timeout=240, what="fleet ready")
    assert kget(c, "pdb", name, "-n", env["ns"])["spec"]["minAvailable"] == max(0, 2 - count)
    patch_storage(env, storage(env, "file"), name=name)
    wait_for(lambda: swap_done(env, "file", name=name), timeout=240, interval=1, what="swap to file")
    c.kubectl("delete", "hcd", name, "-n", env["ns"])
