"""A managed Mooncake master and RDMA: what the operator renders, refuses, warns about, derives
into the status, and when it applies the fleet's StatefulSet or deletes the master."""

from __future__ import annotations

import pytest
from op_helpers import RecordingKube, body, context, gpu_node, seen

from hicache_operator.api import labels
from hicache_operator.plan import render
from hicache_operator.control.pipeline import plan, reconcile
from hicache_operator.api.status import MooncakeMasterStatus
from hicache_operator.plan.status import build_status
from hicache_operator.plan.validation import validate

NODES = [gpu_node("n")]


def spec(mooncake: dict | None = None, backend: str = "mooncake", **more) -> dict:
    storage = {"backend": backend, **({"mooncake": mooncake} if mooncake is not None else {})}
    return {"image": "img", "maxTotalTokens": 4096, "hicache": {"memLayout": "page_first", "storage": storage}, **more}


def kids(s: dict, **kw) -> dict[tuple[str, str], dict]:
    p = plan(body(s), NODES, **kw)
    assert p.outcome.ok, p.outcome.findings
    return {(c["kind"], c["metadata"]["name"]): c for c in p.children}


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def env(sts: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container(sts)["env"]}


def test_managed_master_is_a_deployment_and_service_the_pods_point_at():
    out = kids(spec({"managed": {}}), process_backed=True)
    dep, svc, sts = out[("Deployment", "demo-mooncake")], out[("Service", "demo-mooncake")], out[("StatefulSet", "demo")]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    c = container(dep)
    assert c["image"] == "img" and c["command"] == ["mooncake_master"]
    assert c["args"] == ["--rpc_address=$(POD_IP)", "--rpc_port=50051", "--metrics_host=$(POD_IP)",
                         "--metrics_port=9003", "--default_kv_lease_ttl=10000", "--client_ttl=10",
                         "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.05",
                         "--enable_http_metadata_server=false", "--logtostderr=true"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert c["securityContext"]["runAsNonRoot"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert dep["spec"]["template"]["metadata"]["annotations"] == {labels.PROCESS_BACKED: "true"}
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    # never one of the fleet's pods: not selected by the StatefulSet, the Services or the PDB, not indexed
    assert not labels.selector_labels("demo").items() <= pod_labels.items()
    assert labels.DEPLOYMENT not in pod_labels and dep["metadata"]["labels"][labels.DEPLOYMENT] == "demo"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("rpc", 50051), ("metrics", 9003)]
    assert env(sts)["MOONCAKE_MASTER"] == "demo-mooncake.ns.svc:50051"
    assert "MC_STORE_CLUSTER_ID" not in env(sts)
    assert list(out)[-1] == ("StatefulSet", "demo")


def test_the_master_address_is_storage_config_so_moving_to_managed_is_a_live_swap():
    ext = plan(body(spec({"masterAddress": "m:50051"})), NODES)
    managed = plan(body(spec({"managed": {}})), NODES)
    assert managed.outcome.spec.hicache.storage.extra_config["master_server_address"] == "demo-mooncake.ns.svc:50051"
    assert ext.desired.restart_hash == managed.desired.restart_hash
    assert ext.desired.storage_hash != managed.desired.storage_hash


def test_master_settings_image_and_http_metadata_server():
    out = kids(spec({"managed": {"image": "reg/mooncake:1", "rpcPort": 6000, "metricsPort": 6001,
                                 "kvLeaseTTLMs": 500, "clientTTLSeconds": 3, "evictionHighWatermarkRatio": 0.8,
                                 "evictionRatio": 0.1, "httpMetadataServer": {"port": 6002},
                                 "nodeSelector": {"pool": "cpu"}}}))
    dep = out[("Deployment", "demo-mooncake")]
    c = container(dep)
    assert c["image"] == "reg/mooncake:1" and dep["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    for arg in ("--rpc_port=6000", "--metrics_port=6001", "--default_kv_lease_ttl=500", "--client_ttl=3",
                "--eviction_high_watermark_ratio=0.8", "--eviction_ratio=0.1", "--enable_http_metadata_server=true",
                "--http_metadata_server_port=6002"):
        assert arg in c["args"], arg
    assert {p["name"]: p["port"] for p in out[("Service", "demo-mooncake")]["spec"]["ports"]} == \
        {"rpc": 6000, "metrics": 6001, "http-metadata": 6002}
    e = env(out[("StatefulSet", "demo")])
    assert e["MOONCAKE_MASTER"] == "demo-mooncake.ns.svc:6000"
    assert e["MOONCAKE_TE_META_DATA_SERVER"] == "http://demo-mooncake.ns.svc:6002/metadata"


def test_ha_masters_are_elected_through_etcd_and_found_there():
    out = kids(spec({"managed": {"ha": {"etcdEndpoints": ["etcd-0.etcd:2379", "etcd-1.etcd:2379"], "replicas": 3}}}))
    dep = out[("Deployment", "demo-mooncake")]
    assert dep["spec"]["replicas"] == 3 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    args = container(dep)["args"]
    assert "--enable_ha=true" in args and "--etcd_endpoints=etcd-0.etcd:2379;etcd-1.etcd:2379" in args
    assert "--cluster_id=ns.demo" in args
    assert [p["name"] for p in out[("Service", "demo-mooncake")]["spec"]["ports"]] == ["metrics"]  # standbys: no RPC
    e = env(out[("StatefulSet", "demo")])
    assert e["MOONCAKE_MASTER"] == "etcd://etcd-0.etcd:2379;etcd-1.etcd:2379" and e["MC_STORE_CLUSTER_ID"] == "ns.demo"


def test_a_managed_master_runs_before_the_fleet_swaps_to_mooncake():
    """With another backend the master already runs and the pods already know it (a later swap is live)."""
    out = kids(spec({"managed": {}}, backend="file", extraVolumeMounts=[]))
    assert ("Deployment", "demo-mooncake") in out
    assert env(out[("StatefulSet", "demo")])["MOONCAKE_MASTER"] == "demo-mooncake.ns.svc:50051"
    assert ("Deployment", "demo-mooncake") not in kids(spec({"masterAddress": "m:1"}))


def test_rdma_devices_capability_and_privileged_opt_in():
    plain = kids(spec({"masterAddress": "m:1", "protocol": "rdma"}, rdma={"resource": "rdma/hca_shared_devices_a",
                                                                             "count": 2}))
    c = container(plain[("StatefulSet", "demo")])
    assert c["resources"]["requests"]["rdma/hca_shared_devices_a"] == c["resources"]["limits"][
        "rdma/hca_shared_devices_a"] == "2"
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "privileged": False,
                                    "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    priv = container(kids(spec({"masterAddress": "m:1", "protocol": "rdma"},
                               rdma={"resource": "rdma/x", "privileged": True}))[("StatefulSet", "demo")])
    assert priv["securityContext"]["privileged"] is True and priv["securityContext"]["runAsUser"] == 0
    without = plan(body(spec({"masterAddress": "m:1", "protocol": "rdma"})), NODES)
    assert plan(body(spec({"masterAddress": "m:1", "protocol": "rdma"}, rdma={"resource": "rdma/x"})),
                NODES).desired.restart_hash != without.desired.restart_hash  # devices are no live swap


@pytest.mark.parametrize("s,rule", [
    (spec({"masterAddress": "m:1", "protocol": "rdma"}), "rdma-without-device"),
    (spec(None, extraConfig={"master_server_address": "m:1", "protocol": "rdma"}), "rdma-without-device"),
    (spec({"masterAddress": "m:1"}, rdma={"resource": "rdma/x", "privileged": True}), "rdma-privileged"),
])
def test_rdma_warnings(s, rule):
    if "extraConfig" in s:
        s["hicache"]["storage"]["extraConfig"] = s.pop("extraConfig")
    out = validate(s, name="demo", nodes=NODES)
    assert out.ok and [f.rule for f in out.of("warning")] == [rule]


@pytest.mark.parametrize("mooncake,extra,rule", [
    ({"managed": {}}, {"master_server_address": "m:1"}, "mooncake-master-source"),
    ({"managed": {"httpMetadataServer": {"port": 9003}}}, {}, "mooncake-master-ports"),
    (None, {}, "mooncake-master-required"),
])
def test_master_errors_the_schema_cannot_see(mooncake, extra, rule):
    s = spec(mooncake)
    s["hicache"]["storage"]["extraConfig"] = extra
    assert [f.rule for f in validate(s, name="demo").errors] == [rule]


def test_rdma_resource_must_be_an_extended_resource():
    for bad in ("hca_shared_devices_a", "kubernetes.io/rdma", "x.kubernetes.io/rdma", "rdma/"):
        assert [f.rule for f in validate(spec(None, backend="none", rdma={"resource": bad})).errors] == \
            ["rdma-resource"], bad
    assert validate(spec(None, backend="none", rdma={"resource": "nvidia.com/hostdev"})).ok


def test_bundled_transfer_buffers_count_in_the_pod_memory():
    s = spec({"masterAddress": "m:1", "globalSegmentSize": "1gb", "localBufferSize": 64 << 20},
             parallelism={"tp": 2}, modelShape={"numLayers": 2, "numKvHeads": 2, "headDim": 64})
    rec = validate(s, name="demo", nodes=NODES).sizing
    assert (rec.mooncake_segment_bytes, rec.mooncake_local_buffer_bytes) == (2**30, 2 * 64 << 20)
    rec_none = validate(spec(None, backend="none", parallelism={"tp": 2},
                             modelShape={"numLayers": 2, "numKvHeads": 2, "headDim": 64}), nodes=NODES).sizing
    assert rec.pod_memory_bytes - rec_none.pod_memory_bytes == rec.storage_bytes


MASTER = MooncakeMasterStatus(deployment="demo-mooncake", address="demo-mooncake.ns.svc:50051", replicas=1,
                              ready_replicas=0, ready=False)


def conds(st) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def test_status_shows_the_master_waits_for_it_and_degrades_without_it():
    desired = plan(body(spec({"managed": {}})), NODES).desired
    waiting = build_status(generation=1, previous=None, desired=desired, errors=[], pods=[], degraded=[], now="t",
                           master=MASTER)
    assert waiting["mooncakeMaster"] == {"deployment": "demo-mooncake", "address": "demo-mooncake.ns.svc:50051",
                                         "replicas": 1, "readyReplicas": 0, "ready": False}
    assert conds(waiting)["Progressing"] == ("True", "WaitingForMooncakeMaster")
    assert conds(waiting)["Degraded"] == ("False", "AsExpected")
    pod = {"metadata": {"name": "demo-0", "annotations": {labels.RESTART_HASH: desired.restart_hash,
                                                          labels.STORAGE_HASH: desired.storage_hash}},
           "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                      "containerStatuses": [{"name": "runtime", "started": True, "ready": True}]}}
    lost = build_status(generation=1, previous=None, desired=desired, errors=[], pods=[pod], degraded=[], now="t",
                        master=MASTER)
    assert conds(lost)["Degraded"] == ("True", "MooncakeMasterUnavailable")
    ready = MASTER.model_copy(update={"ready_replicas": 1, "ready": True})
    fine = build_status(generation=1, previous=None, desired=desired, errors=[], pods=[pod], degraded=[], now="t",
                        master=ready)
    assert conds(fine)["Degraded"] == ("False", "AsExpected") and fine["mooncakeMaster"]["ready"] is True


class MasterKube(RecordingKube):
    def __init__(self, template_hash):
        super().__init__(template_hash, pods=[])
        self.release.set()

    def delete(self, kind, namespace, name):
        self._note(f"delete {kind} {name}")
        return True


@pytest.mark.parametrize("sts_exists,master,applied", [
    (False, None, False),  # the master is not even there yet
    (False, {"name": "demo-mooncake", "replicas": 1, "readyReplicas": 0}, False),
    (False, {"name": "demo-mooncake", "replicas": 1, "readyReplicas": 1}, True),
    (True, {"name": "demo-mooncake", "replicas": 1, "readyReplicas": 0}, True),  # a running fleet is never held
])
def test_a_new_fleets_statefulset_waits_for_its_master(sts_exists, master, applied):
    s = spec({"managed": {}})
    kube = MasterKube(plan(body(s), NODES).desired.restart_hash if sts_exists else None)
    result = reconcile(context(kube), seen(body(s), NODES, [], master=master))
    assert ("apply StatefulSet" in kube.calls) is applied
    assert "apply Deployment" in kube.calls
    assert result.status["mooncakeMaster"]["ready"] is bool(master and master["readyReplicas"])


def test_a_master_the_spec_no_longer_asks_for_is_deleted():
    kube = MasterKube(None)
    reconcile(context(kube), seen(body(spec({"masterAddress": "m:1"})), NODES, [],
                                  master={"name": "demo-mooncake", "replicas": 1, "readyReplicas": 1}))
    assert {"delete Deployment demo-mooncake", "delete Service demo-mooncake"} <= set(kube.calls)
    assert "apply StatefulSet" in kube.calls
    kube = MasterKube(None)
    reconcile(context(kube), seen(body(spec({"masterAddress": "m:1"})), NODES, [], apply=False,
                                  master={"name": "demo-mooncake", "replicas": 1, "readyReplicas": 1}))
    assert not [c for c in kube.calls if c.startswith("delete")]  # the cheap path writes nothing
