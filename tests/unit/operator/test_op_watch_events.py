"""Which pod and EndpointSlice events queue a reconcile. Pod events: all of them, except
during a backend swap those that change nothing a swap step reads at once (a gate or Ready
flip: the EndpointSlice event that follows is what the step waits for). EndpointSlice events
(the watch delivers the serving Services' only): during a swap, those that change an endpoint's
readiness, and for a fleet with a router any such change (its workers follow the endpoints).
The swap poll: only for a deployment not stepped within the interval."""

from __future__ import annotations

import pytest

from hicache_operator.control.controller import SWAP_POLL, Controller
from hicache_operator.control.informers import pod_identity
from hicache_operator.control.workqueue import Request, WorkQueue

KEY = ("ns", "fleet")


def pod(uid="u1", ip="10.0.0.1", phase="Running", ready="True", deleting=False) -> dict:
    meta = {"name": "fleet-0", "uid": uid, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"podIP": ip, "phase": phase,
                                         "conditions": [{"type": "Ready", "status": ready}]}}


def queued(ctl: Controller) -> list:
    out = []
    while (item := ctl.queue.get(timeout=0)) is not None:
        out.append(item)
        ctl.queue.done(item[0])
    return out


def test_a_condition_flip_is_not_part_of_the_identity_but_ip_phase_uid_and_deletion_are():
    base = pod_identity(pod())
    assert pod_identity(pod(ready="False")) == base
    for other in (pod(ip="10.0.0.2"), pod(phase="Pending"), pod(uid="u2"), pod(deleting=True)):
        assert pod_identity(other) != base
    assert pod_identity(pod(), deleted=True) != base


def test_outside_a_swap_every_pod_event_queues_a_reconcile():
    ctl = Controller()
    for body in (pod(), pod(ready="False"), pod(ready="True")):
        ctl.pod_event(KEY, "fleet-0", pod_identity(body))
        assert [(k, r.trigger, r.urgent) for k, r in queued(ctl)] == [(KEY, "pod", False)]


def test_during_a_swap_only_identity_changes_queue_a_step():
    ctl = Controller()
    ctl.swapping.add(KEY)
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod()))  # first sight (e.g. after a restart)
    assert [(r.trigger, r.urgent) for _, r in queued(ctl)] == [("pod", True)]
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod(ready="False")))
    assert queued(ctl) == []
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod(ip="10.0.0.9")))
    assert len(queued(ctl)) == 1
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod(ip="10.0.0.9", deleting=True)))
    assert len(queued(ctl)) == 1
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod(uid="u2", ip=None, phase="Pending")))  # the replacement
    assert len(queued(ctl)) == 1


def test_forgetting_a_deployment_forgets_its_pods():
    ctl = Controller()
    ctl.swapping.add(KEY)
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod()))
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod()))
    assert len(queued(ctl)) == 1  # the same identity again is no news during a swap
    ctl.deployment_deleted(KEY, {})
    assert KEY not in ctl.swapping
    ctl.swapping.add(KEY)  # a new deployment of the same name, in a swap
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod()))
    assert len(queued(ctl)) == 1  # first sight again: nothing of the old one was kept


def test_only_readiness_changes_in_the_serving_services_slices_queue_a_swap_step():
    ctl = Controller()
    ctl.slice_event(KEY, "fleet-abc", {"10.0.0.1": True})
    assert queued(ctl) == []  # no swap in flight, no router
    ctl.swapping.add(KEY)
    ctl.slice_event(KEY, "fleet-abc", {"10.0.0.1": True})  # e.g. only `serving` changed
    assert queued(ctl) == []
    ctl.slice_event(KEY, "fleet-abc", {"10.0.0.1": False})
    assert [(k, r.trigger, r.urgent) for k, r in queued(ctl)] == [(KEY, "endpointslice", True)]
    ctl.slice_event(KEY, "fleet-def", {"10.0.0.2": True})  # a second slice of the Service
    assert len(queued(ctl)) == 1
    ctl.slice_event(KEY, "fleet-def", None)  # deleted
    assert len(queued(ctl)) == 1
    ctl.slice_event(KEY, "fleet-def", None)  # a repeated DELETED says nothing new
    assert queued(ctl) == []


def test_with_a_router_every_readiness_change_queues_a_reconcile_its_workers_follow():
    ctl = Controller()
    ctl.informers.routers = {KEY: [{"metadata": {"name": "fleet-router-x"}}]}
    ctl.slice_event(KEY, "fleet-serving-abc", {"10.0.0.1": False})
    assert [(k, r.trigger, r.urgent) for k, r in queued(ctl)] == [(KEY, "endpointslice", False)]
    ctl.slice_event(KEY, "fleet-serving-abc", {"10.0.0.1": False})
    assert queued(ctl) == []  # nothing changed
    ctl.slice_event(KEY, "fleet-serving-abc", {"10.0.0.1": True})
    assert len(queued(ctl)) == 1


def test_the_swap_poll_skips_a_deployment_stepped_within_the_interval():
    clock = [100.0]
    ctl = Controller()
    ctl.queue = WorkQueue(clock=lambda: clock[0])
    assert ctl.queue.quiet_for(KEY) == float("inf")
    ctl.queue.add(KEY, Request("pod"))
    assert ctl.queue.quiet_for(KEY) == 0.0  # queued
    key, _ = ctl.queue.get(timeout=0)
    clock[0] += 0.3
    assert ctl.queue.quiet_for(KEY) == 0.0  # processing
    ctl.queue.done(key)
    clock[0] += 0.4
    assert ctl.queue.quiet_for(KEY) == pytest.approx(0.4)
    ctl.swapping.add(KEY)
    ctl.swap_poll()
    assert queued(ctl) == []  # stepped 0.4 s ago
    clock[0] += SWAP_POLL
    ctl.swap_poll()
    assert [(k, r.trigger) for k, r in queued(ctl)] == [(KEY, "swap")]
    ctl.queue.forget(KEY)
    assert ctl.queue.quiet_for(KEY) == float("inf")


def test_a_swap_step_in_progress_hears_the_slices_before_its_status_starts_the_swap():
    ctl = Controller()
    ctl.swapper.stepping.add(KEY)  # the first step of a rollout, its status not yet written
    ctl.slice_event(KEY, "fleet-abc", {"10.0.0.1": False})
    assert [(r.trigger, r.urgent) for _, r in queued(ctl)] == [("endpointslice", True)]
