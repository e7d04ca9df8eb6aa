"""The operator's background poll of a drained pod whose runtime still runs a request
(``rollout.act.drains.Drains.watch``), against a real runtime process over HTTP: no "drained" while the
request runs, one as soon as it ends, with a read a swap step may use instead of its own GET."""

from __future__ import annotations

import random
import threading
from datetime import datetime, timedelta, timezone

import pytest

from concurrent.futures import ThreadPoolExecutor

from hicache_operator.api.flags import RUNTIME_PORT
from hicache_operator.rollout.act.drains import Drains
from hicache_operator.rollout.act.views import ViewCache
from testbed.kube import wait_for

from tests.integration.runtime.conftest import ADMIN_KEY


@pytest.fixture(scope="module")
def pod(start_server):
    """A runtime where a pod's runtime listens (its IP, the operator's port): a loopback
    address of its own, so port 30000 is free."""
    ip = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(1, 254)}"
    server = start_server("--page-size", "4", "--max-total-tokens", "32768", "--admin-api-key", ADMIN_KEY,
                          host=ip, port=RUNTIME_PORT)
    return server, {"metadata": {"name": "p0", "uid": f"uid-{ip}"}, "status": {"podIP": ip}}


def running_request(server):
    """A streamed /generate that runs until its stream is closed; returns the Event that closes it."""
    started, close, first = threading.Event(), threading.Event(), []

    def run() -> None:
        with server.client() as c, c.stream("POST", "/generate", json={
                "text": "drain me", "stream": True, "sampling_params": {"max_new_tokens": 30000}}) as r:
            for line in r.iter_lines():
                first.append(line)
                started.set()
                if close.is_set():
                    return
    threading.Thread(target=run, daemon=True).start()
    assert started.wait(60), server.log()
    assert "error" not in first[0], first[0]
    return close


def test_a_busy_drain_is_reported_once_its_request_ends_with_a_read_the_step_can_use(pod):
    server, body = pod
    fleet = ("ns", "drain-watch")
    drains = Drains(ViewCache(), ThreadPoolExecutor(1))
    acted = datetime.now(timezone.utc) - timedelta(seconds=1)  # the pod's take-out, before the poll
    close = running_request(server)
    drained, looks = threading.Event(), []

    def still_out(p: dict) -> bool:
        looks.append(p["metadata"]["uid"])
        return True
    drains.watch(fleet, [body], ADMIN_KEY, still_out, drained.set)
    drains.watch(fleet, [body], ADMIN_KEY, still_out, drained.set)  # already polled: not a second poll

    def busy_read_seen() -> bool:
        last = drains.views.last(fleet, body["metadata"]["uid"], body["status"]["podIP"])
        return last is not None and last.view.in_flight == 1
    wait_for(busy_read_seen, timeout=30, interval=0.02, what="a read of the busy runtime")
    assert not drained.is_set()
    assert drains.usable_read(fleet, body, acted) is None  # busy: the step would only wait
    close.set()
    wait_for(drained.is_set, timeout=30, interval=0.02, what="the drain reported")
    read = drains.usable_read(fleet, body, acted)
    assert read is not None and read.view.in_flight == 0 and read.view.backend is not None
    assert set(looks) == {body["metadata"]["uid"]}
    wait_for(lambda: not drains.polling(fleet, body["metadata"]["uid"]), timeout=10, what="released")


def test_a_pod_no_longer_out_of_serving_is_dropped_without_a_report(pod):
    server, body = pod
    fleet = ("ns", "drain-watch-readmitted")
    drains = Drains(ViewCache(), ThreadPoolExecutor(1))
    close = running_request(server)
    try:
        out = threading.Event()
        out.set()
        drained = threading.Event()
        drains.watch(fleet, [body], ADMIN_KEY, lambda p: out.is_set(), drained.set)
        wait_for(lambda: drains.views.last(fleet, body["metadata"]["uid"], body["status"]["podIP"]) is not None,
                 timeout=30, interval=0.02, what="a read while out of serving")
        out.clear()  # readmitted (or replaced): no read may stand for "drained" any more
        wait_for(lambda: not drains.polling(fleet, body["metadata"]["uid"]), timeout=10, what="dropped")
        assert not drained.is_set()
    finally:
        close.set()
