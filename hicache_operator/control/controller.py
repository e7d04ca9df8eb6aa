"""The controller: a work queue of deployments, the workers that reconcile them, and the loops
that queue what no event announces.

Triggers only enqueue (``handlers`` turns kopf's events into calls here); one worker holds a
deployment's key at a time (``workqueue``):

- HiCacheDeployment events: a new generation (or first sight at startup) queues an urgent
  reconcile that applies the children; the operator's own status writes queue nothing.
- Pod events queue a status refresh of their owner, which also admits new pods through the
  serving gate and moves a swap on; urgent while that owner has a swap in flight.
- EndpointSlice events that change an endpoint's readiness in the serving Service queue the
  owner while a swap is in flight or a swap step runs (drains and readmissions wait on them),
  and for a fleet with a router (whose workers follow the pods in serving).
- Router pod events queue a status refresh (the ROUTER column, RouterReady).
- Node changes that matter for sizing queue every deployment, which reports "no longer fits".
- Events of a managed Mooncake master's Deployment queue its owner (its readiness is in the
  status, and a new fleet's StatefulSet waits for it).
- Loops: a resync of every deployment (applies children, steps swaps, repairs drift nobody
  reported), a swap poll of deployments with a swap in flight that no step has visited within
  ``SWAP_POLL`` (a drain finishes without any Kubernetes event), and the endpoint-lag check.
- Runtimes' L3 health: a step reads every pod's runtime (``GET /hicache/storage-backend``) on
  resync, on master events, and on resume of a degraded deployment; while a pod reports its L3
  store unavailable (status ``Degraded=StorageUnavailable``) the deployment is stepped again
  every ``STORAGE_POLL``, so the condition clears within that once the pods recover (no
  Kubernetes event announces it).

``process`` runs one deployment's reconcile (``pipeline``: observe, plan, apply, swap step,
derive, write, settle) and requeues it by the result; its status is written before the key is
released, so no step plans from a stale status.
"""

from __future__ import annotations

import contextvars
import datetime
import logging
import os
import random
import threading
import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from hicache_operator.control import failures, pipeline
from hicache_operator.control.informers import Informers, Key
from hicache_operator.control.workqueue import Request, WorkQueue
from hicache_operator.fleet import gate
from hicache_operator.io import metrics
from hicache_operator.io.kube import ChildRefused, Kube, load_config
from hicache_operator.rollout import act, due

PROCESS_BACKED_ENV = "HICACHE_PROCESS_BACKED_PODS"
INTERVAL = float(os.environ.get("HICACHE_RECONCILE_INTERVAL", "30"))
SWAP_POLL = float(os.environ.get("HICACHE_SWAP_POLL_SECONDS", "1"))
STORAGE_POLL = 5.0  # while a pod reports L3 unavailable: how soon its runtime is read again
WORKERS_ENV = "HICACHE_WORKERS"
WORKERS = int(os.environ.get(WORKERS_ENV, "16"))
LAG_CHECK_SECONDS = 0.05  # see rollout.endpoint_lag

log = logging.getLogger("hicache_operator")


def process_backed() -> bool:
    return os.environ.get(PROCESS_BACKED_ENV) == "1"


class Controller:
    """The queue, the informers the event handlers fill, the swap executor, and the threads."""

    def __init__(self, kube: Kube | None = None) -> None:
        self.queue = WorkQueue()
        self.informers = Informers()
        self.swapper = act.Swapper()
        self.touches = act.EndpointTouches(self.touch_service, self.informers.serving_service)
        self._kube = kube
        self._kube_guard = threading.Lock()
        self.known: dict[Key, float] = {}  # deployment -> when its next resync is due (monotonic)
        self._known_guard = threading.Lock()
        self.swapping: set[Key] = set()  # deployments whose last status has a swap in flight
        self.l3_unavailable: set[Key] = set()  # deployments with a pod whose runtime last reported L3 unavailable
        self.failing: dict[Key, int] = {}  # deployment -> the generation whose reconcile last failed
        self.stop = threading.Event()
        self._started = False
        self._start_guard = threading.Lock()

    @property
    def kube(self) -> Kube:
        with self._kube_guard:
            if self._kube is None:
                # workers, the calls they make concurrently (a new deployment's children), the
                # node watch and swap steps' gate patches (up to 32 at once)
                load_config(connections=3 * WORKERS + 36)
                self._kube = Kube(memo_seconds=INTERVAL, parallel_calls=2 * WORKERS)
            return self._kube

    def start(self, pods: Any, routers: Any, slices: Any, masters: Any) -> None:
        """Start the threads on the first handler call: by then kopf has filled its indexes, and
        the context holds kopf's Event poster, so ``kopf.event`` works from the worker threads."""
        with self._start_guard:
            if self._started:
                return
            self._started = True
            self.informers.pods, self.informers.routers = pods, routers
            self.informers.slices, self.informers.masters = slices, masters
            loops = [self._worker] * WORKERS + [self._resync_loop, self._swap_poll_loop, self._endpoint_lag_loop]
            for i, target in enumerate(loops):
                threading.Thread(target=contextvars.copy_context().run, args=(target,), daemon=True,
                                 name=f"hicache-{target.__name__.strip('_')}-{i}").start()

    def close(self) -> None:
        self.stop.set()
        self.queue.close()

    # ------------------------------------------------------------------ triggers

    def enqueue(self, key: Key, request: Request) -> None:
        self.queue.add(key, request)
        metrics.QUEUE_DEPTH.set(self.queue.depth())

    def deployment_seen(self, key: Key, body: dict, initial: bool) -> None:
        """A HiCacheDeployment event (not a deletion). ``initial``: from the first listing (the
        operator started)."""
        self.informers.bodies.offer(key, body)
        self.track(key)
        status = body.get("status") or {}
        self.track_swap(key, status)
        generation = (body.get("metadata") or {}).get("generation")
        if initial:
            self.enqueue(key, Request("resume", apply=True, urgent=True))
        elif status.get("observedGeneration") != generation and self.failing.get(key) != generation:
            self.enqueue(key, Request("spec", apply=True, urgent=True))  # not the failure report of this generation

    def deployment_deleted(self, key: Key, body: dict) -> None:
        self.informers.bodies.deleted(key, body)
        with self._known_guard:
            self.known.pop(key, None)
            self.failing.pop(key, None)
        self.informers.forget(key)
        metrics.forget(*key)
        self.swapper.forget(key)
        self.swapping.discard(key)
        self.l3_unavailable.discard(key)
        self.queue.forget(key)
        if self._kube is not None:
            self._kube.forget(*key)

    def pod_event(self, key: Key, pod: str, identity: tuple) -> None:
        """Reconcile the pod's deployment, except during a backend swap when nothing a step
        reads at once changed (``informers.pod_identity``): each gate patch makes one or two pod
        events (the gate, then Ready), and a step they started would only hold the deployment
        while the EndpointSlice event it waits for arrives. During a swap the status is
        rewritten at least every SWAP_POLL."""
        changed = self.informers.pod_changed(key, pod, identity)
        self.touches.dirty(key)
        swapping = key in self.swapping
        if changed or not swapping:
            self.enqueue(key, Request("pod", urgent=swapping))

    def slice_event(self, key: Key, slice_name: str, readiness: dict[str, bool] | None) -> None:
        """A swap step waits on the readiness of the serving Service's endpoints (the only slices
        the watch delivers); a slice update that leaves every address's readiness as it was has
        nothing for a step. ``readiness``: ``informers.slice_readiness`` of the slice, None if
        deleted. A step in progress counts as a swap in flight: the first step of a rollout takes
        pods out before its status (which starts the swap) is written, and the slice events may
        come first. A fleet with a router is stepped on any readiness change: its routers follow
        the endpoints (``rollout.due``)."""
        self.touches.dirty(key)
        active = key in self.swapping or key in self.swapper.stepping
        if active:
            self.touches.written(key, self.informers.live_pods(key), self.informers.serving_endpoints(key),
                                 time.monotonic())
        unready = self.informers.slice_changed(key[0], slice_name, readiness)
        if unready is not None and not active and self.informers.router_pods(key):
            self.enqueue(key, Request("endpointslice"))
        if unready is None or not active:
            return
        if unready:  # pods out of serving whose endpoints just turned not ready: read them meanwhile
            self.swapper.read_after_unready(key, [p for p in self.informers.live_pods(key)
                                                  if (p.get("status") or {}).get("podIP") in unready
                                                  and gate.serving_gate(p) is False])
        self.enqueue(key, Request("endpointslice", urgent=True))

    def router_event(self, key: Key) -> None:
        """A router pod changed: the status shows its readiness."""
        self.enqueue(key, Request("router"))

    def master_event(self, key: Key) -> None:
        """A managed Mooncake master's Deployment changed (created, became ready or not)."""
        self.enqueue(key, Request("master", apply=True))

    def nodes_changed(self) -> None:
        """A node changed in a way sizing sees: re-check every deployment ("no longer fits")."""
        for key in list(self.known):
            self.enqueue(key, Request("node", apply=True))

    def track(self, key: Key) -> None:
        """Resyncs are spread over the interval (a random phase per deployment), so a thousand
        deployments do not all re-apply their children in the same second."""
        with self._known_guard:
            if key not in self.known:
                self.known[key] = time.monotonic() + random.uniform(0, INTERVAL)

    def track_swap(self, key: Key, status: dict | None) -> None:
        if due.pending(status):
            self.swapping.add(key)
        else:
            self.swapping.discard(key)

    def touch_service(self, namespace: str, service: str) -> None:
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        touching = self.kube.submit(lambda: self.kube.touch_service(namespace, service, stamp))
        touching.add_done_callback(lambda done: done.exception() is None or log.warning(
            "touching Service %s/%s failed: %s", namespace, service, done.exception()))

    # ------------------------------------------------------------------ loops

    def _worker(self) -> None:
        assert self.informers.nodes is not None
        while not self.informers.nodes.wait_synced(timeout=1.0):  # sizing needs every node
            if self.stop.is_set():
                return
        while not self.stop.is_set():
            item = self.queue.get(timeout=1.0)
            if item is None:
                continue
            key, request = item
            metrics.QUEUE_DEPTH.set(self.queue.depth())
            try:
                self.process(key, request)
                self.queue.succeeded(key)
                self.failing.pop(key, None)
            except Exception as exc:  # a bug must not stop the worker or the other deployments
                if self.stop.is_set():  # cut short by the operator's own shutdown: the next operator redoes it
                    log.warning("reconcile of %s/%s stopped by the shutdown: %s", *key, failures.failure_message(exc))
                    continue
                api = isinstance(exc, ApiException)
                metrics.RECONCILES.labels(request.trigger, "api_error" if api else "error").inc()
                delay = self.queue.retry(key, request)
                failures.report_failure(self.kube, self.informers.bodies, self.failing, key, exc, delay)
            finally:
                self.swapper.written(key)
                self.queue.done(key)

    def _resync_loop(self) -> None:
        while not self.stop.wait(min(1.0, INTERVAL / 4)):
            now_, due_keys = time.monotonic(), []
            with self._known_guard:
                for key, when in self.known.items():
                    if when <= now_:
                        self.known[key] = max(when + INTERVAL, now_)
                        due_keys.append(key)
            for key in due_keys:
                self.enqueue(key, Request("resync", apply=True))

    def _swap_poll_loop(self) -> None:
        while not self.stop.wait(SWAP_POLL / 4):
            self.swap_poll()

    def swap_poll(self) -> None:
        """A step at least every SWAP_POLL while a swap is in flight, counted from the key's last
        step: a poll right after a step the watches started would only hold the deployment when
        the next event comes. Likewise every STORAGE_POLL while a pod reports L3 unavailable:
        its recovery shows only in its runtime."""
        for key in list(self.swapping):
            if self.queue.quiet_for(key) >= SWAP_POLL:
                self.enqueue(key, Request("swap", urgent=True))
        for key in list(self.l3_unavailable):
            if self.queue.quiet_for(key) >= STORAGE_POLL:
                self.enqueue(key, Request("storage"))

    def _endpoint_lag_loop(self) -> None:
        while not self.stop.wait(LAG_CHECK_SECONDS):
            self.check_endpoint_lag(time.monotonic())

    def check_endpoint_lag(self, now_: float) -> None:
        """Touch the client Service of each deployment in a swap (or a step) whose EndpointSlice
        sits on a readiness flip (``rollout.endpoint_lag``)."""
        self.touches.check(set(self.swapping) | set(self.swapper.stepping), self.informers.live_pods,
                           self.informers.serving_endpoints, now_)

    # ------------------------------------------------------------------ one reconcile

    def process(self, key: Key, request: Request) -> pipeline.Result | None:
        """Take the deployment as the watches show it, run the pipeline (its status is written
        before the queue lets another worker at the key), requeue by its result."""
        waited = time.monotonic() - request.queued_at if request.queued_at is not None else 0.0
        metrics.QUEUE_WAIT_SECONDS.labels(request.trigger).observe(waited)
        with metrics.RECONCILE_SECONDS.labels(request.trigger).time():
            ctx = self.context()
            seen = pipeline.observe(ctx, key, trigger=request.trigger, apply=request.apply,
                                    failing=key in self.failing, waited=waited)
            if seen is None:
                return None
            try:
                result = pipeline.reconcile(ctx, seen)
            except ChildRefused as refused:
                failures.report_refused(self.kube, self.informers.bodies, key,
                                        self.informers.bodies.get(key) or seen.body, refused)
                metrics.RECONCILES.labels(request.trigger, "invalid").inc()
                return None
            if not result.written:
                return None
            self.follow(key, result)
        metrics.RECONCILES.labels(request.trigger, "ok" if result.plan.outcome.ok else "invalid").inc()
        return result

    def context(self) -> pipeline.Context:
        return pipeline.Context(kube=self.kube, informers=self.informers, swapper=self.swapper,
                                process_backed=process_backed())

    def follow(self, key: Key, result: pipeline.Result) -> None:
        """Requeue by a written result: a step sooner than the swap poll, when a busy drain
        ends, when a renewed read differs from the one planned on; and keep the sets the poll
        loops read."""
        step = result.step
        if step is not None:
            if step.busy_drains:  # their records are persisted now
                self.swapper.watch_drains(key, step.busy_drains,
                                          still_out=lambda pod: self.informers.still_out(key, pod),
                                          on_drained=lambda: self.enqueue(key, Request("drained", urgent=True)))
            if step.renewing is not None:  # planned on a read that no longer holds: look again when it says so
                step.renewing.add_done_callback(lambda done: done.exception() is None and done.result()
                                                and self.enqueue(key, Request("swap", urgent=True)))
        self.track_swap(key, result.status)
        metrics.record_swap_progress(*key, result.status.get("swapProgress"))
        if result.requeue_after is not None and result.requeue_after < SWAP_POLL:  # the swap poll covers the rest
            self.queue.add_after(key, Request("swap", urgent=True), result.requeue_after)
        (self.l3_unavailable.add if result.l3_unavailable else self.l3_unavailable.discard)(key)  # see swap_poll
