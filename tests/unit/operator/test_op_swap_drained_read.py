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
