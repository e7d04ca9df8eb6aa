"""Which recent runtime reads a swap step may reuse instead of a GET."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hicache_operator.rollout.act.runtime_client import RuntimeView
from hicache_operator.fleet.storage_config import ReportedBackend
from hicache_operator.rollout.act.views import CachedView, ViewCache, _stretch

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
FLEET = ("ns", "fleet")
OK = RuntimeView(backend=ReportedBackend(backend=None), in_flight=0, queued=0, error=None)
UNREACHABLE = RuntimeView(backend=None, in_flight=None, queued=None, error="connection refused")


def cache_with(*views: CachedView, refresh: float = 5.0) -> ViewCache:
    cache = ViewCache(refresh)
    cache.replace(FLEET, list(views))
    return cache


def test_a_recent_read_is_reused_with_its_own_time():
    cache = cache_with(CachedView("u1", "10.0.0.1", T0, OK))
    got = cache.reusable(FLEET, "u1", "10.0.0.1", T0 + timedelta(seconds=4.9))
    assert got is not None and got.observed_at == T0 and got.view == OK


def test_a_read_older_than_its_pods_window_is_not_reused():
    window = 5.0 * _stretch("u1")
    cache = cache_with(CachedView("u1", "10.0.0.1", T0, OK))
    assert cache.reusable(FLEET, "u1", "10.0.0.1", T0 + timedelta(seconds=window - 0.01)) is not None
    assert cache.reusable(FLEET, "u1", "10.0.0.1", T0 + timedelta(seconds=window)) is None


def test_windows_are_spread_over_pods_between_one_and_two_refresh_periods():
    stretches = {_stretch(f"uid-{i}") for i in range(64)}
    assert all(1.0 <= s < 2.0 for s in stretches)
    assert len(stretches) > 32  # not one window for the whole fleet
    assert _stretch("uid-7") == _stretch("uid-7")


def test_a_new_ip_a_failed_read_or_a_read_from_the_future_is_not_reused():
    cache = cache_with(CachedView("u1", "10.0.0.1", T0, OK), CachedView("u2", "10.0.0.2", T0, UNREACHABLE))
    assert cache.reusable(FLEET, "u1", "10.0.0.9", T0 + timedelta(seconds=1)) is None
    assert cache.reusable(FLEET, "u2", "10.0.0.2", T0 + timedelta(seconds=1)) is None
    assert cache.reusable(FLEET, "u1", "10.0.0.1", T0 - timedelta(seconds=1)) is None


def test_reads_belong_to_their_fleet_and_replace_forgets_pods_not_listed():
    cache = cache_with(CachedView("u1", "10.0.0.1", T0, OK), CachedView("u2", "10.0.0.2", T0, OK))
    assert cache.reusable(("other", "fleet"), "u1", "10.0.0.1", T0) is None
    cache.replace(FLEET, [CachedView("u2", "10.0.0.2", T0, OK)])
    assert cache.reusable(FLEET, "u1", "10.0.0.1", T0) is None
    assert cache.reusable(FLEET, "u2", "10.0.0.2", T0) is not None


def test_the_last_read_is_kept_whatever_its_age_or_outcome_but_not_for_a_new_ip():
    cache = cache_with(CachedView("u1", "10.0.0.1", T0, OK), CachedView("u2", "10.0.0.2", T0, UNREACHABLE))
    assert cache.last(FLEET, "u1", "10.0.0.1").observed_at == T0
    assert cache.last(FLEET, "u2", "10.0.0.2").view == UNREACHABLE
    assert cache.last(FLEET, "u1", "10.0.0.9") is None
    assert cache.last(FLEET, "u3", "10.0.0.3") is None


def test_update_replaces_the_reads_given_and_keeps_the_others():
    cache = cache_with(CachedView("u1", "10.0.0.1", T0, OK), CachedView("u2", "10.0.0.2", T0, OK))
    later = T0 + timedelta(seconds=1)
    cache.update(FLEET, [CachedView("u2", "10.0.0.2", later, UNREACHABLE)])
    assert cache.last(FLEET, "u1", "10.0.0.1").observed_at == T0
    assert cache.last(FLEET, "u2", "10.0.0.2").observed_at == later
    cache.update(("new", "fleet"), [CachedView("u9", "10.0.0.9", T0, OK)])
    assert cache.last(("new", "fleet"), "u9", "10.0.0.9") is not None


def test_a_late_background_read_does_not_replace_a_newer_one():
    """A renewal started before a step re-read the pod may finish after it."""
    newer = CachedView("u1", "10.0.0.1", T0 + timedelta(seconds=2), OK)
    cache = cache_with(newer)
    cache.update(FLEET, [CachedView("u1", "10.0.0.1", T0 + timedelta(seconds=1), UNREACHABLE),
                         CachedView("u2", "10.0.0.2", T0, OK)])
    assert cache.last(FLEET, "u1", "10.0.0.1") == newer
    assert cache.last(FLEET, "u2", "10.0.0.2") is not None
    later = CachedView("u1", "10.0.0.1", T0 + timedelta(seconds=3), UNREACHABLE)
    cache.update(FLEET, [later])
    assert cache.last(FLEET, "u1", "10.0.0.1") == later
