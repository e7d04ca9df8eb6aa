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
pool its gate patches go out on, and which deployments are in a step whose status is not yet
written (``stepping``). The controller owns one; tests make their own. One step's run is
``step.StepRun``.
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

from hicache_operator.api.conditions import Condition
from hicache_operator.fleet import gate
from hicache_operator.io import metrics

from ..actions import Event, SetServingGate
from ..passes import watch_will_follow
from ..state import Stage
from .drains import Drains
from .pod_writes import PodWrites
from .runtime_client import shared_client
from .step import Fleet, StepInput, StepRun, busy_drains
from .views import CachedView, ViewCache, read_pod

log = logging.getLogger("hicache_operator.rollout")
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
        self.gate_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="hicache-gate")
        self._renewing: dict[Fleet, Future] = {}
        self._admin_keys: dict[Fleet, str | None] = {}  # the admin key each deployment's last step used
        self.routes: dict[Fleet, dict[str, tuple[int, int | None]]] = {}  # pod IP -> routing.membership, last step
        self.stepping: set[Fleet] = set()  # in a step whose status is not yet written (``written``)

    def use_key(self, fleet: Fleet, key: str | None) -> None:
        """The admin key the deployment's steps use (read from its Secret in a step); the
        background reads between steps use it."""
        self._admin_keys[fleet] = key

    def forget(self, fleet: Fleet) -> None:
        self.views.forget(fleet)
        self._admin_keys.pop(fleet, None)
        self.routes.pop(fleet, None)

    def written(self, fleet: Fleet) -> None:
        """The status of the deployment's last step is written (or its reconcile ended)."""
        self.stepping.discard(fleet)

    def read_after_unready(self, fleet: Fleet, pods: list[dict]) -> None:
        """``Drains.read_after_unready`` with the key the deployment's last step used (none
        before its first step: the key is read from its Secret in a step)."""
        if fleet in self._admin_keys:
            self.drains.read_after_unready(fleet, pods, self._admin_keys[fleet])

    def watch_drains(self, fleet: Fleet, pods: list[dict], still_out: Callable[[dict], bool],
                     on_drained: Callable[[], None]) -> None:
        if fleet in self._admin_keys:
            self.drains.watch(fleet, pods, self._admin_keys[fleet], still_out, on_drained)

    def step(self, api: client.ApiClient, given: StepInput) -> StepResult:
        """Observe, then plan and act (again for pods whose runtime call succeeded, and for
        readmissions that finished meanwhile: ``rollout.passes``); returns what to persist.

        The step runs on a loop of its own (``asyncio.run``) on the calling worker thread: the
        worker holds the deployment's key for the step's whole span, steps of different
        deployments run side by side on their workers, and the planner's CPU work stays on the
        worker that waits for it. The loop lives for one step; what outlives it (the TLS context,
        reads, drains, gate patches) is the swapper's and is not tied to any loop."""
        self.stepping.add(given.fleet)
        self.use_key(given.fleet, given.key)
        writes = PodWrites(client.CoreV1Api(api), given.fleet[0], given.target_fp, given.target.backend)
        step = StepRun(self, writes, given)
        try:
            run = asyncio.run(step.run())
        except BaseException:
            wait_all([f for _, f in step.settling])  # none left in flight behind the caller's back
            raise
        plan = run.plan
        metrics.SWAP_STEP_SECONDS.observe(time.monotonic() - step.t0)
        log.info("swap step %s/%s %s", *given.fleet, step.summary(run))
        # After acting, look again at once unless a watch event will bring the next step (a
        # failed call, a gate patch that changes no endpoint). Otherwise when the planner says.
        requeue = plan.requeue_after
        if run.actions and plan.requeue_after is not None and not watch_will_follow(run):
            requeue = AFTER_ACTIONS_SECONDS
        gates = [(o.action.pod, o.action.uid, o.action.serving) for o in run.outcomes
                 if o.error is None and isinstance(o.action, SetServingGate)]
        return StepResult(run.state.to_status(), plan.conditions, run.events, requeue, step.settling, step.renewal,
                          gates, busy_drains(run, step.by_name))

    async def reads(self, http: httpx.AsyncClient, fleet: Fleet, pods: list[dict], endpoints: dict[str, bool],
                    stages: dict[str, str | None], key: str | None, rolling: bool,
                    acted: dict[str, dt.datetime]) -> tuple[list[CachedView | None], list[CachedView]]:
        """Each pod as seen now: gate and endpoint from the watches, its runtime from a GET made
        now, or from an earlier read where a new one could not change the plan, or need not
        come first:

        - a settled pod (no record, gate True, endpoint ready), and one being readmitted with
          its gate already True: its recent read (``views``);
        - while a rollout runs or starts (``rolling``), a settled pod whose last read succeeded
          but is too old to reuse: that read all the same, returned to be renewed in the
          background (``renew``). Such reads only pick the pods to take out next; a pod taken
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
        record's last action. Returns each pod's read (None: no IP) and the reads to renew."""
        now = dt.datetime.now(dt.timezone.utc)
        kept: list[CachedView] = []
        renew: list[CachedView] = []

        async def one(pod: dict) -> CachedView | None:
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
            return read
        reads = list(await asyncio.gather(*(one(p) for p in pods)))
        self.views.replace(fleet, kept)
        return reads, renew

    def renew(self, fleet: Fleet, stale: list[tuple[dict, CachedView]], key: str | None) -> Future | None:
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
