"""The local control plane behaves like a real cluster: scheduling on GPU resources,
process-backed pods with real readiness, EndpointSlices, CEL, kubectl and helm."""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from localcluster.podspec import PROCESS_BACKED_ANNOTATION
from testbed.kube import kget, wait_for

pytestmark = pytest.mark.e2e


def echo_deployment(name: str, ns: str, *, gpus: int = 1, process_backed: bool = True, replicas: int = 1) -> list[dict]:
    labels = {"app": name}
    annotations = {PROCESS_BACKED_ANNOTATION: "true"} if process_backed else {}
    container = {
        "name": "echo", "image": "python:3.11-slim",
        "command": ["python", "-m", "localcluster.echoserver"], "args": ["8080"],
        "ports": [{"containerPort": 8080, "name": "http"}],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "MY_GREETING", "value": "hello from $(NODE_NAME)"}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1,
                           "failureThreshold": 1},
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {},
    }
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns},
         "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels, "annotations": annotations},
                               "spec": {"containers": [container], "terminationGracePeriodSeconds": 3}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
         "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]}},
    ]


@pytest.fixture
def ns(cluster, request):
    name = "t-" + request.node.name.lower().replace("_", "-")[:40]
    cluster.kubectl("create", "namespace", name)
    wait_for(lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
             what="default ServiceAccount")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def endpoint_states(cluster, ns: str, svc: str) -> list[tuple[str, bool]]:
    slices = kget(cluster, "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={svc}")["items"]
    return [(e["addresses"][0], bool(e.get("conditions", {}).get("ready")))
            for s in slices for e in (s.get("endpoints") or [])]


def test_gpu_pod_runs_as_real_process_and_drives_endpoints(cluster, ns):
    if not cluster.network.endpoints_work:
        pytest.skip("needs a private network namespace (run as root)")
    cluster.kubectl_apply(echo_deployment("echo", ns), "-n", ns)

    pod = wait_for(lambda: next((p for p in kget(cluster, "pods", "-n", ns, "-l", "app=echo")["items"]
                                 if p.get("status", {}).get("podIP")), None), what="pod with an IP")
    assert pod["spec"]["nodeName"].startswith("gpu-"), pod["spec"]["nodeName"]
    ip = pod["status"]["podIP"]
    assert ip.startswith("10.244."), ip

    # The process is real, listens on the pod IP and got its downward-API environment.
    info = wait_for(lambda: _try_get(f"http://{ip}:8080/"), what="echo server answering")
    assert info["env"]["POD_IP"] == ip
    assert info["env"]["NODE_NAME"] == pod["spec"]["nodeName"]
    assert info["env"]["MY_GREETING"] == f"hello from {pod['spec']['nodeName']}"
    os.kill(info["pid"], 0)  # a live local process

    assert wait_for(lambda: endpoint_states(cluster, ns, "echo") == [(ip, True)], what="endpoint ready")

    httpx.post(f"http://{ip}:8080/unready")
    assert wait_for(lambda: endpoint_states(cluster, ns, "echo") == [(ip, False)], what="endpoint not ready")
    pod = kget(cluster, "pod", pod["metadata"]["name"], "-n", ns)
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "False"

    httpx.post(f"http://{ip}:8080/ready")
    assert wait_for(lambda: endpoint_states(cluster, ns, "echo") == [(ip, True)], what="endpoint ready again")

    cluster.kubectl("delete", "deployment", "echo", "-n", ns)
    wait_for(lambda: not kget(cluster, "pods", "-n", ns, "-l", "app=echo")["items"], what="pod gone")
    wait_for(lambda: not _pid_alive(info["pid"]), what="process stopped")


def test_readiness_gate_holds_pod_out_of_endpoints(cluster, ns):
    """Ready = probe AND every readinessGate, as a kubelet computes it."""
    if not cluster.network.endpoints_work:
        pytest.skip("needs a private network namespace (run as root)")
    docs = echo_deployment("gated", ns)
    docs[0]["spec"]["template"]["spec"]["readinessGates"] = [{"conditionType": "hicache.dev/serving"}]
    cluster.kubectl_apply(docs, "-n", ns)
    pod = wait_for(lambda: next((p for p in kget(cluster, "pods", "-n", ns, "-l", "app=gated")["items"]
                                 if p.get("status", {}).get("podIP")), None), what="pod with an IP")
    ip, name = pod["status"]["podIP"], pod["metadata"]["name"]
    wait_for(lambda: _try_get(f"http://{ip}:8080/"), what="server up")
    time.sleep(2)
    assert endpoint_states(cluster, ns, "gated") == [(ip, False)]

    core = __import__("kubernetes").client.CoreV1Api(cluster.api_client())
    core.patch_namespaced_pod_status(name, ns, {"status": {"conditions": [
        {"type": "hicache.dev/serving", "status": "True"}]}})
    assert wait_for(lambda: endpoint_states(cluster, ns, "gated") == [(ip, True)], what="gate opens endpoint")


def test_gpu_requests_never_land_on_cpu_nodes(cluster, ns):
    cluster.kubectl_apply(echo_deployment("sim", ns, process_backed=False, replicas=6, gpus=2), "-n", ns)
    pods = wait_for(lambda: [p for p in kget(cluster, "pods", "-n", ns, "-l", "app=sim")["items"]
                             if p.get("status", {}).get("phase") == "Running"] if
                    len([p for p in kget(cluster, "pods", "-n", ns, "-l", "app=sim")["items"]
                         if p.get("status", {}).get("phase") == "Running"]) == 6 else None,
                    what="6 simulated pods Running")
    assert all(p["spec"]["nodeName"].startswith("gpu-") for p in pods), [p["spec"]["nodeName"] for p in pods]

    # Nine GPUs fit on no node: the scheduler must leave it Pending with its own reason.
    cluster.kubectl_apply(echo_deployment("toobig", ns, process_backed=False, gpus=9), "-n", ns)
    pod = wait_for(lambda: next((p for p in kget(cluster, "pods", "-n", ns, "-l", "app=toobig")["items"]
                                 if any(c.get("reason") == "Unschedulable"
                                        for c in p.get("status", {}).get("conditions", []))), None),
                   what="unschedulable pod")
    msg = next(c["message"] for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    assert "Insufficient nvidia.com/gpu" in msg


def test_cel_rule_rejected_by_the_real_apiserver(cluster):
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.smoke.hicache.dev"},
        "spec": {"group": "smoke.hicache.dev", "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "properties": {"spec": {
                         "type": "object", "properties": {"ratio": {"type": "number"}},
                         "x-kubernetes-validations": [{"rule": "self.ratio > 1.0",
                                                       "message": "ratio must be greater than 1"}]}}}}}]}}
    cluster.kubectl_apply([crd])
    cluster.wait_established("widgets.smoke.hicache.dev")
    bad = {"apiVersion": "smoke.hicache.dev/v1", "kind": "Widget",
           "metadata": {"name": "w", "namespace": "default"}, "spec": {"ratio": 0.5}}
    res = wait_for(lambda: (lambda r: r if "not found" not in r.stderr else None)(
        cluster.kubectl_apply([bad], check=False)), what="CRD served")
    assert res.returncode != 0
    assert "ratio must be greater than 1" in res.stderr
    good = dict(bad, spec={"ratio": 2.0})
    assert cluster.kubectl_apply([good], check=False).returncode == 0


def test_kubectl_and_helm_talk_to_the_cluster(cluster):
    ver = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert ver["serverVersion"]["gitVersion"].startswith("v1.34.")
    assert ver["clientVersion"]["gitVersion"].startswith("v1.34.")
    out = cluster.helm("version", "--short").stdout
    assert out.startswith("v3."), out
    assert cluster.helm("list", "-A").returncode == 0


def _try_get(url: str):
    try:
        return httpx.get(url, timeout=1).json()
    except httpx.HTTPError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False
