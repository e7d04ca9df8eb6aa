"""Runtime reads of a fleet's pods, and which of them a swap step may reuse instead of a GET.

A swap step's decisions about a pod it is swapping (drained? attached? verified?) always rest
on a read made in that step. The fleet's other pods only matter for picking the next pod to
take out (does it run something other than the target?) and for the summary, so a settled
pod's last read stands in for a few seconds: a GET pair per pod per step would sit between one
pod's readmission and the next pod's drain (about a second for 16 busy pods on 2 cores).

- Only for a settled pod (no swap record, serving gate True, endpoint ready), or one being
  readmitted whose gate is already True (read to verify it just before; what it still waits
  for, its endpoint turning ready, comes from the watch). A pod out of serving for any other
  reason, or new, is read afresh: it may be dead or just started.
- Only while the pod has the same uid and IP, and only if the last read reached the runtime
  and did not report its L3 store unavailable: such a pod is read afresh, since its recovery is
  what the status waits for (``l3_unavailable``).
- Re-read after ``refresh_seconds``, stretched by up to 2x per pod (from its uid) so a fleet
  read in one step is not re-read all in one later step.

While a rollout runs or starts, a settled pod's expired read is still planned on and renewed in
the background (``executor.Swapper``), so a rollout never waits on a settled pod's GET. A reused
read keeps the time it was made as ``observed_at``, so the planner never mistakes it for a fresh
one. The cost: a pod whose runtime changed behind the operator's back (restarted with an older
config) is noticed up to ``2 * refresh_seconds`` later; a pod taken out on an old read that
turns out to be on the target is readmitted by the next step. A restarted operator reads all.
"""

from __future__ import annotations

import datetime as dt
import zlib
from dataclasses import dataclass
from typing import Hashable

import httpx

from hicache_operator.api.flags import RUNTIME_PORT

from .runtime_client import RuntimeClient, RuntimeView

DEFAULT_REFRESH_SECONDS = 5.0


@dataclass(frozen=True)
class CachedView:
    """One read of a pod's runtime. ``after_unready``: the read started after the watch showed
    the pod's endpoint not ready while its gate was False (``drains``), so it can answer
    "drained?" for as long as the pod stays out of serving."""

    uid: str
    ip: str
    observed_at: dt.datetime
    view: RuntimeView
    after_unready: bool = False


async def read_pod(http: httpx.AsyncClient, pod: dict, key: str | None, after_unready: bool = False) -> CachedView:
    """The pod's runtime now (``observed_at`` is taken before the GETs: the read was true then)."""
    now = dt.datetime.now(dt.timezone.utc)
    ip = pod["status"]["podIP"]
    view = await RuntimeClient(f"http://{ip}:{RUNTIME_PORT}", key, timeout=3.0, http=http).observe()
    return CachedView(pod["metadata"]["uid"], ip, now, view, after_unready)


def idle(view: RuntimeView) -> bool:
    """Read without error, no request running or queued."""
    return view.error is None and view.in_flight == 0 and view.queued == 0


class ViewCache:
    """Per deployment: pod uid -> its last runtime read. One step per deployment at a time
    (the caller's guarantee) and its background renewal (``update`` keeps the newer read);
    different deployments may step concurrently."""

    def __init__(self, refresh_seconds: float = DEFAULT_REFRESH_SECONDS) -> None:
        self.refresh_seconds = refresh_seconds
        self._fleets: dict[Hashable, dict[str, CachedView]] = {}

    def reusable(self, fleet: Hashable, uid: str, ip: str, now: dt.datetime) -> CachedView | None:
        """The last read of this pod if it may stand in for a new one (the caller has checked
        that the pod is settled)."""
        cached = self._fleets.get(fleet, {}).get(uid)
        if cached is None or cached.ip != ip or cached.view.backend is None or cached.view.error is not None \
                or cached.view.storage_unavailable is not None:
            return None
        age = (now - cached.observed_at).total_seconds()
        return cached if 0 <= age < self.refresh_seconds * _stretch(uid) else None

    def last(self, fleet: Hashable, uid: str, ip: str) -> CachedView | None:
        """The last read of this pod, however old or failed, for a pod whose new read could not
        change the plan, or may come after it (see ``executor.Swapper.observe``). It keeps its
        own ``observed_at``, so the planner treats it as stale for any pod it has acted on since."""
        cached = self._fleets.get(fleet, {}).get(uid)
        return cached if cached is not None and cached.ip == ip else None

    def l3_unavailable(self, fleet: Hashable, pods: list[dict]) -> dict[str, str]:
        """Pod name -> why its runtime's L3 store is unavailable, for the pods whose last read
        (same uid and IP) said so: what ``status.Observed.l3_unavailable`` holds."""
        out = {}
        for pod in pods:
            meta, ip = pod.get("metadata") or {}, (pod.get("status") or {}).get("podIP")
            cached = self._fleets.get(fleet, {}).get(meta.get("uid")) if ip else None
            if cached is not None and cached.ip == ip and cached.view.storage_unavailable is not None:
                out[meta["name"]] = cached.view.storage_unavailable
        return out

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

    def forget(self, fleet: Hashable) -> None:
        self._fleets.pop(fleet, None)


def _stretch(uid: str) -> float:
    return 1.0 + (zlib.crc32(uid.encode()) % 1000) / 1000
