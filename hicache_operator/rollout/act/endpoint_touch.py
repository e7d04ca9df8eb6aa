"""Touching a serving Service whose EndpointSlice sits on a pod's readiness flip, while its
deployment is in a swap (when and why: ``rollout.endpoint_lag``)."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Collection

from hicache_operator.io import metrics

from ..endpoint_lag import LagWatch, unpublished

log = logging.getLogger("hicache_operator.rollout")
Key = tuple[str, str]


class EndpointTouches:
    """Each swapping deployment's ``LagWatch``. ``touch(namespace, service)`` asks the
    EndpointSlice controller to sync the Service again (an annotation write); ``service(key)``
    names the deployment's serving Service."""

    def __init__(self, touch: Callable[[str, str], None], service: Callable[[Key], str]) -> None:
        self._touch = touch
        self._service = service
        self._watches: dict[Key, LagWatch] = {}
        self._dirty: set[Key] = set()  # deployments with a pod or slice event since the last check
        self._guard = threading.Lock()  # the check loop and the slice handler

    def dirty(self, key: Key) -> None:
        self._dirty.add(key)

    def watching(self, key: Key) -> bool:
        with self._guard:
            return key in self._watches

    def written(self, key: Key, pods: list[dict], endpoints: dict[str, bool], now: float) -> None:
        """The serving Service's slices were just written: the flips still unpublished were left
        out of that write (``LagWatch.written``)."""
        current = unpublished(pods, endpoints)
        with self._guard:
            self._watches.setdefault(key, LagWatch()).written(now, current)

    def check(self, active: Collection[Key], pods: Callable[[Key], list[dict]],
              endpoints: Callable[[Key], dict[str, bool]], now: float) -> None:
        """Touch the Service of each deployment in ``active`` (in a swap) whose slices sit on a
        flip for too long. Only deployments with an event since the last check or a flip still
        unpublished are looked at: a fleet-wide swap must not cost a core."""
        dirty, self._dirty = self._dirty, set()
        with self._guard:
            for gone in [k for k in self._watches if k not in active]:
                del self._watches[gone]
        for key in active:
            with self._guard:
                watch = self._watches.setdefault(key, LagWatch())
                if key not in dirty and not watch.since:
                    continue
                overdue = watch.observe(now, unpublished(pods(key), endpoints(key)))
                wanted = {"not ready" if watch.since[p][0] else "ready" for p in overdue}
            if overdue:
                service = self._service(key)
                metrics.ENDPOINT_RESYNCS.inc()
                log.info("%s/%s: EndpointSlice of Service %s still shows %s as %s; touching the Service so "
                         "the EndpointSlice controller syncs it again", key[0], key[1], service, ", ".join(overdue),
                         "/".join(sorted(wanted)))
                self._touch(key[0], service)
