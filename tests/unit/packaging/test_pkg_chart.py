"""The Helm chart as rendered: lint, hardening, probes, exact RBAC, namespaced mode, options."""
from __future__ import annotations

import pytest
from pkg_helpers import CHART, REPO, only

from hicache_operator.__main__ import parse_args

# What the operator does with the API, read from hicache_operator/ (kube.py, rollout/act/,
# handlers.py, informers/) and kopf: (apiGroup, resource) -> verbs. Written out here, not read from
# the chart, so a template change that widens or narrows a permission fails.
NAMESPACED = {
    ("hicache.dev", "hicachedeployments"): {"get", "list", "watch"},
    ("hicache.dev", "hicachedeployments/status"): {"patch"},
    ("apps", "statefulsets"): {"get", "create", "patch"},
    ("apps", "deployments"): {"list", "watch", "create", "patch", "delete"},  # the router, a managed Mooncake master
    ("", "services"): {"create", "patch", "delete"},
    ("", "serviceaccounts"): {"create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"create", "patch", "delete"},
    ("", "configmaps"): {"create", "patch"},
    ("policy", "poddisruptionbudgets"): {"create", "patch"},
    ("", "secrets"): {"get", "create"},
    ("", "persistentvolumeclaims"): {"get"},
    ("", "pods"): {"list", "watch", "patch", "delete"},
    ("discovery.k8s.io", "endpointslices"): {"list", "watch"},
    ("", "events"): {"create"},
}
CLUSTER = {
    ("", "nodes"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}
NAMESPACES = {("", "namespaces"): {"list", "watch"}}  # kopf, only with --namespace


def permissions(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def container(objs: list[dict]) -> dict:
    (c,) = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("sets", [(), ("watchNamespaces={a,b}",), ("metrics.serviceMonitor.enabled=true",),
                                  ("processBacked=true", "logLevel=debug"),
                                  ("monitoring.podMonitor.enabled=true", "monitoring.grafanaDashboard.enabled=true")])
def test_helm_lint_is_clean(helm, sets):
    args = ["lint", "--strict", str(CHART)] + [a for s in sets for a in ("--set", s)]
    out = helm.run(*args).stdout
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def test_default_install_is_cluster_wide_with_exactly_these_objects(helm):
    objs = helm.render()
    assert sorted(o["kind"] for o in objs) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                                               "ServiceAccount"]
    assert all(o["metadata"].get("namespace") == "hicache-system" for o in objs
               if o["kind"] not in ("ClusterRole", "ClusterRoleBinding"))
    assert "--all-namespaces" in container(objs)["args"]


def test_pod_is_hardened(helm):
    objs = helm.render()
    deployment = only(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # standalone kopf: never two at once
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    csc = container(objs)["securityContext"]
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert pod["serviceAccountName"] == only(objs, "ServiceAccount")["metadata"]["name"]
    resources = container(objs)["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]


@pytest.mark.parametrize("sets,port,path", [((), 8081, "/healthz"),
                                             (("kopf.liveness.port=9000", "kopf.liveness.path=/live"), 9000, "/live")])
def test_probes_hit_kopfs_liveness_endpoint(helm, sets, port, path):
    c = container(helm.render(*sets))
    assert f"--liveness=http://0.0.0.0:{port}{path}" in c["args"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["healthz"] == port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": path, "port": "healthz"}, probe


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses(helm):
    objs = helm.render()
    role = only(objs, "ClusterRole")
    assert permissions(role) == {**CLUSTER, **NAMESPACED}
    binding = only(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = only(objs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding")]


def test_namespaced_mode_renders_a_role_per_namespace(helm):
    objs = helm.render("watchNamespaces={team-a,team-b}")
    assert permissions(only(objs, "ClusterRole")) == {**CLUSTER, **NAMESPACES}
    sa = only(objs, "ServiceAccount")["metadata"]
    for ns in ("team-a", "team-b"):
        role = only(objs, "Role", namespace=ns)
        assert permissions(role) == NAMESPACED
        binding = only(objs, "RoleBinding", namespace=ns)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": "hicache-system"}]
    # kopf posts Events about nodes in its own namespace.
    assert permissions(only(objs, "Role", namespace="hicache-system")) == {("", "events"): {"create"}}
    args = container(objs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


def test_namespaced_mode_watching_its_own_namespace_needs_no_extra_role(helm):
    objs = helm.render("watchNamespaces={hicache-system}")
    (role,) = [o for o in objs if o["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "hicache-system" and permissions(role) == NAMESPACED


def test_cluster_scoped_names_carry_the_release_namespace(helm):
    a = only(helm.render(namespace="ns-a"), "ClusterRole")["metadata"]["name"]
    b = only(helm.render(namespace="ns-b"), "ClusterRole")["metadata"]["name"]
    assert a != b


def test_rbac_can_be_left_to_the_user(helm):
    objs = helm.render("rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=mine")
    assert sorted(o["kind"] for o in objs) == ["Deployment", "Service"]
    assert only(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    assert "serviceAccount.name is required" in helm.render_error("serviceAccount.create=false")


def test_metrics_service_and_optional_service_monitor(helm):
    objs = helm.render()
    assert not [o for o in objs if o["kind"] == "ServiceMonitor"]
    svc = only(objs, "Service")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]
    assert svc["spec"]["selector"].items() <= only(objs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    assert "--metrics-port=8080" in container(objs)["args"]

    objs = helm.render("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")
    sm = only(objs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= only(objs, "Service")["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"

    objs = helm.render("metrics.port=0")
    assert not [o for o in objs if o["kind"] == "Service"]
    assert "--metrics-port=0" in container(objs)["args"]
    assert "needs metrics.port > 0" in helm.render_error("metrics.port=0", "metrics.serviceMonitor.enabled=true")


def test_process_backed_is_off_by_default_and_complete_when_on(helm):
    objs = helm.render()
    pod = only(objs, "Deployment")["spec"]["template"]
    assert "hicache.dev/process-backed" not in (pod["metadata"].get("annotations") or {})
    assert "HICACHE_PROCESS_BACKED_PODS" not in {e["name"] for e in container(objs)["env"]}

    objs = helm.render("processBacked=true", "podAnnotations.extra=kept")
    pod = only(objs, "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"hicache.dev/process-backed": "true", "extra": "kept"}
    c = container(objs)
    env = {e["name"]: e for e in c["env"]}
    assert env["HICACHE_PROCESS_BACKED_PODS"]["value"] == "1"
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert c["command"] == ["python", "-m", "hicache_operator"]
    assert "--metrics-host=$(POD_IP)" in c["args"] and "--liveness=http://$(POD_IP):8081/healthz" in c["args"]


@pytest.mark.parametrize("sets,expected", [
    ((), {"all_namespaces": True, "namespace": None, "verbose": False, "metrics_port": 8080,
          "metrics_host": "0.0.0.0", "liveness": "http://0.0.0.0:8081/healthz", "reconcile_interval": 30}),
    (("watchNamespaces={a,b}", "logLevel=debug", "reconcileInterval=7.5"),
     {"all_namespaces": False, "namespace": ["a", "b"], "verbose": True, "reconcile_interval": 7.5}),
    (("processBacked=true", "metrics.port=0"),
     {"metrics_port": 0, "metrics_host": "10.0.0.1", "liveness": "http://10.0.0.1:8081/healthz"}),
])
def test_rendered_command_line_is_one_the_operator_accepts(helm, sets, expected):
    c = container(helm.render(*sets))
    assert c["command"] == ["python", "-m", "hicache_operator"]
    args = vars(parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]]))
    assert {k: args[k] for k in expected} == expected


def test_image_defaults_to_the_released_image_of_the_app_version(helm):
    """The registry path the release process pushes to (docs/release.md), so an install needs no edits."""
    assert container(helm.render())["image"] == "ghcr.io/hicache-dev/hicache-operator:0.1.0"
    assert "ghcr.io/hicache-dev/hicache-operator:<version>" in (REPO / "docs" / "release.md").read_text()
    assert container(helm.render("image.repository=reg.example/op", "image.tag=v2"))["image"] == "reg.example/op:v2"


@pytest.mark.parametrize("sets,message", [
    (("logLevel=warn",), "logLevel"),
    (("watchNamespaces={team-*}",), "does not match pattern"),
    (("watchNamespaces={a,a}",), "watchNamespaces"),
    (("wathNamespaces={a}",), "wathNamespaces"),
    (("reconcileInterval=0",), "reconcileInterval"),
    (("image.pullPolicy=Sometimes",), "pullPolicy"),
])
def test_bad_values_are_refused_with_the_key_named(helm, sets, message):
    assert message in helm.render_error(*sets)
