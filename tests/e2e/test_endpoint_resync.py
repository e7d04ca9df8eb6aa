"""The operator's touch of a client Service whose EndpointSlice sits on a readiness flip
(``hicache_operator.rollout.endpoint_lag``), against the real API server: the annotation lands, the
operator's own apply of the Service leaves it alone, and a deployment no longer in a swap is not
looked at. What the watches show is given directly (the stale-cache refusal it answers cannot be
provoked on demand)."""
from __future__ import annotations

import pytest

from hicache_operator.api import labels
from hicache_operator.io import metrics
from hicache_operator.plan import render
from hicache_operator.control.controller import Controller
from hicache_operator.io.kube import Kube
from hicache_operator.rollout import endpoint_lag
from testbed.kube import wait_for

pytestmark = pytest.mark.e2e
NS = "endpoint-resync"


def annotation(core, name: str) -> str | None:
    return (core.read_namespaced_service(name, NS).metadata.annotations or {}).get(labels.ENDPOINTS_RESYNC)


def test_an_unpublished_flip_touches_the_client_service_and_the_apply_keeps_the_touch(cluster):
    from kubernetes import client
    api = cluster.api_client()
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": NS}})
    kube = Kube(api)
    service = render.service(render.Owner("fleet", NS, "no-owner"))
    del service["metadata"]["ownerReferences"]  # no real owner here: the garbage collector would take it
    kube.apply(service)
    name = service["metadata"]["name"]

    ctl = Controller(kube=kube)
    key = (NS, "fleet")
    back = {"metadata": {"name": "fleet-0"},
            "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}
    ctl.informers.pods, ctl.informers.slices = {key: [back]}, {key: [(name, {"10.0.0.7": False})]}
    ctl.swapping.add(key)
    before = metrics.ENDPOINT_RESYNCS._value.get()

    ctl.touches.dirty(key)
    ctl.check_endpoint_lag(100.0)
    ctl.check_endpoint_lag(100.0 + endpoint_lag.AFTER / 2)
    assert annotation(core, name) is None  # within the grace: the controller gets its chance
    ctl.check_endpoint_lag(100.0 + endpoint_lag.AFTER + 0.01)
    wait_for(lambda: annotation(core, name) is not None, timeout=10, what="the resync annotation")
    assert metrics.ENDPOINT_RESYNCS._value.get() == before + 1

    kube.apply(service)  # the operator's resync of its children
    assert annotation(core, name) is not None

    ctl.swapping.discard(key)  # the swap is over: nothing is looked at, the watch is dropped
    ctl.touches.dirty(key)
    ctl.check_endpoint_lag(200.0)
    assert not ctl.touches.watching(key)
    assert metrics.ENDPOINT_RESYNCS._value.get() == before + 1
    core.delete_namespace(NS)
