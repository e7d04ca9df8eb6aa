"""Rendered children: names, owners, hashes, pod identity, security."""

from __future__ import annotations

import base64

from op_helpers import body, gpu_node

from hicache_operator.api import labels
from hicache_operator.plan import render
from hicache_operator.control.pipeline import plan
from hicache_operator.fleet.storage_config import attach_payload

MOONCAKE = {"backend": "mooncake", "mooncake": {"masterAddress": "m:50051", "protocol": "tcp",
                                                "globalSegmentSize": "4gb"}}


def children(spec, nodes=None, **kw):
    p = plan(body({"image": "img", **spec}), nodes if nodes is not None else [gpu_node("n")], **kw)
    assert p.outcome.ok, p.outcome.findings
    return p, {c["kind"] + ("/headless" if c["metadata"]["name"].endswith("-pods") else ""): c for c in p.children}


def pod_spec(kids):
    return kids["StatefulSet"]["spec"]["template"]["spec"]


def env(kids):
    return {e["name"]: e for e in pod_spec(kids)["containers"][0]["env"]}


def test_children_names_owner_and_rendered_hash():
    _, kids = children({})
    assert set(kids) == {"ConfigMap", "Service/headless", "Service", "PodDisruptionBudget", "StatefulSet"}
    for obj in kids.values():
        ref = obj["metadata"]["ownerReferences"][0]
        assert ref == {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment", "name": "demo",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["namespace"] == "ns"
        assert len(obj["metadata"]["annotations"][labels.RENDERED_HASH]) == 16
    assert kids["Service/headless"]["spec"]["clusterIP"] == "None"
    assert kids["StatefulSet"]["spec"]["serviceName"] == "demo-pods"


def test_statefulset_is_on_delete_with_serving_label_probes_and_gpus():
    _, kids = children({"parallelism": {"tp": 2, "pp": 2}, "engine": "sglang", "model": "Qwen/Qwen3-8B", "engineVersion": "0.5.23"})
    sts = kids["StatefulSet"]["spec"]
    assert sts["updateStrategy"] == {"type": "OnDelete"}
    ps = sts["template"]["spec"]
    # every new pod starts in serving; only the client Service and the PDB select on it
    assert sts["template"]["metadata"]["labels"]["hicache.dev/serving"] == "true"
    assert "hicache.dev/serving" not in sts["selector"]["matchLabels"] and "readinessGates" not in ps
    assert kids["Service"]["spec"]["selector"]["hicache.dev/serving"] == "true"
    assert "hicache.dev/serving" not in kids["Service/headless"]["spec"]["selector"]
    assert kids["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]["hicache.dev/serving"] == "true"
    c = ps["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"port": "http", "path": "/health"}
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_placement_spread_requires_one_pod_per_node_and_pack_prefers_siblings():
    selector = {"matchLabels": labels.selector_labels("demo")}
    user = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "other"}}, "topologyKey": "kubernetes.io/hostname"}]}}
    _, spread = children({"placement": {"policy": "spread"}, "affinity": user})
    anti = pod_spec(spread)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["labelSelector"] == {"matchLabels": {"app": "other"}}  # the user's term is kept
    assert anti[1] == {"labelSelector": selector, "topologyKey": "kubernetes.io/hostname"}
    assert "podAffinity" not in pod_spec(spread)["affinity"]
    _, pack = children({})
    aff = pod_spec(pack)["affinity"]
    assert "podAntiAffinity" not in aff
    assert aff["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {"weight": 100, "podAffinityTerm": {"labelSelector": selector, "topologyKey": "kubernetes.io/hostname"}}]


def test_bundled_probe_and_termination_message():
    _, kids = children({})
    c = pod_spec(kids)["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # the same route for both engines
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_sglang_probe_and_command():
    _, kids = children({"engine": "sglang", "model": "Qwen/Qwen3-8B", "engineVersion": "0.5.23"})
    c = pod_spec(kids)["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["command"] == ["python", "-m", "sglang.launch_server"]


def test_security_context_is_locked_down_and_no_literal_key():
    _, kids = children({"engine": "sglang", "model": "Qwen/Qwen3-8B", "engineVersion": "0.5.23"})
    ps = pod_spec(kids)
    c = ps["containers"][0]
    assert ps["securityContext"]["runAsNonRoot"] and ps["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert ps["automountServiceAccountToken"] is False
    assert env(kids)["HICACHE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "demo-admin",
                                                                               "key": "admin-api-key"}
    # SGLang answers /server_info (admin key included) to anyone unless clients need a key too
    assert env(kids)["HICACHE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "demo-api", "key": "api-key"}
    assert c["args"][-4:] == ["--admin-api-key", "$(HICACHE_ADMIN_API_KEY)", "--api-key", "$(HICACHE_API_KEY)"]


def test_user_secret_ref_is_used():
    _, kids = children({"adminKeySecretRef": {"name": "mine", "key": "k"}})
    assert env(kids)["HICACHE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "k"}


def test_per_pod_identity_from_downward_api():
    _, kids = children({"hicache": {"storage": MOONCAKE}})
    e = env(kids)
    assert e["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert e["MOONCAKE_LOCAL_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert e["MOONCAKE_MASTER"]["value"] == "m:50051"
    assert e["MOONCAKE_PROTOCOL"]["value"] == "tcp"
    assert e["MOONCAKE_TE_META_DATA_SERVER"]["value"] == "P2PHANDSHAKE"
    assert e["MOONCAKE_GLOBAL_SEGMENT_SIZE"]["value"] == "4gb"
    _, host = children({"hostNetwork": True, "hicache": {"storage": MOONCAKE}})
    assert env(host)["MOONCAKE_LOCAL_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert pod_spec(host)["hostNetwork"] is True


def test_no_hostname_in_the_shared_config():
    p, kids = children({"hicache": {"storage": {**MOONCAKE, "extraConfig": {"local_hostname": "node-a"}}}})
    text = kids["ConfigMap"]["data"]["extra_config.json"]
    assert "local_hostname" not in text and "node-a" not in text
    payload = attach_payload(render.storage_config(p.outcome.spec))
    assert "local_hostname" not in payload["hicache_storage_backend_extra_config_json"]
    nested, _ = children({"hicache": {"storage": {**MOONCAKE, "extraConfig": {"x": [{"Local_Hostname": "node-b"}]}}}})
    assert "node-b" not in attach_payload(render.storage_config(nested.outcome.spec))["hicache_storage_backend_extra_config_json"]
    assert "x[0].Local_Hostname removed" in next(f.message for f in nested.outcome.findings
                                                 if f.rule == "extra-config-local-hostname")


def test_restart_hash_ignores_storage_but_not_other_changes():
    base, _ = children({})
    swapped, kids = children({"hicache": {"storage": {"backend": "file", "prefetchPolicy": "timeout",
                                                      "extraConfig": {"file_storage_path": "/x"}}}})
    assert swapped.desired.restart_hash == base.desired.restart_hash
    assert swapped.desired.storage_hash != base.desired.storage_hash
    ann = kids["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    assert ann[labels.STORAGE_HASH] == swapped.desired.storage_hash and ann[labels.STORAGE_BACKEND] == "file"
    for change in ({"image": "img2"}, {"pageSize": 16}, {"hicache": {"hostPool": {"ratio": 3}}},
                   {"hicache": {"writePolicy": "write_through_selective"}}):
        other, _ = children(change)
        assert other.desired.restart_hash != base.desired.restart_hash, change


def test_mooncake_layout_normalisation_restarts_because_layout_is_not_storage():
    base, _ = children({})
    mooncake, _ = children({"hicache": {"storage": MOONCAKE}})
    assert mooncake.desired.restart_hash != base.desired.restart_hash  # layer_first -> page_first
    pre, _ = children({"hicache": {"memLayout": "page_first"}})
    live, _ = children({"hicache": {"memLayout": "page_first", "storage": MOONCAKE}})
    assert pre.desired.restart_hash == live.desired.restart_hash


def test_process_backed_annotation_is_opt_in():
    _, plain = children({})
    assert labels.PROCESS_BACKED not in plain["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    # set by the harness: the operator's env (process_backed) or the HiCacheDeployment's annotation
    marked = body({"image": "img"})
    marked["metadata"]["annotations"] = {labels.PROCESS_BACKED: "true"}
    for p in (plan(body({"image": "img"}), [gpu_node("n")], process_backed=True), plan(marked, [gpu_node("n")])):
        sts = p.children[-1]
        assert sts["spec"]["template"]["metadata"]["annotations"][labels.PROCESS_BACKED] == "true"


def test_memory_request_from_sizing_and_user_values_kept():
    p, kids = children({"hicache": {"hostPool": {"sizeGBPerRank": 4}}, "resources": {"requests": {"cpu": "2"}}})
    res = pod_spec(kids)["containers"][0]["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"] == p.desired.sizing.pod_memory
    assert res["requests"]["cpu"] == "2"


def test_generated_key_secrets_and_pdb():
    owner = render.Owner("demo", "ns", "uid-1")
    keys = iter(["s3cret", "cl1ent"])
    p, _ = children({"engine": "sglang", "model": "Qwen/Qwen3-8B", "engineVersion": "0.5.23"})
    admin, api = render.generated_secrets(p.outcome.spec, owner, lambda: next(keys))
    assert (admin["metadata"]["name"], base64.b64decode(admin["data"]["admin-api-key"])) == ("demo-admin", b"s3cret")
    assert (api["metadata"]["name"], base64.b64decode(api["data"]["api-key"])) == ("demo-api", b"cl1ent")
    bundled, _ = children({})
    assert [s["metadata"]["name"] for s in render.generated_secrets(bundled.outcome.spec, owner, lambda: "k")] == [
        "demo-admin"]
    # the count restarts and swaps use: 25% of 7 rounds down to 1 (a PDB's own percentage would round up to 2)
    _, kids = children({"replicas": 7, "rollout": {"maxUnavailable": "25%"}})
    assert kids["PodDisruptionBudget"]["spec"]["minAvailable"] == 7 - 1
    _, kids = children({"replicas": 8, "rollout": {"maxUnavailable": "25%"}})
    assert kids["PodDisruptionBudget"]["spec"]["minAvailable"] == 8 - 2
    _, kids = children({"replicas": 1, "rollout": {"maxUnavailable": 3}})
    assert kids["PodDisruptionBudget"]["spec"]["minAvailable"] == 0


def test_rendering_is_deterministic():
    a, _ = children({"hicache": {"storage": MOONCAKE}})
    b, _ = children({"hicache": {"storage": MOONCAKE}})
    assert a.children == b.children
