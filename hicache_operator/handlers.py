"""kopf glue: triggers only enqueue; worker threads reconcile (``reconcile``) and step swaps (``swap``).

Why a work queue instead of one kopf handler per trigger: at fleet scale each deployment's pods,
EndpointSlices and timers fire bursts of events, and a full reconcile per event (plus two kopf
timers and a finalizer per object) made the operator slow and large. Now:

- HiCacheDeployment events: a new generation (or first sight at startup) queues an urgent
  reconcile that applies the children; our own status writes queue nothing.
- Pod events (pods we manage) queue a status refresh of their owner, which also admits new pods
  through the serving gate and moves a swap on; urgent while that owner has a swap in flight.
- EndpointSlice events that change an endpoint's readiness in the client Service queue the
  owner while a swap is in flight or a swap step runs (drains and readmissions wait on them).
- Nodes: ``nodecache.NodeCache`` lists and watches them itself, keeping only what sizing reads;
  workers wait for its first listing, and a change that matters for sizing queues every
  deployment, which reports "no longer fits".
- Two periodic loops: a resync of every deployment (applies children, steps swaps, repairs drift
  nobody reported) and a short swap poll of deployments with a swap in flight that no step has
  visited within SWAP_POLL (a drain finishes without any Kubernetes event), so no handler ever
  sleeps.

No kopf change handlers or timers on HiCacheDeployments means no finalizer and no annotations
written on them: deletion is left to the garbage collector through owner references.
An invalid spec sets ConfigValid=False and posts Warning Events; it never raises, so there is no
crash loop. A reconcile that raises (an API error, a bug) sets Degraded=True with reason
ReconcileFailed and the error, posts a Warning Event when the error is new, and is retried with a
per-deployment backoff during which the deployment's other triggers wait (``report_failure``).
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import datetime
import json
import logging
import os
import random
import re
import threading
import time
from concurrent.futures import wait
from typing import Any

import kopf
import urllib3
from kubernetes.client.exceptions import ApiException

from hicache_operator import endpoint_lag, labels, metrics, render, swap
from hicache_operator.bodycache import BodyCache
from hicache_operator.kube import ChildRefused, Kube, load_config
from hicache_operator.nodecache import NodeCache
from hicache_operator.reconcile import Plan, Result, reconcile
from hicache_operator.spec import GROUP, PLURAL, VERSION, HiCacheDeploymentSpec
from hicache_operator.status import SwapView, failed
from hicache_operator.workqueue import Request, WorkQueue

PROCESS_BACKED_ENV = "HICACHE_PROCESS_BACKED_PODS"
INTERVAL_ENV = "HICACHE_RECONCILE_INTERVAL"
INTERVAL = float(os.environ.get(INTERVAL_ENV, "30"))
SWAP_POLL = float(os.environ.get("HICACHE_SWAP_POLL_SECONDS", "1"))
WORKERS_ENV = "HICACHE_WORKERS"
WORKERS = int(os.environ.get(WORKERS_ENV, "16"))
LAG_CHECK_SECONDS = 0.05  # see Controller.check_endpoint_lag
RESOURCE = {"group": GROUP, "version": VERSION, "plural": PLURAL}

log = logging.getLogger("hicache_operator")
Key = tuple[str, str]  # (namespace, name)


class Controller:
    """The queue, what the event handlers learned, and the workers draining the queue."""

    def __init__(self) -> None:
        self.queue = WorkQueue()
        self.bodies = BodyCache()  # the newest HiCacheDeployment bodies: reconciles do not GET them
        self.kube: Kube | None = None
        self.nodes: NodeCache | None = None
        self.pod_index: kopf.Index | None = None
        self.slice_index: kopf.Index | None = None
        self.known: dict[Key, float] = {}  # deployment -> when its next resync is due (monotonic)
        self._known_guard = threading.Lock()
        self.swapping: set[Key] = set()  # deployments whose last status has a swap in flight
        self.stepping: set[Key] = set()  # deployments in a swap step whose status is not yet written
        self.pod_identities: dict[tuple[Key, str], tuple] = {}  # (deployment, pod) -> pod_identity
        self.slice_readiness: dict[tuple[str, str], dict[str, bool]] = {}  # (namespace, client slice) -> IP -> ready
        self.acked_gates: dict[Key, dict[str, tuple[str, bool]]] = {}  # see note_gates
        self.failing: dict[Key, int] = {}  # deployment -> the generation whose reconcile last failed
        self.lag_watches: dict[Key, endpoint_lag.LagWatch] = {}  # see check_endpoint_lag
        self.lag_dirty: set[Key] = set()  # deployments with a pod or slice event since the last check
        self._lag_guard = threading.Lock()  # lag_watches: the check loop and the slice handler
        self.stop = threading.Event()
        self._started = False
        self._start_guard = threading.Lock()

    def start(self, pod_index: kopf.Index, slice_index: kopf.Index) -> None:
        """Start the threads on the first handler call: by then kopf has filled its indexes, and
        the context holds kopf's Event poster, so ``kopf.event`` works from the worker threads."""
        with self._start_guard:
            if self._started:
                return
            self._started = True
            self.pod_index = pod_index
            self.slice_index = slice_index
            loops = [self._worker] * WORKERS + [self._resync_loop, self._swap_poll_loop, self._endpoint_lag_loop]
            for i, target in enumerate(loops):
                threading.Thread(target=contextvars.copy_context().run, args=(target,), daemon=True,
                                 name=f"hicache-{target.__name__.strip('_')}-{i}").start()

    def enqueue(self, key: Key, request: Request) -> None:
        self.queue.add(key, request)
        metrics.QUEUE_DEPTH.set(self.queue.depth())

    def pod_event(self, key: Key, pod: str, identity: tuple) -> None:
        """Reconcile the pod's deployment, except during a backend swap when nothing a step
        reads at once changed (``pod_identity``): each gate patch makes one or two pod events
        (the gate, then Ready), and the steps they started did nothing but hold the deployment
        while the EndpointSlice event a step waits for arrived (up to 0.6 s per pod at
        maxUnavailable 1). During a swap the status is rewritten at least every SWAP_POLL."""
        with self._known_guard:
            changed = self.pod_identities.get((key, pod)) != identity
            if identity[1]:
                self.pod_identities.pop((key, pod), None)
            else:
                self.pod_identities[(key, pod)] = identity
        self.lag_dirty.add(key)
        swapping = key in self.swapping
        if changed or not swapping:
            self.enqueue(key, Request("pod", urgent=swapping))

    def slice_event(self, key: Key, service: str | None, slice_name: str, readiness: dict[str, bool] | None) -> None:
        """A swap step waits on the readiness of the client Service's endpoints; other slice
        changes are not news to it. The headless Service's slices (published not-ready) change
        with every readiness flip, and a slice update that leaves every address's readiness as
        it was (serving, terminating, a hint) has nothing for a step: the steps they started only
        held the deployment. ``readiness``: ``slice_readiness`` of the slice, None if deleted.
        A step in progress counts as a swap in flight: the first step of a rollout takes pods
        out before its status (which starts the swap) is written, and the EndpointSlice events
        that follow may come first."""
        if service != render.names(key[1])["service"]:
            return
        self.lag_dirty.add(key)
        self.slices_written(key, service, time.monotonic())
        with self._known_guard:
            slot = (key[0], slice_name)
            before = self.slice_readiness.get(slot) or {}
            changed = self.slice_readiness.get(slot) != readiness
            if readiness is None:
                self.slice_readiness.pop(slot, None)
            else:
                self.slice_readiness[slot] = readiness
        if changed and (key in self.swapping or key in self.stepping):
            # pods out of serving whose endpoints just turned not ready: read them while this
            # event waits for its step
            unready = {ip for ip, ready in (readiness or {}).items() if not ready and before.get(ip) is True}
            if unready and self.pod_index is not None:
                swap.read_drained(key, [p for p in list(self.pod_index.get(key, []))
                                        if (p.get("status") or {}).get("podIP") in unready
                                        and swap.serving_gate(p) is False])
            self.enqueue(key, Request("endpointslice", urgent=True))

    def note_gates(self, key: Key, gates: list[tuple[str, str, bool]]) -> None:
        """The serving gates a step patched, acknowledged by the API server: (pod, uid, serving).
        ``cached_pods`` shows them until the pod watch does.

        Why: the next step plans on the pods as the watch shows them, 50-150 ms behind a patch.
        One that still saw a pod's old gate took the pod out again (or readmitted it again), and
        forgot the record the last step had just written as that of a pod "seen serving again":
        with a step's gate patches going out while its status is written, 20-30 extra gate
        patches per 64-pod rollout. The operator is the gate's only writer, so what the API
        server acknowledged is the gate until the next patch."""
        with self._known_guard:
            noted = self.acked_gates.setdefault(key, {})
            for pod, uid, serving in gates:
                noted[pod] = (uid, serving)

    def still_out(self, key: Key, pod: dict) -> bool:
        """Whether the watches show the pod (same uid and IP, not being deleted) out of serving,
        its gate False (the operator's acknowledged patch counting where the watch is behind),
        and its endpoint not ready."""
        assert self.pod_index is not None
        uid, ip, name = pod["metadata"]["uid"], pod["status"]["podIP"], pod["metadata"]["name"]
        live = next((p for p in list(self.pod_index.get(key, [])) if p["metadata"].get("uid") == uid), None)
        if live is None or live["metadata"].get("deletionTimestamp") or (live.get("status") or {}).get("podIP") != ip:
            return False
        with self._known_guard:
            noted = (self.acked_gates.get(key) or {}).get(name)
        gate = noted[1] if noted is not None and noted[0] == uid else swap.serving_gate(live)
        return gate is False and self.endpoints(key[0], render.names(key[1])["service"]).get(ip) is not True

    def cached_pods(self, key: Key) -> list[dict]:
        """The deployment's pods as the watch last saw them (copies: a reconcile edits its own),
        with the serving gates the operator's own patches set where the watch is still behind."""
        assert self.pod_index is not None
        pods = copy.deepcopy(list(self.pod_index.get(key, [])))
        with self._known_guard:
            noted = self.acked_gates.get(key)
            if not noted:
                return pods
            live = {p["metadata"].get("name"): p for p in pods}
            for name, (uid, serving) in list(noted.items()):
                pod = live.get(name)
                if pod is None or pod["metadata"].get("uid") != uid or swap.serving_gate(pod) is serving:
                    del noted[name]  # gone, replaced, or the watch has caught up
                    continue
                conditions = [c for c in (pod.get("status") or {}).get("conditions") or []
                              if c.get("type") != labels.SERVING_CONDITION]
                conditions.append({"type": labels.SERVING_CONDITION, "status": str(serving)})
                pod.setdefault("status", {})["conditions"] = conditions
            if not noted:
                del self.acked_gates[key]
        return pods

    def endpoints(self, namespace: str, service: str) -> dict[str, bool]:
        """Pod IP -> ready, over the Service's EndpointSlices as the watch last saw them."""
        assert self.slice_index is not None
        out: dict[str, bool] = {}
        for readiness in list(self.slice_index.get((namespace, service), [])):
            for ip, ready in readiness.items():
                out[ip] = out.get(ip, False) or ready
        return out

    def nodes_changed(self) -> None:
        """A node changed in a way sizing sees: re-check every deployment ("no longer fits")."""
        for key in list(self.known):
            self.enqueue(key, Request("node", apply=True))

    def _worker(self) -> None:
        assert self.nodes is not None
        while not self.nodes.wait_synced(timeout=1.0):  # sizing needs every node
            if self.stop.is_set():
                return
        while not self.stop.is_set():
            item = self.queue.get(timeout=1.0)
            if item is None:
                continue
            key, request = item
            metrics.QUEUE_DEPTH.set(self.queue.depth())
            try:
                process(self, key, request)
                self.queue.succeeded(key)
                self.failing.pop(key, None)
            except Exception as exc:  # a bug must not stop the worker or the other deployments
                api = isinstance(exc, ApiException)
                metrics.RECONCILES.labels(request.trigger, "api_error" if api else "error").inc()
                delay = self.queue.retry(key, request)
                report_failure(self, key, exc, delay)
            finally:
                self.stepping.discard(key)
                self.queue.done(key)

    def track(self, key: Key) -> None:
        """Resyncs are spread over the interval (a random phase per deployment), so a thousand
        deployments do not all re-apply their children in the same second."""
        with self._known_guard:
            if key not in self.known:
                self.known[key] = time.monotonic() + random.uniform(0, INTERVAL)

    def untrack(self, key: Key) -> None:
        with self._known_guard:
            self.known.pop(key, None)
            self.acked_gates.pop(key, None)
            self.failing.pop(key, None)
            for gone in [k for k in self.pod_identities if k[0] == key]:
                del self.pod_identities[gone]
        self.swapping.discard(key)
        self.queue.forget(key)

    def _resync_loop(self) -> None:
        while not self.stop.wait(min(1.0, INTERVAL / 4)):
            now_, due_keys = time.monotonic(), []
            with self._known_guard:
                for key, due in self.known.items():
                    if due <= now_:
                        self.known[key] = max(due + INTERVAL, now_)
                        due_keys.append(key)
            for key in due_keys:
                self.enqueue(key, Request("resync", apply=True))

    def _swap_poll_loop(self) -> None:
        """A step at least every SWAP_POLL while a swap is in flight (a drain ends without any
        Kubernetes event), counted from the key's last step: steps the watches started already
        looked, and a poll right after one only held the deployment when the next event came."""
        while not self.stop.wait(SWAP_POLL / 4):
            self.swap_poll()

    def _endpoint_lag_loop(self) -> None:
        while not self.stop.wait(LAG_CHECK_SECONDS):
            self.check_endpoint_lag(time.monotonic())

    def slices_written(self, key: Key, service: str, now_: float) -> None:
        """The client Service's slices were written: the flips still unpublished were left out
        (``endpoint_lag.LagWatch.written``). Only while a swap is in flight, as for the checks."""
        if self.pod_index is None or self.slice_index is None or not (key in self.swapping or key in self.stepping):
            return
        current = endpoint_lag.unpublished(list(self.pod_index.get(key, [])), self.endpoints(key[0], service))
        with self._lag_guard:
            self.lag_watches.setdefault(key, endpoint_lag.LagWatch()).written(now_, current)

    def check_endpoint_lag(self, now_: float) -> None:
        """Touch the client Service of a deployment in a swap whose EndpointSlice sits on a pod's
        readiness flip (``endpoint_lag``). Only deployments with an event since the last check or
        a flip still unpublished are looked at: a fleet-wide swap must not cost a core."""
        if self.pod_index is None or self.slice_index is None:
            return
        active = set(self.swapping) | set(self.stepping)
        dirty, self.lag_dirty = self.lag_dirty, set()
        with self._lag_guard:
            for gone in [k for k in self.lag_watches if k not in active]:
                del self.lag_watches[gone]
        for key in active:
            service = render.names(key[1])["service"]
            with self._lag_guard:
                watch = self.lag_watches.setdefault(key, endpoint_lag.LagWatch())
                if key not in dirty and not watch.since:
                    continue
                pods = list(self.pod_index.get(key, []))
                overdue = watch.observe(now_, endpoint_lag.unpublished(pods, self.endpoints(key[0], service)))
                wanted = {"not ready" if watch.since[p][0] else "ready" for p in overdue}
            if overdue:
                metrics.ENDPOINT_RESYNCS.inc()
                log.info("%s/%s: EndpointSlice of Service %s still shows %s as %s; touching the Service so "
                         "the EndpointSlice controller syncs it again", key[0], key[1], service, ", ".join(overdue),
                         "/".join(sorted(wanted)))
                _touch_service(key[0], service)

    def swap_poll(self) -> None:
        for key in list(self.swapping):
            if self.queue.quiet_for(key) >= SWAP_POLL:
                self.enqueue(key, Request("swap", urgent=True))


controller = Controller()


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def process_backed() -> bool:
    return os.environ.get(PROCESS_BACKED_ENV) == "1"


def _kube() -> Kube:
    if controller.kube is None:
        # workers, the calls they make concurrently (a new deployment's children), the node watch
        # and swap steps' gate patches (up to 32 at once)
        load_config(connections=3 * WORKERS + 36)
        controller.kube = Kube(memo_seconds=INTERVAL, parallel_calls=2 * WORKERS)
    return controller.kube


class NoDiffBase(kopf.DiffBaseStorage):
    """No essence kept or compared. kopf builds one (a deep copy of the body) on every watch event
    for change-detecting handlers (on.create/update/resume); this operator registers none, only
    event handlers and indexes, so it was pure cost: with a thousand deployments' pods and
    EndpointSlices, deep copies were the largest single share of the operator's CPU."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return None

    def fetch(self, *, body: Any) -> Any:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.diffbase_storage = NoDiffBase()
    # The handlers' label filters are applied by kopf after it has received and decoded each
    # event; these make the API server send only our pods and EndpointSlices, not every pod of
    # the cluster. Of the EndpointSlices, only the client Services' (which carry their Service's
    # labels): the headless Services' change with every pod and nothing reads them.
    ours = f"{labels.MANAGED_BY}={labels.MANAGER}"
    settings.watching.label_selectors["pods"] = ours
    settings.watching.label_selectors[("discovery.k8s.io", "endpointslices")] = \
        f"{ours},{labels.COMPONENT}={render.CLIENT_SERVICE_COMPONENT}"
    settings.posting.level = logging.WARNING  # kopf's own chatter stays in the log; our Events are explicit
    settings.posting.reporting_component = labels.MANAGER
    settings.posting.event_name_prefix = "hicache-"
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.networking.request_timeout = 60
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # liveness probes, every few seconds
    logging.getLogger("httpx").setLevel(logging.WARNING)  # runtime GETs on every swap step
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # "Handler succeeded" for every pod event
    controller.nodes = NodeCache(_kube().api, controller.nodes_changed, controller.stop)
    controller.nodes.start()


@kopf.on.cleanup()
def shutdown(**_: Any) -> None:
    controller.stop.set()
    controller.queue.close()


def _nodes() -> list[dict]:
    assert controller.nodes is not None
    return controller.nodes.nodes()


def _post(body: Any, result: Result, previous: dict) -> None:
    for etype, reason, message in result.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    old = {c.get("type"): c for c in previous.get("conditions") or []}.get("Degraded") or {}
    new = {c["type"]: c for c in result.status.get("conditions", [])}.get("Degraded") or {}
    posted = {reason for _, reason, _ in result.events}  # e.g. the swap's own BackendSwapFailed
    if new.get("status") == "True" and (old.get("status") != "True" or old.get("reason") != new.get("reason")) \
            and new.get("reason") not in posted:
        kopf.event(body, type="Warning", reason=new["reason"], message=new.get("message", ""))


def process(ctl: Controller, key: Key, request: Request) -> Result | None:
    """One reconcile (+ one swap step) of the deployment as it is NOW; the status is written
    before the queue lets another worker at the same key, so no step plans from a stale status.
    Validation findings are posted when the generation is new to the status."""
    namespace, name = key
    waited = time.monotonic() - request.queued_at if request.queued_at is not None else 0.0
    metrics.QUEUE_WAIT_SECONDS.labels(request.trigger).observe(waited)
    with metrics.RECONCILE_SECONDS.labels(request.trigger).time():
        raw = ctl.bodies.get(key) or _kube().get_deployment(namespace, name)
        if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
            return None
        previous = raw.get("status") or {}
        post_findings = previous.get("observedGeneration") != raw["metadata"].get("generation")
        why = f"{request.trigger} waited={waited:.3f}"

        def swap_step(p: Plan, pods: list[dict]) -> swap.SwapStep | None:
            spec = p.outcome.spec
            if p.outcome.ok and spec is not None and (pods or swap.pending(previous)) and (
                    request.trigger == "resync" or swap.needed(previous, spec, pods)):
                ctl.stepping.add(key)  # until its status is written (see slice_event)
                return _swap_step(ctl, raw, spec, pods, why)
            return None
        try:
            result = reconcile(_kube(), raw, _nodes(), apply=request.apply, now=now(),
                               process_backed=process_backed(), post_findings=post_findings,
                               cached_pods=ctl.cached_pods(key), alongside=swap_step, defer_workload=True)
        except ChildRefused as refused:
            _report_refused(ctl, key, raw, refused)
            metrics.RECONCILES.labels(request.trigger, "invalid").inc()
            return None
        t_acted = time.monotonic()
        try:  # the swap step's last gate patches go out while the status is written
            step = result.alongside
            requeue = _swap_events(result, step) if step is not None else None
            result.status = status = result.status.rederive(
                spec_replicas=spec_replicas(raw), swap=None if step is None else SwapView(
                    step.backend_swap, tuple(dataclasses.asdict(c) for c in step.conditions)))
            write = (lambda: _write_status(ctl, key, status)) if status != previous else (lambda: True)
            if result.workload is None:
                stored = write()
            else:
                # The StatefulSet goes out while the status is written (nothing in the status depends
                # on it), except after a failed reconcile: then the status waits for the applies, so
                # one that fails again leaves the failure in the status instead of flipping it back.
                writing = _kube().submit(write) if key not in ctl.failing else None
                try:
                    result.workload()
                except ChildRefused as refused:
                    wait([writing] if writing is not None else [])
                    _report_refused(ctl, key, ctl.bodies.get(key) or raw, refused)
                    metrics.RECONCILES.labels(request.trigger, "invalid").inc()
                    return None
                except BaseException:
                    if writing is not None:
                        wait([writing])
                        if not writing.exception() and post_findings:  # the status now has this generation:
                            _post(raw, result, previous)  # the retry would not post its findings again
                    raise
                stored = writing.result() if writing is not None else write()
            if not stored:
                return None
            t_written = time.monotonic()
        finally:
            settled = swap.settle(result.alongside)
        t_settled = time.monotonic()
        if not settled:  # a gate patch failed: its watch event will not come
            requeue = swap.AFTER_ACTIONS_SECONDS
        elif result.alongside is not None and result.alongside.gates:
            ctl.note_gates(key, result.alongside.gates)
        if result.alongside is not None:
            log.info("swap step %s/%s persisted: status=%.3f gates=+%.3f", namespace, name,
                     t_written - t_acted, t_settled - t_written)
        if result.alongside is not None and result.alongside.busy_drains:  # their records are persisted now
            swap.watch_drains(key, result.alongside.busy_drains, still_out=lambda pod: ctl.still_out(key, pod),
                              on_drained=lambda: ctl.enqueue(key, Request("drained", urgent=True)))
        if result.alongside is not None and result.alongside.renewing is not None:
            # planned on a read that no longer holds: look again once the renewal says so
            result.alongside.renewing.add_done_callback(
                lambda done: done.exception() is None and done.result() and ctl.enqueue(key, Request("swap", urgent=True)))
        _track_swap(ctl, key, status)
        if requeue is not None and requeue < SWAP_POLL:  # the swap poll covers the rest
            ctl.queue.add_after(key, Request("swap", urgent=True), requeue)
    outcome = result.plan.outcome
    if post_findings:
        for f in outcome.findings:
            if f.severity == "error":
                metrics.VALIDATION_FAILURES.labels(f.rule).inc()
            elif f.severity == "normalised":
                metrics.NORMALISATIONS.labels(f.rule).inc()
    metrics.POD_RESTARTS.inc(len(result.deleted_pods))
    metrics.RECONCILES.labels(request.trigger, "ok" if outcome.ok else "invalid").inc()
    _post(raw, result, previous)
    return result


def _write_status(ctl: Controller, key: Key, status: dict) -> bool:
    """Write the whole status; False when the deployment is gone meanwhile."""
    try:
        ctl.bodies.offer(key, _kube().replace_deployment_status(*key, status))
    except ApiException as exc:
        if exc.status != 404:
            raise
        ctl.bodies.deleted(key)  # deleted meanwhile: its DELETED event untracks it
        return False
    return True


def _touch_service(namespace: str, service: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    touching = _kube().submit(lambda: _kube().touch_service(namespace, service, stamp))
    touching.add_done_callback(lambda done: done.exception() is None or log.warning(
        "touching Service %s/%s failed: %s", namespace, service, done.exception()))


def _report_refused(ctl: Controller, key: Key, raw: dict, refused: ChildRefused) -> None:
    """ConfigValid=False with the API server's message, and a Warning Event when that is news;
    the rest of the status stands. The periodic resync tries again (an unchanged spec fails the
    same way, quietly); a spec edit is reconciled at once."""
    previous = raw.get("status") or {}
    generation = int(raw["metadata"].get("generation") or 0)
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == "ConfigValid"), {})
    cond = {"type": "ConfigValid", "status": "False", "reason": "RefusedByAPIServer", "message": str(refused),
            "observedGeneration": generation,
            "lastTransitionTime": (old.get("lastTransitionTime") if old.get("status") == "False" else None) or now()}
    others = [c for c in previous.get("conditions") or [] if c.get("type") != "ConfigValid"]
    status = {**previous, "observedGeneration": generation, "conditions": [cond, *others]}
    if status != previous:
        ctl.bodies.offer(key, _kube().replace_deployment_status(*key, status))
    if (old.get("reason"), old.get("message")) != (cond["reason"], cond["message"]):
        log.warning("%s/%s: %s", *key, refused)
        kopf.event(raw, type="Warning", reason="RefusedByAPIServer", message=str(refused))


FAILED_REASON = "ReconcileFailed"
# Errors from the API server or the way to it: the message says all, a traceback would not help.
TRANSIENT = (ApiException, urllib3.exceptions.HTTPError, OSError)


def failure_message(exc: BaseException, limit: int = 600) -> str:
    """One line for a condition and an Event: the API server's own message for an API error,
    else the exception's type and text (a pydantic error's lines joined, without its links)."""
    if isinstance(exc, ApiException):
        try:
            said = json.loads(exc.body or "{}").get("message") or ""
        except (ValueError, AttributeError):
            said = str(exc.body or "")
        text = f"Kubernetes API error {exc.status} {exc.reason}" + (f": {said}" if said else "")
    else:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
        text = f"{type(exc).__name__}: {' '.join(lines)}" if lines else type(exc).__name__
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def report_failure(ctl: Controller, key: Key, exc: Exception, delay: float) -> None:
    """A reconcile raised: Degraded=True (reason ReconcileFailed, the error as message) and
    Progressing=False in the status, and a Warning Event, when that is news; the log says it
    once with the traceback (a bug) or in one line (an API error), and later repeats in one
    line. The queue retries with backoff and holds other triggers meanwhile; a new generation
    of the spec is tried at once."""
    message = failure_message(exc)
    raw = ctl.bodies.get(key)
    if raw is None:
        try:
            raw = _kube().get_deployment(*key)
        except Exception as read_exc:  # the API server may be what failed
            log.warning("reconcile of %s/%s failed (%s); retrying in %.0fs; status not updated: %s",
                        *key, message, delay, failure_message(read_exc))
            return
        if raw is None:
            return
    previous = raw.get("status") or {}
    generation = int(raw["metadata"].get("generation") or 0)
    ctl.failing[key] = generation
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == "Degraded"), {})
    news = (old.get("reason"), old.get("message")) != (FAILED_REASON, message)
    if news and not isinstance(exc, TRANSIENT):
        log.error("reconcile of %s/%s failed; retrying in %.0fs", *key, delay, exc_info=exc)
    else:
        log.warning("reconcile of %s/%s failed%s: %s; retrying in %.0fs", *key, "" if news else " again", message,
                    delay)
    if not news:
        return
    status = failed(previous, generation, (FAILED_REASON, message), now())
    try:
        ctl.bodies.offer(key, _kube().replace_deployment_status(*key, status))
    except Exception as write_exc:
        log.warning("%s/%s: writing the failure to the status failed: %s", *key, failure_message(write_exc))
    kopf.event(raw, type="Warning", reason=FAILED_REASON, message=message)


def _track_swap(ctl: Controller, key: Key, status: dict | None) -> None:
    if swap.pending(status):
        ctl.swapping.add(key)
    else:
        ctl.swapping.discard(key)


def _swap_step(ctl: Controller, raw: dict, spec: HiCacheDeploymentSpec, pods: list[dict], why: str) -> swap.SwapStep:
    """One backend-swap step (observe, plan, act) on the pods as this reconcile sees them."""
    meta = raw["metadata"]
    secret, field = render.secret_ref(spec, meta["name"], "admin")
    return swap.step(_kube().api, raw, spec, pods, now(),
                     endpoints=lambda: ctl.endpoints(meta["namespace"], render.names(meta["name"])["service"]),
                     key=_kube().admin_key(meta["namespace"], secret, field), why=why)


def _swap_events(result: Result, step: swap.SwapStep) -> float | None:
    """The step's Events join the reconcile's; returns its requeue hint."""
    for ev in step.events:
        metrics.SWAP_EVENTS.labels(ev.reason).inc()
        result.events.append((ev.type, ev.reason, ev.message))
    return step.requeue_after


def spec_replicas(raw: dict) -> int | None:
    """spec.replicas as written (the CRD defaults it to 1), READY's denominator even when the
    rest of the spec is invalid."""
    value = (raw.get("spec") or {}).get("replicas", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@kopf.on.event(**RESOURCE)
async def on_deployment(event: dict, body: kopf.Body, namespace: str, name: str, pod_index: kopf.Index,
                        slice_index: kopf.Index, **_: Any) -> None:
    controller.start(pod_index, slice_index)
    key = (namespace, name)
    if event.get("type") == "DELETED":
        controller.bodies.deleted(key, body)
        controller.untrack(key)
        _kube().forget(namespace, name)
        return
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    controller.bodies.offer(key, body)
    controller.track(key)
    status = body.get("status") or {}
    _track_swap(controller, key, status)
    if event.get("type") is None:  # the initial listing: the operator (re)started
        controller.enqueue(key, Request("resume", apply=True, urgent=True))
    elif status.get("observedGeneration") != (generation := body.get("metadata", {}).get("generation")) \
            and controller.failing.get(key) != generation:  # not the failure report of this generation
        controller.enqueue(key, Request("spec", apply=True, urgent=True))


def _owner(body: kopf.Body) -> str | None:
    return ((body.get("metadata") or {}).get("labels") or {}).get(labels.DEPLOYMENT)


def pod_essence(body: Any) -> dict:
    """What status, restarts and swaps read from a pod (no spec, no managedFields: memory)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels", "annotations",
                                               "deletionTimestamp", "creationTimestamp") if k in meta},
            "status": {**{k: status[k] for k in ("phase", "podIP", "conditions") if k in status},
                       "containerStatuses": [_container_essence(cs) for cs in status.get("containerStatuses") or []]}}


def _container_essence(cs: dict) -> dict:
    out = {k: cs[k] for k in ("name", "started", "ready", "restartCount") if k in cs}
    state = cs.get("state") or {}
    if state.get("running") is not None:
        out["state"] = {"running": {"startedAt": state["running"].get("startedAt")}}
    elif state.get("waiting") is not None:
        out["state"] = {"waiting": {"reason": state["waiting"].get("reason")}}
    return out


@kopf.index("", "v1", "pods", labels={labels.MANAGED_BY: labels.MANAGER})
async def pod_index(body: kopf.Body, namespace: str, **_: Any) -> dict:
    owner = _owner(body)
    return {(namespace, owner): pod_essence(body)} if owner else {}


@kopf.index("discovery.k8s.io", "v1", "endpointslices", labels={labels.MANAGED_BY: labels.MANAGER})
async def slice_index(body: kopf.Body, namespace: str, **_: Any) -> dict:
    service = ((body.get("metadata") or {}).get("labels") or {}).get("kubernetes.io/service-name")
    return {(namespace, service): swap.slice_readiness(body)} if service else {}


def pod_identity(body: Any, deleted: bool = False) -> tuple:
    """What a swap step needs to hear about at once: which pod (uid), whether it is going away,
    where its runtime is (IP) and its phase. Its conditions (the serving gate, Ready) are not
    in it: a swap step waits for what they cause, the EndpointSlice change, which has its own
    event."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    return (meta.get("uid"), deleted or bool(meta.get("deletionTimestamp")), status.get("podIP"), status.get("phase"))


@kopf.on.event("", "v1", "pods", labels={labels.MANAGED_BY: labels.MANAGER})
async def on_pod(event: dict, body: kopf.Body, namespace: str, pod_index: kopf.Index, slice_index: kopf.Index,
                 **_: Any) -> None:
    controller.start(pod_index, slice_index)
    owner = _owner(body)
    if owner:
        controller.pod_event((namespace, owner), body["metadata"]["name"],
                             pod_identity(body, deleted=event.get("type") == "DELETED"))


@kopf.on.event("discovery.k8s.io", "v1", "endpointslices", labels={labels.MANAGED_BY: labels.MANAGER})
async def on_endpointslice(event: dict, body: kopf.Body, namespace: str, pod_index: kopf.Index,
                           slice_index: kopf.Index, **_: Any) -> None:
    controller.start(pod_index, slice_index)
    owner = _owner(body)
    if owner:
        meta = body.get("metadata") or {}
        controller.slice_event((namespace, owner), (meta.get("labels") or {}).get("kubernetes.io/service-name"),
                               meta.get("name", ""),
                               None if event.get("type") == "DELETED" else swap.slice_readiness(body))
