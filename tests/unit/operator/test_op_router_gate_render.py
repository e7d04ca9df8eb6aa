"""Three keys behind the router: clients hold theirs for the gate only; the pods, the router and the
operator share the fleet's internal key; the admin key stays with the pods and the operator."""

from __future__ import annotations

from op_helpers import body, gpu_node

from hicache_operator.api import flags
from hicache_operator.plan import render
from hicache_operator.control.pipeline import plan

SGLANG = {"image": "img", "engine": "sglang", "model": "Qwen/Qwen3-8B", "engineVersion": "0.5.23"}


def rendered(spec):
    p = plan(body(spec), [gpu_node("n")])
    assert p.outcome.ok, p.outcome.findings
    return p, {(c["kind"], c["metadata"]["name"]): c for c in p.children}


def env(container) -> dict[str, dict]:
    return {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", e.get("value")) for e in container["env"]}


def test_behind_the_router_the_pods_key_is_the_internal_one_and_clients_reach_only_the_gate():
    p, kids = rendered({**SGLANG, "router": {"enabled": True}})
    pod = kids["StatefulSet", "demo"]["spec"]["template"]["spec"]["containers"][0]
    assert env(pod)[flags.API_KEY_ENV] == {"name": "demo-internal", "key": "api-key"}
    (router,) = kids["Deployment", "demo-router"]["spec"]["template"]["spec"]["containers"]
    # the gate runs the router as its child: its own arguments, then the router's command line
    assert router["command"] == ["python", "-m", "hicache_operator.router_gate"]
    split = router["args"].index("--")
    gate_args, router_args = router["args"][:split], router["args"][split + 1:]
    assert router_args[:3] == ["python", "-m", "sglang_router.launch_router"]
    assert gate_args[gate_args.index("--upstream") + 1].endswith(f":{flags.ROUTER_API_PORT}")
    assert router_args[router_args.index("--port") + 1] == str(flags.ROUTER_API_PORT)
    assert router_args[router_args.index("--api-key") + 1] == f"$({flags.API_KEY_ENV})"
    assert env(router)[render.CLIENT_KEY_ENV] == {"name": "demo-api", "key": "api-key"}
    assert env(router)[flags.API_KEY_ENV] == {"name": "demo-internal", "key": "api-key"}
    # the client Service's port is the gate's: the router's own port is in no Service
    ports = {pt["name"]: pt["containerPort"] for pt in router["ports"]}
    assert ports["http"] == flags.RUNTIME_PORT and ports["router"] == flags.ROUTER_API_PORT
    assert kids["Service", "demo"]["spec"]["ports"][0]["targetPort"] == "http"
    secrets = {s["metadata"]["name"] for s in render.generated_secrets(p.outcome.spec, p.owner, lambda: "k")}
    assert {"demo-api", "demo-internal", "demo-admin"} <= secrets


def test_without_the_router_clients_hold_the_pods_key_and_a_warning_says_what_that_exposes():
    p, kids = rendered(SGLANG)
    pod = kids["StatefulSet", "demo"]["spec"]["template"]["spec"]["containers"][0]
    assert env(pod)[flags.API_KEY_ENV] == {"name": "demo-api", "key": "api-key"}
    assert "clients-hold-pods-key" in {f.rule for f in p.outcome.findings}
    assert "demo-internal" not in {s["metadata"]["name"] for s in render.generated_secrets(
        p.outcome.spec, p.owner, lambda: "k")}
