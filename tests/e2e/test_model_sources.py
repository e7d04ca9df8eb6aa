"""spec.modelSource end to end: a checkpoint from a PersistentVolumeClaim, a node's hostPath, an
image volume, and the Hugging Face Hub (a local server speaking the Hub API, downloaded by the real
huggingface_hub in the model-download init container into a shared cache claim), each served by
real bundled-runtime processes and answering chat completions under spec.model."""
from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from cache_runtime.synth.checkpoint import write_checkpoint
from hicache_operator.plan.model import download as model_download
from testbed.hub import LocalHub
from testbed.kube import condition, kget, wait_for

pytestmark = pytest.mark.e2e
NAME = "org/tiny-llama"
SHAPE = {"numLayers": 2, "numKvHeads": 2, "headDim": 16, "dtypeBytes": 4}  # tiny-llama in float32
TOKEN = "hf_e2e_secret_token_value"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint(out, "tiny-llama", dtype="float32", max_shard_bytes=200_000)
    return out


@pytest.fixture(autouse=True)
def pod_network(cluster):
    if not cluster.network.endpoints_work:
        pytest.skip("needs a private network namespace (run as root)")


def fleet(name: str, source: dict, *, replicas: int = 1, process_backed: bool = True) -> dict:
    meta = {"name": name, "annotations": {"hicache.dev/process-backed": "true"} if process_backed else {}}
    return {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment", "metadata": meta,
            "spec": {"image": "ghcr.io/hicache-dev/hicache-runtime:0.1.0", "model": NAME, "modelShape": SHAPE,
                     "maxTotalTokens": 2048, "replicas": replicas, "modelSource": source}}


def apply(cluster, ns: str, *docs: dict) -> None:
    docs = [copy.deepcopy(d) for d in docs]
    for d in docs:
        d["metadata"]["namespace"] = ns
    cluster.kubectl_apply(docs)


def claim(cluster, ns: str, name: str, root: Path, modes: tuple[str, ...] = ("ReadWriteMany",)) -> None:
    """A claim bound to a hostPath volume at ``root`` (what a storage class would provision)."""
    pv = f"{ns}-{name}"
    cluster.kubectl_apply([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "10Gi"}, "accessModes": list(modes), "hostPath": {"path": str(root)},
                  "storageClassName": "manual", "claimRef": {"namespace": ns, "name": name}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
         "spec": {"accessModes": list(modes), "storageClassName": "manual", "volumeName": pv,
                  "resources": {"requests": {"storage": "10Gi"}}}}])
    wait_for(lambda: kget(cluster, "pvc", name, "-n", ns)["status"].get("phase") == "Bound", what=f"{name} Bound")


def hcd(cluster, ns: str, name: str) -> dict:
    return kget(cluster, "hicachedeployment", name, "-n", ns)


def pods_of(cluster, ns: str, name: str) -> list[dict]:
    return kget(cluster, "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"]


def serving(cluster, ns: str, name: str, replicas: int = 1) -> list[dict]:
    wait_for(lambda: (hcd(cluster, ns, name).get("status") or {}).get("readyReplicas") == replicas, timeout=240,
             what=f"{name}: {replicas} pod(s) Ready")
    pods = [p for p in pods_of(cluster, ns, name) if not p["metadata"].get("deletionTimestamp")]
    for p in pods:
        answer = httpx.post(f"http://{p['status']['podIP']}:30000/v1/chat/completions", timeout=60, json={
            "model": NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == NAME and answer.json()["usage"]["completion_tokens"] >= 1
    return pods


def engine_container(pod: dict) -> dict:
    return pod["spec"]["containers"][0]


def arg(container: dict, flag: str) -> str:
    return container["args"][container["args"].index(flag) + 1]


def test_a_checkpoint_on_a_claim_is_served_read_only(cluster, operator, ns, checkpoint, tmp_path):
    shutil.copytree(checkpoint, tmp_path / "volume" / "models" / "tiny")
    claim(cluster, ns, "models", tmp_path / "volume", modes=("ReadOnlyMany",))
    apply(cluster, ns, fleet("from-pvc", {"pvc": {"claimName": "models", "path": "models/tiny"}}, replicas=2))
    pods = serving(cluster, ns, "from-pvc", replicas=2)
    c = engine_container(pods[0])
    assert arg(c, "--model-path") == "/hicache/model/models/tiny" and arg(c, "--served-model-name") == NAME
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in \
        pods[0]["spec"]["volumes"]
    assert condition(hcd(cluster, ns, "from-pvc"), "Degraded") == "False"


def test_a_checkpoint_on_the_nodes_is_served_from_a_host_path(cluster, operator, ns, checkpoint):
    apply(cluster, ns, fleet("from-host", {"hostPath": {"path": str(checkpoint)}}))
    (pod,) = serving(cluster, ns, "from-host")
    assert arg(engine_container(pod), "--model-path") == "/hicache/model"


def test_a_checkpoint_in_an_image_volume_is_served(cluster, operator, ns, checkpoint):
    reference = "registry.local/models/tiny-llama:v1"
    image = cluster.image_volume(reference)
    if not (image / "weights").exists():
        shutil.copytree(checkpoint, image / "weights")
    apply(cluster, ns, fleet("from-image", {"image": {"reference": reference, "path": "weights"}}))
    (pod,) = serving(cluster, ns, "from-image")
    assert {"name": "model", "image": {"reference": reference, "pullPolicy": "IfNotPresent"}} in pod["spec"]["volumes"]
    assert arg(engine_container(pod), "--model-path") == "/hicache/model/weights"


def test_claims_a_fleet_cannot_use_are_reported_with_the_field_to_change(cluster, operator, ns, tmp_path):
    claim(cluster, ns, "one-node", tmp_path, modes=("ReadWriteOnce",))
    apply(cluster, ns, fleet("rwo", {"huggingFace": {"cache": {"claimName": "one-node"}}}, replicas=2,
                             process_backed=False),
          fleet("missing", {"pvc": {"claimName": "nowhere"}}, process_backed=False))
    for name, reason, words in (("rwo", "ModelClaimNotShared", "modelSource.huggingFace.cache PersistentVolumeClaim "
                                 "one-node has access modes ReadWriteOnce"),
                                ("missing", "ModelClaimMissing", "PersistentVolumeClaim nowhere (modelSource.pvc) "
                                 "does not exist")):
        obj = wait_for(lambda: (lambda o: o if condition(o, "Degraded") == "True" else None)(hcd(cluster, ns, name)),
                       what=f"{name} Degraded")
        cond = next(c for c in obj["status"]["conditions"] if c["type"] == "Degraded")
        assert cond["reason"] == reason and words in cond["message"], cond


def test_a_hugging_face_model_is_downloaded_once_into_the_shared_cache_then_served_offline(
        cluster, operator, ns, checkpoint, tmp_path):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    claim(cluster, ns, "hf-cache", cache)
    cluster.kubectl("create", "secret", "generic", "hf-token", "-n", ns, f"--from-literal=token={TOKEN}")
    with LocalHub() as hub:
        hub.add(NAME, checkpoint, token=TOKEN)
        hub.hold("*.safetensors")  # the weights wait, so the download is seen in flight
        apply(cluster, ns, fleet("from-hub", {"huggingFace": {
            "revision": "main", "tokenSecretRef": {"name": "hf-token"}, "endpoint": hub.endpoint,
            "cache": {"claimName": "hf-cache", "path": "hub"}}}))
        try:
            assert hub.holding.wait(180), "the download never asked for the weights"

            progress = re.compile(r"1 of 1 pod\(s\) downloading the model: org/tiny-llama@main [\d.]+ [MG]iB of "
                                  r"[\d.]+ [MG]iB \((\d+)%\)")

            def downloading():
                o = hcd(cluster, ns, "from-hub")
                c = next((c for c in (o.get("status") or {}).get("conditions") or [] if c["type"] == "Progressing"), {})
                return progress.fullmatch(c.get("message", "")) if c.get("reason") == "ModelDownloading" else None
            # the weights are held, so the download stays in flight until the bytes are shown
            assert int(wait_for(downloading, timeout=60, what="Progressing=ModelDownloading with its bytes").group(1)) < 100
            (pod,) = pods_of(cluster, ns, "from-hub")
            init = pod["spec"]["initContainers"][0]
            assert init["name"] == "model-download"
            assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in init["env"]
        finally:
            hub.release()
        (pod,) = serving(cluster, ns, "from-hub")
        c = engine_container(pod)
        assert arg(c, "--model-path") == "/hicache/model/hub/org--tiny-llama/main"
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]
        fetched = hub.seen()
        assert fetched and all(s.authorization == f"Bearer {TOKEN}" for s in fetched)
        landed = cache / "hub" / "org--tiny-llama" / "main"
        assert json.loads((landed / model_download.MARKER).read_text())["commit"] == hub.repos[NAME].commit
        for f in checkpoint.iterdir():
            assert (landed / f.name).read_bytes() == f.read_bytes(), f.name
        # the token is nowhere but in its Secret
        assert TOKEN not in json.dumps(pod) and TOKEN not in json.dumps(hcd(cluster, ns, "from-hub"))

        # a new pod finds the download and never calls the Hub
        before = len(hub.seen())
        cluster.kubectl("delete", "pod", pod["metadata"]["name"], "-n", ns)
        wait_for(lambda: [p for p in pods_of(cluster, ns, "from-hub") if p["metadata"]["uid"] != pod["metadata"]["uid"]],
                 timeout=120, what="the replacement pod")
        (again,) = serving(cluster, ns, "from-hub")
        assert again["metadata"]["uid"] != pod["metadata"]["uid"]
        assert (again["status"]["initContainerStatuses"][0]["state"]["terminated"]["reason"]) == "Completed"
        assert hub.seen(before) == [], hub.seen(before)
