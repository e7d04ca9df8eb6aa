"""What `kubectl get hcd` and the conditions say, from `kubectl apply` on the local control plane
(real kube-apiserver, scheduler, controllers, KWOK GPU nodes, runtime processes, a real Mooncake
master): READY counts against spec.replicas, BACKEND and SWAP count only pods that run, a new
fleet is no swap, a failed swap and an invalid spec are Degraded and not Progressing, and a
reconcile that raises (a real API refusal) is a condition and an Event, retried with backoff."""
from __future__ import annotations

import copy
import hashlib
import re

import pytest

from testbed.kube import kget, wait_for
from testbed.mooncake import free_port, start_master
from testbed.operator_proc import start_operator
from tests.e2e.helpers import skip_without_pod_network_or_mooncake

pytestmark = pytest.mark.e2e
SWAP_EVENTS = {"BackendSwapStarted", "PodDraining", "PodSwapped", "BackendSwapComplete", "BackendSwapFailed",
               "PodAdopted", "PodRolledBack"}


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    skip_without_pod_network_or_mooncake(cluster)
    op = start_operator(cluster, tmp_path_factory.mktemp("status-truth"), reconcile_interval=5)
    master = start_master()
    yield {"cluster": cluster, "op": op, "master": master}
    op.stop()
    master.stop()


@pytest.fixture
def ns(env, request):
    slug = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())
    name = f"truth-{hashlib.sha1(slug.encode()).hexdigest()[:8]}"
    env["cluster"].kubectl("create", "namespace", name)
    yield name
    env["cluster"].kubectl("delete", "namespace", name, "--wait=false", check=False)


def fleet(name: str, ns: str, storage: dict, replicas: int = 2) -> dict:
    return {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
            "metadata": {"name": name, "namespace": ns, "annotations": {"hicache.dev/process-backed": "true"}},
            "spec": {"image": "hicache-runtime:test", "replicas": replicas, "pageSize": 4, "maxTotalTokens": 4096,
                     "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 60},
                     "hicache": {"memLayout": "page_first", "storage": storage}}}


def mooncake(master: str) -> dict:
    return {"backend": "mooncake", "mooncake": {"masterAddress": master, "protocol": "tcp",
                                                "metadataServer": "P2PHANDSHAKE", "globalSegmentSize": 268435456}}


def row(env, ns: str, name: str) -> dict[str, str | None]:
    """The line `kubectl get hcd` prints, by column (None where it prints nothing: an unset field)."""
    header, line = env["cluster"].kubectl("get", "hcd", name, "-n", ns).stdout.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)] + [None]
    return {header[a:b].strip(): line[a:b].strip() or None for a, b in zip(starts, starts[1:])}


def hcd(env, ns: str, name: str) -> dict:
    return kget(env["cluster"], "hcd", name, "-n", ns)


def conds(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def state(obj: dict, ctype: str) -> tuple[str | None, str | None]:
    c = conds(obj).get(ctype) or {}
    return c.get("status"), c.get("reason")


def events(env, ns: str, name: str) -> list[dict]:
    return kget(env["cluster"], "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]


def check_columns_agree(env, ns: str, name: str) -> tuple[dict, dict[str, str]]:
    """Read the object, then its row, until both are of the same status; check they agree."""
    def read():
        obj, shown = hcd(env, ns, name), row(env, ns, name)
        return (obj, shown) if hcd(env, ns, name)["metadata"]["resourceVersion"] == obj["metadata"][
            "resourceVersion"] else None
    obj, shown = wait_for(read, timeout=30, what="a stable read")
    c, st = conds(obj), obj.get("status") or {}
    ready, want = map(int, shown["READY"].split("/"))
    assert want == obj["spec"].get("replicas", 1), shown
    assert c["Ready"]["status"] == str(ready >= want) and c["Ready"]["message"] == f"{ready}/{want} pod(s) ready"
    assert (shown["BACKEND"], shown["TARGET"], shown["SWAP"]) == (st.get("currentBackend"), st.get("targetBackend"),
                                                              st.get("swapProgress")), (shown, st)
    if c["ConfigValid"]["status"] == "False" or c.get("BackendSwapFailed", {}).get("status") == "True":
        assert c["Progressing"]["status"] == "False" and c["Degraded"]["status"] == "True", c
    return obj, shown


def no_traceback(env) -> None:
    log = env["op"].log.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:][:6000]


def swap_events(env, ns: str, name: str) -> set[str]:
    return {e["reason"] for e in events(env, ns, name)} & SWAP_EVENTS


def test_a_new_fleet_is_no_swap_and_backend_and_swap_count_only_running_pods(env, ns):
    c = env["cluster"]
    gpu_nodes = [n["metadata"]["name"] for n in kget(c, "nodes")["items"] if n["metadata"]["name"].startswith("gpu")]
    for node in gpu_nodes:  # its pods stay Pending until the nodes take pods again
        c.kubectl("cordon", node)
    try:
        c.kubectl_apply([fleet("fresh", ns, mooncake(env["master"].address))])
        wait_for(lambda: (hcd(env, ns, "fresh").get("status") or {}).get("replicas") == 2, what="two Pending pods")
        obj, shown = check_columns_agree(env, ns, "fresh")
        assert (shown["READY"], shown["BACKEND"], shown["TARGET"], shown["SWAP"]) == ("0/2", None, "mooncake", "0/2"), shown
        assert state(obj, "Ready")[0] == "False" and state(obj, "Progressing") != ("True", "BackendSwap")
        assert state(obj, "Degraded")[0] == "True"  # no node takes them: something needs a look
    finally:
        for node in gpu_nodes:
            c.kubectl("uncordon", node)
    obj = wait_for(lambda: (o := hcd(env, ns, "fresh")) and state(o, "Ready")[0] == "True"
                   and state(o, "Progressing")[0] == "False" and o, timeout=180, what="fleet Ready")
    obj, shown = check_columns_agree(env, ns, "fresh")
    assert (shown["READY"], shown["BACKEND"], shown["SWAP"]) == ("2/2", "mooncake", "2/2"), shown
    assert state(obj, "Degraded") == ("False", "AsExpected") and state(obj, "BackendSwapFailed")[0] == "False"
    assert not swap_events(env, ns, "fresh")
    no_traceback(env)


def test_a_new_fleet_whose_store_is_down_at_start_is_degraded_and_not_swapped(env, ns):
    c = env["cluster"]
    c.kubectl_apply([fleet("nostore", ns, mooncake(f"127.0.0.1:{free_port()}"))])
    obj = wait_for(lambda: (o := hcd(env, ns, "nostore")) and state(o, "Degraded") == ("True", "StorageUnavailable")
                   and state(o, "Ready")[0] == "True" and o, timeout=180, what="Degraded StorageUnavailable")
    obj, shown = check_columns_agree(env, ns, "nostore")
    assert (shown["READY"], shown["BACKEND"], shown["TARGET"], shown["SWAP"]) == ("2/2", "none", "mooncake",
                                                                                 "0/2"), shown
    message = conds(obj)["Degraded"]["message"]
    assert "nostore-0, nostore-1 could not attach mooncake" in message and "not reachable" in message, message
    assert state(obj, "Progressing")[0] == "False" and state(obj, "BackendSwapFailed")[0] == "False"
    assert not swap_events(env, ns, "nostore")  # no pod was taken out of serving
    warnings = {e["reason"] for e in events(env, ns, "nostore") if e["type"] == "Warning"}
    assert "StorageUnavailable" in warnings, warnings
    no_traceback(env)


def test_a_failed_swap_is_degraded_and_not_progressing(env, ns):
    c = env["cluster"]
    doc = fleet("stuck", ns, {"backend": "none"})
    c.kubectl_apply([doc])
    wait_for(lambda: state(hcd(env, ns, "stuck"), "Ready")[0] == "True", timeout=180, what="fleet Ready")
    doc = copy.deepcopy(doc)
    doc["spec"]["hicache"]["storage"] = mooncake(f"127.0.0.1:{free_port()}")
    c.kubectl_apply([doc])
    obj = wait_for(lambda: (o := hcd(env, ns, "stuck")) and state(o, "BackendSwapFailed")[0] == "True"
                   and state(o, "Ready")[0] == "True" and not (o["status"].get("backendSwap") or {}).get("pods")
                   and o, timeout=180, what="the failed swap rolled back")
    obj, shown = check_columns_agree(env, ns, "stuck")
    assert (shown["READY"], shown["BACKEND"], shown["TARGET"], shown["SWAP"]) == ("2/2", "none", "mooncake",
                                                                                 "0/2"), shown
    assert state(obj, "Progressing") == ("False", "BackendSwapFailed")
    assert state(obj, "Degraded") == ("True", "BackendSwapFailed")
    assert "BackendSwapFailed" in {e["reason"] for e in events(env, ns, "stuck") if e["type"] == "Warning"}
    no_traceback(env)


def test_an_invalid_spec_is_not_ready_against_spec_replicas(env, ns):
    storage = {**mooncake("10.1.2.3:50051"), "extraConfig": {"master_server_address": "10.9.9.9:50051"}}
    doc = fleet("invalid", ns, storage)
    del doc["spec"]["replicas"]  # the CRD's default, 1
    env["cluster"].kubectl_apply([doc])
    obj = wait_for(lambda: (o := hcd(env, ns, "invalid")) and state(o, "ConfigValid")[0] == "False" and o,
                   what="ConfigValid=False")
    obj, shown = check_columns_agree(env, ns, "invalid")
    assert (shown["READY"], shown["BACKEND"], shown["TARGET"], shown["SWAP"]) == ("0/1", None, None, None), shown
    assert state(obj, "ConfigValid")[1] == "mooncake-config-conflict"
    assert state(obj, "Ready") == ("False", "ReplicasNotReady")
    assert state(obj, "Degraded") == ("True", "ConfigInvalid")
    assert state(obj, "Progressing") == ("False", "ConfigInvalid")
    no_traceback(env)


def test_a_reconcile_that_raises_is_a_condition_and_an_event_and_backs_off(env, ns):
    """Injected: a ResourceQuota allowing no Services, so the operator's apply of the fleet's
    Service is refused by the API server (403) on every reconcile, a real failure of a real call."""
    c = env["cluster"]
    c.kubectl_apply([{"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-services", "namespace": ns},
                      "spec": {"hard": {"services": "0"}}}])
    c.kubectl_apply([fleet("blocked", ns, {"backend": "none"}, replicas=1)])
    obj = wait_for(lambda: (o := hcd(env, ns, "blocked")) and state(o, "Degraded") == ("True", "ReconcileFailed")
                   and o, timeout=60, what="Degraded ReconcileFailed")
    message = conds(obj)["Degraded"]["message"]
    assert message.startswith("Kubernetes API error 403 Forbidden:") and "exceeded quota: no-services" in message
    assert state(obj, "Progressing") == ("False", "ReconcileFailed")
    key = f"reconcile of {ns}/blocked failed"
    delays = wait_for(lambda: (d := [int(x) for x in re.findall(re.escape(key) + r".*retrying in (\d+)s",
                                                               env["op"].log.read_text())]) and len(d) >= 4 and d,
                      timeout=60, what="four failed reconciles")
    assert delays[:4] == [1, 2, 4, 8], delays  # backoff: pod events and resyncs meanwhile wait for the retry
    failures = [e for e in events(env, ns, "blocked") if e["reason"] == "ReconcileFailed"]
    assert len(failures) == 1 and failures[0]["type"] == "Warning" and failures[0]["message"] == message, failures
    assert failures[0].get("count", 1) == 1  # one Event for the error, not one per retry

    c.kubectl("delete", "resourcequota", "no-services", "-n", ns)
    obj = wait_for(lambda: (o := hcd(env, ns, "blocked")) and state(o, "Degraded")[1] != "ReconcileFailed"
                   and state(o, "Ready")[0] == "True" and o, timeout=120, what="recovered and Ready")
    assert c.kubectl("get", "service", "blocked", "-n", ns, check=False).returncode == 0
    check_columns_agree(env, ns, "blocked")
    no_traceback(env)  # an API error is one line in the log, not a traceback
