"""The acting half of drain-aware backend swaps: observe, run the planner's step, act.

``rollout.plan_step`` decides; this module only gathers what it needs (pods, their
EndpointSlice entries, each runtime's ``GET /hicache/storage-backend`` and request counts)
and carries out the actions it returns (serving-gate patches guarded by the pod's uid,
detach/attach through the admin API with the key from the Secret). One call is one step:
nothing here waits for Kubernetes (a drain, an endpoint turning ready), so a handler returns
quickly and the next trigger (a pod event or the swap timer) takes the next step from what is
then observed; only a pod's own runtime calls are followed through within the step.

The serving gate: every pod carries the readiness gate ``hicache.dev/serving``, and the
planner is its only writer. A new pod is admitted by setting it True; a pod to be swapped
is taken out by setting it False, which makes the pod not Ready, so the EndpointSlice
controller marks its endpoint not ready and clients stop routing to it. This works for
both engines (SGLang has no drain switch) and is exactly what a real kubelet honours.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine

import httpx
from kubernetes import client

from hicache_operator import labels, metrics, render
from hicache_operator.flags import RUNTIME_PORT
from hicache_operator.kube import plain_json
from hicache_operator.rollout import (
    ActionOutcome,
    Attach,
    Condition,
    Detach,
    Event,
    PodObservation,
    RolloutSettings,
    SetServingGate,
    Step,
    storage_fingerprint,
)
from hicache_operator.rollout.follow_through import StepRun, run_handover, run_step, watch_will_follow
from hicache_operator.rollout.runtime_client import RuntimeClient, shared_client
from hicache_operator.rollout.view_cache import CachedView, ViewCache
from hicache_operator.spec import HiCacheDeploymentSpec

log = logging.getLogger(__name__)
AFTER_ACTIONS_SECONDS = 0.05
READMITTING, DRAINING = Step.READMITTING.value, Step.DRAINING.value
VIEWS = ViewCache()  # recent runtime reads of settled pods, per deployment
# Gate patches are blocking client calls. A step's go out at once (maxUnavailable pods leave
# or rejoin serving together); asyncio's default executor has cpu+4 threads, so on a small
# machine a wave of eight waited for a second round trip.
_GATE_PATCHES = ThreadPoolExecutor(max_workers=32, thread_name_prefix="hicache-gate")


@dataclass
class SwapStep:
    """What a step leaves to persist; ``settling``: its last pass's gate patches, still in flight
    when it returns (see ``settle``); ``renewing``: its renewal of old reads (see ``_renew``)."""

    backend_swap: dict[str, Any]
    conditions: list[Condition] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    settling: list[tuple[SetServingGate, Future]] = field(default_factory=list)
    renewing: Future | None = None  # -> bool: a renewed read differs from the one planned on
    gates: list[tuple[str, str, bool]] = field(default_factory=list)  # (pod, uid, serving) patched
    busy_drains: list[dict] = field(default_factory=list)  # pods left draining on requests in flight


def settle(step: SwapStep | None) -> bool:
    """Wait for the step's gate patches still in flight; whether they all succeeded.

    Why they are left in flight: a step's last pass is one with no runtime call, in practice the
    readmissions (gate True) of the pods it verified. Nothing in the step depends on their
    outcome (a gate failure leaves no trace in the state: the next observation still shows the
    old gate and the planner asks again), so the handler writes the status while they go out
    instead of after; on the loaded API server both took 0.1-0.8 s, and the deployment's next
    step waited for their sum. The caller waits here before its key is released, so no step
    plans while a gate patch of the previous one is in flight, and looks again at once if one
    failed (the watch event it waits for will not come)."""
    if step is None or not step.settling:
        return True
    wait_all([f for _, f in step.settling])
    ok = True
    for action, future in step.settling:
        if future.exception() is not None:
            ok = False
            log.warning("serving gate of pod %s (-> %s) failed: %s", action.pod, action.serving, future.exception())
    return ok


def slice_readiness(endpoint_slice: dict[str, Any]) -> dict[str, bool]:
    """Pod IP -> the `ready` condition of its endpoint in one EndpointSlice (the operator keeps
    these per slice from its watch; a Service's view is their union, ready if any says so)."""
    out: dict[str, bool] = {}
    for ep in endpoint_slice.get("endpoints") or []:
        ready = bool((ep.get("conditions") or {}).get("ready"))
        for addr in ep.get("addresses") or []:
            out[addr] = out.get(addr, False) or ready
    return out


def serving_gate(pod: dict) -> bool | None:
    """The pod's ``hicache.dev/serving`` condition: True, False, or None when it has none."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == labels.SERVING_CONDITION:
            return c.get("status") == "True"
    return None


def _parse_time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _acted_at(record: Any) -> dt.datetime | None:
    """A persisted swap record's last action, None where unreadable (the planner reports that)."""
    value = record.get("actedAt") if isinstance(record, dict) else None
    try:
        when = _parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return when if when is not None and when.tzinfo is not None else None


def _observation(pod: dict, endpoints: dict[str, bool], read: CachedView | None, target_hash: str) -> PodObservation:
    """``target_hash``: ``render.storage_hash`` of the target, which a pod created from a
    template carrying it has in its storage annotation."""
    meta, status = pod["metadata"], pod.get("status") or {}
    ip = status.get("podIP")
    fields: dict[str, Any] = {"runtime_error": "pod has no IP yet"}
    observed_at = dt.datetime.now(dt.timezone.utc)
    if read is not None:
        fields, observed_at = read.view.observation_fields(), read.observed_at
    return PodObservation(name=meta["name"], uid=meta["uid"], phase=status.get("phase") or "Pending",
                          deletion_timestamp=_parse_time(meta.get("deletionTimestamp")),
                          serving_gate=serving_gate(pod), endpoint_ready=endpoints.get(ip) if ip else None,
                          started_on_target=(meta.get("annotations") or {}).get(labels.STORAGE_HASH) == target_hash,
                          observed_at=observed_at, **fields)


async def _read(http: httpx.AsyncClient, pod: dict, key: str | None, after_unready: bool = False) -> CachedView:
    """The pod's runtime now (``observed_at`` is taken before the GETs: the read was true then)."""
    now = dt.datetime.now(dt.timezone.utc)
    ip = pod["status"]["podIP"]
    view = await RuntimeClient(f"http://{ip}:{RUNTIME_PORT}", key, timeout=3.0, http=http).observe()
    return CachedView(pod["metadata"]["uid"], ip, now, view, after_unready)


def _drained_read(fleet: tuple[str, str], pod: dict, acted_at: dt.datetime | None) -> CachedView | None:
    """A pod being drained: its read from ``read_drained`` if it can stand in for a GET now.
    It must have started after the watch showed the endpoint not ready (no request is routed
    to the pod after that, its gate being False until the operator readmits it), be newer than
    the pod's last action (else the planner would only wait on it, and the step would take it
    again), and show the runtime idle: a busy one is read again, it may have finished since."""
    ip = pod["status"]["podIP"]
    read = VIEWS.last(fleet, pod["metadata"]["uid"], ip)
    if read is None or not read.after_unready or acted_at is None or read.observed_at <= acted_at:
        return None
    view = read.view
    return read if view.error is None and view.backend is not None and view.in_flight == 0 and view.queued == 0 \
        else None


_ADMIN_KEYS: dict[tuple[str, str], str | None] = {}  # per deployment: the admin key its last step used


def read_drained(fleet: tuple[str, str], pods: list[dict]) -> None:
    """Read, in the background, pods out of serving whose endpoints the watch has just shown
    not ready: the step that this event queues finds the read done (``_drained_read``).

    Why: a drained pod's first runtime call waited for a GET made at the start of its step
    (0.05-0.3 s on loaded runtimes), and the event had already waited for the step in
    progress, idle time the GET can use. Only for a deployment whose admin key a step has
    used (the key is read from its Secret in the step)."""
    if fleet not in _ADMIN_KEYS or not pods:
        return
    key = _ADMIN_KEYS[fleet]

    async def read_all() -> None:
        async with shared_client() as http:
            VIEWS.update(fleet, list(await asyncio.gather(*(_read(http, p, key, after_unready=True) for p in pods))))
    _RENEWALS.submit(asyncio.run, read_all())


DRAIN_POLL_FIRST_SECONDS = 0.05
DRAIN_POLL_GROWTH = 1.5
DRAIN_POLL_MAX_SECONDS = 1.0


class _DrainPolls:
    """The pods ``watch_drains`` polls, on one event loop in a thread of its own (any number of
    deployments' drains at once, none holding a worker)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.polled: set[tuple[tuple[str, str], str]] = set()  # (deployment, pod uid)

    def claim(self, fleet: tuple[str, str], pods: list[dict]) -> list[dict]:
        with self._guard:
            new = [p for p in pods if (fleet, p["metadata"]["uid"]) not in self.polled]
            self.polled.update((fleet, p["metadata"]["uid"]) for p in new)
            return new

    def release(self, fleet: tuple[str, str], uid: str) -> None:
        with self._guard:
            self.polled.discard((fleet, uid))

    def run(self, poll: Coroutine[Any, Any, None]) -> None:
        with self._guard:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name="hicache-drains").start()
            loop = self._loop
        asyncio.run_coroutine_threadsafe(poll, loop)


_DRAINS = _DrainPolls()


def watch_drains(fleet: tuple[str, str], pods: list[dict], still_out: Callable[[dict], bool],
                 on_drained: Callable[[], None]) -> None:
    """Poll, in the background, pods a step left draining because their runtimes still ran
    requests, until each is idle; then ``on_drained()`` (queue a step), which finds the read
    done (``_drained_read``). ``still_out(pod)``: whether the watches show the pod (same uid
    and IP) still out of serving with its endpoint not ready; checked before every read, so
    each read can answer "drained?" as ``read_drained``'s does. A pod no longer out, or seen
    drained by a step's own read, is dropped without a call.

    Why: a drain ends without any Kubernetes event. A step that found a pod busy (requests
    routed to it before its endpoint turned not ready, still running) left it to the swap poll,
    up to a second later, while its slot stayed out of serving: the last pod of a rollout,
    with no other step coming, waited for it every time. Here the wait is at most about half
    the time drained so far (the interval grows from 50 ms by 1.5x, up to 1 s), and costs
    GETs of that pod only, not steps of the deployment."""
    new = _DRAINS.claim(fleet, pods)
    if new and fleet in _ADMIN_KEYS:
        _DRAINS.run(_poll_drains(fleet, new, _ADMIN_KEYS[fleet], still_out, on_drained))
    else:
        for pod in new:
            _DRAINS.release(fleet, pod["metadata"]["uid"])


async def _poll_drains(fleet: tuple[str, str], pods: list[dict], key: str | None,
                       still_out: Callable[[dict], bool], on_drained: Callable[[], None]) -> None:
    pending = {p["metadata"]["uid"]: p for p in pods}
    names = {uid: p["metadata"]["name"] for uid, p in pending.items()}
    last_read = {uid: dt.datetime.now(dt.timezone.utc) for uid in pending}
    interval, started = DRAIN_POLL_FIRST_SECONDS, time.monotonic()
    log.info("%s/%s: waiting for the requests in flight on %s to finish", *fleet,
             ", ".join(p["metadata"]["name"] for p in pods))
    try:
        async with shared_client() as http:
            while pending:
                await asyncio.sleep(interval)
                interval = min(DRAIN_POLL_MAX_SECONDS, interval * DRAIN_POLL_GROWTH)
                for uid, pod in list(pending.items()):
                    known = VIEWS.last(fleet, uid, pod["status"]["podIP"])
                    seen_drained = known is not None and known.observed_at > last_read[uid] and _idle(known.view)
                    if seen_drained or not still_out(pod):
                        del pending[uid]
                        _DRAINS.release(fleet, uid)
                if not pending:
                    return
                reads = await asyncio.gather(*(_read(http, p, key, after_unready=True) for p in pending.values()))
                VIEWS.update(fleet, list(reads))
                done = [r.uid for r in reads if r.view.error is not None or _idle(r.view)]
                for read in reads:
                    last_read[read.uid] = read.observed_at
                for uid in done:
                    del pending[uid]
                    _DRAINS.release(fleet, uid)
                if done:
                    log.info("%s/%s: %s drained after %.2f s more", *fleet,
                             ", ".join(names[r.uid] + (" (unreadable)" if r.view.error else "")
                                       for r in reads if r.uid in done), time.monotonic() - started)
                    on_drained()
    except Exception:  # a bug must not leave pods claimed: the swap poll still covers them
        log.exception("polling the drains of %s/%s failed", *fleet)
    finally:
        for uid in pending:
            _DRAINS.release(fleet, uid)


def _idle(view: Any) -> bool:
    return view.error is None and view.in_flight == 0 and view.queued == 0


async def _observe(http: httpx.AsyncClient, fleet: tuple[str, str], pods: list[dict], endpoints: dict[str, bool],
                   records: dict[str, str], key: str | None, target_hash: str, rolling: bool = False,
                   acted: dict[str, dt.datetime] | None = None) -> tuple[list[PodObservation], list[CachedView]]:
    """Each pod as seen now: gate and endpoint from the watches, runtime from a GET made now,
    or an earlier read where a new one could not change the plan, or need not come first:

    - a settled pod (no record, gate True, endpoint ready) and one being readmitted with its
      gate already True: its recent read (see ``rollout.view_cache``); what the latter still
      waits for (its endpoint turning ready) comes from the watch;
    - while a rollout runs or starts (``rolling``), a settled pod whose last read succeeded but
      is too old to reuse: that read all the same, and it is returned to be read again in the
      background (``renew``, see ``_renew``). Those reads only pick the pods to take out next; waiting for
      them put a GET round trip of a busy runtime before the first drain of a rollout (a read
      of every pod) and between one pod's endpoint turning ready and the next pod's drain. A
      pod taken out on such a read that turns out to be on the target is readmitted by the
      next step, as with any reused read, and a renewed read that differs from the one
      planned on brings the next step at once. A settled fleet's periodic step still reads
      every pod first: it is how drift nobody reported is found;
    - a pod taken out (gate False) whose endpoint is still ready: its last read, whatever its
      age. It is stale for the planner (older than the pod's last action), which only waits:
      no runtime call is made while the pod is routable, and the next step comes with the
      EndpointSlice event that marks it not ready.

    - a pod being drained (gate False, endpoint not ready, record Draining): its read from
      ``read_drained`` where it may stand in for a GET (``_drained_read``).

    ``records``: pod name -> the step of its swap record; ``acted``: pod name -> its record's
    last action. Returns the observations and the reads to renew."""
    now = dt.datetime.now(dt.timezone.utc)
    acted = acted or {}
    kept: list[CachedView] = []
    renew: list[CachedView] = []

    async def one(pod: dict) -> PodObservation:
        meta, status = pod["metadata"], pod.get("status") or {}
        ip, gate = status.get("podIP"), serving_gate(pod)
        read = None
        if ip:
            step, endpoint_ready = records.get(meta["name"]), endpoints.get(ip)
            settled = gate is True and step is None and endpoint_ready is True
            if settled or gate is True and step == READMITTING:
                read = VIEWS.reusable(fleet, meta["uid"], ip, now)
                if read is None and settled and rolling:
                    last = VIEWS.last(fleet, meta["uid"], ip)
                    if last is not None and last.view.backend is not None and last.view.error is None:
                        read = last
                        renew.append(last)
            elif gate is False and endpoint_ready is True and step is not None:
                read = VIEWS.last(fleet, meta["uid"], ip)
            elif gate is False and endpoint_ready is not True and step == DRAINING:
                read = _drained_read(fleet, pod, acted.get(meta["name"]))
            if read is None:
                read = await _read(http, pod, key)
            kept.append(read)
        return _observation(pod, endpoints, read, target_hash)
    observations = list(await asyncio.gather(*(one(p) for p in pods)))
    VIEWS.replace(fleet, kept)
    return observations, renew


_RENEWALS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hicache-renew")
_RENEWING: dict[tuple[str, str], Future] = {}  # per deployment: the renewal in flight


def _renew(fleet: tuple[str, str], stale: list[tuple[dict, CachedView]], key: str | None) -> Future | None:
    """Read again, in the background, settled pods whose old reads a step planned on; the
    future's result says whether any read changed (the caller then steps the deployment again).

    Why in the background: these reads only pick the pods to take out next, and a step that
    waited for them held its deployment for them; at the start of a 64-pod rollout, a GET of
    every busy runtime, 0.8-1.6 s, delayed the step that follows the first drains. A step while
    a renewal is still in flight starts none (it plans on the same old reads)."""
    running = _RENEWING.get(fleet)
    if running is not None and not running.done():
        return None

    async def read_all() -> bool:
        async with shared_client() as http:
            renewed = await asyncio.gather(*(_read(http, pod, key) for pod, _ in stale))
        VIEWS.update(fleet, renewed)
        return any((new.view.backend, new.view.error) != (old.view.backend, old.view.error)
                   for (_, old), new in zip(stale, renewed))
    future = _RENEWALS.submit(asyncio.run, read_all())
    _RENEWING[fleet] = future
    future.add_done_callback(lambda done: _RENEWING.pop(fleet, None) if _RENEWING.get(fleet) is done else None)
    return future


def _set_gate(core: client.CoreV1Api, namespace: str, action: SetServingGate, target_hash: str,
              target_backend: str, target_fp: str, now: str) -> None:
    """One patch of the pod's status: the gate, and with a readmission the storage annotations
    (the pods/status subresource accepts metadata changes other than owner references), so a
    readmission is one round trip and the annotations never disagree with the gate."""
    meta: dict[str, Any] = {"uid": action.uid}  # precondition: never touch a replacement pod of the same name
    if action.serving and action.runs is not None:
        on_target = storage_fingerprint(action.runs) == target_fp
        meta["annotations"] = {
            labels.STORAGE_HASH: target_hash if on_target else storage_fingerprint(action.runs),
            labels.STORAGE_BACKEND: target_backend if on_target else (action.runs.get("backend") or "none")}
    reason, message = ("Serving", "admitted by the operator") if action.serving else \
        ("BackendSwap", "taken out of serving to swap the L3 storage backend")
    with metrics.API_SECONDS.labels("patch", "Pod/status").time():
        plain_json(core.patch_namespaced_pod_status, action.pod, namespace, {
            "metadata": meta,
            "status": {"conditions": [{"type": labels.SERVING_CONDITION,
                                       "status": "True" if action.serving else "False",
                                       "reason": reason, "message": message, "lastTransitionTime": now}]}})


def _set_gate_counted(*args: Any) -> None:
    try:
        _set_gate(*args)
    except Exception:
        metrics.SWAP_ACTIONS.labels(SetServingGate.__name__, "error").inc()
        raise
    metrics.SWAP_ACTIONS.labels(SetServingGate.__name__, "ok").inc()


async def _execute(http: httpx.AsyncClient, core: client.CoreV1Api, namespace: str, actions: list,
                   ips: dict[str, str], key: str | None, target_hash: str, target_backend: str, target_fp: str,
                   now: str, sent: dict[tuple[str, bool], float]) -> list[ActionOutcome]:
    """Run one pass's actions at once; ``sent``: (pod, serving) -> when its gate patch went out (wall clock)."""
    async def one(action) -> ActionOutcome:
        kind = type(action).__name__
        try:
            if isinstance(action, SetServingGate):
                sent[(action.pod, action.serving)] = time.time()
                await asyncio.get_running_loop().run_in_executor(
                    _GATE_PATCHES, _set_gate, core, namespace, action, target_hash, target_backend, target_fp, now)
            else:
                ip = ips.get(action.pod)
                if not ip:
                    raise RuntimeError(f"pod {action.pod} has no IP")
                rc = RuntimeClient(f"http://{ip}:{RUNTIME_PORT}", key, timeout=30.0, http=http)
                if isinstance(action, Detach):
                    await rc.detach()
                elif isinstance(action, Attach):
                    await rc.attach(action.payload)
            metrics.SWAP_ACTIONS.labels(kind, "ok").inc()
            return ActionOutcome(action)
        except Exception as exc:  # every failure is reported to the planner, never raised
            metrics.SWAP_ACTIONS.labels(kind, "error").inc()
            return ActionOutcome.failed(action, exc)
    return list(await asyncio.gather(*(one(a) for a in actions)))


def step(api: client.ApiClient, body: dict, spec: HiCacheDeploymentSpec, pods: list[dict], now: str, *,
         endpoints: Callable[[], dict[str, bool]], key: str | None, why: str = "") -> SwapStep:
    """One step for one HiCacheDeployment: observe, then plan and act (again for pods whose
    runtime call succeeded, and for readmissions that finished meanwhile, see
    ``rollout.follow_through``); returns what to persist. ``pods`` as the operator's watch sees
    them; ``endpoints()``: pod IP -> ready in the client Service's EndpointSlices, as the watch
    sees them now; ``key``: the admin API key; ``why``: the trigger, for the log."""
    t0, wall0 = time.monotonic(), time.time()
    endpoints_then = endpoints()
    meta = body["metadata"]
    ns, name = meta.get("namespace", "default"), meta["name"]
    core = client.CoreV1Api(api)
    target = render.storage_config(spec)
    settings = RolloutSettings(max_unavailable=spec.rollout.max_unavailable,
                               drain_timeout_seconds=spec.rollout.drain_timeout_seconds,
                               desired_replicas=spec.replicas, poll_seconds=2.0)
    ips = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in pods}
    swap_state = (body.get("status") or {}).get("backendSwap")
    recorded = swap_state.get("pods") if isinstance(swap_state, dict) else None
    records = {name: (rec.get("step") if isinstance(rec, dict) else None) for name, rec in recorded.items()} \
        if isinstance(recorded, dict) else {}  # unreadable: the planner says so
    acted = {name: when for name, rec in (recorded.items() if isinstance(recorded, dict) else [])
             if (when := _acted_at(rec)) is not None}
    _ADMIN_KEYS[(ns, name)] = key
    by_name = {p["metadata"]["name"]: p for p in pods}
    by_uid = {p["metadata"]["uid"]: p for p in pods}
    timings: dict[str, float] = {}
    settling: list[tuple[SetServingGate, Future]] = []
    renewals: list[Future] = []
    sent: dict[tuple[str, bool], float] = {}  # (pod, serving) -> when its gate patch went out, for the log

    async def observe_plan_act() -> StepRun:
        async with shared_client() as http:
            rolling = isinstance(swap_state, dict) and (swap_state.get("phase") == "InProgress" or
                                                        swap_state.get("target") != storage_fingerprint(target))
            observations, renew = await _observe(http, (ns, name), pods, endpoints_then, records, key,
                                                 render.storage_hash(spec), rolling, acted)
            timings["observe"] = time.monotonic()
            if renew and (renewal := _renew((ns, name), [(by_uid[v.uid], v) for v in renew], key)) is not None:
                renewals.append(renewal)

            gate_args = (render.storage_hash(spec), spec.hicache.storage.backend, storage_fingerprint(target), now)

            async def execute(actions: list) -> list[ActionOutcome]:
                if actions and all(isinstance(a, SetServingGate) for a in actions):
                    # no runtime call: the last pass (``run_step`` follows only runtime calls).
                    # Its gate patches go out while the status is written (``settle``).
                    for a in actions:
                        sent[(a.pod, a.serving)] = time.time()
                        settling.append((a, _GATE_PATCHES.submit(_set_gate_counted, core, ns, a, *gate_args)))
                    return [ActionOutcome(a) for a in actions]
                return await _execute(http, core, ns, actions, ips, key, *gate_args, sent)

            async def reobserve(names: list[str]) -> list[PodObservation]:
                named = [n for n in names if ips.get(n)]
                reads = await asyncio.gather(*(_read(http, by_name[n], key) for n in named))
                VIEWS.update((ns, name), reads)
                return [_observation(by_name[n], endpoints_then, r, gate_args[0]) for n, r in zip(named, reads)]

            clock = lambda: dt.datetime.now(dt.timezone.utc)  # noqa: E731

            def endpoint_ready() -> dict[str, bool | None]:
                ready = endpoints()
                return {n: ready.get(ip) for n, ip in ips.items() if ip}
            run = await run_step(target, observations, settings, swap_state, clock=clock, execute=execute,
                                 reobserve=reobserve, endpoint_ready=endpoint_ready)
            run = await run_handover(run, target, settings, endpoint_ready(), clock=clock, execute=execute)
            timings["act"], timings["renewing"] = time.monotonic(), len(renew)
            return run

    try:
        run = asyncio.run(observe_plan_act())
    except BaseException:
        wait_all([f for _, f in settling])  # none left in flight behind the caller's back
        raise
    plan = run.plan
    t_end = time.monotonic()
    metrics.SWAP_STEP_SECONDS.observe(t_end - t0)
    log.info("swap step %s/%s at=%.3f (%s) observe=%.3f plan+act=%.3f passes=%d renewing=%d actions=%s",
             ns, name, wall0, why, timings["observe"] - t0, timings["act"] - timings["observe"], run.passes,
             timings.get("renewing", 0),
             ",".join(f"{type(a).__name__}:{a.pod}" + (f":{a.serving}@{sent[a.pod, a.serving] - wall0:.3f}"
                                                        if isinstance(a, SetServingGate) and (a.pod, a.serving) in sent
                                                        else "")
                      for a in run.actions) or "-")
    # After acting, look again at once unless a watch event will bring the next step (a failed
    # call, a gate patch that changes no endpoint). Otherwise when the planner says.
    requeue = plan.requeue_after
    if run.actions and plan.requeue_after is not None and not watch_will_follow(run):
        requeue = AFTER_ACTIONS_SECONDS
    gates = [(o.action.pod, o.action.uid, o.action.serving) for o in run.outcomes
             if o.error is None and isinstance(o.action, SetServingGate)]
    return SwapStep(run.state.to_status(), plan.conditions, run.events, requeue, settling,
                    renewals[0] if renewals else None, gates, _busy_drains(run, by_name))


def _busy_drains(run: StepRun, pods: dict[str, dict]) -> list[dict]:
    """Pods the step left draining because their runtimes still ran requests: out of serving,
    endpoint not ready, read without error and busy (see ``watch_drains``)."""
    out = []
    for name, record in run.state.pods.items():
        seen = run.observed.get(name)
        if record.step is Step.DRAINING and name in pods and seen is not None and seen.uid == record.uid \
                and seen.serving_gate is False and seen.endpoint_ready is not True \
                and seen.runtime_error is None and not seen.idle and (pods[name].get("status") or {}).get("podIP"):
            out.append(pods[name])
    return out


def needed(status: dict | None, spec: HiCacheDeploymentSpec, pods: list[dict]) -> bool:
    """Whether a step could do anything: a swap pending, a target the last step did not plan
    for, or a live pod not (or no longer) admitted. Otherwise the fleet is settled and the
    observation (a GET per pod) is skipped; the periodic reconcile still steps regardless, so
    drift nobody reported is found within one interval."""
    swap_state = (status or {}).get("backendSwap")
    if not swap_state or pending(status):
        return True
    if swap_state.get("target") != storage_fingerprint(render.storage_config(spec)):
        return True
    return any(serving_gate(p) is not True for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp"))


def pending(status: dict | None) -> bool:
    """Whether a swap step is due without any other trigger (drain waits, verification)."""
    swap = (status or {}).get("backendSwap") or {}
    return swap.get("phase") == "InProgress" or bool(swap.get("pods"))
