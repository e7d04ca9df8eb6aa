"""One reconcile of a HiCacheDeployment, top to bottom (independent of kopf).

``reconcile(ctx, seen)`` runs these phases in order, each a function below:

1. plan    validate the spec and render its children (``plan``, pure);
2. apply   the children, in the order their pods need them (``children``); a new fleet's
           StatefulSet waits for its managed Mooncake master to be ready, and when no pod is
           to restart the StatefulSet's apply is left to go out with the status write;
3. step    the swap step (``stepping``; it also restarts pods on an older template, drained
           first): beside the applies when every pod runs the current template (a swap's first
           pod leaves serving without waiting for those writes), else after them, and only
           once the StatefulSet carries the new template;
4. derive  the status, once, from everything seen (``plan.status.derive``);
5. write   the status, before the deployment's key is released (no step plans from a stale
           status);
6. settle  wait for the step's last gate patches, then post the Events.

``observe`` builds the ``Observation`` (``context``) from the watches. The ``Result`` says when to look
again; the controller requeues by it. With ``seen.apply`` False (pod and node events) nothing
is applied: the status is derived and written, and a swap step may run.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from kubernetes.client.exceptions import ApiException

from hicache_operator.api import labels
from hicache_operator.api.status import EffectiveConfig, MooncakeMasterStatus, RuleNote
from hicache_operator.control import children, problems
from hicache_operator.control.context import Context, Observation
from hicache_operator.control.informers import Key
from hicache_operator.control.stepping import swap_step
from hicache_operator.fleet.names import names
from hicache_operator.fleet.pods import pod_is_terminating, restart_hash_of
from hicache_operator.io import metrics, model_progress
from hicache_operator.io.kube import ChildRefused, Kube
from hicache_operator.plan import render
from hicache_operator.plan import status as status_
from hicache_operator.plan.status import Desired, Observed, Status, SwapView
from hicache_operator.plan.validation import Finding, Outcome, check_rendered, validate
from hicache_operator.rollout import act

log = logging.getLogger("hicache_operator")


@dataclass
class Plan:
    outcome: Outcome
    owner: render.Owner
    desired: Desired | None = None
    children: list[dict[str, Any]] = field(default_factory=list)  # without the admin Secret


@dataclass(frozen=True)
class Result:
    """What one reconcile did and what it leaves to follow: ``written`` False when the
    deployment was gone; ``settled``: the step's gate patches all succeeded; ``requeue_after``:
    step again this soon (None: an event or the swap poll brings the next step); the step's
    ``busy_drains`` and ``renewing`` say when else to; ``l3_unavailable``: pod -> why its
    runtime last reported its L3 store unavailable."""

    plan: Plan
    pods: list[dict[str, Any]]
    events: list[problems.Event]
    status: Status
    step: act.StepResult | None
    written: bool
    settled: bool
    requeue_after: float | None
    l3_unavailable: dict[str, str]


@dataclass
class _Run:
    """The working state one reconcile's phases pass on."""

    seen: Observation
    plan: Plan
    pods: list[dict[str, Any]]
    events: list[problems.Event]
    master: MooncakeMasterStatus | None = None
    created: list[str] = field(default_factory=list)  # key Secrets this reconcile generated
    workload: children.Workload | None = None  # the StatefulSet's apply, left to the write
    step: act.StepResult | None = None
    found: list[problems.Problem] = field(default_factory=list)  # what Degraded names besides the pods
    timings: dict[str, float] = field(default_factory=dict)  # monotonic: "write", "written"

    @property
    def restarts(self) -> bool:
        """Some pod runs an older template than the plan's."""
        assert self.plan.desired is not None
        return any(restart_hash_of(pod) != self.plan.desired.restart_hash for pod in self.pods)


def reconcile(ctx: Context, seen: Observation) -> Result:
    """Bring the deployment's children in line with its spec, step its swap, write its status
    (see the module docstring). Raises ``ChildRefused`` when the API server refuses a child."""
    p = plan(seen.body, seen.nodes, process_backed=ctx.process_backed)
    run = _Run(seen, p, seen.pods if seen.pods is not None else ctx.kube.pods(*seen.key),
               problems.finding_events(p.outcome) if seen.post_findings else [])
    if p.desired is not None:
        beside = start_step_beside_applies(ctx, run)
        try:
            apply(ctx, run)
        finally:
            wait([beside] if beside is not None else [])  # one step per deployment at a time
        step(ctx, run, beside)
        find_problems(ctx, run)
    status = derive(ctx, run)
    try:
        written = write(ctx, run, status)
    finally:
        settled = settle(ctx, run)
    if written:
        post(ctx, run, status)
    return Result(p, run.pods, run.events, status, run.step, written, settled, requeue_after(run.step, settled),
                  dict(status.observed.l3_unavailable))


def observe(ctx: Context, key: Key, *, trigger: str, apply: bool, failing: bool = False,
            waited: float = 0.0) -> Observation | None:
    """The deployment as the watches show it now; None when it is gone or being deleted."""
    body = ctx.informers.bodies.get(key) or ctx.kube.get_deployment(*key)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    nodes = ctx.informers.nodes.nodes() if ctx.informers.nodes is not None else None
    return Observation(key, body, trigger, apply, nodes, ctx.informers.cached_pods(key), ctx.informers.master(key),
                       ctx.informers.router_pods(key), failing, waited)


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


def start_step_beside_applies(ctx: Context, run: _Run) -> Future | None:
    """The swap step, started beside the applies when every pod runs the current template;
    None when it is to wait for them (or nothing is applied)."""
    desired, spec = run.plan.desired, run.plan.outcome.spec
    if not (run.seen.apply and ctx.swapper is not None and run.pods and not run.restarts):
        return None
    assert desired is not None and spec is not None
    return ctx.kube.submit(lambda: swap_step(ctx, run.seen, spec, desired.storage_hash, run.pods,
                                             desired.restart_hash))


def apply(ctx: Context, run: _Run) -> None:
    """The children, a managed master the spec no longer asks for deleted, and the router's
    children once the router is off. A new fleet's StatefulSet waits until its managed master
    is ready (pods that started first would run without L3 until restarted)."""
    seen, p, spec = run.seen, run.plan, run.plan.outcome.spec
    assert spec is not None
    namespace, name = seen.key
    run.master = problems.master_view(spec, name, seen.master)
    if not seen.apply:
        return
    hold = run.master is not None and not run.master.ready and ctx.kube.template_hash(namespace, name) is None
    if seen.master is not None and run.master is None:
        children.remove_master(ctx.kube, p.owner)
    if run.restarts:  # a step that restarts pods reads the live template: applied first
        run.created = apply_children(ctx.kube, p, ctx.new_key, hold_workload=hold)
    else:
        run.created, run.workload = children.start(ctx.kube, p.children, generated_secrets(p, ctx.new_key),
                                                   hold_workload=hold)
    live_routers = [r for r in seen.router_pods if not pod_is_terminating(r)]
    if not spec.router_on and (live_routers or seen.previous.get("routerReady") is not None):
        if children.remove_router(ctx.kube, p.owner):
            run.events.append(("Normal", "RouterRemoved", f"the router is off: removed {names(name).router}; "
                               f"Service {name} selects the pods in serving"))


def apply_children(kube: Kube, p: Plan, new_key: Callable[[], str], *, hold_workload: bool = False) -> list[str]:
    """Apply every child of the plan (``children.start``, then its workload); returns the key
    Secrets this call generated."""
    created, workload = children.start(kube, p.children, generated_secrets(p, new_key), hold_workload=hold_workload)
    workload.finish()
    return created


def generated_secrets(p: Plan, new_key: Callable[[], str]) -> list[dict[str, Any]]:
    return render.generated_secrets(p.outcome.spec, p.owner, new_key) if p.outcome.spec else []


def step(ctx: Context, run: _Run, beside: Future | None) -> None:
    """The swap step's outcome: the one started beside the applies, or one run now. Pods about
    to restart take no step until the StatefulSet carries their new template: a live swap would
    move a pod of the old page format into the new format's L3 namespace."""
    desired, spec = run.plan.desired, run.plan.outcome.spec
    assert desired is not None and spec is not None
    if beside is not None:
        run.step = beside.result()
    elif ctx.swapper is not None and (not run.restarts or
                                      ctx.kube.template_hash(*run.seen.key) == desired.restart_hash):
        run.step = swap_step(ctx, run.seen, spec, desired.storage_hash, run.pods, desired.restart_hash)
    if run.step is not None:
        for ev in run.step.events:
            metrics.SWAP_EVENTS.labels(ev.reason).inc()
            run.events.append((ev.type, ev.reason, ev.message))


def find_problems(ctx: Context, run: _Run) -> None:
    """What Degraded names besides the pods: missing Secrets and claims, a sizing that no
    longer fits; and an Event for each key Secret this reconcile generated."""
    spec, desired = run.plan.outcome.spec, run.plan.desired
    assert spec is not None and desired is not None
    namespace, name = run.seen.key
    events, found = problems.secrets(ctx.kube, spec, namespace, name, run.created, run.seen.apply)
    run.events += events
    run.found = found + problems.elsewhere(ctx.kube, spec, namespace, run.plan.outcome, desired.sizing,
                                           run.seen.nodes)


def derive(ctx: Context, run: _Run) -> Status:
    """The whole status from this reconcile's observation: the only ``derive`` it makes."""
    seen, p, s = run.seen, run.plan, run.step
    valid = p.desired is not None
    l3_down = ctx.swapper.views.l3_unavailable(seen.key, run.pods) if ctx.swapper is not None else {}
    return status_.derive(Observed(
        generation=seen.generation, previous=seen.previous, now=ctx.clock(), desired=p.desired,
        errors=() if valid else tuple((f.rule, f.message) for f in p.outcome.errors), pods=tuple(run.pods),
        problems=tuple(run.found), spec_replicas=spec_replicas(seen.body),
        swap=None if s is None else SwapView(s.backend_swap, tuple(c.brief() for c in s.conditions)),
        downloads=model_progress.read(run.pods) if valid else {}, master=run.master,
        router_pods=tuple(seen.router_pods), l3_unavailable=l3_down))


def write(ctx: Context, run: _Run, status: Status) -> bool:
    """Write the status (unless unchanged); False when the deployment is gone meanwhile. A
    StatefulSet left to this phase goes out while the status is written (nothing in the status
    depends on it), except after a failed reconcile: then the status waits for the applies, so
    one that fails again leaves the failure in the status."""
    seen = run.seen
    run.timings["write"] = time.monotonic()
    written = (lambda: write_status(ctx, seen.key, status)) if status != seen.previous else (lambda: True)

    def store() -> bool:
        ok = written()
        run.timings["written"] = time.monotonic()
        return ok
    if run.workload is None:
        return store()
    writing = ctx.kube.submit(store) if not seen.failing else None
    try:
        run.workload.finish()
    except BaseException as exc:
        if writing is not None:
            wait([writing])
            if not isinstance(exc, ChildRefused) and not writing.exception() and seen.post_findings:
                post(ctx, run, status)  # the status now has this generation: a retry would not post them
        raise
    return writing.result() if writing is not None else store()


def write_status(ctx: Context, key: Key, status: dict) -> bool:
    """Write the whole status; False when the deployment is gone meanwhile."""
    try:
        ctx.informers.bodies.offer(key, ctx.kube.replace_deployment_status(*key, status))
    except ApiException as exc:
        if exc.status != 404:
            raise
        ctx.informers.bodies.deleted(key)  # deleted meanwhile: its DELETED event forgets it
        return False
    return True


def settle(ctx: Context, run: _Run) -> bool:
    """Wait for the step's last gate patches (``act.settle``); the next step sees the ones the
    API server acknowledged before the pod watch does. Whether they all succeeded."""
    settled = act.settle(run.step)
    if run.step is not None:
        if settled and run.step.gates:
            ctx.informers.note_gates(run.seen.key, run.step.gates)
        t = run.timings
        if "written" in t:
            log.info("swap step %s/%s persisted: status=%.3f gates=+%.3f", *run.seen.key, t["written"] - t["write"],
                     time.monotonic() - t["written"])
    return settled


def post(ctx: Context, run: _Run, status: Status) -> None:
    """The reconcile's Events, and a Warning when Degraded turns True or changes reason."""
    if run.seen.post_findings:
        for f in run.plan.outcome.findings:
            if f.severity == "error":
                metrics.VALIDATION_FAILURES.labels(f.rule).inc()
            elif f.severity == "normalised":
                metrics.NORMALISATIONS.labels(f.rule).inc()
    body = run.seen.body
    for etype, reason, message in run.events:
        ctx.post(body, etype, reason, message)
    old = {c.get("type"): c for c in run.seen.previous.get("conditions") or []}.get("Degraded") or {}
    new = {c["type"]: c for c in status.get("conditions", [])}.get("Degraded") or {}
    posted = {reason for _, reason, _ in run.events}  # e.g. the swap's own BackendSwapFailed
    if new.get("status") == "True" and (old.get("status") != "True" or old.get("reason") != new.get("reason")) \
            and new.get("reason") not in posted:
        ctx.post(body, "Warning", new["reason"], new.get("message", ""))


def requeue_after(step_result: act.StepResult | None, settled: bool) -> float | None:
    """When to step again: at once after a failed gate patch (its watch event will not come),
    else when the step said."""
    if not settled:
        return act.AFTER_ACTIONS_SECONDS
    return step_result.requeue_after if step_result is not None else None


def spec_replicas(raw: dict) -> int | None:
    """spec.replicas as written (the CRD defaults it to 1), READY's denominator even when the
    rest of the spec is invalid."""
    value = (raw.get("spec") or {}).get("replicas", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
