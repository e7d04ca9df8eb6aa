"""kopf glue: every handler reads, calls ``reconcile``/``swap``, writes status and Events.

Triggers:
- HiCacheDeployment create/update/resume and a timer: full reconcile (apply children), then one
  backend-swap step (``swap.step``: admit new pods through the serving gate, move a swap on).
- A short swap timer: one more swap step while a swap is pending (drains finish without any
  Kubernetes event, so something must look again), never sleeping in a handler.
- Pod events (pods we manage): a cheap reconcile of the owner (no apply) plus a swap step, so new
  pods are admitted at once and restarts and swaps roll on as pods change.
- EndpointSlice events (of our Services) while a swap is pending: the next swap step at once.
- Node events: nodes feed an index (sizing reads it; kopf fills indexes before handlers run),
  and a change that matters for sizing (labels, taints, allocatable, schedulability)
  re-reconciles every HiCacheDeployment, which reports "no longer fits" in Degraded.
An invalid spec sets ConfigValid=False and posts Warning Events; it never raises, so there is
no crash loop. API errors become kopf TemporaryErrors (retried with a delay).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from hicache_operator import labels, metrics, swap
from hicache_operator.kube import Kube, load_config
from hicache_operator.reconcile import Result, reconcile
from hicache_operator.spec import GROUP, PLURAL, VERSION

PROCESS_BACKED_ENV = "HICACHE_PROCESS_BACKED_PODS"
INTERVAL_ENV = "HICACHE_RECONCILE_INTERVAL"
INTERVAL = float(os.environ.get(INTERVAL_ENV, "30"))
SWAP_POLL = float(os.environ.get("HICACHE_SWAP_POLL_SECONDS", "1"))
RESOURCE = {"group": GROUP, "version": VERSION, "plural": PLURAL}

_state: dict[str, Any] = {"kube": None}
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
_seen_nodes: dict[str, dict] = {}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def process_backed() -> bool:
    return os.environ.get(PROCESS_BACKED_ENV) == "1"


def _kube() -> Kube:
    if _state["kube"] is None:
        load_config()
        _state["kube"] = Kube()
    return _state["kube"]


def _lock(namespace: str, name: str) -> threading.Lock:
    """One reconcile per deployment at a time (timers, change and pod handlers run concurrently)."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{labels.PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=labels.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=labels.PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # kopf's own chatter stays in the log; our Events are explicit
    settings.posting.reporting_component = labels.MANAGER
    settings.posting.event_name_prefix = "hicache-"
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # liveness probes, every few seconds
    logging.getLogger("httpx").setLevel(logging.WARNING)  # runtime GETs on every swap step
    _kube()


def node_essence(body: Any) -> dict:
    """What sizing reads from a node; heartbeats do not change it."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    return {"metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
            "spec": {"taints": list(spec.get("taints") or []), "unschedulable": bool(spec.get("unschedulable"))},
            "status": {"allocatable": dict(status.get("allocatable") or {})}}


@kopf.index("", "v1", "nodes")
def node_index(body: kopf.Body, **_: Any) -> dict:
    return {None: node_essence(body)}


@kopf.index(**RESOURCE)
def deployment_index(namespace: str, name: str, **_: Any) -> dict:
    return {None: (namespace, name)}


def _nodes(index: kopf.Index) -> list[dict]:
    return list(index.get(None, []))


def _post(body: Any, result: Result, previous: dict) -> None:
    for etype, reason, message in result.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    old = {c.get("type"): c for c in previous.get("conditions") or []}.get("Degraded") or {}
    new = {c["type"]: c for c in result.status.get("conditions", [])}.get("Degraded") or {}
    if new.get("status") == "True" and (old.get("status") != "True" or old.get("reason") != new.get("reason")):
        kopf.event(body, type="Warning", reason=new["reason"], message=new.get("message", ""))


def _run(namespace: str, name: str, nodes: list[dict], *, trigger: str, apply: bool,
         post_findings: bool | None = None) -> Result | None:
    """One reconcile (+ one swap step) of the deployment as it is NOW, status written before
    the lock is released, so concurrent triggers never plan from a stale status or overwrite a
    newer one. ``post_findings`` None: post them when the generation is new."""
    with _lock(namespace, name), metrics.RECONCILE_SECONDS.labels(trigger).time():
        try:
            raw = _kube().get_deployment(namespace, name)
            if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
                return None
            previous = raw.get("status") or {}
            if post_findings is None:
                post_findings = previous.get("observedGeneration") != raw["metadata"].get("generation")
            result = reconcile(_kube(), raw, nodes, apply=apply, now=now(), process_backed=process_backed(),
                               post_findings=post_findings)
            spec = result.plan.outcome.spec
            if result.plan.outcome.ok and spec is not None and (
                    trigger == "timer" or swap.needed(previous, spec, result.pods)):
                _swap_step(raw, result)
            status = {**previous, **result.status}
            if status != previous:
                _kube().replace_deployment_status(namespace, name, status)
        except ApiException as exc:
            metrics.RECONCILES.labels(trigger, "api_error").inc()
            raise kopf.TemporaryError(f"Kubernetes API error {exc.status} {exc.reason}: {exc.body}", delay=10) from exc
    outcome = result.plan.outcome
    if post_findings:
        for f in outcome.findings:
            if f.severity == "error":
                metrics.VALIDATION_FAILURES.labels(f.rule).inc()
            elif f.severity == "normalised":
                metrics.NORMALISATIONS.labels(f.rule).inc()
    metrics.POD_RESTARTS.inc(len(result.deleted_pods))
    metrics.RECONCILES.labels(trigger, "ok" if outcome.ok else "invalid").inc()
    _post(raw, result, previous)
    return result


def _swap_step(raw: dict, result: Result) -> None:
    """One backend-swap step; its state and conditions join the reconcile's status."""
    step = swap.step(_kube().api, raw, result.plan.outcome.spec, result.pods, now())
    result.status["backendSwap"] = step.backend_swap
    generation = int(raw["metadata"].get("generation") or 0)
    before = {c.get("type"): c for c in result.status.get("conditions") or []}
    for cond in step.conditions:
        old = before.get(cond.type)
        before[cond.type] = {"type": cond.type, "status": cond.status, "reason": cond.reason,
                             "message": cond.message, "observedGeneration": generation,
                             "lastTransitionTime": old["lastTransitionTime"]
                             if old and old.get("status") == cond.status and old.get("lastTransitionTime") else now()}
    result.status["conditions"] = list(before.values())
    for ev in step.events:
        metrics.SWAP_EVENTS.labels(ev.reason).inc()
        result.events.append((ev.type, ev.reason, ev.message))


@kopf.on.resume(**RESOURCE)
@kopf.on.create(**RESOURCE)
@kopf.on.update(**RESOURCE)
def on_spec(namespace: str, name: str, reason: str, node_index: kopf.Index, **_: Any) -> None:
    _run(namespace, name, _nodes(node_index), trigger=getattr(reason, "value", str(reason)), apply=True,
         post_findings=True)


@kopf.timer(**RESOURCE, interval=INTERVAL, initial_delay=INTERVAL)
def on_timer(namespace: str, name: str, node_index: kopf.Index, **_: Any) -> None:
    _run(namespace, name, _nodes(node_index), trigger="timer", apply=True)


@kopf.timer(**RESOURCE, interval=SWAP_POLL, initial_delay=SWAP_POLL)
def on_swap_timer(body: kopf.Body, namespace: str, name: str, node_index: kopf.Index, **_: Any) -> None:
    if swap.pending(body.get("status")):
        _run(namespace, name, _nodes(node_index), trigger="swap", apply=False, post_findings=False)


@kopf.on.event("", "v1", "pods", labels={labels.MANAGED_BY: labels.MANAGER})
def on_pod(body: kopf.Body, namespace: str, node_index: kopf.Index, **_: Any) -> None:
    owner = ((body.get("metadata") or {}).get("labels") or {}).get(labels.DEPLOYMENT)
    if owner:
        _run(namespace, owner, _nodes(node_index), trigger="pod", apply=False, post_findings=False)


@kopf.on.event("discovery.k8s.io", "v1", "endpointslices", labels={labels.MANAGED_BY: labels.MANAGER})
def on_endpointslice(body: kopf.Body, namespace: str, node_index: kopf.Index, deployment_index: kopf.Index,
                     **_: Any) -> None:
    """A swap waits on endpoints (drained, back in serving): look again as soon as they change,
    rather than at the next poll. Only while a swap is pending, so steady state costs nothing."""
    owner = ((body.get("metadata") or {}).get("labels") or {}).get(labels.DEPLOYMENT)
    if owner and (namespace, owner) in set(deployment_index.get(None, [])) and swap.pending(_swap_status(namespace, owner)):
        _run(namespace, owner, _nodes(node_index), trigger="endpointslice", apply=False, post_findings=False)


def _swap_status(namespace: str, name: str) -> dict | None:
    body = _kube().get_deployment(namespace, name)
    return (body or {}).get("status")


@kopf.on.event("", "v1", "nodes")
def on_node(event: dict, body: kopf.Body, name: str, node_index: kopf.Index, deployment_index: kopf.Index,
            **_: Any) -> None:
    essence = None if event.get("type") == "DELETED" else node_essence(body)
    if _seen_nodes.get(name) == essence:
        return
    first_sight = name not in _seen_nodes and event.get("type") is None  # initial listing at startup
    if essence is None:
        _seen_nodes.pop(name, None)
    else:
        _seen_nodes[name] = essence
    if first_sight:
        return
    for namespace, deployment in list(deployment_index.get(None, [])):
        _run(namespace, deployment, _nodes(node_index), trigger="node", apply=True, post_findings=False)
