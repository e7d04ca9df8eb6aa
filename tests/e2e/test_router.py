"""SGLang's router in front of a fleet, end to end.

Real control plane, real runtime processes at their pod IPs, and the real router (sglang-router
0.3.2's binary, from its wheel) as a process-backed pod whose discovery lists and watches the
fleet's pods through the real API server with its own ServiceAccount's token. Clients reach
the fleet only through the client Service, which points at the router; every request must
succeed through a live backend swap and a rolling update of the pod template, and the router's
workers must agree with the pods the operator has in serving.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from kubernetes import client

from hicache_operator.api.flags import ROUTER_API_PORT
from hicache_operator.rollout.act.router_client import ADD_SECONDS
from testbed.gateway import Gateway
from testbed.kube import condition, kget, wait_for
from testbed.operator_proc import start_operator

pytestmark = pytest.mark.e2e
NS = "router-e2e"
NAME = "rt"
REPLICAS = 4
SERVING = "hicache.dev/serving"
HELD = ("Swapping", "RollingBack", "Restarting")  # stages entered only once no router lists the pod
JOIN_SECONDS = ADD_SECONDS + 5  # a pod that turned Ready is checked by the router before it is listed


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    if not cluster.network.endpoints_work:
        pytest.skip("process-backed pods need a private network namespace (run as root)")
    workdir = tmp_path_factory.mktemp("router")
    op = start_operator(cluster, workdir, reconcile_interval=5)
    cluster.kubectl("create", "namespace", NS)
    yield {"cluster": cluster, "op": op, "dir": workdir}
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    op.stop()


def deployment(env, image: str = "hicache-runtime:test", storage: dict | None = None) -> dict:
    # no spec.router: four replicas turn it on
    return {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
            "metadata": {"name": NAME, "namespace": NS, "annotations": {"hicache.dev/process-backed": "true"}},
            "spec": {"image": image, "replicas": REPLICAS, "pageSize": 4, "maxTotalTokens": 4096,
                     "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 60},
                     "hicache": {"memLayout": "page_first", "storage": storage or {"backend": "none"}}}}


def hcd(env) -> dict:
    return kget(env["cluster"], "hcd", NAME, "-n", NS)


def fleet_pods(env) -> list[dict]:
    return kget(env["cluster"], "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={NAME}")["items"]


def router_pods(env) -> list[dict]:
    return kget(env["cluster"], "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={NAME}-router")["items"]


def url(ip: str) -> str:
    return f"http://{ip}:30000"


def workers(ip: str) -> set[str]:
    """A router pod's workers, from its own API (the router's port, behind the client gate)."""
    return {w["url"] for w in httpx.get(f"http://{ip}:{ROUTER_API_PORT}/workers", timeout=5).json()["workers"]}


def router_workers(env) -> list[set[str]]:
    return [workers(p["status"]["podIP"]) for p in router_pods(env) if p["status"].get("podIP")]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def serving_urls(env) -> set[str]:
    return {url(p["status"]["podIP"]) for p in fleet_pods(env) if ready(p)
            and p["metadata"]["labels"].get(SERVING) == "true" and not p["metadata"].get("deletionTimestamp")}


def unsettled(env, image: str | None = None) -> str:
    """Why the fleet is not settled ("" when it is): every pod serving (on ``image``), no swap
    record, the router Ready, and every router pod's workers exactly the pods in serving."""
    obj = hcd(env)
    st = obj.get("status") or {}
    ps = fleet_pods(env)
    if len(ps) != REPLICAS or st.get("readyReplicas") != REPLICAS:
        return f"pods {sorted(p['metadata']['name'] for p in ps)}, readyReplicas {st.get('readyReplicas')}"
    if (st.get("backendSwap") or {}).get("pods"):
        return f"swap records {st['backendSwap']['pods']}"
    if st.get("routerReady") != "1/1" or condition(obj, "RouterReady") != "True":
        return f"routerReady {st.get('routerReady')}"
    stale = [p["metadata"]["name"] for p in ps if image and p["spec"]["containers"][0]["image"] != image]
    if stale:
        return f"pods not on {image}: {stale}"
    lists, serving = router_workers(env), serving_urls(env)
    if not lists or any(listed != serving for listed in lists):
        return f"router workers {[sorted(x) for x in lists]} but serving {sorted(serving)}"
    return ""


def wait_settled(env, what: str, timeout: float, image: str | None = None) -> None:
    why: list[str] = []

    def settled() -> bool:
        now = unsettled(env, image)
        if not why or now != why[0]:
            print(f"{time.strftime('%H:%M:%S')} {what}: {now or 'settled'}", flush=True)
        why[:] = [now]
        return not now
    try:
        wait_for(settled, timeout=timeout, interval=1, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {why[0] if why else ''}") from None


class Agreement(threading.Thread):
    """Compares, again and again, the operator's view of the fleet (pods: uid, serving label,
    Ready, terminating; its swap records) read before and after every router pod's worker list:

    - a router never lists an address that belongs to no pod of the fleet;
    - a pod whose swap record was Swapping, RollingBack or Restarting in both views, its label
      false in both (the operator enters those stages only once no router lists the pod, and
      adds it back only once its label is true again), is in no router's list;
    - where both views are the same settled fleet (every pod in serving, no record) and have
      been for ``JOIN_SECONDS``, every router lists exactly the pods in serving. The grace is
      for a pod that has just turned Ready (a restarted one): it joins a router once the
      router has checked it (``router_client.ADD_SECONDS``), and until then is routed nothing,
      which fails no request; ``join_lag`` is the longest such wait seen."""

    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(daemon=True)
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.stop_event = threading.Event()
        self.violations: list[str] = []
        self.samples = self.settled_samples = 0
        self.settled_view: tuple[dict, float] | None = None  # the settled pods, since when
        self.join_lag = 0.0

    def view(self) -> tuple[dict, dict]:
        pods = {}
        for p in self.core.list_namespaced_pod(NS, label_selector=f"app.kubernetes.io/instance={NAME}").items:
            if p.status.pod_ip:
                cond = {c.type: c.status for c in p.status.conditions or []}
                pods[p.status.pod_ip] = (p.metadata.uid, p.metadata.name, (p.metadata.labels or {}).get(SERVING),
                                         cond.get("Ready") == "True", p.metadata.deletion_timestamp is not None)
        obj = self.custom.get_namespaced_custom_object("hicache.dev", "v1alpha1", NS, "hicachedeployments", NAME)
        records = {n: (r.get("uid"), r.get("stage")) for n, r in
                   (((obj.get("status") or {}).get("backendSwap") or {}).get("pods") or {}).items()}
        return pods, records

    def run(self) -> None:
        routers = client.CoreV1Api(self.core.api_client)
        while not self.stop_event.wait(0.1):
            try:
                before = self.view()
                ips = [p.status.pod_ip for p in routers.list_namespaced_pod(
                    NS, label_selector=f"app.kubernetes.io/instance={NAME}-router").items if p.status.pod_ip]
                lists = [workers(ip) for ip in ips]
                after = self.view()
            except Exception:  # a router pod starting, an API call timing out: no sample
                continue
            self.samples += 1
            self.check(before, lists, after)

    def check(self, before: tuple[dict, dict], lists: list[set[str]], after: tuple[dict, dict]) -> None:
        (pods1, rec1), (pods2, rec2) = before, after
        known = {url(ip) for ip in pods1} | {url(ip) for ip in pods2}
        for listed in lists:
            if listed - known:
                self.violations.append(f"router lists {sorted(listed - known)}, no pod of the fleet")
        for ip, (uid, name, label, _, _) in pods1.items():
            other = pods2.get(ip)
            if other is None or other[0] != uid or label != "false" or other[2] != "false":
                continue
            if rec1.get(name, (None, None))[1] in HELD and rec2.get(name) == rec1.get(name) and rec1[name][0] == uid \
                    and any(url(ip) in listed for listed in lists):
                self.violations.append(f"{name} listed by a router while {rec1[name][1]}")
        settled = pods1 == pods2 and not rec1 and not rec2 and len(pods1) == REPLICAS and \
            all(label == "true" and is_ready and not gone for _, _, label, is_ready, gone in pods1.values())
        if not settled:
            self.settled_view = None
            return
        now = time.monotonic()
        if self.settled_view is None or self.settled_view[0] != pods1:
            self.settled_view = (pods1, now)
        serving, waited = {url(ip) for ip in pods1}, now - self.settled_view[1]
        agree = all(listed == serving for listed in lists)
        if not agree:
            self.join_lag = max(self.join_lag, waited)
        if waited >= JOIN_SECONDS:
            self.settled_samples += 1
            for listed in [] if agree else lists:
                if listed != serving:
                    self.violations.append(f"settled fleet {sorted(serving)} for {now - self.settled_view[1]:.0f}s "
                                           f"but a router lists {sorted(listed)}")


def test_the_router_fronts_the_fleet_from_four_replicas(env):
    c = env["cluster"]
    c.kubectl_apply([deployment(env)])
    wait_settled(env, "4 runtime pods and the router ready, agreeing", 240)
    table = c.kubectl("get", "hcd", NAME, "-n", NS).stdout
    header, row = table.splitlines()[:2]
    assert header.split()[:3] == ["NAME", "READY", "ROUTER"] and row.split()[:3] == [NAME, "4/4", "1/1"], table

    (router,) = router_pods(env)
    spec = router["spec"]
    assert spec["serviceAccountName"] == f"{NAME}-router"
    # the client gate, with the router as its child
    container = spec["containers"][0]
    assert container["command"] == ["python", "-m", "hicache_operator.router_gate"]
    assert container["args"][container["args"].index("--") + 1:][:3] == ["python", "-m", "sglang_router.launch_router"]
    # clients keep the Service name and port: the client Service now selects the router pod
    service = kget(c, "service", NAME, "-n", NS)
    assert service["spec"]["ports"][0]["port"] == 30000
    assert service["spec"]["selector"]["app.kubernetes.io/name"] == "hicache-router"
    slices = kget(c, "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={NAME}")["items"]
    assert {a for s in slices for e in s["endpoints"] for a in e["addresses"]} == {router["status"]["podIP"]}
    serving = kget(c, "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={NAME}-serving")["items"]
    assert {url(a) for s in serving for e in s["endpoints"] if e["conditions"]["ready"] for a in e["addresses"]} == \
        serving_urls(env)

    # least privilege: the router's account lists and watches pods in its namespace, nothing else
    sa = f"system:serviceaccount:{NS}:{NAME}-router"
    for verb, resource, namespace, allowed in [("list", "pods", NS, "yes"), ("watch", "pods", NS, "yes"),
                                               ("get", "secrets", NS, "no"), ("patch", "pods", NS, "no"),
                                               ("list", "pods", "default", "no")]:
        out = c.kubectl("auth", "can-i", verb, resource, "-n", namespace, f"--as={sa}", check=False).stdout.strip()
        assert out == allowed, (verb, resource, namespace, out)

    # the bundled runtime serves what the router asks of a worker and what it proxies
    ip = router["status"]["podIP"]
    with httpx.Client(base_url=url(ip), timeout=60) as http:
        models = http.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"], models.text
        model = models.json()["data"][0]["id"]
        r = http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"], r.text
        # a conversation's turns reach the pod that holds its prefix: later turns hit the cache
        prompt = "a conversation about caches: " + "the router keeps it on one pod " * 12
        hits = []
        for turn in range(4):
            prompt += f" turn {turn}: and then?"
            r = http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 4,
                                                                                "temperature": 0}})
            assert r.status_code == 200, r.text
            hits.append(r.json()["meta_info"]["cached_tokens"])
        assert hits[0] < hits[1] and all(h > 0 for h in hits[1:]), hits


def test_discovery_keeps_a_pod_whose_serving_label_turns_false(env):
    """Without the operator, the router's discovery alone: a pod taken out of serving (label
    false, its endpoint gone from the serving Service) stays a worker. The proof is ordered: the
    router watches pods in one stream, and a pod created after the label changed was added."""
    c, op = env["cluster"], env["op"]
    c.kubectl_apply([deployment(env)])
    wait_settled(env, "fleet settled", 240)
    by_name = {p["metadata"]["name"]: p for p in fleet_pods(env)}
    out_url = url(by_name[f"{NAME}-1"]["status"]["podIP"])
    op.stop()
    try:
        c.kubectl("label", "pod", f"{NAME}-1", "-n", NS, f"{SERVING}=false", "--overwrite")
        wait_for(lambda: out_url not in serving_urls(env), what="the pod out of serving")
        c.kubectl("scale", "statefulset", NAME, "-n", NS, f"--replicas={REPLICAS + 1}")
        new = wait_for(lambda: next((p for p in fleet_pods(env) if p["metadata"]["name"] == f"{NAME}-{REPLICAS}"
                                     and ready(p)), None), timeout=180, what="a fifth pod Ready")
        wait_for(lambda: all(url(new["status"]["podIP"]) in listed for listed in router_workers(env)), timeout=60,
                 what="discovery adding the fifth pod")
        assert all(out_url in listed for listed in router_workers(env)), "discovery dropped the pod taken out"
    finally:
        c.kubectl("label", "pod", f"{NAME}-1", "-n", NS, f"{SERVING}=true", "--overwrite")
        op.start()
    # the operator back: the StatefulSet returns to spec.replicas, and the routers follow
    wait_settled(env, "fleet settled again", 240)


@pytest.mark.timeout(1500)  # a swap and a rolling restart of four pods, one at a time, on two cores
def test_swap_and_rolling_update_through_the_router_fail_no_request(env):
    c = env["cluster"]
    c.kubectl_apply([deployment(env)])
    wait_settled(env, "fleet settled", 240)
    gw = Gateway(c.api_client(), NS, NAME, concurrency=3).start()
    agreement = Agreement(c.api_client())
    agreement.start()
    try:
        wait_for(lambda: len(gw.report.outcomes) > 10, timeout=60, what="load flowing through the router")
        storage = {"backend": "file", "extraConfig": {"file_storage_path": str(env["dir"] / "l3")}}
        c.kubectl_apply([deployment(env, storage=storage)])
        wait_for(lambda: (hcd(env).get("status") or {}).get("backendSwap", {}).get("phase") == "Complete"
                 and hcd(env)["status"].get("currentBackend") == "file", timeout=300, interval=1,
                 what="the swap to file complete")
        wait_settled(env, "the fleet settled on file", 120)
        assert not gw.report.failures, gw.report.failures[:3]
        c.kubectl_apply([deployment(env, image="hicache-runtime:test2", storage=storage)])
        wait_settled(env, "every pod restarted on the new template", 600, image="hicache-runtime:test2")
        time.sleep(2 * JOIN_SECONDS)  # the settled fleet under load, compared with the routers a while longer
    finally:
        agreement.stop_event.set()
        agreement.join(30)
        report = gw.stop()
    print("through the router:", report.summary(), f"agreement samples {agreement.samples} "
          f"(settled {agreement.settled_samples}), longest wait for a Ready pod to join the routers "
          f"{agreement.join_lag:.1f}s")
    assert not report.failures, report.failures[:3]
    assert len(report.outcomes) > 50
    assert {o.endpoint for o in report.outcomes} == {p["status"]["podIP"] for p in router_pods(env)}
    assert agreement.samples > 20 and agreement.settled_samples > 0
    assert not agreement.violations, agreement.violations[:5]
    events = kget(c, "events", "-n", NS, "--field-selector", f"involvedObject.name={NAME}")["items"]
    reasons = {e["reason"] for e in events}
    assert {"PodDraining", "PodSwapped", "BackendSwapComplete", "PodRestarted"} <= reasons, reasons
    assert sum(1 for e in events if e["reason"] == "PodRestarted") >= 1
    hits = report.summary()["cached_tokens_by_tier"]
    assert hits.get("device", 0) > 0, hits  # turns of a conversation keep finding their prefix
