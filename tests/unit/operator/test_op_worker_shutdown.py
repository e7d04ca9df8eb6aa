"""A reconcile the operator's own shutdown cuts short (its API pool closed under it) is no failure:
nothing is written to the status and no retry is queued; the next operator redoes it."""

from __future__ import annotations

from hicache_operator.control.controller import Controller
from hicache_operator.control.workqueue import Request

KEY = ("ns", "demo")


class Synced:
    def wait_synced(self, timeout: float) -> bool:
        return True


class StatusKube:
    def __init__(self) -> None:
        self.written: list[dict] = []

    def replace_deployment_status(self, namespace: str, name: str, status: dict) -> dict:
        self.written.append(status)
        return {"metadata": {"namespace": namespace, "name": name, "resourceVersion": "2"}, "status": status}


def test_a_reconcile_cut_short_by_the_shutdown_writes_no_failure():
    kube = StatusKube()
    ctl = Controller(kube=kube)
    ctl.informers.nodes = Synced()

    def process(key, request):
        ctl.stop.set()
        raise RuntimeError("cannot schedule new futures after shutdown")
    ctl.process = process
    ctl.enqueue(KEY, Request("resync", apply=True))
    ctl._worker()
    assert kube.written == [] and KEY not in ctl.failing
    assert ctl.queue.get(timeout=0) is None  # no retry queued

