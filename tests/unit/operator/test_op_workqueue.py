"""The work queue's contract: dedup with merge, one worker per key, urgent first, retry backoff."""
from __future__ import annotations

import threading

from hicache_operator.control.workqueue import BACKOFF_BASE_SECONDS, BACKOFF_MAX_SECONDS, Request, WorkQueue


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_adding_a_queued_key_merges_instead_of_queueing_twice():
    q = WorkQueue()
    q.add("a", Request("pod"))
    q.add("a", Request("spec", apply=True))
    q.add("a", Request("pod"))
    assert q.depth() == 1
    key, req = q.get(timeout=0)
    assert key == "a" and req == Request("spec", apply=True, urgent=False)
    assert q.get(timeout=0) is None


def test_a_merged_request_remembers_when_its_first_trigger_was_queued():
    clock = Clock()
    q = WorkQueue(clock=clock)
    clock.t = 10.0
    q.add("a", Request("pod"))
    clock.t = 12.5
    q.add("a", Request("endpointslice", urgent=True))
    _, req = q.get(timeout=0)
    assert req.queued_at == 10.0 and req.trigger == "endpointslice"


def test_urgent_requests_overtake_routine_ones_even_when_upgraded_in_place():
    q = WorkQueue()
    for k in ("a", "b", "c"):
        q.add(k, Request("pod"))
    q.add("c", Request("spec", apply=True, urgent=True))
    q.add("d", Request("swap", urgent=True))
    order = [q.get(timeout=0)[0] for _ in range(4)]
    assert order == ["c", "d", "a", "b"]


def test_a_key_is_never_handed_to_two_workers_and_a_readd_while_processing_runs_after():
    q = WorkQueue()
    q.add("a", Request("pod"))
    key, _ = q.get(timeout=0)
    q.add("a", Request("spec", apply=True))  # arrives mid-reconcile
    assert q.get(timeout=0) is None  # not handed out while "a" is processing
    q.done("a")
    key, req = q.get(timeout=0)
    assert key == "a" and req.apply and req.trigger == "spec"
    q.done("a")
    assert q.get(timeout=0) is None


def test_retry_backs_off_exponentially_per_key_and_success_resets_it():
    clock = Clock()
    q = WorkQueue(clock=clock)
    delays = []
    for _ in range(7):
        delays.append(q.retry("a", Request("pod", apply=True)))
    assert delays == [min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** n) for n in range(7)]
    assert delays[-1] == BACKOFF_MAX_SECONDS
    assert q.get(timeout=0) is None  # nothing due yet
    clock.t = BACKOFF_BASE_SECONDS
    key, req = q.get(timeout=0)
    assert key == "a" and req.trigger == "retry" and req.apply
    q.done("a")
    q.succeeded("a")
    assert q.retry("a", Request("pod")) == BACKOFF_BASE_SECONDS


def test_while_a_key_backs_off_its_other_triggers_wait_for_the_retry_except_a_new_spec():
    """A failing reconcile is not re-run by every pod event, swap poll and resync meanwhile."""
    clock = Clock()
    q = WorkQueue(clock=clock)
    q.add("a", Request("pod"))
    q.get(timeout=0)
    q.add("a", Request("pod"))  # while the reconcile runs
    delay = q.retry("a", Request("pod"))  # the reconcile raised
    q.done("a")
    for trigger in ("pod", "swap", "resync", "endpointslice"):
        q.add("a", Request(trigger, apply=trigger == "resync", urgent=trigger == "swap"))
    assert q.get(timeout=0) is None
    clock.t = delay
    key, req = q.get(timeout=0)
    assert key == "a" and req.apply and req.urgent  # the retry carries what was held
    q.done("a")
    assert q.get(timeout=0) is None  # held triggers run once, in the retry, not after it
    q.retry("a", Request("pod"))
    q.add("a", Request("spec", apply=True, urgent=True))  # a new generation may be the fix
    assert q.get(timeout=0)[1].trigger == "spec"


def test_a_blocked_get_wakes_on_add_and_on_close():
    q = WorkQueue()
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=10)))
    t.start()
    q.add("a", Request("pod"))
    t.join(5)
    assert got and got[0][0] == "a"
    t = threading.Thread(target=lambda: got.append(q.get(timeout=10)))
    t.start()
    q.close()
    t.join(5)
    assert not t.is_alive() and got[-1] is None


def test_concurrent_workers_process_every_key_and_never_one_key_twice_at_once():
    q = WorkQueue()
    active: set[str] = set()
    overlaps: list[str] = []
    processed: list[str] = []
    guard = threading.Lock()

    def worker() -> None:
        while (item := q.get(timeout=0.5)) is not None:
            key, _ = item
            with guard:
                if key in active:
                    overlaps.append(key)
                active.add(key)
            with guard:
                active.discard(key)
                processed.append(key)
            q.done(key)

    keys = [f"k{i % 50}" for i in range(2000)]
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for k in keys:
        q.add(k, Request("pod"))
    for t in threads:
        t.join(30)
    assert not overlaps
    assert set(processed) == set(keys)
    assert len(processed) <= len(keys)
