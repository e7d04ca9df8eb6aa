"""A step's last gate patches are left in flight for the handler to wait on (``swap.settle``)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from hicache_operator import swap
from hicache_operator.rollout import SetServingGate


def gate(pod: str) -> SetServingGate:
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
        step = swap.SwapStep({}, settling=[(gate("a"), pool.submit(patch, "a", False)),
                                           (gate("b"), pool.submit(patch, "b", True))])
        threading.Timer(0.05, release.set).start()
        assert swap.settle(step) is False
        assert sorted(finished) == ["a", "b"]  # returned only once both were done


def test_settle_with_nothing_in_flight():
    assert swap.settle(None) is True
    assert swap.settle(swap.SwapStep({})) is True
    with ThreadPoolExecutor(1) as pool:
        assert swap.settle(swap.SwapStep({}, settling=[(gate("a"), pool.submit(lambda: None))])) is True
