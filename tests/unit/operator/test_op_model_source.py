"""spec.modelSource: validation, the pod parts it renders, the claims it needs, and the status a
download shows."""

from __future__ import annotations

import json

import pytest
from op_helpers import body, gpu_node

from hicache_operator.api import labels
from hicache_operator.plan.model import source as model_source
from hicache_operator.control.informers import pod_essence
from hicache_operator.control.pipeline import plan
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.plan.status import build_status
from hicache_operator.plan.validation import validate

SHAPE = {"numLayers": 2, "numKvHeads": 2, "headDim": 16, "dtypeBytes": 4}
HF = {"huggingFace": {"revision": "refs/pr/3", "tokenSecretRef": {"name": "hf", "key": "hf-token"},
                      "endpoint": "https://hub.internal", "cache": {"claimName": "hf-cache", "path": "hub"},
                      "allowPatterns": ["*.json", "*.safetensors"]}}


def spec(source: dict | None, **over) -> dict:
    out = {"image": "hicache-runtime:0.1.0", "model": "org/tiny", "modelShape": SHAPE, "maxTotalTokens": 4096}
    if source is not None:
        out["modelSource"] = source
    return {**out, **over}


def planned(s: dict):
    p = plan(body(s), [gpu_node("n")])
    assert p.outcome.ok, p.outcome.findings
    return p


def pod_spec(p) -> dict:
    return p.children[-1]["spec"]["template"]["spec"]


def engine(p) -> dict:
    return pod_spec(p)["containers"][0]


def arg(container: dict, flag: str) -> str:
    return container["args"][container["args"].index(flag) + 1]


@pytest.mark.parametrize("source, path, volume", [
    ({"pvc": {"claimName": "models", "path": "tiny"}}, "/hicache/model/tiny",
     {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
    ({"pvc": {"claimName": "models"}}, "/hicache/model", {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
    ({"hostPath": {"path": "/data/tiny"}}, "/hicache/model", {"hostPath": {"path": "/data/tiny", "type": "Directory"}}),
    ({"image": {"reference": "reg.local/tiny:v1", "path": "model", "pullPolicy": "IfNotPresent"}}, "/hicache/model/model",
     {"image": {"reference": "reg.local/tiny:v1", "pullPolicy": "IfNotPresent"}}),
    (HF, "/hicache/model/hub/org--tiny/refs--pr--3", {"persistentVolumeClaim": {"claimName": "hf-cache"}}),
])
@pytest.mark.parametrize("engine_name", ["bundled", "sglang"])
def test_every_source_is_a_read_only_model_directory_served_under_the_model_name(source, path, volume, engine_name):
    s = spec(source, engine=engine_name, image="lmsysorg/sglang:v0.5.23" if engine_name == "sglang" else "img")
    p = planned(s)
    c = engine(p)
    assert arg(c, "--model-path") == path and arg(c, "--served-model-name") == "org/tiny"
    assert {"name": "model", **volume} in pod_spec(p)["volumes"]
    assert {"name": "model", "mountPath": "/hicache/model", "readOnly": True} in c["volumeMounts"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]
    assert p.desired.effective_config.args == c["args"]
    assert ("initContainers" in pod_spec(p)) == ("huggingFace" in source)


def test_without_a_source_nothing_changes_but_the_startup_budget():
    c = engine(planned(spec(None, model="/models/tiny")))
    assert arg(c, "--model-path") == "/models/tiny" and "--served-model-name" not in c["args"]
    assert not any(e["name"] == "HF_HUB_OFFLINE" for e in c["env"])
    assert not any(v["name"] == "model" for v in pod_spec(planned(spec(None, model="/models/tiny")))["volumes"])


def test_the_hugging_face_download_runs_first_with_the_token_from_its_secret_only():
    p = planned(spec(HF))
    (init,) = pod_spec(p)["initContainers"]
    assert init["name"] == "model-download" and init["image"] == "hicache-runtime:0.1.0"
    assert init["command"] == ["python", "/etc/hicache/model-download/model_download.py"]
    a = init["args"]
    assert [arg(init, f) for f in ("--repo", "--revision", "--dest", "--port")] == \
        ["org/tiny", "refs/pr/3", arg(engine(p), "--model-path"), "30000"]
    assert [a[i + 1] for i, x in enumerate(a) if x == "--allow"] == ["*.json", "*.safetensors"]
    assert [a[i + 1] for i, x in enumerate(a) if x == "--ignore"] == ["original/*", "*.pth", "*.gguf", "*.onnx",
                                                                        "*.h5", "*.msgpack"]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "hf-token"}}}
    assert env["HF_ENDPOINT"]["value"] == "https://hub.internal"
    assert "nvidia.com/gpu" not in json.dumps(init["resources"])
    assert {"name": "model", "mountPath": "/hicache/model"} in init["volumeMounts"]  # writable: it downloads
    assert init["securityContext"] == engine(p)["securityContext"]
    # the script travels in a ConfigMap of its own, applied before the StatefulSet
    kinds = [(c["kind"], c["metadata"]["name"]) for c in p.children]
    assert kinds.index(("ConfigMap", "demo-model")) < kinds.index(("StatefulSet", "demo"))
    script = next(c for c in p.children if c["metadata"]["name"] == "demo-model")["data"]["model_download.py"]
    assert "snapshot_download" in script and "HF_TOKEN" in script
    assert {"name": "model-download", "configMap": {"name": "demo-model"}} in pod_spec(p)["volumes"]
    # the token is a reference: no value of it anywhere in what the operator writes
    assert "hf-token" not in json.dumps(p.desired.effective_config.dump())


def test_a_pvc_source_renders_no_download_configmap():
    assert [c["metadata"]["name"] for c in planned(spec({"pvc": {"claimName": "m"}})).children
            if c["kind"] == "ConfigMap"] == ["demo-storage"]


@pytest.mark.parametrize("s, seconds", [
    (spec(None, model="/models/tiny"), 600),
    (spec(HF), 600),
    (spec(None, engine="sglang", image="lmsysorg/sglang:v0.5.23", model="Qwen/Qwen3-8B"), 1800),
    (spec(HF, engine="sglang", image="lmsysorg/sglang:v0.5.23"), 600),
    (spec(HF, startupTimeoutSeconds=3600), 3600),
])
def test_the_startup_probe_covers_the_load_not_a_download_done_before_it(s, seconds):
    probe = engine(planned(s))["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == seconds


@pytest.mark.parametrize("changed, rule", [
    ({"modelSource": {"pvc": {"claimName": "m"}, "hostPath": {"path": "/m"}}}, "model-source-one-of"),
    ({"modelSource": {}}, "model-source-one-of"),
    ({"model": "/models/tiny", "modelSource": {"pvc": {"claimName": "m"}}}, "model-source-name"),
    ({"model": "builtin:tiny", "modelSource": HF}, "model-source-name"),
    ({"model": "https://huggingface.co/org/tiny", "modelSource": HF}, "hugging-face-repo-id"),
    ({"model": "org/tiny/extra", "modelSource": HF}, "hugging-face-repo-id"),
    ({"model": "org/tiny", "modelSource": None}, "bundled-model-source"),
])
def test_each_model_source_rule_names_what_to_change(changed, rule):
    s = {k: v for k, v in {**spec(None), **changed}.items() if v is not None}
    out = validate(s, name="demo", nodes=[gpu_node("n")])
    assert [f.rule for f in out.errors] == [rule]


def test_a_hub_id_with_a_source_that_downloads_it_passes_the_bundled_engine():
    assert validate(spec(HF), name="demo", nodes=[gpu_node("n")]).ok
    assert validate(spec({"pvc": {"claimName": "m"}}, model="my-finetune"), name="demo", nodes=[gpu_node("n")]).ok


@pytest.mark.parametrize("field, value", [
    ("path", "../etc"), ("path", "/abs"), ("path", "a/../../b"), ("claimName", "Bad_Name"),
])
def test_claim_paths_stay_inside_their_volume(field, value):
    s = spec({"pvc": {"claimName": "m", field: value}})
    assert [f.rule for f in validate(s, name="demo").errors] == ["schema"]


@pytest.mark.parametrize("source", [{"hostPath": {"path": "relative"}}, {"hostPath": {"path": "/a/../b"}},
                                    {"huggingFace": {"cache": {"claimName": "c"}, "endpoint": "ftp://x"}},
                                    {"huggingFace": {"cache": {"claimName": "c"}, "revision": "../main"}},
                                    {"huggingFace": {}}])
def test_malformed_sources_are_schema_errors(source):
    assert [f.rule for f in validate(spec(source), name="demo").errors] == ["schema"]


def test_the_model_volumes_are_reserved_only_when_a_source_uses_them():
    extra = {"extraVolumes": [{"name": "model", "emptyDir": {}}],
             "extraVolumeMounts": [{"name": "model", "mountPath": "/data"}]}
    assert validate(spec(None, model="/models/tiny", **extra), name="demo", nodes=[gpu_node("n")]).ok
    out = validate(spec({"pvc": {"claimName": "m"}}, **extra), name="demo", nodes=[gpu_node("n")])
    assert [f.rule for f in out.errors] == ["invalid-pod-field"] and "extraVolumes[0].name" in out.errors[0].message
    mount = {"extraVolumes": [{"name": "x", "emptyDir": {}}],
             "extraVolumeMounts": [{"name": "x", "mountPath": "/hicache/model"}]}
    out = validate(spec({"pvc": {"claimName": "m"}}, **mount), name="demo", nodes=[gpu_node("n")])
    assert [f.rule for f in out.errors] == ["invalid-pod-field"] and "mountPath" in out.errors[0].message


def _spec(s: dict) -> HiCacheDeploymentSpec:
    return HiCacheDeploymentSpec.model_validate(s)


@pytest.mark.parametrize("source, replicas, modes, reasons", [
    (HF, 2, ["ReadWriteMany"], []),
    (HF, 2, ["ReadWriteOnce"], ["ModelClaimNotShared"]),
    (HF, 2, ["ReadOnlyMany"], ["ModelClaimNotShared"]),  # the download writes
    (HF, 1, ["ReadWriteOnce"], []),
    ({"pvc": {"claimName": "hf-cache"}}, 3, ["ReadOnlyMany"], []),
    ({"pvc": {"claimName": "hf-cache"}}, 3, ["ReadWriteOncePod"], ["ModelClaimNotShared"]),
    (HF, 2, None, ["ModelClaimMissing"]),
    ({"hostPath": {"path": "/m"}}, 4, None, []),
])
def test_claims_the_fleet_cannot_share_degrade_it_with_the_field_to_change(source, replicas, modes, reasons):
    s = _spec(spec(source, replicas=replicas))
    found = {c.name: modes for c in model_source.claims(s)}
    problems = model_source.claim_problems(s, found)
    assert [r for r, _ in problems] == reasons
    for _, message in problems:
        assert "hf-cache" in message and "modelSource." in message


def _downloading(p, name: str, restarts: int = 0, waiting: str | None = None, message: str = "") -> dict:
    """A pod of ``p``'s template in its model-download init container."""
    init = {"name": "model-download", "restartCount": restarts,
            "state": {"waiting": {"reason": waiting}} if waiting else {"running": {"startedAt": "2025-01-01T10:00:00Z"}}}
    if message:
        init["lastState"] = {"terminated": {"exitCode": 1, "message": f"Fetching...\n{message}\n"}}
    meta = {"name": name, "annotations": {labels.RESTART_HASH: p.desired.restart_hash}}
    return pod_essence({"metadata": meta, "status": {
        "phase": "Pending", "podIP": "10.0.0.1", "initContainerStatuses": [init],
        "containerStatuses": [{"name": "runtime", "started": False, "ready": False, "restartCount": 0,
                               "state": {"waiting": {"reason": "PodInitializing"}}}],
        "conditions": [{"type": "Ready", "status": "False"}]}})


def _conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_a_download_in_flight_is_progress_with_its_bytes():
    p = planned(spec(HF, replicas=2))
    pods = [_downloading(p, "demo-0"), _downloading(p, "demo-1")]
    report = {"repo": "org/tiny", "revision": "main", "phase": "downloading",
              "bytesDone": 3 * 2**30, "bytesTotal": 12 * 2**30}
    status = build_status(generation=1, previous={}, desired=p.desired, errors=[], pods=pods, degraded=[],
                          now="2025-01-01T10:01:00Z", downloads={"demo-1": report})
    cond = _conditions(status)
    assert cond["Progressing"]["reason"] == "ModelDownloading"
    assert cond["Progressing"]["message"] == \
        "2 of 2 pod(s) downloading the model: org/tiny@main 3.0 GiB of 12.0 GiB (25%)"
    assert cond["Degraded"]["status"] == "False"
    quiet = build_status(generation=1, previous={}, desired=p.desired, errors=[], pods=pods, degraded=[],
                         now="2025-01-01T10:01:00Z")
    assert _conditions(quiet)["Progressing"]["message"].endswith("(no progress reported yet)")


def test_a_download_that_fails_degrades_the_fleet_with_its_last_line():
    p = planned(spec(HF))
    why = "error: org/tiny@main: org/tiny is gated or private and the token cannot read it (401): set " \
          "modelSource.huggingFace.tokenSecretRef to a Secret whose token has access"
    pods = [_downloading(p, "demo-0", restarts=2, waiting="CrashLoopBackOff", message=why)]
    status = build_status(generation=1, previous={}, desired=p.desired, errors=[], pods=pods, degraded=[],
                          now="2025-01-01T10:01:00Z")
    cond = _conditions(status)["Degraded"]
    assert cond["status"] == "True" and cond["reason"] == "ReplicasUnavailable"
    assert f"demo-0: Init:CrashLoopBackOff: {why}" in cond["message"]
