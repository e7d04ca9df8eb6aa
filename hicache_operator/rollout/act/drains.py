"""Reads of pods being drained, made off a swap step's path.

A drain ends without any Kubernetes event: the pod's endpoint turns not ready (an
EndpointSlice event), then the requests routed to it before finish. So:

- When the watch shows a drained pod's endpoint turn not ready, its runtime is read at once in
  the background (``read_after_unready``); the step that event queues finds the read done
  instead of waiting for a GET of a loaded runtime (0.05-0.3 s).
- A step that found a pod still running requests leaves it here (``watch``): the pod alone is
  read again until idle, at intervals growing from 50 ms by 1.5x up to 1 s (at most about half
  the time drained so far), and then a step is queued. Without it the pod's slot stays out of
  serving until the next swap poll, and the last pod of a rollout always waits for one.

A read made after the endpoint turned not ready answers "drained?" for as long as the pod stays
out of serving (its gate stays False until the operator readmits it, so no request reaches it
after that); ``usable_read`` says when one may stand in for a GET in a step.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, Coroutine

from .runtime_client import shared_client
from .views import CachedView, ViewCache, idle, read_pod

log = logging.getLogger("hicache_operator.rollout")
Fleet = tuple[str, str]

POLL_FIRST_SECONDS = 0.05
POLL_GROWTH = 1.5
POLL_MAX_SECONDS = 1.0


class Drains:
    """Background reads of drained pods for every deployment, on one event loop in a thread of
    its own (none holds a worker); ``background`` runs the one-off reads."""

    def __init__(self, views: ViewCache, background: Executor) -> None:
        self.views = views
        self._background = background
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._polled: set[tuple[Fleet, str]] = set()  # (deployment, pod uid)

    def usable_read(self, fleet: Fleet, pod: dict, acted_at: dt.datetime | None) -> CachedView | None:
        """A drained pod's read that may stand in for a GET now: made after the watch showed its
        endpoint not ready, newer than the pod's last action (else the planner would only wait
        on it, and the step would take it again), and showing the runtime idle (a busy one is
        read again: it may have finished since)."""
        read = self.views.last(fleet, pod["metadata"]["uid"], pod["status"]["podIP"])
        if read is None or not read.after_unready or acted_at is None or read.observed_at <= acted_at:
            return None
        return read if read.view.backend is not None and idle(read.view) else None

    def read_after_unready(self, fleet: Fleet, pods: list[dict], key: str | None) -> None:
        """Read, in the background, pods out of serving whose endpoints just turned not ready."""
        if not pods:
            return

        async def read_all() -> None:
            async with shared_client() as http:
                self.views.update(fleet, list(await asyncio.gather(
                    *(read_pod(http, p, key, after_unready=True) for p in pods))))
        self._background.submit(asyncio.run, read_all())

    def watch(self, fleet: Fleet, pods: list[dict], key: str | None, still_out: Callable[[dict], bool],
              on_drained: Callable[[], None]) -> None:
        """Poll pods a step left draining on requests in flight until each is idle, then
        ``on_drained()``. ``still_out(pod)``: whether the watches still show the pod (same uid
        and IP) out of serving with its endpoint not ready; checked before every read. A pod no
        longer out, or seen drained by a step's own read, is dropped without a call."""
        new = self._claim(fleet, pods)
        if new:
            self._run(self._poll(fleet, new, key, still_out, on_drained))

    def polling(self, fleet: Fleet, uid: str) -> bool:
        """Whether the pod is being polled now."""
        with self._guard:
            return (fleet, uid) in self._polled

    def _claim(self, fleet: Fleet, pods: list[dict]) -> list[dict]:
        with self._guard:
            new = [p for p in pods if (fleet, p["metadata"]["uid"]) not in self._polled]
            self._polled.update((fleet, p["metadata"]["uid"]) for p in new)
            return new

    def _release(self, fleet: Fleet, uid: str) -> None:
        with self._guard:
            self._polled.discard((fleet, uid))

    def _run(self, poll: Coroutine[Any, Any, None]) -> None:
        with self._guard:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name="hicache-drains").start()
            loop = self._loop
        asyncio.run_coroutine_threadsafe(poll, loop)

    async def _poll(self, fleet: Fleet, pods: list[dict], key: str | None, still_out: Callable[[dict], bool],
                    on_drained: Callable[[], None]) -> None:
        pending = {p["metadata"]["uid"]: p for p in pods}
        names = {uid: p["metadata"]["name"] for uid, p in pending.items()}
        last_read = {uid: dt.datetime.now(dt.timezone.utc) for uid in pending}
        interval, started = POLL_FIRST_SECONDS, time.monotonic()
        log.info("%s/%s: waiting for the requests in flight on %s to finish", *fleet,
                 ", ".join(p["metadata"]["name"] for p in pods))
        try:
            async with shared_client() as http:
                while pending:
                    await asyncio.sleep(interval)
                    interval = min(POLL_MAX_SECONDS, interval * POLL_GROWTH)
                    for uid, pod in list(pending.items()):
                        known = self.views.last(fleet, uid, pod["status"]["podIP"])
                        seen_drained = known is not None and known.observed_at > last_read[uid] and idle(known.view)
                        if seen_drained or not still_out(pod):
                            del pending[uid]
                            self._release(fleet, uid)
                    if not pending:
                        return
                    reads = await asyncio.gather(*(read_pod(http, p, key, after_unready=True)
                                                   for p in pending.values()))
                    self.views.update(fleet, list(reads))
                    done = [r.uid for r in reads if r.view.error is not None or idle(r.view)]
                    for read in reads:
                        last_read[read.uid] = read.observed_at
                    for uid in done:
                        del pending[uid]
                        self._release(fleet, uid)
                    if done:
                        log.info("%s/%s: %s drained after %.2f s more", *fleet,
                                 ", ".join(names[r.uid] + (" (unreadable)" if r.view.error else "")
                                           for r in reads if r.uid in done), time.monotonic() - started)
                        on_drained()
        except Exception:  # a bug must not leave pods claimed: the swap poll still covers them
            log.exception("polling the drains of %s/%s failed", *fleet)
        finally:
            for uid in pending:
                self._release(fleet, uid)
