"""SGLang's router in front of the fleet (``spec.router_on``): its Deployment (sglang-router behind
the client gate, discovering the pods in serving through the API server), its ServiceAccount, and
a Role and RoleBinding that let it list and watch pods in the namespace, nothing else."""

from __future__ import annotations

from typing import Any

from hicache_operator.api import flags, labels
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.fleet import gate
from hicache_operator.fleet.names import names
from hicache_operator.plan.render.common import (Owner, container_security, field_env, meta, pod_security,
                                                 resources_of, secret_env, stamp)
from hicache_operator.plan.render.secrets import secret_ref, uses_api_key

ROUTER_CONTAINER = "router"
CLIENT_KEY_ENV = "HICACHE_CLIENT_API_KEY"  # router_gate.py reads the clients' key from it
ROUTER_METRICS_PORT = 29000


def router_args(spec: HiCacheDeploymentSpec, owner: Owner) -> list[str]:
    """sglang-router's command line: Kubernetes discovery of the pods in serving (the client
    Service's selector) in the fleet's namespace, at their runtime port; its own port is
    ``ROUTER_API_PORT``, behind the client gate."""
    selector = {**labels.selector_labels(owner.name), **gate.selector()}
    args = ["--host", "$(POD_IP)", "--port", str(flags.ROUTER_API_PORT), "--policy", spec.router.policy,
            "--service-discovery", "--selector", *(f"{k}={v}" for k, v in selector.items()),
            "--service-discovery-port", str(flags.RUNTIME_PORT), "--service-discovery-namespace", owner.namespace,
            "--prometheus-host", "$(POD_IP)", "--prometheus-port", str(ROUTER_METRICS_PORT),
            "--shutdown-grace-period-secs", str(spec.rollout.drain_timeout_seconds)]
    if uses_api_key(spec):  # the pods' key: the router gives it to the pods it discovers, and wants it
        args += ["--api-key", f"$({flags.API_KEY_ENV})"]
    return args


def gate_args() -> list[str]:
    """The client gate (hicache_operator/router_gate.py): the clients' port, in front of the router's."""
    return ["--host", "$(POD_IP)", "--port", str(flags.RUNTIME_PORT),
            "--upstream", f"http://$(POD_IP):{flags.ROUTER_API_PORT}"]


def router_pod_labels(owner: Owner) -> dict[str, str]:
    return {**labels.router_selector_labels(owner.name), labels.COMPONENT: "router", labels.ROUTER: owner.name}


def router_deployment(spec: HiCacheDeploymentSpec, owner: Owner, *, process_backed: bool = False) -> dict[str, Any]:
    n = names(owner.name)
    env = [field_env("POD_IP", "status.podIP")]
    if uses_api_key(spec):
        env += [secret_env(flags.API_KEY_ENV, *secret_ref(spec, owner.name, "internal")),
                secret_env(CLIENT_KEY_ENV, *secret_ref(spec, owner.name, "api"))]
    # the client gate (router_gate.py) runs the router as its child: clients reach the gate's port,
    # inference paths only, with their own key; the router's port is the operator's
    container = {
        "name": ROUTER_CONTAINER,
        "image": spec.router.image,
        "command": ["python", "-m", "hicache_operator.router_gate"],
        "args": [*gate_args(), "--shutdown-grace-period-secs", str(spec.rollout.drain_timeout_seconds), "--",
                 "python", "-m", "sglang_router.launch_router", *router_args(spec, owner)],
        "ports": [{"name": "http", "containerPort": flags.RUNTIME_PORT, "protocol": "TCP"},
                  {"name": "router", "containerPort": flags.ROUTER_API_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources_of(spec.router.resources),
        # ready once it routes to at least one healthy pod (asked through the gate)
        "readinessProbe": {"httpGet": {"port": "http", "path": "/readiness"}, "periodSeconds": 5,
                           "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"port": "router", "path": "/liveness"}, "periodSeconds": 15,
                          "timeoutSeconds": 5, "failureThreshold": 4},
        "securityContext": container_security(read_only_root=True),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    template = {
        "metadata": {"labels": router_pod_labels(owner),
                     "annotations": {labels.PROCESS_BACKED: "true"} if process_backed else {}},
        "spec": {
            "serviceAccountName": n.router,
            "automountServiceAccountToken": True,  # its discovery lists and watches pods
            "securityContext": pod_security(),
            "terminationGracePeriodSeconds": spec.rollout.drain_timeout_seconds + 30,
            "containers": [container],
        },
    }
    return stamp({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": meta(owner, n.router, "router"),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels.router_selector_labels(owner.name)},
            # a new router pod serves before an old one leaves
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "revisionHistoryLimit": 3,
            "template": template,
        },
    })


ROUTER_RBAC_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


def router_rbac(owner: Owner) -> list[dict[str, Any]]:
    """The router's ServiceAccount, and a Role (pods: list, watch, in this namespace) bound to it."""
    name = names(owner.name).router
    return [
        stamp({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(owner, name, "router")}),
        stamp({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(owner, name, "router"),
                "rules": ROUTER_RBAC_RULES}),
        stamp({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": meta(owner, name, "router"),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]}),
    ]


def router_children(owner: Owner) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what only a fleet with the router has: removed when it is turned off."""
    n = names(owner.name)
    return [("apps/v1", "Deployment", n.router), ("v1", "Service", n.serving),
            ("rbac.authorization.k8s.io/v1", "RoleBinding", n.router),
            ("rbac.authorization.k8s.io/v1", "Role", n.router), ("v1", "ServiceAccount", n.router)]
