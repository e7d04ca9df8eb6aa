"""Escape hatches: env, envFrom, extraArgs and the podTemplate overlay, rendered and refused."""

from __future__ import annotations

import pytest
from op_helpers import body, gpu_node

from hicache_operator.plan.engine import cli as engine_cli
from hicache_operator.api import flags, labels
from hicache_operator.plan import overlay, render
from hicache_operator.control.pipeline import plan

SGLANG = {"engine": "sglang", "image": "lmsysorg/sglang:v0.5.23-cu129", "model": "Qwen/Qwen3-8B"}


def planned(spec: dict):
    return plan(body({"image": "img", **spec}), [gpu_node("n")])


def errors(spec: dict) -> list[tuple[str, str]]:
    return [(f.rule, f.message) for f in planned(spec).outcome.errors]


def template(p) -> dict:
    return p.children[-1]["spec"]["template"]


# ---- the merge --------------------------------------------------------------------------------

def test_merge_keys_lists_by_their_kubernetes_merge_keys_and_replaces_the_others():
    base = {"metadata": {"labels": {"a": "1"}},
            "spec": {"containers": [{"name": "runtime", "image": "i", "env": [{"name": "X", "value": "1"}],
                                     "ports": [{"containerPort": 1, "name": "http"}],
                                     "volumeMounts": [{"name": "v", "mountPath": "/v"}],
                                     "securityContext": {"capabilities": {"drop": ["ALL"]}}}],
                     "volumes": [{"name": "v", "emptyDir": {}}], "readinessGates": [{"conditionType": "g"}],
                     "securityContext": {"runAsUser": 1000, "fsGroup": 1000}}}
    patch = {"metadata": {"labels": {"b": "2"}},
             "spec": {"containers": [{"name": "side", "image": "s"},
                                     {"name": "runtime", "env": [{"name": "Y", "value": "2"}],
                                      "ports": [{"containerPort": 9, "name": "m"}],
                                      "volumeMounts": [{"name": "w", "mountPath": "/w"}],
                                      "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}],
                      "volumes": [{"name": "w", "hostPath": {"path": "/w"}}],
                      "readinessGates": [{"conditionType": "mine"}],
                      "securityContext": {"fsGroup": None, "runAsGroup": 5}}}
    out = overlay.merge(base, patch)
    assert out["metadata"]["labels"] == {"a": "1", "b": "2"}
    runtime, side = out["spec"]["containers"]
    assert side == {"name": "side", "image": "s"} and runtime["image"] == "i"
    assert [e["name"] for e in runtime["env"]] == ["X", "Y"]
    assert [p["containerPort"] for p in runtime["ports"]] == [1, 9]
    assert [m["mountPath"] for m in runtime["volumeMounts"]] == ["/v", "/w"]
    assert runtime["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert [v["name"] for v in out["spec"]["volumes"]] == ["v", "w"]
    assert out["spec"]["readinessGates"] == [{"conditionType": "mine"}]  # no merge key: replaced
    assert out["spec"]["securityContext"] == {"runAsUser": 1000, "runAsGroup": 5}  # null deletes
    assert base["spec"]["volumes"] == [{"name": "v", "emptyDir": {}}]  # the base is not changed


def test_merge_of_an_item_without_its_key_is_refused():
    with pytest.raises(overlay.OverlayError, match=r"volumes\[0\] needs its name"):
        overlay.merge({"spec": {"volumes": [{"name": "v"}]}}, {"spec": {"volumes": [{"emptyDir": {}}]}})


# ---- what the overlay may not touch, read from the rendered pod ------------------------------

def test_conflicts_come_from_what_was_rendered():
    """A field the operator renders is protected because it is rendered, whatever it is."""
    base = {"metadata": {"labels": {"x": "1"}}, "spec": {"someNewField": 1, "containers": [
        {"name": "c", "anotherField": {"k": 1}}]}}
    found = overlay.conflicts(base, {"metadata": {"labels": {"x": "2", "y": "3"}},
                                     "spec": {"someNewField": 2, "other": 1,
                                              "containers": [{"name": "c", "anotherField": {"j": 2}}]}}, "c")
    assert [p for p, _ in found] == ["podTemplate.metadata.labels.x", "podTemplate.spec.someNewField",
                                     "podTemplate.spec.containers[name=c].anotherField"]


@pytest.mark.parametrize("patch,path", [
    ({"terminationGracePeriodSeconds": 5}, "podTemplate.spec.terminationGracePeriodSeconds"),
    ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, "podTemplate.spec.volumes[name=dshm]"),
    ({"volumes": [{"name": "storage-config", "configMap": {"name": "x"}}]},
     "podTemplate.spec.volumes[name=storage-config]"),
    ({"nodeSelector": {"a": "b"}}, "podTemplate.spec.nodeSelector"),
    ({"tolerations": []}, "podTemplate.spec.tolerations"),
    ({"affinity": {}}, "podTemplate.spec.affinity"),
    ({"hostNetwork": True}, "podTemplate.spec.hostNetwork"),
    ({"containers": [{"name": "runtime", "readinessProbe": {"periodSeconds": 1}}]},
     "podTemplate.spec.containers[name=runtime].readinessProbe"),
    ({"containers": [{"name": "runtime", "livenessProbe": None}]},
     "podTemplate.spec.containers[name=runtime].livenessProbe"),
    ({"containers": [{"name": "runtime", "startupProbe": {}}]}, "podTemplate.spec.containers[name=runtime].startupProbe"),
    ({"containers": [{"name": "runtime", "command": ["sh"]}]}, "podTemplate.spec.containers[name=runtime].command"),
    ({"containers": [{"name": "runtime", "args": ["--x"]}]}, "podTemplate.spec.containers[name=runtime].args"),
    ({"containers": [{"name": "runtime", "ports": [{"containerPort": 30000, "name": "x"}]}]},
     "podTemplate.spec.containers[name=runtime].ports[containerPort=30000]"),
    ({"containers": [{"name": "runtime", "env": [{"name": "A", "value": "1"}]}]},
     "podTemplate.spec.containers[name=runtime].env"),
    ({"containers": [{"name": "runtime", "resources": {"limits": {"rdma/hca": 1}}}]},
     "podTemplate.spec.containers[name=runtime].resources"),
    ({"containers": [{"name": "runtime", "image": "other"}]}, "podTemplate.spec.containers[name=runtime].image"),
    ({"containers": [{"name": "runtime", "volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]}]},
     "podTemplate.spec.containers[name=runtime].volumeMounts[mountPath=/dev/shm]"),
    ({"containers": [{"name": "runtime", "terminationMessagePolicy": "File"}]},
     "podTemplate.spec.containers[name=runtime].terminationMessagePolicy"),
    ({"containers": [{"image": "no-name"}]}, "podTemplate.spec.containers"),
])
def test_an_overlay_that_changes_what_the_operator_renders_is_refused_naming_the_path(patch, path):
    found = errors({"podTemplate": {"spec": patch}})
    assert [r for r, _ in found] == ["pod-template-conflict"], found
    assert found[0][1].startswith(f"{path}: ")
    assert "podTemplate adds to the pods the operator renders; it cannot change them" in found[0][1]


def test_a_volume_of_extra_volumes_is_protected_like_the_operators():
    found = errors({"extraVolumes": [{"name": "models", "emptyDir": {}}],
                    "podTemplate": {"spec": {"volumes": [{"name": "models", "hostPath": {"path": "/m"}}]}}})
    assert [m.split(":")[0] for _, m in found] == ["podTemplate.spec.volumes[name=models]"]


def test_pod_template_metadata_may_not_use_the_operators_keys():
    for meta in ({"labels": {labels.INSTANCE: "x"}}, {"labels": {"hicache.dev/serving": "true"}},
                 {"annotations": {labels.RESTART_HASH: "x"}}):
        assert [r for r, _ in errors({"podTemplate": {"metadata": meta}})] == ["pod-template-metadata"], meta
    assert errors({"podTemplate": {"metadata": {"labels": {"team": "a"}, "annotations": {labels.INSTANCE: "ok"}}}}) == []


def test_an_allowed_overlay_reaches_the_pod_template_beside_everything_the_operator_renders():
    spec = {"podTemplate": {
        "metadata": {"labels": {"team": "infra"}, "annotations": {"prometheus.io/scrape": "true"}},
        "spec": {"priorityClassName": "gpu-high", "schedulerName": "default-scheduler", "runtimeClassName": "nvidia",
                 "imagePullSecrets": [{"name": "regcred"}], "securityContext": {"supplementalGroups": [44]},
                 "automountServiceAccountToken": True,
                 "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
                 "containers": [
                     {"name": "runtime", "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                      "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                      "ports": [{"containerPort": 9000, "name": "extra"}]},
                     {"name": "log-shipper", "image": "fluent-bit:3"}]}}}
    plain, p = planned({}), planned(spec)
    assert p.outcome.ok, p.outcome.findings
    t, base = template(p), template(plain)
    assert t["metadata"]["labels"] == {**base["metadata"]["labels"], "team": "infra"}
    assert t["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert t["metadata"]["annotations"][labels.RESTART_HASH] != base["metadata"]["annotations"][labels.RESTART_HASH]
    ps = t["spec"]
    assert (ps["priorityClassName"], ps["schedulerName"], ps["runtimeClassName"]) == \
        ("gpu-high", "default-scheduler", "nvidia")
    assert ps["imagePullSecrets"] == [{"name": "regcred"}] and ps["automountServiceAccountToken"] is True
    assert ps["securityContext"] == {**base["spec"]["securityContext"], "supplementalGroups": [44]}
    assert "readinessGates" not in ps  # serving is the hicache.dev/serving label, not a gate
    assert [v["name"] for v in ps["volumes"]] == [v["name"] for v in base["spec"]["volumes"]] + ["models"]
    runtime, shipper = ps["containers"]
    assert shipper == {"name": "log-shipper", "image": "fluent-bit:3"}
    ours = base["spec"]["containers"][0]
    for key in ("command", "args", "env", "readinessProbe", "livenessProbe", "startupProbe", "resources", "image"):
        assert runtime[key] == ours[key], key
    assert runtime["ports"] == ours["ports"] + [{"containerPort": 9000, "name": "extra"}]
    assert runtime["volumeMounts"][-1] == {"name": "models", "mountPath": "/models"}
    assert runtime["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


# ---- env and envFrom ---------------------------------------------------------------------------

def test_env_and_env_from_are_added_after_the_operators_env():
    p = planned({"env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                         {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                 "envFrom": [{"configMapRef": {"name": "tuning"}}]})
    c = template(p)["spec"]["containers"][0]
    ours = render.operator_env(p.outcome.spec, render.Owner("demo", "ns", "uid-1"))
    assert c["env"] == ours + [{"name": "NCCL_DEBUG", "value": "INFO"},
                               {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    assert c["envFrom"] == [{"configMapRef": {"name": "tuning"}}]


@pytest.mark.parametrize("name,source", [
    ("POD_IP", " (the pod's status.podIP)"),
    ("HICACHE_ADMIN_API_KEY", " (key admin-api-key of Secret demo-admin)"),
    ("HOME", ""),
    ("MOONCAKE_MASTER", " (from hicache.storage.mooncake.masterAddress)"),
])
def test_an_env_var_the_operator_sets_is_refused(name, source):
    spec = {"env": [{"name": "OK", "value": "1"}, {"name": name, "value": "mine"}],
            "hicache": {"storage": {"backend": "mooncake", "mooncake": {"masterAddress": "m:1"}}}}
    assert errors(spec) == [("env-owned", f"env[1] {name} is set by the operator{source}: remove it from env")]


# ---- extraArgs ---------------------------------------------------------------------------------

def test_extra_args_follow_the_operators_args_in_the_pod_and_in_status():
    p = planned({**SGLANG, "extraArgs": ["--mem-fraction-static", "0.85", "--log-level=debug",
                                         "--served-model-name", "$(POD_NAME)"]})
    assert p.outcome.ok, p.outcome.findings
    c = template(p)["spec"]["containers"][0]
    assert c["args"][-5:] == ["--mem-fraction-static", "0.85", "--log-level=debug", "--served-model-name", "$(POD_NAME)"]
    assert c["args"] == p.desired.effective_config.args
    assert p.desired.restart_hash != planned(SGLANG).desired.restart_hash


@pytest.mark.parametrize("engine_spec,arg,field", [
    (SGLANG, "--tp-size", "spec.parallelism.tp"),
    (SGLANG, "--tensor-parallel-size", "spec.parallelism.tp"),  # an alias SGLang's parser declares
    (SGLANG, "--tp", "spec.parallelism.tp"),  # an abbreviation argparse accepts
    (SGLANG, "--model=/x", "spec.model"),
    (SGLANG, "--hicache-size", "spec.hicache.hostPool"),
    (SGLANG, "--hicache-storage-backend", "spec.hicache.storage.backend"),
    (SGLANG, "--api-key", "spec.apiKeySecretRef"),
    (SGLANG, "--dp-size", "spec.parallelism.dp"),
    ({}, "--page-size", "spec.pageSize"),
    ({}, "--admin-api-key", "spec.adminKeySecretRef"),
])
def test_a_flag_the_operator_renders_is_refused_naming_the_field_that_sets_it(engine_spec, arg, field):
    found = errors({**engine_spec, "extraArgs": [arg, "1"]})
    flag = arg.split("=")[0]
    assert found == [("extra-args-owned-flag",
                      f"extraArgs {flag} is rendered from {field}: set that instead; remove it from extraArgs")]


@pytest.mark.parametrize("arg", ["--host", "--port", "--enable-hierarchical-cache", "--enable-metrics", "--config"])
def test_flags_the_operator_always_sets_are_refused(arg):
    found = errors({**SGLANG, "extraArgs": [arg, "x"]})
    assert [r for r, _ in found] == ["extra-args-owned-flag"] and found[0][1].startswith(f"extraArgs {arg} ")


def test_every_flag_the_renderer_emits_is_owned():
    for spec in ({**SGLANG, "parallelism": {"tp": 4, "dp": 2}, "enableCacheReport": True, "maxTotalTokens": 9,
                  "hicache": {"storage": {"backend": "mooncake", "mooncake": {"masterAddress": "m:1"}}}},
                 {**SGLANG, "engineVersion": "0.5.9", "parallelism": {"tp": 4, "dp": 2}},
                 {"hicache": {"hostPool": {"sizeGBPerRank": 3}, "storage": {"backend": "file"}},
                  "extraVolumes": [{"name": "l3", "emptyDir": {}}],
                  "extraVolumeMounts": [{"name": "l3", "mountPath": "/tmp/hicache"}]}):
        p = planned({**spec, "image": spec.get("image", "img")})
        assert p.outcome.ok, p.outcome.findings
        rendered = {a for a in p.desired.effective_config.args if a.startswith("--")}
        assert rendered <= set(flags.owned_flags(p.outcome.spec.engine)), rendered - set(flags.owned_flags("sglang"))


def test_a_flag_the_engine_does_not_know_is_refused():
    assert errors({**SGLANG, "extraArgs": ["--mem-fraction-statc", "0.8"]}) == [
        ("extra-args-unknown-flag",
         "extraArgs --mem-fraction-statc: SGLang 0.5.23 does not know it; correct it or remove it from extraArgs")]
    assert [r for r, _ in errors({"extraArgs": ["--mem-fraction-static", "0.8"]})] == ["extra-args-unknown-flag"]
    assert errors({"extraArgs": ["--cpu-threads", "2", "--log-level", "debug"]}) == []
    ambiguous = errors({**SGLANG, "extraArgs": ["--hicache"]})
    assert "it abbreviates several flags of SGLang 0.5.23" in ambiguous[0][1]


def test_values_are_not_read_as_flags():
    assert errors({**SGLANG, "extraArgs": ["--json-model-override-args", '{"a": -1}', "--max-running-requests",
                                           "-1", "--chat-template", "-"]}) == []


def test_an_unchecked_release_is_read_for_owned_flags_only():
    newer = {**SGLANG, "image": "lmsysorg/sglang:v0.6.1"}
    assert engine_cli.known_flags("sglang", "0.6.1") is None
    assert [r for r, _ in errors({**newer, "extraArgs": ["--a-flag-from-the-future"]})] == []
    assert [r for r, _ in errors({**newer, "extraArgs": ["--tp", "2"]})] == ["extra-args-owned-flag"]
    between = engine_cli.known_flags("sglang", "0.5.15")
    assert between is not None and ("--model", "--model-path") in between  # every checked release's flags


def test_the_bundled_flag_table_is_the_runtimes_own_parser():
    from testbed.engine_cli import bundled

    assert engine_cli._table()["bundled"] == bundled(), "run python -m testbed.engine_cli"


def test_a_spec_whose_pod_cannot_be_rendered_is_refused_for_that_not_for_the_overlay():
    found = errors({"affinity": {"podAffinity": []}, "podTemplate": {"spec": {"readinessGates": []}}})
    assert [r for r, _ in found] == ["invalid-pod-field"], found
