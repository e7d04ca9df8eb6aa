"""Where the status's ``l3_unavailable`` comes from and how it is kept fresh: the runtimes' last
reads (``ViewCache.l3_unavailable``, only for the pod that was read: same uid and IP), a read
reporting L3 unavailable is never reused in place of a new GET, and the controller steps a
deployment whose pods report it every STORAGE_POLL (recovery comes without a Kubernetes event)."""

from __future__ import annotations

from datetime import datetime, timezone

from op_helpers import RecordingKube, StepRecorder, body, context, gpu_node, seen

from hicache_operator.api import labels
from hicache_operator.control.controller import STORAGE_POLL, Controller
from hicache_operator.control.pipeline import plan, reconcile
from hicache_operator.control.stepping import READ_TRIGGERS, degraded
from hicache_operator.rollout.act.runtime_client import RuntimeView
from hicache_operator.rollout.act.views import CachedView, ViewCache
from hicache_operator.fleet.gate import LABEL as SERVING
from hicache_operator.fleet.storage_config import ReportedBackend
from hicache_operator.control.workqueue import Request, WorkQueue

KEY = ("ns", "demo")
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
DOWN = "StorageUnavailable: mooncake put failed with RPC_FAIL"
OK = RuntimeView(backend=ReportedBackend(backend="mooncake"), in_flight=0, queued=0, error=None)
L3_DOWN = RuntimeView(backend=ReportedBackend(backend="mooncake"), in_flight=0, queued=0, error=None,
                      storage_unavailable=DOWN)


def pod(name: str, uid: str, ip: str | None) -> dict:
    return {"metadata": {"name": name, "uid": uid}, "status": {"podIP": ip} if ip else {}}


def test_the_pods_last_reads_say_which_report_l3_unavailable():
    views = ViewCache()
    views.update(KEY, [CachedView("u0", "10.0.0.1", T0, L3_DOWN), CachedView("u1", "10.0.0.2", T0, OK),
                       CachedView("u2", "10.0.0.3", T0, L3_DOWN)])
    pods = [pod("demo-0", "u0", "10.0.0.1"), pod("demo-1", "u1", "10.0.0.2"),
            pod("demo-2", "u2-new", "10.0.0.3"),  # replaced since its read: not the pod that was read
            pod("demo-3", "u3", None)]
    assert views.l3_unavailable(KEY, pods) == {"demo-0": DOWN}
    assert views.l3_unavailable(KEY, [pod("demo-0", "u0", "10.0.0.9")]) == {}  # new IP: a new runtime
    assert views.l3_unavailable(("ns", "other"), pods) == {}


def test_a_read_reporting_l3_unavailable_is_not_reused_for_a_new_one():
    views = ViewCache()
    views.update(KEY, [CachedView("u0", "10.0.0.1", T0, L3_DOWN), CachedView("u1", "10.0.0.2", T0, OK)])
    assert views.reusable(KEY, "u1", "10.0.0.2", T0) is not None
    assert views.reusable(KEY, "u0", "10.0.0.1", T0) is None


def test_a_deployment_whose_pods_report_l3_unavailable_is_stepped_every_storage_poll():
    clock = [100.0]
    ctl = Controller()
    ctl.queue = WorkQueue(clock=lambda: clock[0])
    ctl.queue.add(KEY, Request("pod"))
    key, _ = ctl.queue.get(timeout=0)
    ctl.queue.done(key)
    ctl.swap_poll()
    assert ctl.queue.get(timeout=0) is None  # nothing reported
    ctl.l3_unavailable.add(KEY)
    clock[0] += STORAGE_POLL / 2
    ctl.swap_poll()
    assert ctl.queue.get(timeout=0) is None  # looked at within the interval
    clock[0] += STORAGE_POLL / 2
    ctl.swap_poll()
    key, request = ctl.queue.get(timeout=0)
    assert (key, request.trigger) == (KEY, "storage") and request.trigger in READ_TRIGGERS  # a step: fresh reads
    ctl.queue.done(key)
    ctl.deployment_deleted(KEY, {"metadata": {"namespace": "ns", "name": "demo"}})
    clock[0] += STORAGE_POLL
    ctl.swap_poll()
    assert ctl.queue.get(timeout=0) is None


def test_a_restarted_operator_reads_the_runtimes_of_a_degraded_deployment_at_once():
    assert degraded({"conditions": [{"type": "Degraded", "status": "True", "reason": "StorageUnavailable"}]})
    assert not degraded({"conditions": [{"type": "Degraded", "status": "False", "reason": "AsExpected"}]})
    assert not degraded({})


def test_the_status_a_worker_writes_is_degraded_while_the_last_reads_say_so_and_polls_until_they_do_not():
    spec = {"image": "img", "replicas": 1, "router": {"enabled": False},
            "hicache": {"memLayout": "page_first", "storage": {"backend": "file"}}}
    p = plan(body(spec), [gpu_node("n")])
    pods = [{"metadata": {"name": "demo-0", "uid": "u0", "labels": {SERVING: "true"},
                          "annotations": {labels.RESTART_HASH: p.desired.restart_hash,
                                          labels.STORAGE_HASH: p.desired.storage_hash}},
             "status": {"podIP": "10.0.0.1", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                        "containerStatuses": [{"name": "runtime", "started": True, "state": {"running": {}}}]}}]
    ctl, swapper = Controller(), StepRecorder()

    def worker_writes(view: RuntimeView) -> dict:
        swapper.views.update(KEY, [CachedView("u0", "10.0.0.1", T0, view)])
        kube = RecordingKube(p.desired.restart_hash)
        result = reconcile(context(kube, swapper), seen(body(spec), [gpu_node("n")], pods, trigger="storage", apply=False))
        assert result.written
        ctl.follow(KEY, result)
        return next(c for c in kube.written["conditions"] if c["type"] == "Degraded")

    down = worker_writes(L3_DOWN)
    assert (down["status"], down["reason"]) == ("True", "StorageUnavailable") and f"demo-0 ({DOWN})" in down["message"]
    assert KEY in ctl.l3_unavailable
    back = worker_writes(OK)
    assert (back["status"], back["reason"]) == ("False", "AsExpected") and KEY not in ctl.l3_unavailable
