"""Which background read of a pod being drained a swap step may use instead of a GET."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hicache_operator.rollout.act.drains import Drains
from hicache_operator.rollout.act.executor import Swapper
from hicache_operator.rollout.act.step import busy_drains
from hicache_operator.rollout.act.runtime_client import RuntimeView
from hicache_operator.rollout.act.views import CachedView, ViewCache
from hicache_operator.fleet.storage_config import ReportedBackend

T0 = datetime(2026, 11, 22, 5, 0, tzinfo=timezone.utc)
FLEET = ("ns", "drained-read")
POD = {"metadata": {"name": "p0", "uid": "u0"}, "status": {"podIP": "10.0.0.1"}}
IDLE = RuntimeView(backend=ReportedBackend(backend=None), in_flight=0, queued=0, error=None)


class Submitted(list):
    """An executor that keeps what it is given instead of running it."""

    def submit(self, fn, *args):
        self.append(args)


def drains_with(view: RuntimeView = IDLE, *, at: datetime = T0, after_unready: bool = True) -> Drains:
    views = ViewCache()
    views.replace(FLEET, [CachedView("u0", "10.0.0.1", at, view, after_unready)])
    return Drains(views, Submitted())


def test_a_read_made_after_the_endpoint_turned_not_ready_stands_in_for_a_get():
    assert drains_with().usable_read(FLEET, POD, acted_at=T0 - timedelta(seconds=1)) is not None


def test_any_other_read_does_not():
    acted = T0 - timedelta(seconds=1)
    # may predate the endpoint change: requests could still arrive
    assert drains_with(after_unready=False).usable_read(FLEET, POD, acted) is None
    # not newer than the pod's last action: the planner would only wait on it
    assert drains_with(at=acted).usable_read(FLEET, POD, acted) is None
    assert drains_with().usable_read(FLEET, POD, None) is None  # no readable record
    busy = RuntimeView(backend=ReportedBackend(backend=None), in_flight=1, queued=0, error=None)
    assert drains_with(busy).usable_read(FLEET, POD, acted) is None  # busy then: it may be idle now
    failed = RuntimeView(backend=None, in_flight=None, queued=None, error="connection refused")
    assert drains_with(failed).usable_read(FLEET, POD, acted) is None
    replaced = {"metadata": {"name": "p0", "uid": "u1"}, "status": {"podIP": "10.0.0.1"}}
    assert drains_with().usable_read(FLEET, replaced, acted) is None


def test_the_background_read_waits_for_a_step_to_have_used_the_deployments_key():
    submitted = Submitted()
    swapper = Swapper(background=submitted)
    swapper.read_after_unready(FLEET, [POD])
    assert submitted == []  # the key is read from the Secret by a step
    swapper.use_key(FLEET, "key")
    swapper.read_after_unready(FLEET, [])
    assert submitted == []
    swapper.read_after_unready(FLEET, [POD])
    assert len(submitted) == 1
    submitted[0][0].close()  # the read itself is not run here


def test_the_pods_a_step_hands_to_the_drain_poll_are_its_busy_drains_out_of_serving():
    from hicache_operator.rollout import PodObservation, Stage, SwapState
    from hicache_operator.rollout.actions import SwapPlan
    from hicache_operator.rollout.passes import Passes

    def record(stage: Stage, uid: str) -> dict:
        return {"uid": uid, "stage": stage.value, "since": T0.isoformat(), "actedAt": T0.isoformat()}

    def seen(name: str, *, gate=False, endpoint=False, in_flight=1, error=None, uid=None) -> PodObservation:
        return PodObservation(name=name, uid=uid or f"u-{name}", serving_gate=gate, endpoint_ready=endpoint,
                              backend=None if error else ReportedBackend(backend=None), in_flight=in_flight,
                              queued=0, runtime_error=error, observed_at=T0 + timedelta(seconds=1))
    cases = {
        "busy": (Stage.DRAINING, seen("busy")),
        "no-endpoint": (Stage.DRAINING, seen("no-endpoint", endpoint=None)),
        "idle": (Stage.DRAINING, seen("idle", in_flight=0)),
        "still-routed": (Stage.DRAINING, seen("still-routed", endpoint=True)),
        "unreachable": (Stage.DRAINING, seen("unreachable", in_flight=None, error="connection refused")),
        "replaced": (Stage.DRAINING, seen("replaced", uid="a-new-uid")),
        "swapping": (Stage.SWAPPING, seen("swapping")),
        "readmitting": (Stage.READMITTING, seen("readmitting", gate=True)),
    }
    state = SwapState.from_status({"phase": "InProgress", "target": "t", "targetBackend": "file",
                                   "startedAt": T0.isoformat(),
                                   "pods": {n: record(stage, f"u-{n}") for n, (stage, _) in cases.items()}})
    run = Passes(plan=SwapPlan(state=state), state=state, observed={n: obs for n, (_, obs) in cases.items()})
    pods = {n: {"metadata": {"name": n, "uid": f"u-{n}"}, "status": {"podIP": f"10.0.0.{i}"}}
            for i, n in enumerate(cases)}
    assert [p["metadata"]["name"] for p in busy_drains(run, pods)] == ["busy", "no-endpoint"]
