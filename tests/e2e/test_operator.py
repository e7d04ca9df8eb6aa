"""The operator end to end: kubectl apply a HiCacheDeployment on the local control plane
(real kube-apiserver, scheduler, controllers, simulated GPU nodes) and get a correct fleet,
or a refusal that says what to change."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from hicache_operator.plan.engine import versions as engine_versions
from testbed import sglang_oracle
from testbed.kube import condition, kget, wait_for

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def expected_error(path: Path) -> str:
    m = re.search(r"^# expected-error: (.+)$", path.read_text(), re.M)
    assert m, f"{path.name} documents no expected error"
    return m.group(1).strip()


def apply(cluster, doc: dict, ns: str, check: bool = True):
    doc = copy.deepcopy(doc)
    doc["metadata"]["namespace"] = ns
    return cluster.kubectl_apply([doc], check=check)


def hcd(cluster, ns: str, name: str) -> dict:
    return kget(cluster, "hicachedeployment", name, "-n", ns)


def owned_children(cluster, ns: str, uid: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for kind in ("statefulsets", "services", "configmaps", "secrets", "poddisruptionbudgets"):
        for item in kget(cluster, kind, "-n", ns)["items"]:
            if any(o["uid"] == uid for o in item["metadata"].get("ownerReferences", [])):
                out.setdefault(kind, []).append(item["metadata"]["name"])
    return out


def pods_of(cluster, ns: str, name: str) -> list[dict]:
    return kget(cluster, "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"]


def env_of(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}


def check_fleet(cluster, ns: str, name: str, replicas: int) -> tuple[dict, list[dict]]:
    """The common 'Must show' checks for a valid sample."""
    obj = wait_for(lambda: (lambda o: o if condition(o, "ConfigValid") == "True" else None)(hcd(cluster, ns, name)),
                   what=f"{name} ConfigValid")
    kids = wait_for(lambda: (lambda k: k if len(k) == 5 else None)(owned_children(cluster, ns, obj["metadata"]["uid"])),
                    what="all five kinds of children")
    routed = obj["spec"].get("replicas", 1) > 1  # the router is on by default from two replicas
    assert set(kids["services"]) == {name, f"{name}-pods"} | ({f"{name}-serving"} if routed else set())
    assert kids["statefulsets"] == [name] and kids["poddisruptionbudgets"] == [name]
    sglang = obj["spec"].get("engine") == "sglang"
    # SGLang pods take a key: the clients' without the router, the fleet's internal one behind it
    keys = [f"{name}-admin"] + ([f"{name}-api"] if sglang else []) + ([f"{name}-internal"] if sglang and routed else [])
    assert kids["configmaps"] == [f"{name}-storage"] and sorted(kids["secrets"]) == keys
    sts = kget(cluster, "statefulset", name, "-n", ns)
    assert "hicache.dev/rendered-hash" in sts["metadata"]["annotations"]
    assert sts["spec"]["updateStrategy"]["type"] == "OnDelete"

    pods = wait_for(lambda: (lambda ps: ps if len(ps) == replicas and all(p["spec"].get("nodeName") for p in ps)
                             else None)(pods_of(cluster, ns, name)), what=f"{replicas} scheduled pods")
    nodes = {n["metadata"]["name"]: n for n in kget(cluster, "nodes")["items"]}
    effective = hcd(cluster, ns, name)["status"]["effectiveConfig"]
    for p in pods:
        node = nodes[p["spec"]["nodeName"]]
        c = p["spec"]["containers"][0]
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        assert int(node["status"]["allocatable"].get("nvidia.com/gpu", "0")) >= gpus > 0, "GPU pod on a non-GPU node"
        assert parse_bytes(node["status"]["allocatable"]["memory"]) >= parse_bytes(c["resources"]["requests"]["memory"])
        assert c["command"] == effective["command"] and c["args"] == effective["args"]
        env = env_of(p)
        host_net = p["spec"].get("hostNetwork", False)
        assert env["MOONCAKE_LOCAL_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            ("status.hostIP" if host_net else "status.podIP")
        assert env["HICACHE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == f"{name}-admin"
        assert not any("local_hostname" in a for a in c["args"])
        assert all(a != kget(cluster, "secret", f"{name}-admin", "-n", ns)["data"]["admin-api-key"] for a in c["args"])
    return hcd(cluster, ns, name), pods


def parse_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", q)
    return int(m.group(1)) * units.get(m.group(2), 1)


def test_bundled_sample_runs_real_runtime_pods(cluster, operator, ns):
    doc = load(SAMPLES / "bundled-minimal.yaml")
    doc["metadata"].setdefault("annotations", {})["hicache.dev/process-backed"] = "true"
    apply(cluster, doc, ns)
    obj, pods = check_fleet(cluster, ns, "tiny", 1)
    c = pods[0]["spec"]["containers"][0]
    assert c["command"][:3] == ["python", "-m", "cache_runtime"]
    assert "--host" in c["args"] and c["args"][c["args"].index("--host") + 1] == "$(POD_IP)"
    # The runtime really runs and the Ready column counts it.
    obj = wait_for(lambda: (lambda o: o if o["status"].get("readyReplicas") == 1 else None)(hcd(cluster, ns, "tiny")),
                   timeout=120, what="runtime pod Ready")
    assert condition(obj, "Ready") == "True"
    table = cluster.kubectl("get", "hcd", "-n", ns).stdout
    assert re.search(r"tiny\s+1/1\s+bundled\s+none", table), table
    # A new fleet starting on its storage config is not a swap: nothing to report complete. Its
    # pods were starting, not unavailable: no Warning either.
    wait_for(lambda: condition(hcd(cluster, ns, "tiny"), "BackendSwapInProgress") == "False", timeout=60,
             what="swap state settled")
    events = kget(cluster, "events", "-n", ns, "--field-selector", "involvedObject.name=tiny")["items"]
    assert not [e for e in events if e["reason"].startswith("BackendSwap") or e["type"] == "Warning"], \
        [(e["type"], e["reason"], e["message"]) for e in events]


def test_sglang_mooncake_sample(cluster, operator):
    doc = load(SAMPLES / "sglang-mooncake.yaml")
    ns = doc["metadata"]["namespace"]
    cluster.kubectl("create", "namespace", ns, check=False)
    apply(cluster, doc, ns)
    obj, pods = check_fleet(cluster, ns, "llama-8b", 2)
    for p in pods:
        c = p["spec"]["containers"][0]
        assert c["command"][:3] == ["python", "-m", "sglang.launch_server"]
        args = c["args"]
        for flag, val in [("--tp-size", "8"), ("--page-size", "64"), ("--hicache-storage-backend", "mooncake"),
                          ("--hicache-mem-layout", "page_first"), ("--hicache-storage-prefetch-policy", "timeout"),
                          ("--hicache-size", "24")]:
            assert args[args.index(flag) + 1] == val, flag
        assert "--admin-api-key" in args and args[args.index("--admin-api-key") + 1] == "$(HICACHE_ADMIN_API_KEY)"
        assert "--api-key" in args and args[args.index("--api-key") + 1] == "$(HICACHE_API_KEY)"
        env = env_of(p)
        assert env["MOONCAKE_MASTER"]["value"] == "mooncake-master.mooncake.svc:50051"
        assert env["MOONCAKE_PROTOCOL"]["value"] == "rdma"
        assert p["spec"]["hostNetwork"] is True
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert p["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        # 2r - 1 pools: a rank may check SGLang's headroom after its 7 peers allocated theirs
        per_pod = 15 * 24 * 10**9 + (32 + 2 + 64 + 10) * 2**30
        assert parse_bytes(c["resources"]["limits"]["memory"]) >= per_pod
    assert len({p["spec"]["nodeName"] for p in pods}) == 2, "one pod per node"
    passes_sglang_headroom_check(obj, pods)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_node_dram_sizing_lands_in_status_and_requests(cluster, operator, ns):
    cluster.kubectl_apply([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-l3"},
         "spec": {"capacity": {"storage": "1Ti"}, "accessModes": ["ReadWriteMany"],
                  "hostPath": {"path": "/tmp/hicache-l3"}, "storageClassName": "manual",
                  "claimRef": {"namespace": ns, "name": "hicache-l3"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "hicache-l3", "namespace": ns},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual", "volumeName": f"{ns}-l3",
                  "resources": {"requests": {"storage": "1Ti"}}}}])
    apply(cluster, load(SAMPLES / "node-dram-sized.yaml"), ns)
    obj, pods = check_fleet(cluster, ns, "qwen-dram", 2)
    sizing = obj["status"]["sizing"]
    nodes = {n["metadata"]["name"]: n for n in kget(cluster, "nodes")["items"]}
    eligible = [n for n in nodes.values() if int(n["status"]["allocatable"].get("nvidia.com/gpu", "0")) >= 8]
    smallest = min(eligible, key=lambda n: parse_bytes(n["status"]["allocatable"]["memory"]))
    assert sizing["sizingNode"] == smallest["metadata"]["name"]
    alloc = parse_bytes(smallest["status"]["allocatable"]["memory"])
    fixed = (8 + 2 + 10) * 2**30  # overheadGiB, shmGiB, SGLang's host reserve (defaults)
    budget = (alloc * 0.75 - 32 * 2**30 - fixed) / 15
    args = pods[0]["spec"]["containers"][0]["args"]
    size_gb = int(args[args.index("--hicache-size") + 1])
    assert size_gb == int(budget // 10**9), (size_gb, budget)
    limit = parse_bytes(pods[0]["spec"]["containers"][0]["resources"]["limits"]["memory"])
    assert 15 * size_gb * 10**9 <= limit <= alloc * 0.75 - 32 * 2**30
    assert json.dumps(sizing).count(str(sizing["sizingNode"])) >= 1
    assert "last rank to allocate" in sizing["engineHeadroomCheck"]
    passes_sglang_headroom_check(obj, pods)


def passes_sglang_headroom_check(obj: dict, pods: list[dict]) -> None:
    """Each pod's argv, as its process would see it, resolved by the SGLang release its image runs,
    and that release's own host-memory check run for every rank against the pod's memory limit
    (the k-th rank seeing k peers' pools already allocated)."""
    sizing = obj["status"]["sizing"]
    version = engine_versions.version_from_image(obj["spec"]["image"])
    usage = sizing["overheadBytes"] + sizing["shmBytes"] + sizing.get("mooncakeSegmentBytes", 0)
    containers = [p["spec"]["containers"][0] for p in pods]
    answers = sglang_oracle.resolve(
        version, [sglang_oracle.container_argv(c) for c in containers],
        [{"pool_bytes": sizing["hostPoolBytesPerRank"], "limit": parse_bytes(c["resources"]["limits"]["memory"]),
          "usage": usage} for c in containers])
    for answer in answers:
        assert "error" not in answer, answer
        assert answer["headroom"] and all(answer["headroom"]), (answer["headroom"], sizing)
        assert not answer["server_info_open"]


@pytest.mark.parametrize("sample", sorted(p.name for p in (SAMPLES / "invalid").glob("*.yaml")))
def test_invalid_sample_is_refused_with_its_message(cluster, operator, ns, sample):
    path = SAMPLES / "invalid" / sample
    message = expected_error(path)
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    doc = docs[-1]
    res = apply(cluster, doc, ns, check=False)
    if res.returncode != 0:  # refused by the API server itself (schema or CEL)
        assert message in res.stderr or _schema_refusal(sample, res.stderr), res.stderr
        return
    name = doc["metadata"]["name"]
    obj = wait_for(lambda: (lambda o: o if condition(o, "ConfigValid") == "False" else None)(hcd(cluster, ns, name)),
                   what="ConfigValid=False")
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "ConfigValid")
    assert message in cond["message"] or _same_template(message, cond["message"]), cond["message"]
    events = kget(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["type"] == "Warning" for e in events)
    assert not kget(cluster, "statefulsets", "-n", ns)["items"], "an invalid spec must not create a workload"
    assert operator.alive()


def _schema_refusal(sample: str, stderr: str) -> bool:
    return sample == "schema.yaml" and "Invalid value" in stderr or "Unsupported value" in stderr


def _same_template(expected: str, actual: str) -> bool:
    """Messages with node-dependent numbers: compare the fixed words around them."""
    words = [w for w in re.split(r"[^A-Za-z_.]+", expected) if len(w) > 3]
    return sum(w in actual for w in words) >= 0.8 * len(words)


def test_operator_keeps_serving_others_after_invalid_specs(cluster, operator, ns):
    bad = load(SAMPLES / "invalid" / "host-pool-exceeds-node.yaml")
    apply(cluster, bad, ns, check=False)
    good = load(SAMPLES / "bundled-minimal.yaml")
    good["metadata"]["name"] = "still-works"
    apply(cluster, good, ns)
    check_fleet(cluster, ns, "still-works", 1)
    assert operator.alive()


def test_scale_edit_and_delete_converge(cluster, operator, ns):
    doc = load(SAMPLES / "bundled-minimal.yaml")
    doc["metadata"]["name"] = "conv"
    # KWOK's pods run no runtime and its router pod no router: a drain can only time out
    doc["spec"]["rollout"] = {"drainTimeoutSeconds": 5}
    apply(cluster, doc, ns)
    check_fleet(cluster, ns, "conv", 1)

    cluster.kubectl("scale", "hcd/conv", "-n", ns, "--replicas=3")
    wait_for(lambda: len(pods_of(cluster, ns, "conv")) == 3, what="scaled to 3")
    wait_for(lambda: hcd(cluster, ns, "conv")["status"].get("replicas") == 3, what="status.replicas 3")

    old = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods_of(cluster, ns, "conv")}
    cluster.kubectl("patch", "hcd/conv", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"image": "hicache-runtime:0.2.0"}}))

    def rolled():
        ps = pods_of(cluster, ns, "conv")
        return len(ps) == 3 and all(p["spec"]["containers"][0]["image"] == "hicache-runtime:0.2.0"
                                    and p["metadata"]["uid"] != old.get(p["metadata"]["name"]) for p in ps)
    wait_for(rolled, timeout=120, what="image rolled to every pod")

    assert kget(cluster, "deployment", "conv-router", "-n", ns)["spec"]["replicas"] == 1  # on from two replicas
    cluster.kubectl("patch", "hcd/conv", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"replicas": 1}}))
    wait_for(lambda: len(pods_of(cluster, ns, "conv")) == 1, what="scaled to 1")
    # one replica: the router is off, its objects go and the client Service selects the pods again
    wait_for(lambda: cluster.kubectl("get", "deployment", "conv-router", "-n", ns, check=False).returncode != 0,
             what="the router removed")
    selector = kget(cluster, "service", "conv", "-n", ns)["spec"]["selector"]
    assert selector["app.kubernetes.io/name"] == "hicache" and selector["hicache.dev/serving"] == "true"

    uid = hcd(cluster, ns, "conv")["metadata"]["uid"]
    cluster.kubectl("delete", "hcd/conv", "-n", ns)
    wait_for(lambda: not owned_children(cluster, ns, uid) and not pods_of(cluster, ns, "conv"),
             timeout=90, what="children garbage-collected")


def test_node_shrinking_after_sizing_reports_no_longer_fits(cluster, operator, ns):
    """Sizing is pinned (no restarts), but a fleet that no longer fits its nodes is reported."""
    doc = load(SAMPLES / "bundled-minimal.yaml")
    doc["metadata"]["name"] = "shrink"
    doc["spec"]["hicache"] = {"hostPool": {"fromNodeMemory": {"fraction": 0.5, "reserveGiB": 8}}}
    doc["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "gpu-3"}
    apply(cluster, doc, ns)
    obj = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("sizing") else None)(hcd(cluster, ns, "shrink")),
                   what="sizing in status")
    assert obj["status"]["sizing"]["sizingNode"] == "gpu-3"
    node = kget(cluster, "node", "gpu-3")
    before = node["status"]["allocatable"]["memory"]
    try:
        cluster.kubectl("patch", "node", "gpu-3", "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"allocatable": {"memory": "64Gi"}, "capacity": {"memory": "64Gi"}}}))
        obj = wait_for(lambda: (lambda o: o if condition(o, "Degraded") == "True" else None)(hcd(cluster, ns, "shrink")),
                       timeout=90, what="Degraded after the node shrank")
        cond = next(c for c in obj["status"]["conditions"] if c["type"] == "Degraded")
        assert cond["reason"] == "SizingNoLongerFits", cond
        assert obj["status"]["sizing"]["sizingNode"] == "gpu-3"  # pinned: no resize, no restart
    finally:
        cluster.kubectl("patch", "node", "gpu-3", "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"allocatable": {"memory": before}, "capacity": {"memory": before}}}))


def test_admin_key_from_the_users_own_secret(cluster, operator, ns, tmp_path):
    """adminKeySecretRef: no Secret is generated; pods read the key from the user's Secret under
    the named field, and the operator uses that same key for the runtime's admin API (a backend
    swap, which the runtime refuses without it). Deleting the Secret is reported, not fatal."""
    cluster.kubectl("create", "secret", "generic", "team-admin", "-n", ns,
                    "--from-literal=token=team-key-0123456789abcdef")
    doc = load(SAMPLES / "bundled-minimal.yaml")
    doc["metadata"]["name"] = "own-key"
    doc["metadata"].setdefault("annotations", {})["hicache.dev/process-backed"] = "true"
    doc["spec"]["adminKeySecretRef"] = {"name": "team-admin", "key": "token"}
    apply(cluster, doc, ns)
    obj = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("readyReplicas") == 1 else None)(
        hcd(cluster, ns, "own-key")), timeout=120, what="runtime pod Ready")
    kids = owned_children(cluster, ns, obj["metadata"]["uid"])
    assert "secrets" not in kids and set(kids) == {"statefulsets", "services", "configmaps", "poddisruptionbudgets"}
    assert env_of(pods_of(cluster, ns, "own-key")[0])["HICACHE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"] == \
        {"name": "team-admin", "key": "token"}

    cluster.kubectl("patch", "hcd/own-key", "-n", ns, "--type=merge", "-p", json.dumps(
        {"spec": {"hicache": {"storage": {"backend": "file", "extraConfig": {"file_storage_path": str(tmp_path)}}}}}))
    def swap_to_file_finished():
        o = hcd(cluster, ns, "own-key")
        bs = (o.get("status") or {}).get("backendSwap") or {}
        return o if bs.get("targetBackend") == "file" and bs.get("phase") in ("Complete", "Failed") \
            and not bs.get("pods") else None
    obj = wait_for(swap_to_file_finished, timeout=120, what="swap to file finished")
    assert obj["status"]["backendSwap"]["phase"] == "Complete", obj["status"]["backendSwap"]
    assert obj["status"]["currentBackend"] == "file"

    cluster.kubectl("delete", "secret", "team-admin", "-n", ns)
    obj = wait_for(lambda: (lambda o: o if condition(o, "Degraded") == "True" else None)(hcd(cluster, ns, "own-key")),
                   timeout=60, what="Degraded once the Secret is gone")
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "Degraded")
    assert cond["reason"] == "AdminSecretMissing" and "team-admin" in cond["message"], cond
    assert operator.alive()


def test_child_refused_by_the_api_server_is_reported_not_retried_forever(cluster, operator, ns):
    """Affinity is passed through to the pod template: one the API server refuses (no node
    selector terms) passes the CRD and the operator's checks, so the refusal is reported as
    ConfigValid=False with the server's message, and fixing the spec recovers."""
    doc = load(SAMPLES / "bundled-minimal.yaml")
    doc["metadata"]["name"] = "refused"
    doc["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": []}}}
    apply(cluster, doc, ns)
    obj = wait_for(lambda: (lambda o: o if condition(o, "ConfigValid") == "False" else None)(hcd(cluster, ns, "refused")),
                   what="ConfigValid=False")
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "ConfigValid")
    assert cond["reason"] == "RefusedByAPIServer" and "StatefulSet refused" in cond["message"], cond
    assert "nodeSelectorTerms" in cond["message"], cond
    events = kget(cluster, "events", "-n", ns, "--field-selector", "involvedObject.name=refused")["items"]
    assert [e for e in events if e["reason"] == "RefusedByAPIServer"], events
    assert operator.alive()

    cluster.kubectl("patch", "hcd/refused", "-n", ns, "--type=json", "-p", '[{"op": "remove", "path": "/spec/affinity"}]')
    check_fleet(cluster, ns, "refused", 1)
