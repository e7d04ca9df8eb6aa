"""A pure-Python fleet for driving the rollout planner through time.

Pods have a serving gate, an EndpointSlice entry that follows readiness
after a random lag, traffic that only arrives while the endpoint is ready,
a pod template generation (a new one makes the planner restart each pod,
drained first), and a runtime that behaves like SGLang's admin API (idle
check, "Detach first", same-backend attach only updates policies, detach of
nothing is a no-op). With ``router``, a router sends traffic to its workers, finds them as
sglang-router 0.3.2's discovery does (a pod joins once Ready and in serving, unless discovery
has seen it before; it leaves only when deleted while still in serving) and takes the planner's
``SetRouted`` changes. The operator loop observes, plans, executes, applies outcomes and
persists — and can crash anywhere in between. Every invariant the planner
promises is checked as the world changes, not only at the end.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from hicache_operator.rollout import Action, ActionOutcome, Attach, DeletePod, Detach, PodObservation, RolloutSettings, SetRouted, SetServingGate, SwapState, apply_outcomes, plan_step
from hicache_operator.fleet.storage_config import ReportedBackend, storage_fingerprint
from hicache_operator.rollout.passes import run_handover, run_passes
from hicache_operator.rollout.act.runtime_client import BackendError, NotIdle, Unreachable

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)

# Targets a test can pick. `sim` in extra_config makes this fake runtime misbehave.
CONFIGS: dict[str, dict[str, Any]] = {
    "file": {"backend": "file", "prefetch_policy": "best_effort", "write_policy": "write_through", "extra_config": {}},
    "file-tuned": {"backend": "file", "prefetch_policy": "wait_complete", "write_policy": "write_through",
                   "extra_config": {"prefetch_threshold": 128}},
    "file-selective": {"backend": "file", "prefetch_policy": "best_effort",
                       "write_policy": "write_through_selective", "extra_config": {}},
    "mooncake": {"backend": "mooncake", "prefetch_policy": "timeout", "write_policy": "write_through",
                 "extra_config": {"master_server_address": "mooncake-master:50051", "protocol": "tcp"}},
    "none": {"backend": "none", "prefetch_policy": "best_effort", "write_policy": "write_through", "extra_config": {}},
    "refused": {"backend": "dynamic", "prefetch_policy": "best_effort", "write_policy": "write_through",
                "extra_config": {"backend_name": "x", "module_path": "m", "class_name": "C", "sim": "refuse"}},
    "mangled": {"backend": "mooncake", "prefetch_policy": "timeout", "write_policy": "write_through",
                "extra_config": {"master_server_address": "mooncake-master:50051", "sim": "mangle"}},
}
GOOD = ("file", "file-tuned", "file-selective", "mooncake", "none")


class InvariantBroken(AssertionError):
    pass


@dataclass
class SimRuntime:
    """SGLang's HiRadixCache storage state, as the admin API sees it."""

    backend: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    prefetch: str = "best_effort"
    write: str = "write_through"

    @classmethod
    def booted_with(cls, cfg: dict[str, Any]) -> SimRuntime:
        rt = cls(prefetch=cfg["prefetch_policy"], write=cfg["write_policy"])
        if cfg["backend"] != "none":
            rt.backend, rt.extra = cfg["backend"], dict(cfg["extra_config"])
            if rt.backend == "mooncake":
                # As if the command line carried the node's address: SGLang
                # reports it back, and it must never be sent to another pod.
                rt.extra["local_hostname"] = "10.0.0.7"
            if rt.extra.get("sim") == "mangle":
                rt.prefetch = "best_effort"
        return rt

    def report(self) -> ReportedBackend:
        body = {
            "hicache_storage_backend": self.backend,
            "hicache_storage_backend_extra_config": json.dumps(self.extra) if self.backend else None,
            "hicache_storage_prefetch_policy": self.prefetch,
            "hicache_write_policy": self.write,
        }
        return ReportedBackend.from_response(body)

    def fingerprint(self) -> str:
        if self.backend is None:
            return storage_fingerprint({"backend": "none"})
        extra = {k: v for k, v in self.extra.items() if k != "local_hostname"}
        return storage_fingerprint({"backend": self.backend, "prefetch_policy": self.prefetch,
                                    "write_policy": self.write, "extra_config": extra})


@dataclass
class SimPod:
    name: str
    uid: str
    boot_config: dict[str, Any]
    runtime: SimRuntime
    gate: bool | None = None
    endpoint_ready: bool | None = None
    up: bool = False
    up_in: int = 1
    in_flight: int = 0
    queued: int = 0
    stuck: bool = False  # requests that never finish: drain must time out
    unhealthy: int = 0  # ticks left of a failing readiness probe
    glitch: bool = False  # the next observation of the runtime fails
    terminating: bool = False
    last_flaky: bool = False
    lag: int = 0
    taken_out_config: str | None = None  # runtime fingerprint when the gate last went False
    taken_out_configs: set[str] = field(default_factory=set)  # ... and every other time it did
    template: int = 0  # the pod template generation it was created from
    out_since: datetime | None = None  # when its gate last went False

    @property
    def boot_fp(self) -> str:
        return SimRuntime.booted_with(self.boot_config).fingerprint()

    @property
    def available(self) -> bool:
        return not self.terminating and self.gate is True and self.endpoint_ready is True

    def busy(self) -> bool:
        return self.in_flight > 0 or self.queued > 0


class Fleet:
    def __init__(self, n: int, initial: str, *, max_unavailable: int | str = 1, seed: int = 0,
                 drain_timeout: float = 8.0, flaky: float = 0.0, passes: bool = False,
                 watch_moves: float = 0.0, router: bool = False) -> None:
        self.rng = random.Random(seed)
        self.router = router
        self.routed: set[str] = set()  # uids of the router's workers
        self.discovered: set[str] = set()  # uids its discovery has added once (it never adds them again)
        self.passes = passes  # the operator's step: rollout.passes.run_passes
        # with passes: how often the endpoints catch up while a step runs, before its
        # handover pass (``run_handover``); a generator of its own keeps other histories as they were
        self.watch_moves, self.watch_rng = watch_moves, random.Random(seed + 1)
        self.clock = T0
        self.replicas = n
        self.target_name = initial
        self.targets_seen = {storage_fingerprint(CONFIGS[initial])}
        self.target_history = [initial]
        self.settings = RolloutSettings(max_unavailable=max_unavailable, drain_timeout_seconds=drain_timeout,
                                        desired_replicas=n, poll_seconds=1.0)
        self.flaky = flaky
        self.uids = 0
        self.template = 0  # the StatefulSet's pod template generation
        self.pods: dict[str, SimPod] = {}
        self.recreate_in: dict[str, int] = {}
        for i in range(n):
            pod = self._new_pod(f"cache-{i}", CONFIGS[initial])
            pod.gate, pod.endpoint_ready, pod.up = True, True, True
            self.pods[pod.name] = pod
            self._discover(pod)
        self.persisted: dict[str, Any] | None = None
        self.last_plan = None
        self.last_actions: list[Action] = []  # of the last step, all its passes
        self.last_run = None  # with passes: the last step's Passes
        self.rollback_failed: set[str] = set()  # uids
        self.attach_payloads: list[dict[str, Any]] = []
        self.failures_seen: list[str] = []
        self.reasons: set[str] = set()  # Event reasons seen, to show what a history exercised

    # ------------------------------------------------------------ world

    def _new_pod(self, name: str, boot: dict[str, Any]) -> SimPod:
        self.uids += 1
        # the template's label puts every new pod in serving
        return SimPod(name=name, uid=f"uid-{self.uids}", boot_config=boot, runtime=SimRuntime.booted_with(boot),
                      up_in=self.rng.randint(1, 3), gate=True, template=self.template)

    @property
    def target(self) -> dict[str, Any]:
        return CONFIGS[self.target_name]

    def set_target(self, name: str) -> None:
        self.target_name = name
        self.target_history.append(name)
        self.targets_seen.add(storage_fingerprint(CONFIGS[name]))

    def revert(self) -> None:
        if len(self.target_history) >= 2:
            self.set_target(self.target_history[-2])

    def new_template(self) -> None:
        """An image, model or engine flag changed: the StatefulSet carries a new template."""
        self.template += 1

    def delete(self, name: str) -> None:
        if name in self.pods:
            self.pods[name].terminating = True
            self._discover(self.pods[name])

    def routes(self, pod: SimPod) -> bool:
        return pod.uid in self.routed

    def _discover(self, pod: SimPod) -> None:
        """The router's discovery seeing the pod: a Ready pod in serving it has not added before
        joins; one deleted while still in serving leaves."""
        if not self.router:
            return
        if pod.terminating:
            if pod.gate is True:
                self.routed.discard(pod.uid)
        elif pod.gate is True and pod.up and pod.unhealthy == 0 and pod.uid not in self.discovered:
            self.discovered.add(pod.uid)
            self.routed.add(pod.uid)

    def restart_container(self, name: str, down: int | None = None) -> None:
        pod = self.pods.get(name)
        if pod and not pod.terminating:
            pod.up, pod.up_in = False, down or self.rng.randint(1, 3)
            pod.in_flight = pod.queued = 0
            pod.runtime = SimRuntime.booted_with(pod.boot_config)

    def tick(self) -> None:
        self.clock += timedelta(seconds=1)
        for name, pod in list(self.pods.items()):
            if pod.terminating:
                del self.pods[name]
                self.recreate_in[name] = self.rng.randint(1, 3)
                continue
            if not pod.up:
                pod.up_in -= 1
                if pod.up_in <= 0:
                    pod.up = True
            pod.unhealthy = max(0, pod.unhealthy - 1)
            ready = pod.gate is True and pod.up and pod.unhealthy == 0
            self._discover(pod)
            if pod.endpoint_ready is not ready:
                # The endpoints controller catches up within 1-3 ticks.
                pod.lag = pod.lag or self.rng.randint(1, 3)
                pod.lag -= 1
                if pod.lag == 0:
                    pod.endpoint_ready = ready
            else:
                pod.lag = 0
            if (pod.endpoint_ready or self.routes(pod)) and pod.up:  # clients reach it either way
                pod.in_flight, pod.queued = self.rng.randint(0, 3), self.rng.randint(0, 1)
            else:
                pod.in_flight, pod.queued = max(0, pod.in_flight - 1), 0
            if pod.stuck and pod.up:
                pod.in_flight = max(1, pod.in_flight)
        for name in list(self.recreate_in):
            self.recreate_in[name] -= 1
            if self.recreate_in[name] <= 0:
                del self.recreate_in[name]
                # The StatefulSet template already carries the current target's flags.
                self.pods[name] = self._new_pod(name, self.target)

    def _endpoints_catch_up(self) -> None:
        """The endpoints controller, faster than ``tick`` lets it be: every endpoint whose pod's
        readiness changed follows it now."""
        for pod in self.pods.values():
            ready = pod.gate is True and pod.up and pod.unhealthy == 0 and not pod.terminating
            if pod.endpoint_ready is not ready:
                pod.endpoint_ready, pod.lag = ready, 0

    def observe(self, names: list[str] | None = None) -> list[PodObservation]:
        out = []
        for pod in self.pods.values():
            if names is not None and pod.name not in names:
                continue
            reachable = pod.up and not pod.glitch
            out.append(PodObservation(
                name=pod.name, uid=pod.uid, phase="Running",
                deletion_timestamp=self.clock if pod.terminating else None,
                serving_gate=pod.gate, endpoint_ready=pod.endpoint_ready,
                backend=pod.runtime.report() if reachable else None,
                in_flight=pod.in_flight if reachable else None, queued=pod.queued if reachable else None,
                runtime_error=None if reachable else "connection refused", observed_at=self.clock,
                stale_template=pod.template != self.template,
                ready=pod.up and pod.unhealthy == 0,
                router_replicas=1 if self.router else 0, routed_by=1 if self.routes(pod) else 0,
            ))
            pod.glitch = False
        return out

    # ------------------------------------------------------------ operator

    def step(self, crash: str = "ok", prefix: int = 0) -> Any:
        """One operator pass. crash: ok | drop (actions run, state not
        persisted) | prefix (first `prefix` actions run, then the operator
        dies) | reorder (actions run in a shuffled order). With
        ``passes``, one operator step of up to a few passes
        (``run_passes``); a crash may then come in any of them."""
        if self.passes:
            return self._step_followed(crash, prefix)
        plan = plan_step(self.target, self.observe(), self.settings, self.persisted, self.clock)
        self.last_plan, self.last_actions = plan, plan.actions
        self._note(plan.events, plan.state)
        actions = self._ordered(plan.actions, crash)
        if crash == "prefix":
            actions = actions[:prefix]
        outcomes = [self.execute(a) for a in actions]
        self._check_state(plan.state)
        if crash in ("ok", "reorder"):
            self.persisted = json.loads(json.dumps(apply_outcomes(plan.state, outcomes).to_status()))
        return plan

    def _step_followed(self, crash: str, prefix: int) -> Any:
        done: list[Action] = []

        class Died(Exception):
            pass

        def clock() -> datetime:
            # passes and re-reads within one step are ordered in time, 1 ms apart
            self.clock += timedelta(milliseconds=1)
            return self.clock

        async def execute(actions: list[Action]) -> list[ActionOutcome]:
            outcomes = []
            gates = {(a.pod, a.serving) for a in done if isinstance(a, SetServingGate)}
            repeated = [a for a in actions if isinstance(a, SetServingGate) and (a.pod, a.serving) in gates]
            if repeated:
                raise InvariantBroken(f"a later pass repeats a gate patch of its step: {repeated}")
            for action in self._ordered(actions, crash):
                if crash == "prefix" and len(done) >= prefix:
                    raise Died
                done.append(action)
                outcomes.append(self.execute(action))
            if self.watch_moves and any(isinstance(a, (Detach, Attach)) for a in actions):
                # runtime calls take time: the step's watch may move before the pass returns, and
                # the step looks at it meanwhile (rollout.passes._hand_over)
                if self.watch_rng.random() < self.watch_moves:
                    self._endpoints_catch_up()
                for _ in range(3):
                    await asyncio.sleep(0)
            return outcomes

        async def reobserve(names: list[str]) -> list[PodObservation]:
            self.clock += timedelta(milliseconds=1)
            return self.observe(names)

        def note(plan) -> None:
            self._note(plan.events, plan.state)

        async def operator_step():
            watched = (lambda: {pod.name: pod.endpoint_ready for pod in self.pods.values()}) if self.watch_moves else None
            run = await run_passes(self.target, self.observe(), self.settings, self.persisted,
                                 clock=clock, execute=execute, reobserve=reobserve, on_plan=note,
                                 endpoint_ready=watched, poll=0)
            if self.watch_moves and self.watch_rng.random() < self.watch_moves:
                self._endpoints_catch_up()  # the watch moved while the step ran
            ready = {pod.name: pod.endpoint_ready for pod in self.pods.values()}
            return await run_handover(run, self.target, self.settings, ready, clock=clock, execute=execute,
                                      on_plan=note)

        try:
            run = asyncio.run(operator_step())
        except Died:
            return self.last_plan
        self.last_plan, self.last_actions, self.last_run = run.plan, run.actions, run
        self._check_state(run.state)
        if crash in ("ok", "reorder"):
            self.persisted = json.loads(json.dumps(run.state.to_status()))
        return run.plan

    def _ordered(self, actions: list[Action], crash: str) -> list[Action]:
        named = [a.pod for a in actions]
        if len(named) != len(set(named)):
            raise InvariantBroken(f"more than one action for a pod in one pass: {actions}")
        actions = list(actions)
        if crash == "reorder":
            self.rng.shuffle(actions)
        return actions

    def _note(self, events, state: SwapState) -> None:
        self.reasons.update(e.reason for e in events)
        if state.failure is not None:
            self.reasons.add(f"failure: {state.failure.cause}")
        for event in events:
            if event.reason == "RollbackFailed" and event.pod in self.pods:
                self.rollback_failed.add(self.pods[event.pod].uid)
            if event.reason in ("BackendSwapFailed", "PodSwapFailed"):
                self.failures_seen.append(event.message)

    def _check_state(self, state: SwapState) -> None:
        status = state.to_status()
        encoded = json.dumps(status)
        if len(encoded) > 600 * max(1, len(state.pods)) + 800:
            raise InvariantBroken(f"swap state is not small: {len(encoded)} bytes")
        if SwapState.from_status(json.loads(encoded)) != state:
            raise InvariantBroken("swap state does not survive a JSON round trip")

    def execute(self, action) -> ActionOutcome:
        pod = self.pods.get(action.pod)
        if pod is None or pod.uid != action.uid:
            return ActionOutcome(action, error="precondition failed: uid changed")
        try:
            if isinstance(action, SetServingGate):
                self._set_gate(pod, action.serving)
            elif isinstance(action, Detach):
                self._runtime_call(pod, "detach", None)
            elif isinstance(action, Attach):
                self._runtime_call(pod, "attach", action.payload)
            elif isinstance(action, DeletePod):
                self._delete_pod(pod)
            elif isinstance(action, SetRouted):
                self._set_routed(pod, action.routed)
            return ActionOutcome(action)
        except Exception as exc:  # the executor turns every failure into an outcome
            if isinstance(exc, InvariantBroken):
                raise
            return ActionOutcome.failed(action, exc)

    def _set_routed(self, pod: SimPod, routed: bool) -> None:
        if not self.router:
            raise InvariantBroken(f"router change for {pod.name} in a fleet without a router")
        if routed:
            if not (pod.gate is True and pod.up and not pod.terminating):
                raise InvariantBroken(f"{pod.name} added to the router while out of serving (gate {pod.gate})")
            if not self._settled(pod):
                raise InvariantBroken(f"{pod.name} added to the router in an intermediate state: {pod.runtime.report()}")
            self.routed.add(pod.uid)
        else:
            self.routed.discard(pod.uid)

    def unavailable(self) -> int:
        """Pods not serving: with a router, clients reach only its workers."""
        live = [p for p in self.pods.values() if not p.terminating]
        return sum(1 for p in live if not p.available or self.router and not self.routes(p)) + \
            max(0, self.replicas - len(live))

    def _set_gate(self, pod: SimPod, serving: bool) -> None:
        if not serving:
            was_available = pod.available and (self.routes(pod) or not self.router)
            if pod.gate is not False:
                pod.taken_out_config = pod.runtime.fingerprint()
                pod.taken_out_configs.add(pod.taken_out_config)
                pod.out_since = self.clock
            pod.gate = False
            if was_available and self.unavailable() > self.settings.budget(self.replicas):
                raise InvariantBroken(
                    f"taking {pod.name} out of serving made {self.unavailable()} pods unavailable "
                    f"(maxUnavailable {self.settings.max_unavailable})")
            return
        if pod.gate is not True and pod.up:
            if not self._settled(pod):
                raise InvariantBroken(f"{pod.name} readmitted in an intermediate state: {pod.runtime.report()}")
        pod.gate = True

    def _delete_pod(self, pod: SimPod) -> None:
        """A restart: only of a pod on an older template, never while it is routable, and while
        it still runs requests only once its drain has timed out."""
        if pod.template == self.template:
            raise InvariantBroken(f"{pod.name} restarted though it runs the current template")
        if pod.endpoint_ready is True:
            raise InvariantBroken(f"{pod.name} deleted while its endpoint is ready (routable)")
        if self.routes(pod):
            raise InvariantBroken(f"{pod.name} deleted while the router routes to it")
        drained_for = (self.clock - pod.out_since).total_seconds() if pod.out_since else 0.0
        if pod.up and pod.busy() and pod.gate is False and drained_for <= self.settings.drain_timeout_seconds:
            raise InvariantBroken(f"{pod.name} deleted while running requests, {drained_for:.0f}s into its drain")
        pod.terminating = True

    def _settled(self, pod: SimPod) -> bool:
        """On a config someone asked for: a target, what the pod booted with,
        or what it ran when taken out of serving (unless its rollback failed)."""
        allowed = self.targets_seen | {pod.boot_fp, pod.taken_out_config}
        return pod.runtime.fingerprint() in allowed or pod.uid in self.rollback_failed

    def _runtime_call(self, pod: SimPod, call: str, payload: dict[str, Any] | None) -> None:
        if not pod.up:
            raise Unreachable(f"{pod.name}: connection refused")
        if self.flaky and not pod.last_flaky and self.rng.random() < self.flaky:
            pod.last_flaky = True
            raise Unreachable(f"{pod.name}: read timeout")
        pod.last_flaky = False
        if pod.gate is not False:
            raise InvariantBroken(f"{call} on {pod.name} while its serving gate is {pod.gate}")
        if pod.endpoint_ready is True:
            raise InvariantBroken(f"{call} on {pod.name} while its endpoint is ready (routable)")
        if self.routes(pod):
            raise InvariantBroken(f"{call} on {pod.name} while the router routes to it")
        record = ((self.persisted or {}).get("pods") or {}).get(pod.name) or {}
        if record.get("uid") != pod.uid:
            # what lets a restarted operator roll the pod back: its `previous`, persisted first
            raise InvariantBroken(f"{call} on {pod.name} before its swap record was persisted")
        if pod.busy():
            raise NotIdle(f"Reject {call}: scheduler is not idle. #queue-req={pod.queued} "
                          f"#running-req={pod.in_flight}", pod.queued, pod.in_flight)
        rt = pod.runtime
        if call == "detach":
            rt.backend, rt.extra = None, {}
            return
        self.attach_payloads.append(payload)
        if "local_hostname" in json.dumps(payload).lower():
            raise InvariantBroken(f"attach payload carries a hostname: {payload}")
        extra = json.loads(payload["hicache_storage_backend_extra_config_json"])
        if extra.get("sim") == "refuse":
            raise BackendError("Failed to attach HiCache storage backend. sim refuses", status=400)
        if rt.backend is not None and rt.backend != payload["hicache_storage_backend"]:
            raise BackendError(f"Cannot attach different backend '{payload['hicache_storage_backend']}'. "
                               "Detach first.", status=400)
        if rt.backend is None:
            rt.backend, rt.extra = payload["hicache_storage_backend"], extra
        rt.prefetch = payload.get("hicache_storage_prefetch_policy", rt.prefetch)
        rt.write = payload.get("hicache_write_policy", rt.write)
        if rt.extra.get("sim") == "mangle":
            rt.prefetch = "best_effort"

    # ------------------------------------------------------------ checks

    def run_until_quiet(self, limit: int = 400) -> Any:
        """Clean operation (no chaos) until the planner has nothing to do."""
        for pod in self.pods.values():
            pod.stuck, pod.unhealthy = False, 0
        self.flaky = 0.0
        plan = None
        quiet = 0
        for _ in range(limit):
            self.tick()
            # what the planner saw, not what the step's watch moved to after it planned
            seen_settled = all(p.up and p.available and (self.routes(p) or not self.router)
                               for p in self.pods.values())
            plan = self.step()
            if (seen_settled and not self.last_actions and not plan.state.pods and not self.recreate_in
                    and all(p.up and p.available and (self.routes(p) or not self.router) for p in self.pods.values())
                    and plan.state.phase.value in ("Complete", "Failed")):
                # twice: the endpoints may have caught up after the step observed them
                quiet += 1
                if quiet == 2:
                    return plan
            else:
                quiet = 0
        raise InvariantBroken(f"no quiescence after {limit} steps: {plan.state.to_status() if plan else None}")

    def check_quiet(self, plan) -> None:
        if len(self.pods) != self.replicas:
            raise InvariantBroken("pods missing at quiescence")
        for pod in self.pods.values():
            if pod.gate is not True:
                raise InvariantBroken(f"{pod.name} left with serving gate {pod.gate}")
            if self.router and not self.routes(pod):
                raise InvariantBroken(f"{pod.name} serves but is not a worker of the router")
            if pod.template != self.template:
                raise InvariantBroken(f"{pod.name} left on pod template {pod.template}, not {self.template}")
            fp = pod.runtime.fingerprint()
            if plan.state.phase.value == "Complete" and fp != storage_fingerprint(self.target):
                raise InvariantBroken(f"rollout Complete but {pod.name} runs {pod.runtime.report()}")
            if not self._settled(pod):
                raise InvariantBroken(f"{pod.name} ended in an intermediate state: {pod.runtime.report()}")
        if plan.state.phase.value == "Failed":
            failing = self.pods.get(plan.state.failure.pod)
            if failing is None:
                raise InvariantBroken(f"failure names no pod of the fleet: {plan.state.failure}")
            # back on what it ran when taken out: the swap record's `previous` may come from an
            # earlier takeout than the last (found by hypothesis: a step whose state was lost had
            # swapped the pod, which was then taken out on the target and its drain timed out)
            restored = failing.taken_out_configs | {failing.boot_fp}
            if failing.runtime.fingerprint() not in restored and failing.uid not in self.rollback_failed:
                raise InvariantBroken(f"failed pod {failing.name} was not restored: {failing.runtime.report()}")
