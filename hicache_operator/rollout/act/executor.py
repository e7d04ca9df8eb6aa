"""One swap step for one HiCacheDeployment: observe, run the planner's passes, act.

The planner (``rollout.planner`` through ``rollout.passes``) decides; this module gathers what
it needs (the pods and their EndpointSlice readiness as the watches show them, each runtime's
``GET /hicache/storage-backend`` and request counts, each router pod's worker list) and carries
out what it returns: serving gate patches (``rollout.gate``), router worker changes
(``router_client``), detach/attach through the admin API, and pod deletions. A step waits for
nothing Kubernetes does (a drain, an endpoint turning ready): the next watch event or the swap
poll brings the next step, which plans on what is observed then. Only a pod's own runtime calls
are followed through within the step.

``Swapper`` holds what outlives one step, for every deployment: recent runtime reads
(``views``), drains being polled (``drains``), background renewals of old reads, the admin key
each deployment's last step used, its routers as that step read them (``routes``), and the
pool its gate patches go out on. The controller owns one; tests make their own.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hicache_operator.api import labels
from hicache_operator.io import metrics
from hicache_operator.plan import render
from hicache_operator.api.conditions import Condition
from hicache_operator.api.flags import RUNTIME_PORT
from hicache_operator.io.kube import plain_json
from hicache_operator.fleet.pods import pod_is_ready, restart_hash_of
from hicache_operator.api.spec import HiCacheDeploymentSpec

from hicache_operator.fleet import gate
from ..actions import ActionOutcome, Attach, DeletePod, Detach, Event, SetRouted, SetServingGate
from ..observation import PodObservation, RolloutSettings
from ..passes import Passes, run_handover, run_passes, watch_will_follow
from ..routing import RouterRead, membership, worker_url
from ..state import Stage
from hicache_operator.fleet.storage_config import storage_fingerprint
from .drains import Drains
from .router_client import RouterClient
from .runtime_client import RuntimeClient, shared_client
from .views import CachedView, ViewCache, read_pod

log = logging.getLogger("hicache_operator.rollout")
Fleet = tuple[str, str]
AFTER_ACTIONS_SECONDS = 0.05


@dataclass
class StepResult:
    """What a step leaves to persist and to follow up. ``settling``: its last pass's gate
    patches, still in flight when it returns (see ``settle``); ``renewing``: its background
    renewal of old reads (-> whether a renewed read differs from the one planned on);
    ``gates``: (pod, uid, serving) patched; ``busy_drains``: pods left draining on requests in
    flight (see ``Drains.watch``)."""

    backend_swap: dict[str, Any]
    conditions: list[Condition] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    settling: list[tuple[SetServingGate, Future]] = field(default_factory=list)
    renewing: Future | None = None
    gates: list[tuple[str, str, bool]] = field(default_factory=list)
    busy_drains: list[dict] = field(default_factory=list)


def settle(result: StepResult | None) -> bool:
    """Wait for the step's gate patches still in flight; whether they all succeeded.

    A step's last pass makes no runtime call (in practice the readmissions of the pods it
    verified), and nothing in the step depends on its patches' outcome: a failed patch leaves no
    trace in the state, the next observation still shows the old gate and the planner asks
    again. So the status is written while they go out (on a loaded API server each takes
    0.1-0.8 s), and the caller waits here before the deployment's key is released: no step
    plans while a gate patch of the previous one is in flight, and one that failed is looked at
    again at once (the watch event it waits for will not come)."""
    if result is None or not result.settling:
        return True
    wait_all([f for _, f in result.settling])
    ok = True
    for action, future in result.settling:
        if future.exception() is not None:
            ok = False
            log.warning("serving gate of pod %s (-> %s) failed: %s", action.pod, action.serving, future.exception())
    return ok


class Swapper:
    """The acting half of swaps, for every deployment (see the module docstring)."""

    def __init__(self, views: ViewCache | None = None, background: Executor | None = None) -> None:
        self.views = views if views is not None else ViewCache()
        self._background = background if background is not None else ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="hicache-renew")
        self.drains = Drains(self.views, self._background)
        # Gate patches are blocking client calls; a step's go out at once (maxUnavailable pods
        # leave or rejoin serving together), so a wave of eight never waits for a second round.
        self._gate_patches = ThreadPoolExecutor(max_workers=32, thread_name_prefix="hicache-gate")
        self._renewing: dict[Fleet, Future] = {}
        self._admin_keys: dict[Fleet, str | None] = {}  # the admin key each deployment's last step used
        self.routes: dict[Fleet, dict[str, tuple[int, int | None]]] = {}  # pod IP -> routing.membership, last step

    def use_key(self, fleet: Fleet, key: str | None) -> None:
        """The admin key the deployment's steps use (read from its Secret in a step); the
        background reads between steps use it."""
        self._admin_keys[fleet] = key

    def forget(self, fleet: Fleet) -> None:
        self.views.forget(fleet)
        self._admin_keys.pop(fleet, None)
        self.routes.pop(fleet, None)

    def read_after_unready(self, fleet: Fleet, pods: list[dict]) -> None:
        """``Drains.read_after_unready`` with the key the deployment's last step used (none
        before its first step: the key is read from its Secret in a step)."""
        if fleet in self._admin_keys:
            self.drains.read_after_unready(fleet, pods, self._admin_keys[fleet])

    def watch_drains(self, fleet: Fleet, pods: list[dict], still_out: Callable[[dict], bool],
                     on_drained: Callable[[], None]) -> None:
        if fleet in self._admin_keys:
            self.drains.watch(fleet, pods, self._admin_keys[fleet], still_out, on_drained)

    def step(self, api: client.ApiClient, body: dict, spec: HiCacheDeploymentSpec, pods: list[dict], *,
             endpoints: Callable[[], dict[str, bool]], key: str | None, restart_hash: str | None = None,
             why: str = "", routers: list[dict] | None = None, api_key: str | None = None) -> StepResult:
        """Observe, then plan and act (again for pods whose runtime call succeeded, and for
        readmissions that finished meanwhile: ``rollout.passes``); returns what to persist.
        ``pods`` as the operator's watch sees them; ``endpoints()``: pod IP -> ready in the
        serving Service's EndpointSlices as the watch sees them now; ``key``: the admin API key;
        ``restart_hash``: the pod template's restart hash once the StatefulSet carries it (pods
        with another one are restarted), None while it does not yet; ``why``: the trigger;
        ``routers``: the router's pods (with the router on); ``api_key``: the key the pods want
        from clients, which a worker added to a router carries."""
        t0, wall0 = time.monotonic(), time.time()
        endpoints_then = endpoints()
        meta = body["metadata"]
        fleet: Fleet = (meta.get("namespace", "default"), meta["name"])
        core = client.CoreV1Api(api)
        target = render.storage_config(spec)
        target_fp = storage_fingerprint(target)
        settings = RolloutSettings(max_unavailable=spec.rollout.max_unavailable,
                                   drain_timeout_seconds=spec.rollout.drain_timeout_seconds,
                                   desired_replicas=spec.replicas, poll_seconds=2.0)
        ips = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in pods}
        swap_state = (body.get("status") or {}).get("backendSwap")
        stages, acted = _records(swap_state)
        self.use_key(fleet, key)
        by_name = {p["metadata"]["name"]: p for p in pods}
        by_uid = {p["metadata"]["uid"]: p for p in pods}
        timings: dict[str, float] = {}
        settling: list[tuple[SetServingGate, Future]] = []
        renewals: list[Future] = []
        sent: dict[tuple[str, bool], float] = {}  # (pod, serving) -> when its gate patch went out, for the log
        send = (core, fleet[0], target_fp, spec.hicache.storage.backend)
        router_pods = [r for r in routers or [] if (r.get("status") or {}).get("podIP")] if spec.router_on else []
        reads: list[RouterRead] = []
        observe = lambda pod, read: _observation(pod, endpoints_then, read, target_fp, restart_hash,  # noqa: E731
                                                 reads)

        async def observe_plan_act() -> Passes:
            async with shared_client() as http:
                rolling = isinstance(swap_state, dict) and (swap_state.get("phase") == "InProgress" or
                                                            swap_state.get("target") != target_fp)
                reading = asyncio.ensure_future(_read_routers(http, router_pods, api_key))
                observations, renew = await self._observe(http, fleet, pods, endpoints_then, stages, key,
                                                          lambda pod, read: read, rolling, acted)
                reads.extend(await reading)
                observations = [observe(pod, read) for pod, read in zip(pods, observations)]
                self.routes[fleet] = {ip: membership(ip, reads) for ip in ips.values() if ip}
                timings["observe"] = time.monotonic()
                if renew and (renewal := self._renew(fleet, [(by_uid[v.uid], v) for v in renew], key)) is not None:
                    renewals.append(renewal)

                async def execute(actions: list) -> list[ActionOutcome]:
                    if actions and all(isinstance(a, SetServingGate) for a in actions):
                        # no runtime call: the last pass (``run_passes`` follows only runtime
                        # calls); its gate patches go out while the status is written (``settle``)
                        for a in actions:
                            sent[(a.pod, a.serving)] = time.time()
                            settling.append((a, self._gate_patches.submit(_send_gate_counted, a, *send)))
                        return [ActionOutcome(a) for a in actions]
                    return await self._execute(http, actions, ips, key, send, sent, router_pods, api_key)

                async def reobserve(names: list[str]) -> list[PodObservation]:
                    named = [n for n in names if ips.get(n)]
                    fresh = await asyncio.gather(*(read_pod(http, by_name[n], key) for n in named))
                    self.views.update(fleet, fresh)
                    return [observe(by_name[n], r) for n, r in zip(named, fresh)]

                clock = lambda: dt.datetime.now(dt.timezone.utc)  # noqa: E731

                def endpoint_ready() -> dict[str, bool | None]:
                    ready = endpoints()
                    return {n: ready.get(ip) for n, ip in ips.items() if ip}
                run = await run_passes(target, observations, settings, swap_state, clock=clock, execute=execute,
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
        metrics.SWAP_STEP_SECONDS.observe(time.monotonic() - t0)
        log.info("swap step %s/%s at=%.3f (%s) observe=%.3f plan+act=%.3f passes=%d renewing=%d actions=%s",
                 *fleet, wall0, why, timings["observe"] - t0, timings["act"] - timings["observe"], run.passes,
                 timings.get("renewing", 0),
                 ",".join(f"{type(a).__name__}:{a.pod}" + (f":{a.serving}@{sent[a.pod, a.serving] - wall0:.3f}"
                                                            if isinstance(a, SetServingGate)
                                                            and (a.pod, a.serving) in sent else "")
                          for a in run.actions) or "-")
        # After acting, look again at once unless a watch event will bring the next step (a
        # failed call, a gate patch that changes no endpoint). Otherwise when the planner says.
        requeue = plan.requeue_after
        if run.actions and plan.requeue_after is not None and not watch_will_follow(run):
            requeue = AFTER_ACTIONS_SECONDS
        gates = [(o.action.pod, o.action.uid, o.action.serving) for o in run.outcomes
                 if o.error is None and isinstance(o.action, SetServingGate)]
        return StepResult(run.state.to_status(), plan.conditions, run.events, requeue, settling,
                          renewals[0] if renewals else None, gates, busy_drains(run, by_name))

    async def _observe(self, http: httpx.AsyncClient, fleet: Fleet, pods: list[dict], endpoints: dict[str, bool],
                       stages: dict[str, str | None], key: str | None,
                       observe: Callable[[dict, CachedView | None], Any], rolling: bool,
                       acted: dict[str, dt.datetime]) -> tuple[list[Any], list[CachedView]]:
        """Each pod as seen now: gate and endpoint from the watches, its runtime from a GET made
        now, or from an earlier read where a new one could not change the plan, or need not
        come first:

        - a settled pod (no record, gate True, endpoint ready), and one being readmitted with
          its gate already True: its recent read (``views``);
        - while a rollout runs or starts (``rolling``), a settled pod whose last read succeeded
          but is too old to reuse: that read all the same, returned to be renewed in the
          background (``_renew``). Such reads only pick the pods to take out next; a pod taken
          out on one that turns out to be on the target is readmitted by the next step, and a
          renewed read that differs brings the next step at once. A settled fleet's periodic
          step still reads every pod first: that is how drift nobody reported is found;
        - a pod taken out (gate False) whose endpoint is still ready: its last read, whatever
          its age. It is stale for the planner (older than the pod's last action), which only
          waits: no runtime call is made while the pod is routable, and the EndpointSlice event
          that marks it not ready brings the next step;
        - a pod being drained (gate False, endpoint not ready, Draining): its read from
          ``drains`` where it may stand in for a GET.

        ``stages``: pod name -> the stage of its swap record; ``acted``: pod name -> its
        record's last action. Returns the observations and the reads to renew."""
        now = dt.datetime.now(dt.timezone.utc)
        kept: list[CachedView] = []
        renew: list[CachedView] = []

        async def one(pod: dict) -> Any:
            meta, status = pod["metadata"], pod.get("status") or {}
            ip, serving = status.get("podIP"), gate.serving_gate(pod)
            read = None
            if ip:
                stage, endpoint_ready = stages.get(meta["name"]), endpoints.get(ip)
                settled = serving is True and stage is None and endpoint_ready is True
                if settled or serving is True and stage == Stage.READMITTING.value:
                    read = self.views.reusable(fleet, meta["uid"], ip, now)
                    if read is None and settled and rolling:
                        last = self.views.last(fleet, meta["uid"], ip)
                        if last is not None and last.view.backend is not None and last.view.error is None:
                            read = last
                            renew.append(last)
                elif serving is False and endpoint_ready is True and stage is not None:
                    read = self.views.last(fleet, meta["uid"], ip)
                elif serving is False and endpoint_ready is not True and stage == Stage.DRAINING.value:
                    read = self.drains.usable_read(fleet, pod, acted.get(meta["name"]))
                if read is None:
                    read = await read_pod(http, pod, key)
                kept.append(read)
            return observe(pod, read)
        observations = list(await asyncio.gather(*(one(p) for p in pods)))
        self.views.replace(fleet, kept)
        return observations, renew

    def _renew(self, fleet: Fleet, stale: list[tuple[dict, CachedView]], key: str | None) -> Future | None:
        """Read again, in the background, settled pods whose old reads a step planned on; the
        future's result says whether any read changed (the caller then steps the deployment
        again). In the background because these reads only pick the next pods to take out: at
        the start of a 64-pod rollout, a GET of every busy runtime takes 0.8-1.6 s. A step while
        a renewal is still in flight starts none (it plans on the same old reads)."""
        running = self._renewing.get(fleet)
        if running is not None and not running.done():
            return None

        async def read_all() -> bool:
            async with shared_client() as http:
                renewed = await asyncio.gather(*(read_pod(http, pod, key) for pod, _ in stale))
            self.views.update(fleet, renewed)
            return any((new.view.backend, new.view.error, new.view.storage_unavailable) !=
                       (old.view.backend, old.view.error, old.view.storage_unavailable)
                       for (_, old), new in zip(stale, renewed))
        future = self._background.submit(asyncio.run, read_all())
        self._renewing[fleet] = future
        future.add_done_callback(
            lambda done: self._renewing.pop(fleet, None) if self._renewing.get(fleet) is done else None)
        return future

    async def _execute(self, http: httpx.AsyncClient, actions: list, ips: dict[str, str], key: str | None,
                       send: tuple, sent: dict[tuple[str, bool], float], routers: list[dict],
                       api_key: str | None) -> list[ActionOutcome]:
        """Run one pass's actions at once; ``sent``: (pod, serving) -> when its gate patch went
        out (wall clock). Every failure is reported to the planner, never raised."""
        async def one(action) -> ActionOutcome:
            kind = type(action).__name__
            try:
                if isinstance(action, SetServingGate):
                    sent[(action.pod, action.serving)] = time.time()
                    await asyncio.get_running_loop().run_in_executor(self._gate_patches, _send_gate, action, *send)
                elif isinstance(action, DeletePod):
                    await asyncio.get_running_loop().run_in_executor(self._gate_patches, _delete_pod, action, *send)
                elif isinstance(action, SetRouted):
                    ip = ips.get(action.pod)
                    if not ip:
                        raise RuntimeError(f"pod {action.pod} has no IP")
                    await _route(http, routers, worker_url(ip), action.routed, api_key)
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
            except Exception as exc:
                metrics.SWAP_ACTIONS.labels(kind, "error").inc()
                return ActionOutcome.failed(action, exc)
        return list(await asyncio.gather(*(one(a) for a in actions)))


def _records(swap_state: Any) -> tuple[dict[str, str | None], dict[str, dt.datetime]]:
    """From a persisted ``status.backendSwap``: pod -> its record's stage, and pod -> its
    record's last action (where readable; the planner reports an unreadable state)."""
    recorded = swap_state.get("pods") if isinstance(swap_state, dict) else None
    if not isinstance(recorded, dict):
        return {}, {}
    stages = {name: (rec.get("stage", rec.get("step")) if isinstance(rec, dict) else None)
              for name, rec in recorded.items()}
    acted = {name: when for name, rec in recorded.items() if (when := _acted_at(rec)) is not None}
    return stages, acted


def _parse_time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _acted_at(record: Any) -> dt.datetime | None:
    value = record.get("actedAt") if isinstance(record, dict) else None
    try:
        when = _parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return when if when is not None and when.tzinfo is not None else None


async def _read_routers(http: httpx.AsyncClient, routers: list[dict], api_key: str | None) -> list[RouterRead]:
    """Each router pod's worker list (None where it could not be read)."""
    async def one(pod: dict) -> RouterRead:
        try:
            listed: frozenset[str] | None = await RouterClient(pod["status"]["podIP"], http, api_key).listed()
        except Exception as exc:  # noqa: BLE001: an unreadable router is an observation
            log.info("router pod %s: %s", pod["metadata"]["name"], exc)
            listed = None
        return RouterRead(pod["metadata"]["name"], listed, pod_is_ready(pod))
    return list(await asyncio.gather(*(one(p) for p in routers)))


async def _route(http: httpx.AsyncClient, routers: list[dict], url: str, routed: bool, api_key: str | None) -> None:
    """Add the worker to (or remove it from) every router pod; a router pod that is not Ready and
    cannot be reached is left alone (starting or gone, it has only what its discovery finds)."""
    async def one(pod: dict) -> None:
        rc = RouterClient(pod["status"]["podIP"], http, api_key)
        try:
            await (rc.add(url) if routed else rc.remove(url))
        except Exception:
            if pod_is_ready(pod):
                raise
    results = await asyncio.gather(*(one(p) for p in routers), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]


def _observation(pod: dict, endpoints: dict[str, bool], read: CachedView | None, target_fp: str,
                 restart_hash: str | None, routers: list[RouterRead] | None = None) -> PodObservation:
    """``target_fp``: the target's fingerprint, which a pod created from a template carrying
    it has in its storage annotation; ``restart_hash``: see ``Swapper.step``; ``routers``: the
    router pods' worker lists."""
    meta, status = pod["metadata"], pod.get("status") or {}
    ip = status.get("podIP")
    fields: dict[str, Any] = {"runtime_error": "pod has no IP yet"}
    observed_at = dt.datetime.now(dt.timezone.utc)
    if read is not None:
        fields, observed_at = read.view.observation_fields(), read.observed_at
    router_replicas, routed_by = membership(ip, routers or [])
    return PodObservation(name=meta["name"], uid=meta["uid"], phase=status.get("phase") or "Pending",
                          ready=pod_is_ready(pod), router_replicas=router_replicas, routed_by=routed_by,
                          deletion_timestamp=_parse_time(meta.get("deletionTimestamp")),
                          serving_gate=gate.serving_gate(pod), endpoint_ready=endpoints.get(ip) if ip else None,
                          started_on_target=(meta.get("annotations") or {}).get(labels.STORAGE_HASH) == target_fp,
                          stale_template=restart_hash is not None and restart_hash_of(pod) != restart_hash,
                          observed_at=observed_at, **fields)


def _send_gate(action: SetServingGate, core: client.CoreV1Api, namespace: str, target_fp: str,
               target_backend: str) -> None:
    with metrics.API_SECONDS.labels("patch", "Pod").time():
        plain_json(core.patch_namespaced_pod, action.pod, namespace, gate.patch(action.uid, action.serving, action.runs, target_fp, target_backend))


def _delete_pod(action: DeletePod, core: client.CoreV1Api, namespace: str, *_: Any) -> None:
    """Delete the pod if it is still the one the action names; gone or replaced already is done
    (404, or 409 from the uid precondition)."""
    try:
        with metrics.API_SECONDS.labels("delete", "Pod").time():
            core.delete_namespaced_pod(action.pod, namespace, body={"preconditions": {"uid": action.uid}},
                                       _preload_content=False)
    except ApiException as exc:
        if exc.status not in (404, 409):
            raise
        return
    metrics.POD_RESTARTS.inc()


def _send_gate_counted(action: SetServingGate, *send: Any) -> None:
    try:
        _send_gate(action, *send)
    except Exception:
        metrics.SWAP_ACTIONS.labels(SetServingGate.__name__, "error").inc()
        raise
    metrics.SWAP_ACTIONS.labels(SetServingGate.__name__, "ok").inc()


def busy_drains(run: Passes, pods: dict[str, dict]) -> list[dict]:
    """Pods the step left draining because their runtimes still ran requests: out of serving,
    endpoint not ready, read without error and busy (see ``Drains.watch``)."""
    out = []
    for name, record in run.state.pods.items():
        seen = run.observed.get(name)
        if record.stage is Stage.DRAINING and name in pods and seen is not None and seen.uid == record.uid \
                and seen.serving_gate is False and seen.endpoint_ready is not True and seen.unrouted \
                and seen.runtime_error is None and not seen.idle and (pods[name].get("status") or {}).get("podIP"):
            out.append(pods[name])
    return out
