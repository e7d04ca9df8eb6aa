"""One reconcile of a HiCacheDeployment, independent of kopf.

``plan`` is pure (body + nodes -> validation outcome, rendered children, desired state);
``reconcile`` does the I/O through ``kube.Kube``: apply children, create the admin Secret once,
delete pods whose template is stale (within maxUnavailable), delete a managed Mooncake master the
spec no longer asks for, and compute the status. Handlers call it; tests can call it directly
against a real API server.
"""

from __future__ import annotations

import re
import secrets
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any, Callable

from hicache_operator.api import labels
from hicache_operator.io import model_progress
from hicache_operator.plan.model import source as model_source
from hicache_operator.plan import render, sizing
from hicache_operator.io.kube import Kube
from hicache_operator.fleet.pods import pod_is_terminating, restart_hash_of
from hicache_operator.api.rules import rule
from hicache_operator.plan.status import Desired, build_status
from hicache_operator.api.status import EffectiveConfig, MooncakeMasterStatus, RuleNote
from hicache_operator.plan.validation import Finding, Outcome, check_rendered, validate


@dataclass
class Plan:
    outcome: Outcome
    owner: render.Owner
    desired: Desired | None = None
    children: list[dict[str, Any]] = field(default_factory=list)  # without the admin Secret


@dataclass
class Result:
    status: dict[str, Any]
    plan: Plan
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    pods: list[dict[str, Any]] = field(default_factory=list)  # as listed in this reconcile
    alongside: Any = None  # what ``reconcile``'s ``alongside`` returned
    workload: Callable[[], Any] | None = None  # the rest of the applies, left to the caller (defer_workload)


def event_reason(rule_name: str) -> str:
    """Kubernetes-style CamelCase reason for a rule name (mooncake-layer-first -> MooncakeLayerFirst)."""
    return "".join(part.capitalize() for part in re.split(r"[-_]", rule_name))


def _effective_hicache(spec) -> dict[str, Any]:
    """spec.hicache as the pods get it: the storage extraConfig with its page namespace applied."""
    hicache = spec.model_dump(by_alias=True, mode="json", exclude_none=True)["hicache"]
    hicache["storage"]["extraConfig"] = render.effective_extra_config(spec)
    return hicache


def plan(body: dict[str, Any], nodes: list[dict] | None, *, process_backed: bool = False) -> Plan:
    meta = body.get("metadata") or {}
    owner = render.Owner(meta.get("name", ""), meta.get("namespace", "default"), meta.get("uid", ""))
    # the local test cluster's harness marks a fleet whose pods it runs as processes (never a spec field)
    process_backed = process_backed or (meta.get("annotations") or {}).get(labels.PROCESS_BACKED) == "true"
    previous = body.get("status") or {}
    outcome = validate(body.get("spec") or {}, name=owner.name, namespace=owner.namespace, nodes=nodes,
                       pinned_sizing=previous.get("sizing"))
    if not outcome.ok:
        return Plan(outcome, owner)
    spec, sized = outcome.spec, outcome.sizing
    assert spec is not None
    try:
        rendered = render.render(spec, sized, owner, process_backed=process_backed)
    except ValueError as exc:  # fromNodeMemory without nodes: only when the caller passed none
        outcome.findings.append(Finding("schema", "error", str(exc)))
        return Plan(outcome, owner)
    outcome.findings += check_rendered(spec, rendered)  # what podTemplate would change in the pod
    if not outcome.ok:
        return Plan(outcome, owner)
    effective = EffectiveConfig(
        engine=spec.engine, model=spec.model,
        hicache=_effective_hicache(spec),
        command=rendered.command,
        args=rendered.args,
        restart_hash=rendered.restart_hash,
        storage_hash=rendered.storage_hash,
        normalisations=[RuleNote(rule=f.rule, message=f.message) for f in outcome.of("normalised")],
        warnings=[RuleNote(rule=f.rule, message=f.message) for f in outcome.of("warning")])
    desired = Desired(replicas=spec.replicas, selector=labels.selector_string(owner.name),
                      router_replicas=spec.router.replicas if spec.router_on else None,
                      restart_hash=effective.restart_hash, storage_hash=effective.storage_hash,
                      backend=spec.hicache.storage.backend, host_pool=render.host_pool_text(spec, sized),
                      effective_config=effective, sizing=sized)
    return Plan(outcome, owner, desired, rendered.children)


def finding_events(outcome: Outcome) -> list[tuple[str, str, str]]:
    return [("Warning", event_reason(f.rule), f"[{f.rule}] {f.message}")
            for f in outcome.findings if f.severity in ("error", "normalised", "warning")]


def master_view(spec: Any, name: str, observed: dict[str, Any] | None) -> MooncakeMasterStatus | None:
    """The managed master as status shows it: wanted by the spec, ready as its Deployment says
    (``informers.master_essence``; None: not created yet). None without a managed master."""
    managed = render.managed_master(spec)
    if managed is None:
        return None
    ready = int((observed or {}).get("readyReplicas") or 0)
    return MooncakeMasterStatus(deployment=render.names(name).mooncake_master,
                                address=spec.hicache.storage.mooncake.master_address,
                                replicas=managed.ha.replicas if managed.ha is not None else 1,
                                ready_replicas=ready, ready=ready > 0)


FIRST = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding")  # what pods read or need at start
WORKLOADS = ("Deployment", "StatefulSet")  # what starts pods


def first_calls(kube: Kube, children: list[dict[str, Any]]) -> list[Callable[[], Any]]:
    """The applies of ``FIRST``, each an independent call but a RoleBinding, which runs after the
    Role in the same call: the API server checks a binding against the rules of the Role it
    references (the operator may grant only what it holds itself), and refuses one whose Role does
    not exist yet with 404."""
    ordered = ("Role", "RoleBinding")
    rbac = sorted((c for c in children if c["kind"] in ordered), key=lambda c: ordered.index(c["kind"]))
    calls: list[Callable[[], Any]] = [lambda child=child: kube.apply(child) for child in children
                                      if child["kind"] in FIRST and child["kind"] not in ordered]
    if rbac:
        calls.append(lambda: [kube.apply(child) for child in rbac])
    return calls


def start_children(kube: Kube, p: Plan, new_key: Callable[[], str], *,
                   hold_workload: bool = False) -> tuple[list[str], Callable[[], None]]:
    """Apply what the pods read or need at start (the ConfigMap, the key Secrets, the router's
    ServiceAccount and RBAC: a router that starts without them waits a minute before it looks
    again) while the Services and the PodDisruptionBudget are started beside them, then start
    the Deployments (the router, a managed Mooncake master); returns (the Secrets this call
    generated, ``finish``). ``finish()`` applies the StatefulSet (after what its pods read, so
    they never start without it; not at all with ``hold_workload``) and then waits for the rest.
    Why not all at once: a ClusterIP Service's create allocates an IP, which on a busy API
    server took ~10x any other apply; nothing waits for it now but the end of the reconcile."""
    *others, sts = p.children
    assert sts["kind"] == "StatefulSet", "render.children puts the workload last"
    first = first_calls(kube, others)
    beside = [kube.submit(lambda child=child: kube.apply(child)) for child in others
              if child["kind"] not in FIRST + WORKLOADS]
    created: list[str] = []
    for secret in render.generated_secrets(p.outcome.spec, p.owner, new_key) if p.outcome.spec else []:
        first.append(lambda secret=secret: created.append(secret["metadata"]["name"])
                     if kube.ensure_secret(secret) else None)

    def finish() -> None:
        try:
            if not hold_workload:
                kube.apply(sts)
        finally:
            wait(beside)  # never leave an apply of this reconcile in flight after it
        for f in beside:
            f.result()
    try:
        kube.concurrently(*first)
    except BaseException:
        wait(beside)
        raise
    beside += [kube.submit(lambda child=child: kube.apply(child)) for child in others if child["kind"] in WORKLOADS]
    return created, finish


def apply_children(kube: Kube, p: Plan, new_key: Callable[[], str], *, hold_workload: bool = False) -> list[str]:
    """Apply every child (see ``start_children``); returns the Secrets this call generated."""
    created, finish = start_children(kube, p, new_key, hold_workload=hold_workload)
    finish()
    return created


def reconcile(kube: Kube, body: dict[str, Any], nodes: list[dict] | None, *, apply: bool, now: str,
              process_backed: bool = False, post_findings: bool = False, cached_pods: list[dict] | None = None,
              new_key: Callable[[], str] = lambda: secrets.token_urlsafe(32), master: dict[str, Any] | None = None,
              alongside: Callable[[Plan, list[dict], str | None], Any] | None = None,
              defer_workload: bool = False, router_pods: list[dict] | None = None) -> Result:
    """Bring the children in line with the spec (``apply``) and compute the status.

    With ``apply`` False nothing is rendered onto the cluster: the reconcile only recomputes the
    status (the cheap path run on pod and node events). ``cached_pods``: the pods as the
    operator's watch last saw them (spares a list call).
    ``alongside(plan, pods, restart_hash)`` (a swap step, which also restarts pods on an older
    template, drained first) runs once the spec is valid: while the children are applied when
    every pod runs the current template (a swap's first pod leaves serving without waiting for
    those writes), else after them, with ``restart_hash`` the template's restart hash once the
    StatefulSet carries it (None while it does not: no pod is restarted into an older one).
    ``defer_workload``: when every pod runs the current template, leave the StatefulSet's apply,
    and the wait for the Services and the PDB, to the caller as ``Result.workload``, so they go
    on while the status is written. ``router_pods``: the router's pods as the operator's watch
    last saw them (for the status; with the router turned off, that some remain means its
    children are to be removed). ``master``: the managed Mooncake master's Deployment as the
    watch saw it (``informers.master_essence``), None when there is none. A new fleet's
    StatefulSet waits until that master is ready (pods that started first would run without L3
    until restarted); one the spec no longer asks for is deleted.
    """
    meta = body["metadata"]
    name, ns, generation = meta["name"], meta.get("namespace", "default"), int(meta.get("generation") or 0)
    p = plan(body, nodes, process_backed=process_backed)
    events = finding_events(p.outcome) if post_findings else []
    pods = cached_pods if cached_pods is not None else kube.pods(ns, name)
    previous = body.get("status") or {}
    if p.desired is None:
        errors = [(f.rule, f.message) for f in p.outcome.errors]
        return Result(build_status(generation=generation, previous=previous, desired=None, errors=errors,
                                   pods=pods, degraded=[], now=now, router_pods=router_pods or []), p,
                      events=events, pods=pods)
    spec = p.outcome.spec
    assert spec is not None
    degraded: list[tuple[str, str]] = []
    master_status = master_view(spec, name, master)
    hold = apply and master_status is not None and not master_status.ready and kube.template_hash(ns, name) is None
    if apply and master is not None and master_status is None:
        n = render.names(name).mooncake_master
        kube.concurrently(lambda: kube.delete("Deployment", ns, n), lambda: kube.delete("Service", ns, n))

    no_restarts = all(restart_hash_of(pod) == p.desired.restart_hash for pod in pods)
    later = apply and defer_workload and no_restarts
    early, workload = None, None

    def children() -> list[str]:
        nonlocal workload
        if not apply:
            return []
        if not later:
            return apply_children(kube, p, new_key, hold_workload=hold)
        created, workload = start_children(kube, p, new_key, hold_workload=hold)
        return created
    if apply and alongside is not None and pods and no_restarts:
        early = kube.submit(lambda: alongside(p, pods, p.desired.restart_hash))
        try:
            secret_created = children()
        finally:
            wait([early])  # one step per deployment at a time: it ends before this reconcile does
    else:
        secret_created = children()
    live_routers = [r for r in router_pods or [] if not pod_is_terminating(r)]
    if apply and not spec.router_on and (live_routers or previous.get("routerReady") is not None):
        if any(kube.concurrently(*(lambda kind=kind, child=child: kube.delete(kind, ns, child)
                                   for _, kind, child in render.router_children(p.owner)))):
            events.append(("Normal", "RouterRemoved", f"the router is off: removed {render.names(name).router}; "
                           f"Service {name} selects the pods in serving"))
    for which, reason, what in (("admin", "Admin", "the admin API key"), ("api", "Api", "the clients' API key")):
        if which == "api" and not render.uses_api_key(spec):
            continue
        secret_name = render.secret_ref(spec, name, which)[0]
        given = (spec.admin_key_secret_ref if which == "admin" else spec.api_key_secret_ref) is not None
        if secret_name in secret_created:
            events.append(("Normal", f"{reason}KeyCreated", f"generated {what} in Secret {secret_name}"))
        elif (given or not apply) and not kube.secret_exists(ns, secret_name):
            degraded.append((f"{reason}SecretMissing", f"Secret {secret_name} with {what} does not exist"))
    degraded += model_source.claim_problems(
        spec, {c.name: kube.claim_access_modes(ns, c.name) for c in model_source.claims(spec)})
    token = model_source.token_secret(spec)
    if token is not None and not kube.secret_exists(ns, token):
        degraded.append(("ModelTokenSecretMissing", f"Secret {token} (modelSource.huggingFace.tokenSecretRef) "
                                                    "does not exist: the model download cannot start"))

    never_fitted = next((f for f in p.outcome.findings if f.rule == "no-eligible-nodes-yet"), None)
    if never_fitted is not None:
        degraded.append(("NoEligibleNodes", never_fitted.message))
    elif nodes is not None and p.desired.sizing and p.desired.sizing.pod_memory_bytes:
        why = sizing.reevaluate(p.desired.sizing, spec, nodes)
        if why:
            degraded.append(("SizingNoLongerFits", rule("sizing-no-longer-fits").message.format(why=why)))

    status = build_status(generation=generation, previous=previous, desired=p.desired, errors=[], pods=pods,
                          degraded=degraded, now=now, downloads=model_progress.read(pods), master=master_status,
                          router_pods=router_pods or [])
    if early is not None:
        beside = early.result()
    elif alongside is not None:
        # Pods about to restart take no step until the StatefulSet carries their new template: a
        # live swap would move a pod of the old page format into the new format's L3 namespace.
        live = no_restarts or kube.template_hash(ns, name) == p.desired.restart_hash
        beside = alongside(p, pods, p.desired.restart_hash) if live else None
    else:
        beside = None
    return Result(status, p, events, pods, beside, workload)
