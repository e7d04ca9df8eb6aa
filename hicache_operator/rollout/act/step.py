"""One swap step's run: observe the fleet, run the planner's passes, carry out their actions.

``StepInput`` is what the caller knows of the deployment; ``StepRun`` holds what the step's
parts share (the pods by name, their IPs, the HTTP client, the gate patches in flight) and runs
them as methods on one event loop (``Swapper.step`` says whose).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import httpx

from hicache_operator.api import labels
from hicache_operator.api.flags import RUNTIME_PORT
from hicache_operator.fleet import gate
from hicache_operator.fleet.pods import pod_is_ready, restart_hash_of
from hicache_operator.fleet.storage_config import StorageConfig
from hicache_operator.io import metrics

from ..actions import ActionOutcome, Attach, DeletePod, Detach, SetRouted, SetServingGate
from ..observation import PodObservation, RolloutSettings
from ..passes import Passes, run_handover, run_passes
from ..routing import RouterRead, membership, worker_url
from ..state import Stage
from .pod_writes import PodWrites
from .router_client import read_routers, route
from .runtime_client import RuntimeClient, shared_client
from .views import CachedView, ViewCache, read_pod

Fleet = tuple[str, str]


class Fleetwide(Protocol):
    """What a step uses of the state that outlives it (``executor.Swapper``)."""

    views: ViewCache
    routes: dict[Fleet, dict[str, tuple[int, int | None]]]
    gate_pool: Executor

    async def reads(self, http: httpx.AsyncClient, fleet: Fleet, pods: list[dict], endpoints: dict[str, bool],
                    stages: dict[str, str | None], key: str | None, rolling: bool,
                    acted: dict[str, dt.datetime]) -> tuple[list[CachedView | None], list[CachedView]]: ...

    def renew(self, fleet: Fleet, stale: list[tuple[dict, CachedView]], key: str | None) -> Future | None: ...


@dataclass(frozen=True)
class StepInput:
    """One deployment as the caller sees it. ``swap_state``: ``status.backendSwap`` as
    persisted; ``target``/``target_fp``: the storage config the spec asks for and its
    fingerprint (derived once by the caller); ``pods`` as the operator's watch sees them;
    ``endpoints()``: pod IP -> ready in the serving Service's EndpointSlices as the watch sees
    them now; ``key``: the admin API key; ``restart_hash``: the pod template's restart hash once
    the StatefulSet carries it (pods with another one are restarted), None while it does not;
    ``why``: the trigger; ``routers``: the router's pods (empty with the router off);
    ``api_key``: the key the pods want from clients, which a worker added to a router carries."""

    fleet: Fleet
    swap_state: Any
    target: StorageConfig
    target_fp: str
    settings: RolloutSettings
    pods: list[dict]
    endpoints: Callable[[], dict[str, bool]]
    key: str | None = None
    restart_hash: str | None = None
    why: str = ""
    routers: list[dict] = field(default_factory=list)
    api_key: str | None = None


class StepRun:
    """The parts of one step (see the module docstring); ``run`` is the whole step."""

    def __init__(self, swapper: Fleetwide, writes: PodWrites, given: StepInput) -> None:
        self.swapper, self.writes, self.given = swapper, writes, given
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.endpoints_then = given.endpoints()
        self.ips = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in given.pods}
        self.by_name = {p["metadata"]["name"]: p for p in given.pods}
        self.by_uid = {p["metadata"]["uid"]: p for p in given.pods}
        self.stages, self.acted = records(given.swap_state)
        self.router_pods = [r for r in given.routers if (r.get("status") or {}).get("podIP")]
        self.reads: list[RouterRead] = []
        self.timings: dict[str, float] = {}
        self.settling: list[tuple[SetServingGate, Future]] = []  # the last pass's gate patches
        self.renewal: Future | None = None
        self.sent: dict[tuple[str, bool], float] = {}  # (pod, serving) -> when its gate patch went out
        self.http: httpx.AsyncClient | None = None

    async def run(self) -> Passes:
        g = self.given
        async with shared_client() as self.http:
            observations = await self.observe()
            run = await run_passes(g.target, observations, g.settings, g.swap_state, clock=now, execute=self.execute,
                                   reobserve=self.reobserve, endpoint_ready=self.endpoint_ready)
            run = await run_handover(run, g.target, g.settings, self.endpoint_ready(), clock=now, execute=self.execute)
            self.timings["act"] = time.monotonic()
            return run

    async def observe(self) -> list[PodObservation]:
        """Every pod (``Swapper.reads``) and every router pod's worker list, read at once."""
        g = self.given
        rolling = isinstance(g.swap_state, dict) and (g.swap_state.get("phase") == "InProgress" or
                                                      g.swap_state.get("target") != g.target_fp)
        assert self.http is not None
        routers = asyncio.ensure_future(read_routers(self.http, self.router_pods, g.api_key))
        reads, renew = await self.swapper.reads(self.http, g.fleet, g.pods, self.endpoints_then, self.stages, g.key,
                                                rolling, self.acted)
        self.reads.extend(await routers)
        self.swapper.routes[g.fleet] = {ip: membership(ip, self.reads) for ip in self.ips.values() if ip}
        self.timings["observe"], self.timings["renewing"] = time.monotonic(), len(renew)
        if renew:
            self.renewal = self.swapper.renew(g.fleet, [(self.by_uid[v.uid], v) for v in renew], g.key)
        return [self.observation(pod, read) for pod, read in zip(g.pods, reads)]

    def observation(self, pod: dict, read: CachedView | None) -> PodObservation:
        return observation(pod, self.endpoints_then, read, self.given.target_fp, self.given.restart_hash, self.reads)

    async def reobserve(self, names: list[str]) -> list[PodObservation]:
        assert self.http is not None
        named = [n for n in names if self.ips.get(n)]
        fresh = await asyncio.gather(*(read_pod(self.http, self.by_name[n], self.given.key) for n in named))
        self.swapper.views.update(self.given.fleet, fresh)
        return [self.observation(self.by_name[n], r) for n, r in zip(named, fresh)]

    def endpoint_ready(self) -> dict[str, bool | None]:
        ready = self.given.endpoints()
        return {n: ready.get(ip) for n, ip in self.ips.items() if ip}

    async def execute(self, actions: list) -> list[ActionOutcome]:
        """Run one pass's actions at once; every failure is reported to the planner, never
        raised. A pass of gate patches only is the last (``run_passes`` follows only runtime
        calls): its patches go out while the status is written (``executor.settle``)."""
        if actions and all(isinstance(a, SetServingGate) for a in actions):
            for a in actions:
                self.sent[(a.pod, a.serving)] = time.time()
                self.settling.append((a, self.swapper.gate_pool.submit(self.writes.gate_counted, a)))
            return [ActionOutcome(a) for a in actions]
        return list(await asyncio.gather(*(self.act(a) for a in actions)))

    async def act(self, action: Any) -> ActionOutcome:
        kind = type(action).__name__
        try:
            if isinstance(action, SetServingGate):
                self.sent[(action.pod, action.serving)] = time.time()
                await asyncio.get_running_loop().run_in_executor(self.swapper.gate_pool, self.writes.gate, action)
            elif isinstance(action, DeletePod):
                await asyncio.get_running_loop().run_in_executor(self.swapper.gate_pool, self.writes.delete, action)
            else:
                ip = self.ips.get(action.pod)
                if not ip:
                    raise RuntimeError(f"pod {action.pod} has no IP")
                assert self.http is not None
                if isinstance(action, SetRouted):
                    await route(self.http, self.router_pods, worker_url(ip), action.routed, self.given.api_key)
                else:
                    rc = RuntimeClient(f"http://{ip}:{RUNTIME_PORT}", self.given.key, timeout=30.0, http=self.http)
                    if isinstance(action, Detach):
                        await rc.detach()
                    elif isinstance(action, Attach):
                        await rc.attach(action.payload)
            metrics.SWAP_ACTIONS.labels(kind, "ok").inc()
            return ActionOutcome(action)
        except Exception as exc:
            metrics.SWAP_ACTIONS.labels(kind, "error").inc()
            return ActionOutcome.failed(action, exc)

    def summary(self, run: Passes) -> str:
        """The step's log line after ``swap step <ns>/<name>``."""
        t = self.timings
        acts = ",".join(f"{type(a).__name__}:{a.pod}" + (f":{a.serving}@{self.sent[a.pod, a.serving] - self.wall0:.3f}"
                                                         if isinstance(a, SetServingGate)
                                                         and (a.pod, a.serving) in self.sent else "")
                        for a in run.actions) or "-"
        return (f"at={self.wall0:.3f} ({self.given.why}) observe={t['observe'] - self.t0:.3f} "
                f"plan+act={t['act'] - t['observe']:.3f} passes={run.passes} renewing={t.get('renewing', 0)} "
                f"actions={acts}")


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def records(swap_state: Any) -> tuple[dict[str, str | None], dict[str, dt.datetime]]:
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


def observation(pod: dict, endpoints: dict[str, bool], read: CachedView | None, target_fp: str,
                restart_hash: str | None, routers: list[RouterRead] | None = None) -> PodObservation:
    """``target_fp``: the target's fingerprint, which a pod created from a template carrying
    it has in its storage annotation; ``restart_hash``: see ``StepInput``; ``routers``: the
    router pods' worker lists."""
    meta, status = pod["metadata"], pod.get("status") or {}
    ip = status.get("podIP")
    fields: dict[str, Any] = {"runtime_error": "pod has no IP yet"}
    observed_at = now()
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
