"""Placement and escape hatches on the local control plane.

Its own LocalCluster (each test pins its fleet to a node of its own by label): ``pack-0``, one
8-GPU node where two tp-4 pods pack and a third waits for GPUs; ``dram-0``, 8 GPUs but memory for
fewer pods of a fixed host pool, where the scheduler stops where status.sizing says; ``run-0``,
where a process-backed fleet runs the real runtime with env, envFrom, extraArgs and a pod template
overlay, and an overlay that collides is refused without touching the running pod.
"""
from __future__ import annotations

import copy
import hashlib
import os
import re
from pathlib import Path

import pytest
import yaml

from hicache_operator.fleet import gate
from localcluster.cluster import LocalCluster
from localcluster.nodes import NodeSpec
from testbed import REPO
from testbed.kube import condition, kget, wait_for
from testbed.operator_proc import OperatorProcess

pytestmark = pytest.mark.e2e
NODE_LABEL = "hicache.test/node"
GIB = 2**30


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory):
    if os.environ.get("HICACHE_E2E_KUBECONFIG"):
        pytest.skip("needs nodes of its own shape")
    nodes = [NodeSpec(name, gpus=8, memory=memory, labels={NODE_LABEL: name})
             for name, memory in (("pack-0", "1Ti"), ("dram-0", "512Gi"), ("run-0", "1Ti"))]
    c = LocalCluster(tmp_path_factory.mktemp("placement-cluster"), nodes=nodes).start()
    c.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    c.wait_established("hicachedeployments.hicache.dev")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def op(own_cluster, tmp_path_factory):
    o = OperatorProcess(own_cluster, tmp_path_factory.mktemp("placement-operator")).start()
    yield o
    o.stop()


@pytest.fixture
def ns(own_cluster, request):
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[5:40].strip("-")
    own_cluster.kubectl("create", "namespace", name)
    yield name
    own_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply(cluster, ns: str, name: str, spec: dict, annotations: dict | None = None, check: bool = True):
    doc = {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
           "metadata": {"name": name, "namespace": ns, "annotations": annotations or {}}, "spec": spec}
    return cluster.kubectl_apply([doc], check=check)


def hcd(cluster, ns: str, name: str) -> dict:
    return kget(cluster, "hcd", name, "-n", ns)


def pods(cluster, ns: str, name: str) -> list[dict]:
    return kget(cluster, "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"]


def node(cluster, name: str) -> dict:
    return kget(cluster, "node", name)


def quantity(q: str) -> int:
    from kubernetes.utils.quantity import parse_quantity

    return int(parse_quantity(q))


def unschedulable(pod: dict) -> str | None:
    for c in pod.get("status", {}).get("conditions") or []:
        if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable":
            return c.get("message", "")
    return None


def settled(cluster, ns: str, name: str, replicas: int) -> list[dict] | None:
    """Every pod of the fleet either bound to a node or refused by the scheduler."""
    ps = pods(cluster, ns, name)
    if len(ps) == replicas and all(p["spec"].get("nodeName") or unschedulable(p) is not None for p in ps):
        return ps
    return None


def sized(cluster, ns: str, name: str) -> dict:
    obj = wait_for(lambda: (lambda o: o if condition(o, "ConfigValid") == "True" and o["status"].get("sizing")
                            else None)(hcd(cluster, ns, name)), what=f"{name} sized")
    return obj["status"]["sizing"]


def test_two_tp4_pods_pack_on_one_8_gpu_node_each_with_its_share_of_memory(own_cluster, op, ns):
    spec = {"engine": "sglang", "image": "lmsysorg/sglang:v0.5.23-cu129", "model": "Qwen/Qwen3-8B", "replicas": 2,
            "parallelism": {"tp": 4}, "pageSize": 64, "nodeSelector": {NODE_LABEL: "pack-0"},
            "hicache": {"hostPool": {"fromNodeMemory": {"fraction": 0.75, "reserveGiB": 32}}}}
    apply(own_cluster, ns, "packed", spec)
    s = sized(own_cluster, ns, "packed")
    alloc = quantity(node(own_cluster, "pack-0")["status"]["allocatable"]["memory"])
    assert (s["placement"], s["sizingNode"], s["nodeAllocatableBytes"]) == ("pack", "pack-0", alloc)
    assert (s["podsPerNodeByGpus"], s["podsPerNode"], s["ranksPerPod"], s["ranksPerNode"]) == (2, 2, 4, 8)
    share = alloc * 0.75 - 32 * GIB
    fixed = s["overheadBytes"] + s["shmBytes"] + s["engineReserveBytes"] + s["admissionSlackBytes"]
    assert s["budgetPerRankBytes"] == int((share / 2 - fixed) / s["poolMultiplier"])

    ps = wait_for(lambda: (lambda p: p if all(x["spec"].get("nodeName") for x in p) else None)(
        settled(own_cluster, ns, "packed", 2)), what="both pods bound")
    assert {p["spec"]["nodeName"] for p in ps} == {"pack-0"}
    requests = []
    for p in ps:
        res = p["spec"]["containers"][0]["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"] == s["podMemory"]
        assert res["requests"]["nvidia.com/gpu"] == "4"
        args = p["spec"]["containers"][0]["args"]
        assert args[args.index("--hicache-size") + 1] == str(s["hicacheSizeGB"])
        requests.append(quantity(res["requests"]["memory"]))
    assert sum(requests) <= share <= alloc  # the two pods' pools and every other term fit the node's share

    # A third pod finds no GPUs left: the scheduler holds the node to the pods sizing assumed.
    own_cluster.kubectl("scale", "hcd/packed", "-n", ns, "--replicas=3")
    ps = wait_for(lambda: settled(own_cluster, ns, "packed", 3), what="third pod settled")
    waiting = [p for p in ps if not p["spec"].get("nodeName")]
    assert len(waiting) == 1 and "nvidia.com/gpu" in unschedulable(waiting[0]), [unschedulable(p) for p in ps]


def test_where_memory_holds_fewer_pods_than_gpus_the_scheduler_stops_where_sizing_says(own_cluster, op, ns):
    spec = {"engine": "sglang", "image": "lmsysorg/sglang:v0.5.23-cu129", "model": "Qwen/Qwen3-8B", "replicas": 6,
            "parallelism": {"tp": 1}, "nodeSelector": {NODE_LABEL: "dram-0"},
            "hicache": {"hostPool": {"sizeGBPerRank": 100}}}
    apply(own_cluster, ns, "dram-bound", spec)
    s = sized(own_cluster, ns, "dram-bound")
    alloc = quantity(node(own_cluster, "dram-0")["status"]["allocatable"]["memory"])
    assert s["podsPerNodeByGpus"] == 8
    assert s["podsPerNodeByMemory"] == alloc // quantity(s["podMemory"]) == s["podsPerNode"] < 6
    ps = wait_for(lambda: settled(own_cluster, ns, "dram-bound", 6), what="six pods bound or refused")
    bound = [p for p in ps if p["spec"].get("nodeName")]
    assert len(bound) == s["podsPerNode"], [unschedulable(p) for p in ps]
    assert all("Insufficient memory" in unschedulable(p) for p in ps if not p["spec"].get("nodeName"))
    events = kget(own_cluster, "events", "-n", ns, "--field-selector", "involvedObject.name=dram-bound")["items"]
    warned = [e["message"] for e in events if e["reason"] == "PodsPerNodeMemoryBound"]
    assert warned and f"GPUs for 8 pods of this deployment but allocatable memory for {s['podsPerNode']}" in warned[0]


def _process_of(pod_name: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environ) of the pod's container process, read from /proc as the kernel holds them."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        env = dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e)
        if env.get("POD_NAME") == pod_name and "cache_runtime" in argv:
            return argv, env
    raise AssertionError(f"no process for pod {pod_name}")


def test_env_env_from_extra_args_and_overlay_reach_a_real_pod_and_a_collision_is_refused(own_cluster, op, ns):
    if not own_cluster.network.endpoints_work:
        pytest.skip("process-backed pods need a private network namespace (run as root)")
    uniq = hashlib.sha1(ns.encode()).hexdigest()[:8]
    own_cluster.kubectl_apply([
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": f"gpu-{uniq}"},
         "value": 1000},
        {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": f"nvidia-{uniq}"},
         "handler": "nvidia"},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tuning", "namespace": ns},
         "data": {"TUNING_FROM_CONFIGMAP": "on"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "extra", "namespace": ns},
         "stringData": {"token": "s3cret"}}])
    doc = yaml.safe_load((REPO / "manifests" / "samples" / "bundled-minimal.yaml").read_text())
    spec = {**doc["spec"], "nodeSelector": {NODE_LABEL: "run-0"},
            "env": [{"name": "GREETING", "value": "hello from $(POD_NAME)"},
                    {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "extra", "key": "token"}}}],
            "envFrom": [{"configMapRef": {"name": "tuning"}}],
            "extraArgs": ["--cpu-threads", "1", "--log-level=debug"],
            "podTemplate": {
                "metadata": {"labels": {"team": "infra"}, "annotations": {"example.com/owner": "me"}},
                "spec": {"priorityClassName": f"gpu-{uniq}", "runtimeClassName": f"nvidia-{uniq}",
                         "imagePullSecrets": [{"name": "regcred"}], "securityContext": {"supplementalGroups": [44]},
                         "volumes": [{"name": "scratch", "emptyDir": {}}],
                         "containers": [
                             {"name": "runtime", "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                              "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}},
                             {"name": "sidecar", "image": "busybox:1.37", "command": ["sleep", "infinity"],
                              "resources": {"requests": {"memory": "64Mi"}, "limits": {"memory": "64Mi"}}}]}}}
    apply(own_cluster, ns, "hatches", spec, annotations={"hicache.dev/process-backed": "true"})
    obj = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("readyReplicas") == 1 else None)(
        hcd(own_cluster, ns, "hatches")), timeout=180, what="the runtime pod Ready")
    assert obj["status"]["sizing"]["sidecarBytes"] == 64 * 2**20
    pod = pods(own_cluster, ns, "hatches")[0]
    meta, ps = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "infra" and meta["labels"]["app.kubernetes.io/instance"] == "hatches"
    assert meta["annotations"]["example.com/owner"] == "me"
    assert (ps["priorityClassName"], ps["runtimeClassName"], ps["imagePullSecrets"]) == \
        (f"gpu-{uniq}", f"nvidia-{uniq}", [{"name": "regcred"}])
    assert ps["securityContext"]["supplementalGroups"] == [44] and ps["securityContext"]["runAsNonRoot"] is True
    assert meta["labels"][gate.LABEL] == "true"  # the operator's serving label stands beside the user's
    assert [c["name"] for c in ps["containers"]] == ["runtime", "sidecar"]
    assert {"name": "scratch", "emptyDir": {}} in ps["volumes"]
    c = ps["containers"][0]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert c["args"] == obj["status"]["effectiveConfig"]["args"] and c["args"][-3:] == \
        ["--cpu-threads", "1", "--log-level=debug"]
    assert c["envFrom"] == [{"configMapRef": {"name": "tuning"}}]

    argv, env = _process_of(meta["name"])
    assert argv[-4:-1] == ["--cpu-threads", "1", "--log-level=debug"]
    assert env["GREETING"] == f"hello from {meta['name']}"
    assert (env["FROM_SECRET"], env["TUNING_FROM_CONFIGMAP"]) == ("s3cret", "on")

    # An edit that would change the operator's probe is refused; the running pod is left alone.
    sts = kget(own_cluster, "statefulset", "hatches", "-n", ns)
    broken = copy.deepcopy(spec)
    broken["podTemplate"]["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": 30000}}
    apply(own_cluster, ns, "hatches", broken, annotations={"hicache.dev/process-backed": "true"})
    refused = wait_for(lambda: (lambda o: o if condition(o, "ConfigValid") == "False" else None)(
        hcd(own_cluster, ns, "hatches")), what="ConfigValid=False")
    message = next(x["message"] for x in refused["status"]["conditions"] if x["type"] == "ConfigValid")
    assert "podTemplate.spec.containers[name=runtime].readinessProbe: the operator sets it" in message
    assert kget(own_cluster, "statefulset", "hatches", "-n", ns)["metadata"]["annotations"] == \
        sts["metadata"]["annotations"]
    assert pods(own_cluster, ns, "hatches")[0]["metadata"]["uid"] == meta["uid"]

    # Labels the operator selects on are refused by the API server itself (CEL).
    relabel = copy.deepcopy(spec)
    relabel["podTemplate"]["metadata"]["labels"]["app.kubernetes.io/instance"] = "other"
    res = apply(own_cluster, ns, "hatches", relabel, check=False)
    assert res.returncode != 0 and "podTemplate.metadata may not set the operator's labels" in res.stderr, res.stderr
    assert hcd(own_cluster, ns, "hatches")["spec"]["podTemplate"] == broken["podTemplate"]
