"""The status: one derivation of every field, printer column and condition from what is
observed, checked against a table of observed states, and the pod readings it rests on."""

from __future__ import annotations

import re

import pytest
from op_helpers import body, gpu_node

from hicache_operator.api import labels
from hicache_operator.tools.crdgen import PRINTER_COLUMNS
from hicache_operator.control.pipeline import plan
from hicache_operator.fleet.gate import LABEL as SERVING
from hicache_operator.api.spec import resolve_max_unavailable
from hicache_operator.plan.status import SwapView, build_status, failed

STARTED_AT = "2025-01-01T10:00:05Z"
STORE_DOWN = "StorageUnavailable: mooncake master 10.0.0.9:50051 not reachable within 5.0s"


def _desired(**spec):
    """Without a router unless the spec asks for one (the router's column and condition are
    tested on their own)."""
    return plan(body({"image": "img", "router": {"enabled": False}, **spec}), [gpu_node("n")]).desired


FILE = _desired(replicas=2, hicache={"memLayout": "page_first", "storage": {"backend": "file"}})
MOONCAKE = _desired(replicas=2, hicache={"memLayout": "page_first", "storage": {
    "backend": "mooncake", "mooncake": {"masterAddress": "10.0.0.9:50051"}}})
assert FILE.restart_hash == MOONCAKE.restart_hash  # a storage change is a live swap, not a restart


def pod(i, d=FILE, *, phase="Running", started=True, ready=True, restart=None, storage=None, backend=None,
        gate="True", restarts=0, waiting=None, unready_since="2025-01-01T10:00:01Z", terminating=False):
    """demo-i as the watch shows it: created from ``d``'s template (its storage annotations) unless
    told otherwise; its container started at STARTED_AT; ContainersReady last flipped at unready_since."""
    ann = {labels.RESTART_HASH: restart or d.restart_hash, labels.STORAGE_HASH: storage or d.storage_hash,
           labels.STORAGE_BACKEND: backend or d.backend}
    meta = {"name": f"demo-{i}", "annotations": ann, "labels": {} if gate is None else {SERVING: gate.lower()}}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {"startedAt": STARTED_AT}}
    conds = [{"type": "Ready", "status": str(ready)},
             {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": unready_since}]
    return {"metadata": meta, "status": {"phase": phase, "conditions": conds, "containerStatuses": [
        {"name": "runtime", "started": started, "ready": ready, "restartCount": restarts, "state": state}]}}


def pending(i, d=FILE):
    return pod(i, d, phase="Pending", started=False, ready=False, gate=None, waiting="ContainerCreating")


def swap(in_progress=None, failed_msg=None, records=(), unattached=None):
    """The rollout module's view: BackendSwapInProgress / BackendSwapFailed and backendSwap."""
    conds = [{"type": "BackendSwapInProgress", "status": "True" if in_progress else "False",
              "reason": "Swapping" if in_progress else "Failed" if failed_msg else "Complete", "message": ""},
             {"type": "BackendSwapFailed", "status": "True" if failed_msg else "False",
              "reason": "AttachFailed" if failed_msg else "NoFailure", "message": failed_msg or ""}]
    state = {"phase": "Failed" if failed_msg else "InProgress" if in_progress else "Complete",
             "pods": {name: {"stage": "Draining"} for name in records}, "unattached": unattached or {}}
    return SwapView(state, tuple(conds))


LAST_VALID = build_status(generation=1, previous=None, desired=FILE, errors=[], pods=[pod(0), pod(1)],
                          degraded=[], now="t0")
INVALID = [("no-eligible-nodes", "no node can take a pod of this deployment")]

# id: (build_status arguments, expected READY, BACKEND, TARGET, SWAP, Ready, Progressing, Degraded)
STATES = {
    "new fleet, pods not started": (
        dict(desired=MOONCAKE, pods=[pending(0, MOONCAKE), pending(1, MOONCAKE)]),
        "0/2", None, "mooncake", "0/2", "False", ("True", "PodsStarting"), ("False", "AsExpected")),
    "new fleet, one pod up": (
        dict(desired=MOONCAKE, pods=[pod(0, MOONCAKE), pending(1, MOONCAKE)]),
        "1/2", "mooncake", "mooncake", "1/2", "False", ("True", "PodsStarting"), ("False", "AsExpected")),
    "settled": (
        dict(desired=MOONCAKE, pods=[pod(0, MOONCAKE), pod(1, MOONCAKE)], swap=swap()),
        "2/2", "mooncake", "mooncake", "2/2", "True", ("False", "Reconciled"), ("False", "AsExpected")),
    "new fleet, store down at start": (
        dict(desired=MOONCAKE, pods=[pod(0, MOONCAKE), pod(1, MOONCAKE)],
             swap=swap(unattached={"demo-0": STORE_DOWN, "demo-1": STORE_DOWN})),
        "2/2", "none", "mooncake", "0/2", "True", ("False", "Reconciled"), ("True", "StorageUnavailable")),
    "storage edited, no step yet": (
        dict(desired=MOONCAKE, pods=[pod(0), pod(1)], swap=swap()),
        "2/2", "file", "mooncake", "0/2", "True", ("True", "BackendSwap"), ("False", "AsExpected")),
    "mid swap, one pod drained": (
        dict(desired=MOONCAKE, pods=[pod(0, MOONCAKE), pod(1, ready=False, gate="False")],
             swap=swap(in_progress=True, records=["demo-1"])),
        "1/2", "file", "mooncake", "1/2", "False", ("True", "BackendSwap"), ("False", "AsExpected")),
    "swap failed, pods rolled back": (
        dict(desired=MOONCAKE, pods=[pod(0), pod(1)], swap=swap(failed_msg="pod demo-0: master unreachable")),
        "2/2", "file", "mooncake", "0/2", "True", ("False", "BackendSwapFailed"), ("True", "BackendSwapFailed")),
    "swap failed, pod still rolling back": (
        dict(desired=MOONCAKE, pods=[pod(0, ready=False, gate="False"), pod(1)],
             swap=swap(failed_msg="pod demo-0: master unreachable", records=["demo-0"])),
        "1/2", "file", "mooncake", "0/2", "False", ("False", "BackendSwapFailed"), ("True", "BackendSwapFailed")),
    "invalid spec, nothing running": (
        dict(desired=None, errors=INVALID, pods=[], spec_replicas=1),
        "0/1", None, None, None, "False", ("False", "ConfigInvalid"), ("True", "ConfigInvalid")),
    "invalid edit of a running fleet": (
        dict(desired=None, errors=INVALID, pods=[pod(0), pod(1)], spec_replicas=2, previous=LAST_VALID),
        "2/2", "file", "file", "2/2", "True", ("False", "ConfigInvalid"), ("True", "ConfigInvalid")),
    "scaling up": (
        dict(desired=_desired(replicas=3, hicache={"memLayout": "page_first", "storage": {"backend": "file"}}),
             pods=[pod(0), pod(1)]),
        "2/3", "file", "file", "2/3", "False", ("True", "Scaling"), ("False", "AsExpected")),
    "crash loop": (
        dict(desired=FILE, pods=[pod(0), pod(1, ready=False, started=False, restarts=3, waiting="CrashLoopBackOff")]),
        "1/2", "file", "file", "1/2", "False", ("False", "Reconciled"), ("True", "ReplicasUnavailable")),
    "rolling restart": (
        dict(desired=FILE, pods=[pod(0, restart="old"), pod(1)]),
        "2/2", "file", "file", "2/2", "True", ("True", "RollingRestart"), ("False", "AsExpected")),
    "old pod terminating": (
        dict(desired=FILE, pods=[pod(0), pod(1), pod(2, terminating=True)]),
        "2/2", "file", "file", "2/2", "True", ("True", "PodsTerminating"), ("False", "AsExpected")),
    "sizing no longer fits": (
        dict(desired=FILE, pods=[pod(0), pod(1)], degraded=[("SizingNoLongerFits", "node gpu-1 shrank")]),
        "2/2", "file", "file", "2/2", "True", ("False", "Reconciled"), ("True", "SizingNoLongerFits")),
}


def derive(previous=None, degraded=(), errors=(), **kw):
    return build_status(generation=2, previous=previous, errors=list(errors), degraded=list(degraded), now="t1",
                        **kw)


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def columns(status) -> dict[str, str | None]:
    """What `kubectl get hcd` shows in each status column of a plain field (jsonPath .status.x; the
    wide condition columns are the conditions themselves)."""
    out = {}
    for col in PRINTER_COLUMNS:
        path = col["jsonPath"]
        if path.startswith(".status.") and "[" not in path:
            out[col["name"]] = status.get(path.removeprefix(".status."))
    return out


def check_consistent(st: dict) -> None:
    """What holds for every status: the columns and the conditions tell one story."""
    c, col = conds(st), columns(st)
    ready, want = map(int, col["Ready"].split("/"))
    assert c["Ready"]["status"] == str(ready >= want) and c["Ready"]["message"] == f"{ready}/{want} pod(s) ready"
    assert st["readyReplicas"] == ready
    if c["ConfigValid"]["status"] == "False":
        assert c["Progressing"]["status"] == "False" and c["Degraded"]["status"] == "True"
    if c.get("BackendSwapFailed", {}).get("status") == "True":
        assert c["Progressing"]["status"] == "False" and c["Degraded"]["status"] == "True"
    if col["Swap"] is not None:
        on, of = map(int, col["Swap"].split("/"))
        assert of == want and on <= st["replicas"]
        if on == want and st["replicas"] == want:
            assert col["Backend"] == col["Target"]
        if col["Backend"] != col["Target"] and c["Progressing"]["status"] == "False":
            assert c["Degraded"]["status"] == "True" or col["Backend"] is None  # off target and not moving


@pytest.mark.parametrize("given, ready_col, backend, target, swap_col, ready, progressing, degraded",
                         STATES.values(), ids=STATES.keys())
def test_each_observed_state_derives_agreeing_columns_and_conditions(given, ready_col, backend, target, swap_col,
                                                                     ready, progressing, degraded):
    st = derive(**given)
    c = conds(st)
    assert columns(st) == {"Ready": ready_col, "Backend": backend, "Target": target, "Swap": swap_col,
                           "Host-Pool": st.get("hostPool"), "Router": None}
    assert c["Ready"]["status"] == ready
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == progressing
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == degraded, c["Degraded"]
    check_consistent(st)


def test_every_condition_message_names_what_to_look_at():
    down = conds(derive(**STATES["new fleet, store down at start"][0]))["Degraded"]["message"]
    assert down.startswith("demo-0, demo-1 could not attach mooncake when started") and STORE_DOWN in down
    failed_swap = conds(derive(**STATES["swap failed, pods rolled back"][0]))
    assert "master unreachable" in failed_swap["Degraded"]["message"]
    assert "BackendSwapFailed" in failed_swap["Progressing"]["message"]
    invalid = conds(derive(**STATES["invalid spec, nothing running"][0]))
    assert invalid["ConfigValid"]["message"] == "no-eligible-nodes: no node can take a pod of this deployment"
    assert invalid["Ready"]["message"] == "0/1 pod(s) ready"


def test_a_status_derived_again_with_what_the_caller_learned_replaces_the_first():
    """The handler learns spec.replicas and its swap step's outcome after the reconcile."""
    first = derive(desired=None, errors=INVALID, pods=[])
    assert first["ready"] == "0/0"  # the reconcile alone cannot know spec.replicas of an invalid spec
    again = first.rederive(spec_replicas=3)
    assert again["ready"] == "0/3" and conds(again)["Ready"]["status"] == "False"
    step = swap(failed_msg="pod demo-0: refused")
    moved = derive(desired=MOONCAKE, pods=[pod(0), pod(1)]).rederive(swap=step)
    assert conds(moved)["Degraded"]["reason"] == "BackendSwapFailed" and moved["backendSwap"] == step.state


def test_a_reconcile_without_a_swap_step_keeps_the_swap_view_it_was_written_with():
    before = derive(desired=MOONCAKE, pods=[pod(0), pod(1)], swap=swap(failed_msg="pod demo-0: refused"))
    after = derive(desired=MOONCAKE, pods=[pod(0), pod(1)], previous=before)
    assert after["backendSwap"] == before["backendSwap"]
    assert conds(after)["BackendSwapFailed"]["status"] == "True" and conds(after)["Degraded"]["status"] == "True"


def test_a_failed_reconcile_is_degraded_and_not_progressing_and_keeps_the_rest():
    before = derive(desired=FILE, pods=[pod(0, restart="old"), pod(1)])
    assert conds(before)["Progressing"]["status"] == "True"
    after = failed(before, 2, ("ReconcileFailed", "Kubernetes API error 403 Forbidden: exceeded quota"), "t2")
    c = conds(after)
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ReconcileFailed")
    assert "exceeded quota" in c["Degraded"]["message"] and c["Degraded"]["lastTransitionTime"] == "t2"
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "ReconcileFailed")
    assert c["Ready"] == conds(before)["Ready"] and c["ConfigValid"] == conds(before)["ConfigValid"]
    assert {k: v for k, v in after.items() if k != "conditions"} == {k: v for k, v in before.items()
                                                                      if k != "conditions"}
    recovered = derive(desired=FILE, pods=[pod(0), pod(1)], previous=after)
    assert conds(recovered)["Degraded"]["status"] == "False" and conds(recovered)["Progressing"]["reason"] == "Reconciled"


def test_max_unavailable():
    assert resolve_max_unavailable(2, 10) == 2
    assert resolve_max_unavailable("25%", 10) == 2
    assert resolve_max_unavailable("10%", 4) == 1


def test_pods_loading_their_model_are_progress_not_degradation():
    d = _desired(replicas=5)
    pods = [pod(0, d), pod(1, d, started=False, ready=False), pending(2, d),
            pod(3, d, ready=False, unready_since=STARTED_AT),  # started, its first readiness probe still to come
            pod(4, d, ready=False, unready_since="2025-01-01T10:07:00Z", gate=None)]  # not yet admitted
    c = conds(derive(desired=d, pods=pods))
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("True", "PodsStarting")
    assert c["Progressing"]["message"].startswith("4 of 5 pod(s) starting")
    assert c["Degraded"]["status"] == "False" and c["Ready"]["status"] == "False"


def test_a_pod_held_out_of_serving_counts_as_not_ready_and_is_degradation_only_without_a_swap_record():
    """A pod taken out of serving stays Ready (its probe passes) but the client Service no longer
    selects it: READY does not count it; during its swap it is progress, otherwise a problem."""
    held = pod(1, gate="False")
    c = conds(derive(desired=FILE, pods=[pod(0), held], swap=swap(in_progress=True, records=["demo-1"])))
    assert c["Degraded"]["status"] == "False", c["Degraded"]
    assert c["Ready"]["message"] == "1/2 pod(s) ready"
    c = conds(derive(desired=FILE, pods=[pod(0), held]))
    assert c["Degraded"]["message"] == "1 of 2 pod(s) ready; demo-1: held out of serving (hicache.dev/serving=false)"


@pytest.mark.parametrize("broken, why", [
    (dict(unready_since="2025-01-01T10:07:00Z"), "not ready"),  # was ready after it started, failing since
    (dict(started=False, restarts=2), "restarted 2 time(s)"),
    (dict(restarts=1, unready_since=STARTED_AT), "restarted 1 time(s)"),  # back from a crash, not ready yet
    (dict(restarts=1, unready_since="2025-01-01T10:07:00Z"), "not ready (earlier restarts: 1)"),
    (dict(phase="Pending", started=False, waiting="CrashLoopBackOff", restarts=3), "CrashLoopBackOff"),
    (dict(phase="Pending", started=False, waiting="ImagePullBackOff"), "ImagePullBackOff"),
    (dict(phase="Pending", started=False, waiting="CreateContainerConfigError"), "CreateContainerConfigError"),
], ids=["unready", "restarted", "restarted-started", "restarted-long-ago", "crash-loop", "image", "config"])
def test_a_pod_that_is_not_starting_and_not_ready_degrades_the_fleet_even_while_others_start(broken, why):
    d = _desired(replicas=3)
    pods = [pod(0, d), pending(1, d), pod(2, d, ready=False, **broken)]
    c = conds(derive(desired=d, pods=pods))
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ReplicasUnavailable")
    assert c["Degraded"]["message"] == f"1 of 3 pod(s) ready, 1 starting; demo-2: {why}"


def test_an_unschedulable_pod_degrades_the_fleet():
    stuck = pending(1)
    stuck["status"]["conditions"].append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable"})
    c = conds(derive(desired=FILE, pods=[pod(0), stuck]))
    assert c["Degraded"]["message"] == "1 of 2 pod(s) ready; demo-1: Unschedulable"


def test_a_crash_looping_pod_shows_the_last_line_its_container_wrote():
    """A bad checkpoint: the runtime's one-line reason reaches Degraded through the termination
    message (terminationMessagePolicy FallbackToLogsOnError)."""
    d = _desired(replicas=1)
    crashed = pod(0, d, ready=False, started=False, waiting="CrashLoopBackOff", restarts=2)
    crashed["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 2, "message": (
        "INFO loading /models/x\nerror: /models/x/config.json: architectures: Gemma2ForCausalLM is not supported\n")}}
    c = conds(derive(desired=d, pods=[crashed]))
    assert c["Degraded"]["message"] == ("0 of 1 pod(s) ready; demo-0: CrashLoopBackOff: error: /models/x/config.json: "
                                        "architectures: Gemma2ForCausalLM is not supported")


def test_the_printer_columns_read_status_fields_the_status_writes():
    written = set(LAST_VALID) | {"currentBackend", "swapProgress", "routerReady"}
    for col in PRINTER_COLUMNS:
        field = re.fullmatch(r"\.status\.(\w+)", col["jsonPath"])
        assert field is None or field.group(1) in written, col


def router_pod(i, *, ready=True, terminating=False):
    meta = {"name": f"demo-router-{i}", "labels": {labels.ROUTER: "demo"}}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_the_router_column_and_condition_count_ready_router_pods_against_spec_router_replicas():
    d = _desired(replicas=2, router={"enabled": True, "replicas": 2, "policy": "round_robin"})
    st = derive(desired=d, pods=[pod(0, d), pod(1, d)],
                router_pods=[router_pod(0), router_pod(1, ready=False), router_pod(2, terminating=True)])
    assert columns(st)["Router"] == "1/2"
    assert (conds(st)["RouterReady"]["status"], conds(st)["RouterReady"]["reason"]) == ("False", "RouterPodsNotReady")
    assert conds(st)["RouterReady"]["message"] == "1/2 router pod(s) ready"
    assert conds(st)["Ready"]["status"] == "True"  # READY counts the fleet's pods; ROUTER its router
    both = derive(desired=d, pods=[pod(0, d), pod(1, d)], router_pods=[router_pod(0), router_pod(1)], previous=st)
    assert columns(both)["Router"] == "2/2" and conds(both)["RouterReady"]["status"] == "True"

    # an invalid edit leaves the router running as the last valid spec had it
    kept = derive(desired=None, errors=INVALID, pods=[pod(0, d), pod(1, d)], previous=both,
                  router_pods=[router_pod(0)])
    assert columns(kept)["Router"] == "1/2"

    # turned off: no column, no condition
    off = derive(desired=_desired(replicas=2), pods=[pod(0), pod(1)], previous=both, router_pods=[router_pod(0)])
    assert columns(off)["Router"] is None and "RouterReady" not in conds(off)


def test_the_router_is_on_by_default_from_two_replicas():
    one = plan(body({"image": "img", "replicas": 1}), [gpu_node("n")]).desired
    two = plan(body({"image": "img", "replicas": 2}), [gpu_node("n")]).desired
    assert (one.router_replicas, two.router_replicas) == (None, 1)
    assert columns(derive(desired=two, pods=[]))["Router"] == "0/1"
