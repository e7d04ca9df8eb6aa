"""Degraded from what the runtimes report about their L3 store (``Observed.l3_unavailable``):
True naming the pods and the runtime's reason while any live pod reports it, whether or not
the managed Mooncake master is ready again, and False only once every pod has recovered."""

from __future__ import annotations

from dataclasses import replace

from op_helpers import body, gpu_node

from hicache_operator.api import labels
from hicache_operator.control.pipeline import plan
from hicache_operator.fleet.gate import LABEL as SERVING
from hicache_operator.api.status import MooncakeMasterStatus
from hicache_operator.plan.status import Observed, SwapView, derive

RPC_FAIL = "StorageUnavailable: mooncake put failed with RPC_FAIL"
TIMEOUT = "StorageUnavailable: mooncake master not reachable within 5.0s"
DESIRED = plan(body({"image": "img", "replicas": 2, "router": {"enabled": False}, "hicache": {
    "memLayout": "page_first", "storage": {"backend": "mooncake", "mooncake": {"managed": {}}}}}),
    [gpu_node("n")]).desired
MASTER_UP = MooncakeMasterStatus(deployment="demo-mooncake", address="demo-mooncake.ns.svc:50051", replicas=1,
                                 ready_replicas=1, ready=True)
MASTER_DOWN = MASTER_UP.model_copy(update={"ready_replicas": 0, "ready": False})


def pod(i: int, terminating: bool = False) -> dict:
    """demo-i, Ready and in serving on the desired template."""
    meta = {"name": f"demo-{i}", "labels": {SERVING: "true"},
            "annotations": {labels.RESTART_HASH: DESIRED.restart_hash, labels.STORAGE_HASH: DESIRED.storage_hash,
                            labels.STORAGE_BACKEND: DESIRED.backend}}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                                         "containerStatuses": [{"name": "runtime", "started": True, "ready": True,
                                                                "state": {"running": {}}}]}}


def observed(l3: dict[str, str], *, master=MASTER_UP, previous=None, pods=(pod(0), pod(1)), swap=None) -> Observed:
    return Observed(generation=1, previous=previous or {}, now="t", desired=DESIRED, pods=tuple(pods), master=master,
                    swap=swap or SwapView({"phase": "Complete", "target": "x"}), l3_unavailable=l3)


def degraded(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Degraded")


def test_l3_down_stays_degraded_after_the_master_is_back_until_every_pod_recovers():
    both = {"demo-0": RPC_FAIL, "demo-1": RPC_FAIL}
    down = derive(observed(both, master=MASTER_DOWN))
    cond = degraded(down)
    assert (cond["status"], cond["reason"]) == ("True", "MooncakeMasterUnavailable")
    assert f"the L3 store is unavailable on demo-0, demo-1 ({RPC_FAIL})" in cond["message"]

    master_back = derive(replace(observed(both), previous=down, now="t2"))
    cond = degraded(master_back)
    assert (cond["status"], cond["reason"]) == ("True", "StorageUnavailable")
    assert cond["message"].startswith(f"the L3 store is unavailable on demo-0, demo-1 ({RPC_FAIL})")
    assert cond["lastTransitionTime"] == "t"  # Degraded all along

    one_back = degraded(derive(observed({"demo-1": RPC_FAIL}, previous=master_back)))
    assert one_back["status"] == "True" and "on demo-1 (" in one_back["message"] and "demo-0" not in \
        one_back["message"]

    recovered = degraded(derive(observed({}, previous=master_back)))
    assert (recovered["status"], recovered["reason"]) == ("False", "AsExpected")


def test_each_reason_names_its_pods_and_pods_that_are_going_or_never_attached_are_left_out():
    cond = degraded(derive(observed({"demo-0": RPC_FAIL, "demo-1": TIMEOUT, "demo-2": RPC_FAIL},
                                    pods=(pod(0), pod(1), pod(2)))))
    assert cond["message"] == (f"the L3 store is unavailable on demo-0, demo-2 ({RPC_FAIL}); demo-1 ({TIMEOUT}); "
                               "they serve from L1+L2 until it recovers")
    going = degraded(derive(observed({"demo-1": RPC_FAIL}, pods=(pod(0), pod(1, terminating=True)))))
    assert "L3 store" not in going["message"]
    unattached = SwapView({"phase": "Complete", "target": "x", "unattached": {"demo-0": TIMEOUT}})
    cond = degraded(derive(observed({"demo-0": TIMEOUT}, swap=unattached)))
    assert cond["reason"] == "StorageUnavailable" and "could not attach" in cond["message"]
    assert "L3 store is unavailable" not in cond["message"]  # one message per pod, the attach failure's
