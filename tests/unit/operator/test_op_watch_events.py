"""Which pod and EndpointSlice events queue a reconcile. Pod events: all of them, except
during a backend swap those that change nothing a swap step reads at once (a gate or Ready
flip: the EndpointSlice event that follows is what the step waits for). EndpointSlice events:
during a swap, those of the client Service."""

from __future__ import annotations

from hicache_operator.handlers import Controller, pod_identity

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
    ctl.pod_event(KEY, "fleet-0", pod_identity(pod()))
    ctl.untrack(KEY)
    assert ctl.pod_identities == {}


def test_only_the_client_services_slices_queue_a_swap_step():
    ctl = Controller()
    ctl.slice_event(KEY, "fleet")
    assert queued(ctl) == []  # no swap in flight
    ctl.swapping.add(KEY)
    ctl.slice_event(KEY, "fleet-pods")  # the headless Service
    ctl.slice_event(KEY, None)
    assert queued(ctl) == []
    ctl.slice_event(KEY, "fleet")
    assert [(k, r.trigger, r.urgent) for k, r in queued(ctl)] == [(KEY, "endpointslice", True)]
