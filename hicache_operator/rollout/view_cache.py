"""Recent runtime reads of settled pods, so a swap step need not GET every pod of the fleet.

A swap step's own decisions about a pod it is swapping (drained? attached? verified?) always
rest on a read made in that step. The other pods of the fleet only matter for picking the next
pod to take out (does it run something other than the target?) and for the summary. Reading
all of them every step made each step cost a GET pair per pod (about a second for 16 pods on a
loaded 2-core machine), and that cost sits between one pod's readmission and the next pod's
drain. So a settled pod's last read is reused for a few seconds:

- only for a pod that is settled: no swap record, serving gate True, endpoint ready (a pod
  out of serving for any reason, or new, is read afresh: it may be dead or just started), or
  one being readmitted whose gate is already True: it was read to verify it just before, and
  what it still waits for (its endpoint turning ready) comes from the watch;
- only while the pod has the same uid and IP, and only if the last read reached the runtime;
- re-read after ``refresh_seconds`` (stretched by up to 2x per pod, from its uid, so a fleet
  read in one step is not re-read all in one later step).

While a rollout runs or starts, a settled pod's expired read is still used for that step's
plan and renewed in the background (``swap._observe``, ``swap._renew``), so a rollout never
waits on a settled pod's GET (its first step used to read the whole fleet before the first drain).

A reused read keeps the time it was made as ``observed_at``, so nothing downstream mistakes it
for a fresh one. What it can cost: a pod whose runtime changed behind the operator's back (it
restarted with an older config) is noticed up to ``2 * refresh_seconds`` later; a pod taken out
on an old read that turns out to be on the target is readmitted by the next step. A restarted
operator starts empty and reads everything.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import datetime
from typing import Hashable

from .runtime_client import RuntimeView

DEFAULT_REFRESH_SECONDS = 5.0


@dataclass(frozen=True)
class CachedView:
    """``after_unready``: the read started after the watch showed the pod's endpoint not ready
    while its gate was False (``swap.read_drained``), so it can answer "drained?" for as long
    as the pod stays out of serving."""

    uid: str
    ip: str
    observed_at: datetime
    view: RuntimeView
    after_unready: bool = False


class ViewCache:
    """Per deployment: pod uid -> its last runtime read. One step per deployment at a time
    (the caller's guarantee), and its background renewal (``update`` keeps the newer read);
    different deployments may step concurrently."""

    def __init__(self, refresh_seconds: float = DEFAULT_REFRESH_SECONDS) -> None:
        self.refresh_seconds = refresh_seconds
        self._fleets: dict[Hashable, dict[str, CachedView]] = {}

    def reusable(self, fleet: Hashable, uid: str, ip: str, now: datetime) -> CachedView | None:
        """The last read of this pod if it may stand in for a new one (the caller has checked
        that the pod is settled)."""
        cached = self._fleets.get(fleet, {}).get(uid)
        if cached is None or cached.ip != ip or cached.view.backend is None or cached.view.error is not None:
            return None
        age = (now - cached.observed_at).total_seconds()
        return cached if 0 <= age < self.refresh_seconds * _stretch(uid) else None

    def last(self, fleet: Hashable, uid: str, ip: str) -> CachedView | None:
        """The last read of this pod, however old or failed, for a pod whose new read could not
        change the plan, or may come after it (see ``swap._observe``). It keeps its own
        ``observed_at``, so the planner treats it as stale for any pod it has acted on since."""
        cached = self._fleets.get(fleet, {}).get(uid)
        return cached if cached is not None and cached.ip == ip else None

    def update(self, fleet: Hashable, views: list[CachedView]) -> None:
        """New reads of some pods; the others' are kept, and so is a read newer than the one
        offered (a background renewal may finish after a step has read the pod again)."""
        known = self._fleets.setdefault(fleet, {})
        for view in views:
            held = known.get(view.uid)
            if held is None or held.observed_at <= view.observed_at:
                known[view.uid] = view

    def replace(self, fleet: Hashable, views: list[CachedView]) -> None:
        """The fleet's reads after a step (fresh and reused); pods not listed are forgotten."""
        self._fleets[fleet] = {v.uid: v for v in views}


def _stretch(uid: str) -> float:
    return 1.0 + (zlib.crc32(uid.encode()) % 1000) / 1000
