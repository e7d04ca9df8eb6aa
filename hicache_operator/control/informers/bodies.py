"""The newest HiCacheDeployment body seen per key: from the watch, and from our own status writes.

A GET of the object per reconcile would be the operator's most frequent API call at fleet scale
(every pod event of every deployment) and, during a backend swap, would sit on the path between
one pod's endpoint turning ready and the next pod's drain. The watch already delivers every
version, so reconciles read from here (the client-go informer pattern).

Why it is safe to plan from it: the status, where swap progress lives, is written only by this
operator, and each write's response (the object as stored) is offered here at once, so a worker
never sees a status older than the last one written. A body replaces the cached one only if its
resourceVersion is not older; watch events for our own earlier writes can arrive after the
response of a later one. Spec edits arrive by the watch before their reconcile is queued. The
API server's resourceVersions are etcd revisions (integers); one that is not an integer is
never cached, so such a server gets a GET per reconcile as before.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

Key = tuple[str, str]


def _version(body: dict[str, Any]) -> int | None:
    try:
        return int((body.get("metadata") or {}).get("resourceVersion"))
    except (TypeError, ValueError):
        return None


class BodyCache:
    def __init__(self) -> None:
        # key -> (resourceVersion, body); body None: deleted at that version (a tombstone, so a
        # status-write response that loses the race with the DELETED event cannot revive it)
        self._bodies: dict[Key, tuple[int, dict[str, Any] | None]] = {}
        self._lock = threading.Lock()

    def offer(self, key: Key, body: dict[str, Any]) -> None:
        """Keep ``body`` (copied) unless the cached one, or the deletion, is newer."""
        version = _version(body)
        if version is None:
            return
        with self._lock:
            cached = self._bodies.get(key)
            if cached is None or version > cached[0] or (version == cached[0] and cached[1] is not None):
                self._bodies[key] = (version, copy.deepcopy(dict(body)))

    def get(self, key: Key) -> dict[str, Any] | None:
        """A copy of the newest body (a reconcile edits its own), or None: read it from the API."""
        with self._lock:
            cached = self._bodies.get(key)
        return copy.deepcopy(cached[1]) if cached and cached[1] is not None else None

    def deleted(self, key: Key, body: dict[str, Any] | None = None) -> None:
        """The object is gone (``body``: its last state, from the DELETED event)."""
        with self._lock:
            cached = self._bodies.get(key)
            version = max(_version(body or {}) or 0, cached[0] if cached else 0)
            self._bodies[key] = (version, None)
