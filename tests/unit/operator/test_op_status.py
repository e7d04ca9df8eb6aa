"""Status computation, restart planning and the serving gate."""

from __future__ import annotations

import pytest
from op_helpers import body, gpu_node

from hicache_operator import labels
from hicache_operator.reconcile import plan
from hicache_operator.restarts import plan_restarts, resolve_max_unavailable
from hicache_operator.status import build_status, merge_conditions


def pod(i, *, ready=True, restart="r1", storage="s1", backend="file", held=False, terminating=False, gate=None):
    ann = {labels.RESTART_HASH: restart, labels.STORAGE_HASH: storage, labels.STORAGE_BACKEND: backend}
    if held:
        gate = "False"
    meta = {"name": f"demo-{i}", "annotations": ann}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    if gate is not None:
        conds.append({"type": labels.SERVING_CONDITION, "status": gate})
    return {"metadata": meta, "status": {"conditions": conds}}


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def test_max_unavailable():
    assert resolve_max_unavailable(2, 10) == 2
    assert resolve_max_unavailable("25%", 10) == 2
    assert resolve_max_unavailable("10%", 4) == 1


def test_restarts_roll_within_budget_highest_ordinal_first():
    pods = [pod(i, restart="old") for i in range(4)]
    assert plan_restarts(pods, "new", 1, 4) == ["demo-3"]
    assert plan_restarts(pods, "new", 2, 4) == ["demo-3", "demo-2"]
    pods[3] = pod(3, restart="new", ready=False)  # restarted, not Ready yet: budget spent
    assert plan_restarts(pods, "new", 1, 4) == []


def test_restarts_take_unready_stale_pods_free_and_never_held_ones():
    pods = [pod(0, restart="old", ready=False), pod(1, restart="old"), pod(2, restart="old", held=True)]
    assert plan_restarts(pods, "new", 1, 3) == ["demo-0"]
    assert plan_restarts([pod(0), pod(1)], "r1", 1, 2) == []


def _desired(**spec):
    p = plan(body({"image": "img", **spec}), [gpu_node("n")])
    return p.desired


def test_status_ready_and_swap_progress():
    d = _desired(replicas=3, hicache={"storage": {"backend": "file"}})
    pods = [pod(i, restart=d.restart_hash, storage=d.storage_hash) for i in range(3)]
    st = build_status(generation=4, previous=None, desired=d, errors=[], pods=pods, degraded=[], now="t1")
    c = conds(st)
    assert st["ready"] == "3/3" and st["observedGeneration"] == 4
    assert c["Ready"]["status"] == "True" and c["Progressing"]["status"] == "False"
    assert c["ConfigValid"]["status"] == "True" and c["Degraded"]["status"] == "False"
    assert (st["currentBackend"], st["targetBackend"], st["swapProgress"]) == ("file", "file", "3/3")
    assert all(x["observedGeneration"] == 4 and x["lastTransitionTime"] == "t1" for x in st["conditions"])


def test_status_mid_swap_reports_old_backend_and_progress():
    d = _desired(replicas=3, hicache={"storage": {"backend": "file"}})
    pods = [pod(0, restart=d.restart_hash, storage=d.storage_hash),
            pod(1, restart=d.restart_hash, storage="old", backend="none"),
            pod(2, restart=d.restart_hash, storage="old", backend="none")]
    st = build_status(generation=1, previous=None, desired=d, errors=[], pods=pods, degraded=[], now="t")
    assert (st["currentBackend"], st["targetBackend"], st["swapProgress"]) == ("none", "file", "1/3")
    assert conds(st)["Progressing"]["reason"] == "BackendSwap"


def test_status_rolling_restart_and_degraded():
    d = _desired(replicas=2)
    pods = [pod(0, restart="old", storage=d.storage_hash), pod(1, restart=d.restart_hash, storage=d.storage_hash,
                                                             ready=False)]
    st = build_status(generation=1, previous=None, desired=d, errors=[], pods=pods,
                      degraded=[("SizingNoLongerFits", "too big")], now="t")
    c = conds(st)
    assert c["Progressing"]["reason"] == "RollingRestart"
    assert c["Degraded"]["reason"] == "SizingNoLongerFits" and c["Ready"]["status"] == "False"


def test_invalid_spec_keeps_describing_running_pods():
    prev = {"replicas": 2, "conditions": []}
    st = build_status(generation=2, previous=prev, desired=None, errors=[("host-ratio", "raise it")],
                      pods=[pod(0), pod(1)], degraded=[], now="t")
    c = conds(st)
    assert c["ConfigValid"]["status"] == "False" and c["ConfigValid"]["reason"] == "host-ratio"
    assert "raise it" in c["ConfigValid"]["message"] and st["ready"] == "2/2"
    assert "backendSwap" not in st


def test_transition_time_moves_only_on_flip_and_foreign_conditions_survive():
    prev = [{"type": "Ready", "status": "True", "lastTransitionTime": "t0"},
            {"type": "BackendSwapHalted", "status": "True", "lastTransitionTime": "t0"}]
    new = [{"type": "Ready", "status": "True", "reason": "a", "message": ""},
           {"type": "Degraded", "status": "False", "reason": "b", "message": ""}]
    merged = {c["type"]: c for c in merge_conditions(prev, new, 3, "t1")}
    assert merged["Ready"]["lastTransitionTime"] == "t0" and merged["Degraded"]["lastTransitionTime"] == "t1"
    assert "BackendSwapHalted" in merged


STARTED_AT = "2025-01-01T10:00:05Z"


def _pod_in(i, d, *, phase="Running", started=True, restarts=0, scheduled=None, ready=False,
            unready_since="2025-01-01T10:00:01Z", gate="True", state=None):
    """A pod whose container started at STARTED_AT; ContainersReady flipped last at unready_since."""
    p = pod(i, restart=d.restart_hash, storage=d.storage_hash, ready=ready, gate=gate)
    p["status"].update(phase=phase, containerStatuses=[{"name": "runtime", "started": started, "ready": ready,
                                                        "restartCount": restarts,
                                                        "state": state or {"running": {"startedAt": STARTED_AT}}}])
    p["status"]["conditions"].append({"type": "ContainersReady", "status": str(ready),
                                      "lastTransitionTime": unready_since})
    if scheduled is not None:
        p["status"]["conditions"].append({"type": "PodScheduled", "status": scheduled, "reason": "Unschedulable"})
    return p


def test_pods_loading_their_model_are_progress_not_degradation():
    d = _desired(replicas=5)
    pods = [_pod_in(0, d, ready=True), _pod_in(1, d, started=False), _pod_in(2, d, phase="Pending", started=False),
            _pod_in(3, d, unready_since=STARTED_AT),  # started, its first readiness probe still to come
            _pod_in(4, d, unready_since="2025-01-01T10:07:00Z", gate=None)]  # ready, not yet admitted to serving
    c = conds(build_status(generation=1, previous=None, desired=d, errors=[], pods=pods, degraded=[], now="t"))
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("True", "PodsStarting")
    assert c["Progressing"]["message"].startswith("4 of 5 pod(s) starting")
    assert c["Degraded"]["status"] == "False" and c["Ready"]["status"] == "False"


def test_a_pod_readmitted_after_a_swap_whose_ready_is_not_yet_recomputed_is_not_degradation():
    """The last pod of a swap: gate True and storage annotations written together, containers
    ready, Ready still False until the kubelet recomputes it. Seen as a ReplicasUnavailable Warning
    at the end of live swaps in the e2e test."""
    d = _desired(replicas=2)
    readmitted = _pod_in(1, d, unready_since="2025-01-01T10:07:00Z")
    next(c for c in readmitted["status"]["conditions"] if c["type"] == "ContainersReady")["status"] = "True"
    c = conds(build_status(generation=1, previous=None, desired=d, errors=[], pods=[_pod_in(0, d, ready=True),
                                                                                   readmitted], degraded=[], now="t"))
    assert c["Degraded"]["status"] == "False", c["Degraded"]
    assert (c["Progressing"]["reason"], c["Ready"]["status"]) == ("PodsStarting", "False")
    next(c for c in readmitted["status"]["conditions"] if c["type"] == labels.SERVING_CONDITION)["status"] = "False"
    c = conds(build_status(generation=1, previous=None, desired=d, errors=[], pods=[_pod_in(0, d, ready=True),
                                                                                   readmitted], degraded=[], now="t"))
    assert c["Degraded"]["message"] == "1 of 2 pod(s) ready; demo-1: held out of serving (hicache.dev/serving False)"


def _waiting(reason):
    return dict(phase="Pending", started=False, state={"waiting": {"reason": reason}})


@pytest.mark.parametrize("broken, why", [
    (dict(unready_since="2025-01-01T10:07:00Z"), "not ready"),  # was ready after it started, failing since
    (dict(started=False, restarts=2), "restarted 2 time(s)"),
    (dict(restarts=1, unready_since=STARTED_AT), "restarted 1 time(s)"),  # back from a crash, not ready yet
    (dict(restarts=1, unready_since="2025-01-01T10:07:00Z"), "not ready (earlier restarts: 1)"),
    (dict(_waiting("CrashLoopBackOff"), restarts=3), "CrashLoopBackOff"),
    (dict(phase="Pending", started=False, scheduled="False"), "Unschedulable"),
    (_waiting("ImagePullBackOff"), "ImagePullBackOff"),
    (_waiting("CreateContainerConfigError"), "CreateContainerConfigError"),
], ids=["unready", "restarted", "restarted-started", "restarted-long-ago", "crash-loop", "unschedulable", "image",
        "config"])
def test_a_pod_that_is_not_starting_and_not_ready_degrades_the_fleet_even_while_others_start(broken, why):
    d = _desired(replicas=3)
    pods = [_pod_in(0, d, ready=True), _pod_in(1, d, **_waiting("ContainerCreating")), _pod_in(2, d, **broken)]
    c = conds(build_status(generation=1, previous=None, desired=d, errors=[], pods=pods, degraded=[], now="t"))
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ReplicasUnavailable")
    assert c["Degraded"]["message"] == f"1 of 3 pod(s) ready, 1 starting; demo-2: {why}"


def test_a_crash_looping_pod_shows_the_last_line_its_container_wrote():
    """A bad checkpoint: the runtime's one-line reason reaches Degraded through the termination
    message (terminationMessagePolicy FallbackToLogsOnError)."""
    d = _desired(replicas=1)
    pod = _pod_in(0, d, **_waiting("CrashLoopBackOff"), restarts=2)
    pod["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 2, "message": (
        "INFO loading /models/x\nerror: /models/x/config.json: architectures: Gemma2ForCausalLM is not supported\n")}}
    c = conds(build_status(generation=1, previous=None, desired=d, errors=[], pods=[pod], degraded=[], now="t"))
    assert c["Degraded"]["message"] == ("0 of 1 pod(s) ready; demo-0: CrashLoopBackOff: error: /models/x/config.json: "
                                        "architectures: Gemma2ForCausalLM is not supported")
