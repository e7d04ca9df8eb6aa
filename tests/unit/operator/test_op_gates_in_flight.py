"""A step's last gate patches are left in flight for the controller to wait on (``act.settle``), and
the next step sees them before the pod watch does (``Informers.note_gates``)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from hicache_operator.control.informers import Informers
from hicache_operator.rollout import SetServingGate, act
from hicache_operator.fleet import gate


def admit(pod: str) -> SetServingGate:
    return SetServingGate(pod=pod, uid=f"uid-{pod}", serving=True)


def test_settle_waits_for_every_patch_and_reports_a_failure():
    release = threading.Event()
    finished: list[str] = []

    def patch(pod: str, fail: bool) -> None:
        release.wait(5)
        finished.append(pod)
        if fail:
            raise RuntimeError("409 uid precondition failed")

    with ThreadPoolExecutor(2) as pool:
        step = act.StepResult({}, settling=[(admit("a"), pool.submit(patch, "a", False)),
                                           (admit("b"), pool.submit(patch, "b", True))])
        threading.Timer(0.05, release.set).start()
        assert act.settle(step) is False
        assert sorted(finished) == ["a", "b"]  # returned only once both were done


def test_settle_with_nothing_in_flight():
    assert act.settle(None) is True
    assert act.settle(act.StepResult({})) is True
    with ThreadPoolExecutor(1) as pool:
        assert act.settle(act.StepResult({}, settling=[(admit("a"), pool.submit(lambda: None))])) is True


def gated_pod(name: str, uid: str, serving: bool | None) -> dict:
    labels = {} if serving is None else {gate.LABEL: str(serving).lower()}
    return {"metadata": {"name": name, "uid": uid, "labels": labels}, "status": {}}


def test_the_next_step_sees_the_gates_the_last_one_patched_until_the_watch_does():
    """The next step plans on the watch's pods: one that saw an old gate took the pod out again."""
    ctl = Informers()
    key = ("ns", "fleet")
    ctl.pods = {key: [gated_pod("p0", "u0", True), gated_pod("p1", "u1", True), gated_pod("p2", "u2", None)]}
    ctl.note_gates(key, [("p0", "u0", False), ("p1", "u1", False), ("p2", "u2", True)])

    pods = {p["metadata"]["name"]: p for p in ctl.cached_pods(key)}
    assert [gate.serving_gate(pods[n]) for n in ("p0", "p1", "p2")] == [False, False, True]
    assert gate.serving_gate(ctl.pods[key][0]) is True  # the watch's own copy is untouched

    # the watch catches up on p0; p1 is replaced (a new uid: its own gate stands); p2 still behind
    ctl.pods = {key: [gated_pod("p0", "u0", False), gated_pod("p1", "u9", None), gated_pod("p2", "u2", None)]}
    pods = {p["metadata"]["name"]: p for p in ctl.cached_pods(key)}
    assert [gate.serving_gate(pods[n]) for n in ("p0", "p1", "p2")] == [False, None, True]
    assert set(ctl.acked_gates[key]) == {"p2"}

    ctl.pods = {key: [gated_pod("p0", "u0", False), gated_pod("p2", "u2", True)]}
    ctl.cached_pods(key)
    assert key not in ctl.acked_gates  # nothing left to show
