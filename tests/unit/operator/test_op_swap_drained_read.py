"""Which background read of a pod being drained a swap step may use instead of a GET."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hicache_operator import swap
from hicache_operator.rollout.runtime_client import RuntimeView
from hicache_operator.rollout.storage_config import ReportedBackend
from hicache_operator.rollout.view_cache import CachedView

T0 = datetime(2026, 11, 22, 5, 0, tzinfo=timezone.utc)
FLEET = ("ns", "drained-read")
POD = {"metadata": {"name": "p0", "uid": "u0"}, "status": {"podIP": "10.0.0.1"}}
IDLE = RuntimeView(backend=ReportedBackend(backend=None), in_flight=0, queued=0, error=None)


def stored(view: RuntimeView = IDLE, *, at: datetime = T0, after_unready: bool = True) -> None:
    swap.VIEWS.replace(FLEET, [CachedView("u0", "10.0.0.1", at, view, after_unready)])


def test_a_read_made_after_the_endpoint_turned_not_ready_stands_in_for_a_get():
    stored()
    assert swap._drained_read(FLEET, POD, acted_at=T0 - timedelta(seconds=1)) is not None


def test_any_other_read_does_not():
    acted = T0 - timedelta(seconds=1)
    stored(after_unready=False)  # may predate the endpoint change: requests could still arrive
    assert swap._drained_read(FLEET, POD, acted) is None
    stored(at=acted)  # not newer than the pod's last action: the planner would only wait on it
    assert swap._drained_read(FLEET, POD, acted) is None
    assert swap._drained_read(FLEET, POD, None) is None  # no readable record
    stored(RuntimeView(backend=ReportedBackend(backend=None), in_flight=1, queued=0, error=None))
    assert swap._drained_read(FLEET, POD, acted) is None  # busy then: it may be idle now
    stored(RuntimeView(backend=None, in_flight=None, queued=None, error="connection refused"))
    assert swap._drained_read(FLEET, POD, acted) is None
    replaced = {"metadata": {"name": "p0", "uid": "u1"}, "status": {"podIP": "10.0.0.1"}}
    stored()
    assert swap._drained_read(FLEET, replaced, acted) is None


def test_the_background_read_waits_for_a_step_to_have_used_the_deployments_key(monkeypatch):
    submitted: list = []
    monkeypatch.setattr(swap._RENEWALS, "submit", lambda fn, *args: submitted.append(args))
    monkeypatch.setitem(swap._ADMIN_KEYS, FLEET, "key")
    del swap._ADMIN_KEYS[FLEET]
    swap.read_drained(FLEET, [POD])
    assert submitted == []  # the key is read from the Secret by a step
    swap._ADMIN_KEYS[FLEET] = "key"
    swap.read_drained(FLEET, [])
    assert submitted == []
    swap.read_drained(FLEET, [POD])
    assert len(submitted) == 1
    submitted[0][0].close()  # the read itself is not run here


def test_the_pods_a_step_hands_to_the_drain_poll_are_its_busy_drains_out_of_serving():
    from hicache_operator.rollout import PodObservation, Step, SwapState
    from hicache_operator.rollout.actions import Plan
    from hicache_operator.rollout.follow_through import StepRun

    def record(step: Step, uid: str) -> dict:
        return {"uid": uid, "step": step.value, "since": T0.isoformat(), "actedAt": T0.isoformat()}

    def seen(name: str, *, gate=False, endpoint=False, in_flight=1, error=None, uid=None) -> PodObservation:
        return PodObservation(name=name, uid=uid or f"u-{name}", serving_gate=gate, endpoint_ready=endpoint,
                              backend=None if error else ReportedBackend(backend=None), in_flight=in_flight,
                              queued=0, runtime_error=error, observed_at=T0 + timedelta(seconds=1))
    cases = {
        "busy": (Step.DRAINING, seen("busy")),
        "no-endpoint": (Step.DRAINING, seen("no-endpoint", endpoint=None)),
        "idle": (Step.DRAINING, seen("idle", in_flight=0)),
        "still-routed": (Step.DRAINING, seen("still-routed", endpoint=True)),
        "unreachable": (Step.DRAINING, seen("unreachable", in_flight=None, error="connection refused")),
        "replaced": (Step.DRAINING, seen("replaced", uid="a-new-uid")),
        "swapping": (Step.SWAPPING, seen("swapping")),
        "readmitting": (Step.READMITTING, seen("readmitting", gate=True)),
    }
    state = SwapState.from_status({"phase": "InProgress", "target": "t", "targetBackend": "file",
                                   "startedAt": T0.isoformat(),
                                   "pods": {n: record(step, f"u-{n}") for n, (step, _) in cases.items()}})
    run = StepRun(plan=Plan(state=state), state=state, observed={n: obs for n, (_, obs) in cases.items()})
    pods = {n: {"metadata": {"name": n, "uid": f"u-{n}"}, "status": {"podIP": f"10.0.0.{i}"}}
            for i, n in enumerate(cases)}
    assert [p["metadata"]["name"] for p in swap._busy_drains(run, pods)] == ["busy", "no-endpoint"]
