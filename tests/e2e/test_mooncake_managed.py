"""A Mooncake master the operator runs (spec.hicache.storage.mooncake.managed), end to end.

The real control plane; the master is a process-backed pod running the real ``mooncake_master``
of the installed wheel, and the fleet's bundled-runtime pods use it as L3 through its Service
(``<name>-mooncake.<ns>.svc``), or with ``ha`` two masters elected through a real etcd."""
from __future__ import annotations

import json
import urllib.request

import pytest

from testbed.etcd import Etcd, etcd_binary
from testbed.kube import condition, kget, wait_for
from testbed.operator_proc import start_operator
from tests.e2e.helpers import l3_hit_across_pods, skip_without_pod_network_or_mooncake

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    skip_without_pod_network_or_mooncake(cluster)
    op = start_operator(cluster, tmp_path_factory.mktemp("mooncake-managed"), reconcile_interval=5)
    ns = "mc-managed"
    cluster.kubectl("create", "namespace", ns)
    yield {"cluster": cluster, "ns": ns}
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    op.stop()


def fleet(env, name: str, managed: dict) -> dict:
    return {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
            "metadata": {"name": name, "namespace": env["ns"], "annotations": {"hicache.dev/process-backed": "true"}},
            "spec": {"image": "hicache-runtime:test", "replicas": 2, "pageSize": 4, "maxTotalTokens": 4096,
                     "hicache": {"memLayout": "page_first", "storage": {
                         "backend": "mooncake", "prefetchPolicy": "wait_complete",
                         "mooncake": {"globalSegmentSize": 268435456, "managed": managed}}}}}


def hcd(env, name: str) -> dict:
    return kget(env["cluster"], "hcd", name, "-n", env["ns"])


def master_pods(env, name: str) -> list[dict]:
    return kget(env["cluster"], "pods", "-n", env["ns"], "-l",
                f"app.kubernetes.io/name=mooncake-master,app.kubernetes.io/instance={name}")["items"]


def fleet_ready(env, name: str) -> bool:
    o = hcd(env, name)
    return condition(o, "Ready") == "True" and (o["status"].get("mooncakeMaster") or {}).get("ready") is True


def master_http(pod: dict, path: str) -> bytes:
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9003{path}", timeout=5) as resp:
        return resp.read()


def ha_state(pod: dict) -> dict:
    """The master's /health ({role, ha_state, ...}); {} while it does not answer."""
    try:
        return json.loads(master_http(pod, "/health")) if pod["status"].get("podIP") else {}
    except OSError:
        return {}


def ready_since(pod: dict) -> str:
    return next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c["type"] == "Ready")


def test_managed_master_is_a_pod_the_fleet_uses_as_l3(env):
    c, name = env["cluster"], "mc"
    c.kubectl_apply([fleet(env, name, {"kvLeaseTTLMs": 1000})])
    wait_for(lambda: fleet_ready(env, name), timeout=240, what="master and fleet ready")
    master = hcd(env, name)["status"]["mooncakeMaster"]
    assert master == {"deployment": "mc-mooncake", "address": f"mc-mooncake.{env['ns']}.svc:50051",
                      "replicas": 1, "readyReplicas": 1, "ready": True}

    (pod,) = master_pods(env, name)
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["mooncake_master"] and "--default_kv_lease_ttl=1000" in container["args"]
    # the StatefulSet was created only once the master was ready
    sts = kget(c, "statefulset", name, "-n", env["ns"])
    assert sts["metadata"]["creationTimestamp"] >= ready_since(pod)
    # both runtime pods lent their segment to this master: the real one, answering at its pod IP
    runtimes = kget(c, "pods", "-n", env["ns"], "-l", f"app.kubernetes.io/name=hicache,app.kubernetes.io/instance={name}")
    ips = sorted(p["status"]["podIP"] for p in runtimes["items"])
    segments = master_http(pod, "/get_all_segments").decode().split()
    assert sorted(s.rsplit(":", 1)[0] for s in segments) == ips, segments
    assert b"master_total_capacity_bytes" in master_http(pod, "/metrics")
    env_of = {e["name"]: e.get("value") for e in runtimes["items"][0]["spec"]["containers"][0]["env"]}
    assert env_of["MOONCAKE_MASTER"] == master["address"]
    assert l3_hit_across_pods(c, env["ns"], name) > 0


def test_the_master_goes_when_the_spec_stops_asking_for_it(env):
    c, name = env["cluster"], "mc"
    c.kubectl_apply([fleet(env, name, {})])  # the fleet of the previous test (or a new one)
    wait_for(lambda: fleet_ready(env, name), timeout=240, what="fleet ready")
    c.kubectl("patch", "hcd", name, "-n", env["ns"], "--type=json", "-p", json.dumps([
        {"op": "replace", "path": "/spec/hicache/storage", "value": {"backend": "none"}}]))
    wait_for(lambda: f"{name}-mooncake" not in {d["metadata"]["name"] for d in kget(c, "deployments", "-n", env["ns"])["items"]},
             timeout=120, what="master Deployment deleted")  # the router's stays
    wait_for(lambda: "mooncakeMaster" not in hcd(env, name)["status"], timeout=60, what="status without a master")
    assert f"{name}-mooncake" not in {s["metadata"]["name"] for s in kget(c, "services", "-n", env["ns"])["items"]}
    wait_for(lambda: hcd(env, name)["status"].get("currentBackend") == "none" and fleet_ready_without_master(env, name),
             timeout=240, what="fleet swapped to no L3")
    c.kubectl("delete", "hcd", name, "-n", env["ns"])


def fleet_ready_without_master(env, name: str) -> bool:
    return condition(hcd(env, name), "Ready") == "True"


def test_ha_masters_elected_through_etcd_survive_the_leader(env):
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary")
    etcd = Etcd().start(binary)  # loopback: inside the test's network namespace like the pods
    c, name = env["cluster"], "mcha"
    try:
        c.kubectl_apply([fleet(env, name, {"ha": {"etcdEndpoints": [etcd.endpoint], "replicas": 2}})])
        wait_for(lambda: fleet_ready(env, name), timeout=240, what="HA masters and fleet ready")
        assert hcd(env, name)["status"]["mooncakeMaster"]["address"] == f"etcd://{etcd.endpoint}"
        roles = {p["metadata"]["name"]: ha_state(p).get("role") for p in master_pods(env, name)}
        assert sorted(roles.values()) == ["leader", "standby"], roles
        assert l3_hit_across_pods(c, env["ns"], name) > 0

        leader = next(n for n, role in roles.items() if role == "leader")
        c.kubectl("delete", "pod", leader, "-n", env["ns"], "--wait=false")
        wait_for(lambda: any(ha_state(p).get("ha_state") == "serving" for p in master_pods(env, name)
                             if p["metadata"]["name"] != leader), timeout=120, what="a standby serving")
        assert l3_hit_across_pods(c, env["ns"], name) > 0  # the fleet's clients found the new leader
        c.kubectl("delete", "hcd", name, "-n", env["ns"])
    finally:
        etcd.stop()
