"""A de-duplicating work queue of HiCacheDeployments to reconcile, in the manner of client-go's.

At fleet scale a deployment sees bursts of triggers (its pods' events, EndpointSlice updates,
timers); a full reconcile per trigger would be mostly redundant. So every trigger only *adds* the
deployment's key:

- a key is queued at most once; adding it again merges the requests (the union of what they ask);
- a key is processed by one worker at a time; adding it while it is being processed queues it
  again for after, so a change seen mid-reconcile is never lost;
- urgent requests (a spec that changed, a swap in flight) go ahead of routine ones (pod status
  refreshes, periodic resyncs), so a thousand pod events never delay a new deployment;
- a failed reconcile is retried after a per-key exponential backoff, and while a key backs off
  every other trigger for it waits for that retry (merged into it): pod events, swap polls and
  resyncs would otherwise re-run a failing reconcile several times a second. Only a new
  generation of the spec (trigger ``spec``, the user's fix) goes ahead at once.

A reconcile reads the newest version of the object when it starts (``informers.bodies``), so a merged
request covers every trigger that arrived before it began.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Hashable

BACKOFF_BASE_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0
NOT_HELD = frozenset({"retry", "spec"})  # the retry itself, and a new spec (which may be the fix)


@dataclass(frozen=True)
class Request:
    """What a trigger asks of a reconcile."""

    trigger: str  # metrics label and log text: spec, resume, resync, pod, endpointslice, swap, drained, node, master, storage, router, retry
    apply: bool = False  # render and apply the children (otherwise only refresh status and step a swap)
    urgent: bool = False
    queued_at: float | None = field(default=None, compare=False)  # set by the queue: how long it waited

    def merge(self, other: "Request") -> "Request":
        trigger = self.trigger if (self.apply, self.urgent) >= (other.apply, other.urgent) else other.trigger
        queued = [t for t in (self.queued_at, other.queued_at) if t is not None]
        return Request(trigger, self.apply or other.apply, self.urgent or other.urgent, min(queued, default=None))


class WorkQueue:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._urgent: deque[Hashable] = deque()
        self._routine: deque[Hashable] = deque()
        self._waiting: dict[Hashable, Request] = {}  # queued, or re-added while processing
        self._processing: set[Hashable] = set()
        self._delayed: list[tuple[float, int, Hashable, Request]] = []
        self._seq = 0
        self._failures: dict[Hashable, int] = {}
        self._last_active: dict[Hashable, float] = {}  # when the key was last taken or done
        self._backoff_until: dict[Hashable, float] = {}  # failing keys: when their retry is due
        self._held: dict[Hashable, Request] = {}  # triggers that came while their key backs off
        self._closed = False

    def add(self, key: Hashable, request: Request) -> None:
        with self._cond:
            self._add_locked(key, request)

    def _add_locked(self, key: Hashable, request: Request) -> None:
        if self._closed:
            return
        if self._clock() < self._backoff_until.get(key, 0.0) and request.trigger not in NOT_HELD:
            held = self._held.get(key)
            self._held[key] = request if held is None else held.merge(request)
            return
        held = self._held.pop(key, None)
        if held is not None:
            request = request.merge(held)
        old = self._waiting.get(key)
        request = replace(request, queued_at=self._clock())
        merged = request if old is None else old.merge(request)
        self._waiting[key] = merged
        if key in self._processing:
            return  # queued by done()
        if old is None:
            (self._urgent if merged.urgent else self._routine).append(key)
        elif merged.urgent and not old.urgent:
            self._routine.remove(key)
            self._urgent.append(key)
        self._cond.notify()

    def add_after(self, key: Hashable, request: Request, delay: float) -> None:
        with self._cond:
            self._seq += 1
            heapq.heappush(self._delayed, (self._clock() + delay, self._seq, key, request))
            self._cond.notify()

    def retry(self, key: Hashable, request: Request) -> float:
        """Re-add after a failure, with exponential backoff per key; returns the delay. Until
        then other triggers for the key are held and merged into the retry, those that came
        while the failed reconcile ran included (called before ``done``)."""
        with self._cond:
            n = self._failures.get(key, 0)
            self._failures[key] = n + 1
            delay = min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** n)
            self._backoff_until[key] = self._clock() + delay
            came = self._waiting.get(key)
            if key in self._processing and came is not None and came.trigger not in NOT_HELD:
                del self._waiting[key]
                held = self._held.get(key)
                self._held[key] = came if held is None else held.merge(came)
        self.add_after(key, Request("retry", request.apply, request.urgent), delay)
        return delay

    def succeeded(self, key: Hashable) -> None:
        with self._cond:
            self._failures.pop(key, None)
            self._backoff_until.pop(key, None)

    def get(self, timeout: float | None = None) -> tuple[Hashable, Request] | None:
        """The next key to process (marked processing until ``done``), or None on close/timeout."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                self._promote_due_locked()
                if self._closed:
                    return None
                queue = self._urgent or self._routine
                if queue:
                    key = queue.popleft()
                    self._processing.add(key)
                    self._last_active[key] = self._clock()
                    return key, self._waiting.pop(key)
                wait = None if not self._delayed else max(0.0, self._delayed[0][0] - self._clock())
                if deadline is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def _promote_due_locked(self) -> None:
        now = self._clock()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key, request = heapq.heappop(self._delayed)
            self._add_locked(key, request)

    def done(self, key: Hashable) -> None:
        with self._cond:
            self._processing.discard(key)
            self._last_active[key] = self._clock()
            if key in self._waiting:  # re-added while processing
                (self._urgent if self._waiting[key].urgent else self._routine).append(key)
                self._cond.notify()

    def forget(self, key: Hashable) -> None:
        """The object is gone: drop its backoff history (a queued request finds it missing)."""
        with self._cond:
            self._failures.pop(key, None)
            self._last_active.pop(key, None)
            self._backoff_until.pop(key, None)
            self._held.pop(key, None)

    def quiet_for(self, key: Hashable) -> float:
        """Seconds since the key was last processed (0 while queued or processing; infinite if
        never): a poll that only has to guarantee a step every so often need not add another
        right after one."""
        with self._cond:
            if key in self._processing or key in self._waiting:
                return 0.0
            last = self._last_active.get(key)
            return float("inf") if last is None else self._clock() - last

    def depth(self) -> int:
        with self._cond:
            return len(self._urgent) + len(self._routine)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
