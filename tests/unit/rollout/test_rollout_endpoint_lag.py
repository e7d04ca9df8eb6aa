"""Which readiness flips the EndpointSlice has not published, and when the Service is touched."""

from __future__ import annotations

from hicache_operator.rollout.endpoint_lag import AFTER, FIRST_INTERVAL, MAX_INTERVAL, SETTLE, LagWatch, unpublished


def pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {**({"podIP": ip} if ip else {}),
                                         "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_unpublished_names_each_pod_whose_endpoint_disagrees_with_its_ready_condition():
    pods = [pod("in-sync", "10.0.0.1", True), pod("back-not-shown", "10.0.0.2", True),
            pod("out-still-shown", "10.0.0.3", False), pod("new-not-listed", "10.0.0.4", True),
            pod("unready-not-listed", "10.0.0.5", False), pod("unready-shown-unready", "10.0.0.6", False)]
    endpoints = {"10.0.0.1": True, "10.0.0.2": False, "10.0.0.3": True, "10.0.0.6": False}
    assert unpublished(pods, endpoints) == {"back-not-shown": True, "out-still-shown": False, "new-not-listed": True}


def test_pods_being_deleted_or_without_an_ip_are_left_to_the_controller():
    pods = [pod("going", "10.0.0.1", True, deleting=True), pod("starting", None, True)]
    assert unpublished(pods, {"10.0.0.1": False}) == {}


def test_a_flip_published_within_the_grace_is_never_touched_for():
    w = LagWatch()
    assert w.observe(0.0, {"a": True}) == []
    assert w.observe(AFTER * 0.9, {"a": True}) == []
    assert w.observe(AFTER * 1.5, {}) == []
    assert w.last_touch is None


def test_an_overdue_flip_touches_once_then_at_doubling_intervals_until_published():
    w = LagWatch()
    w.observe(0.0, {"a": False})
    assert w.observe(AFTER, {"a": False}) == ["a"]
    assert w.observe(AFTER + FIRST_INTERVAL / 2, {"a": False}) == []  # not again within the interval
    t = AFTER + FIRST_INTERVAL
    assert w.observe(t, {"a": False}) == ["a"]
    assert w.observe(t + FIRST_INTERVAL, {"a": False}) == []  # the interval has doubled
    t += 2 * FIRST_INTERVAL
    assert w.observe(t, {"a": False}) == ["a"]
    for _ in range(20):  # a controller that is down: the interval stops growing at its cap
        t += MAX_INTERVAL + 0.01
        assert w.observe(t, {"a": False}) == ["a"]
    assert w.interval == MAX_INTERVAL
    assert w.observe(t + 0.1, {}) == []  # published: the next episode starts at the first interval
    assert w.interval == FIRST_INTERVAL


def test_a_flip_that_changes_direction_starts_its_clock_again():
    w = LagWatch()
    w.observe(0.0, {"a": False})
    w.observe(AFTER * 0.9, {"a": True})  # readmitted before the drain was published
    assert w.observe(AFTER * 1.2, {"a": True}) == []
    assert w.observe(AFTER * 2, {"a": True}) == ["a"]


def test_only_the_overdue_pods_are_named_and_others_wait_their_turn():
    w = LagWatch()
    w.observe(0.0, {"old": True})
    assert w.observe(AFTER, {"old": True}) == ["old"]
    assert w.observe(AFTER + 0.1, {"old": True, "new": False}) == []
    assert w.observe(AFTER + FIRST_INTERVAL, {"old": True, "new": False}) == ["old"]  # "new" not yet overdue
    t = AFTER + FIRST_INTERVAL + 2 * FIRST_INTERVAL
    assert w.observe(t, {"new": False}) == ["new"]


def test_a_flip_left_out_of_a_write_of_the_slices_is_overdue_settle_after_that_write():
    assert SETTLE < AFTER  # the point of it
    w = LagWatch()
    w.observe(0.0, {"a": True, "b": True})
    w.written(0.05, {"b": True})  # "a" published by this write, "b" left out of it
    assert w.observe(0.05 + SETTLE * 0.9, {"b": True}) == []
    assert w.observe(0.05 + SETTLE, {"b": True}) == ["b"]  # well before AFTER
    assert 0.05 + SETTLE < AFTER


def test_a_flip_the_next_write_publishes_within_the_settle_time_is_not_touched_for():
    w = LagWatch()
    w.observe(0.0, {"a": True})
    w.written(0.02, {"a": True})  # a write computed before the controller saw the flip
    assert w.observe(0.02 + SETTLE * 0.5, {"a": True}) == []
    w.written(0.02 + SETTLE * 0.6, {})  # the flip's own sync
    assert w.observe(0.02 + SETTLE * 1.5, {}) == []
    assert w.last_touch is None


def test_the_first_write_that_left_a_flip_out_counts_and_a_new_direction_forgets_it():
    w = LagWatch()
    w.written(0.0, {"a": True})  # seen first at a write
    w.written(0.05, {"a": True})
    assert w.observe(SETTLE, {"a": True}) == ["a"]  # from the first write, not the last
    w = LagWatch()
    w.written(0.0, {"a": True})
    w.observe(0.05, {"a": False})  # changed direction before anyone touched: a new flip, no write missed it
    assert w.observe(0.05 + SETTLE * 1.5, {"a": False}) == []
    assert w.observe(0.05 + AFTER, {"a": False}) == ["a"]
