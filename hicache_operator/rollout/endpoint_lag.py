"""Readiness flips the EndpointSlice controller has not published, and when to ask it again.

Why: kube-controller-manager's EndpointSlice controller refuses to sync a Service while its own
last write to that Service's slices is not yet back in its informer cache ("EndpointSlice informer
cache is out of date"), and syncs it again only on the next change of one of its pods or of the
Service itself, or after a backoff of 1 s that doubles while refusals repeat. A rolling swap flips
readiness in bursts, so refusals are common (about 20 in a 64-pod swap at maxUnavailable 8), and
the last flip of a burst has no change behind it: that pod stays published as serving while it
drains, or as not serving after its readmission, for the whole backoff, and the swap waits with it.

An update of the Service queues it at once. So while a swap is in flight, when a pod's Ready
condition has disagreed with its endpoint for longer than ``AFTER``, the operator touches the
Service (an annotation, ``labels.ENDPOINTS_RESYNC``). If the controller is merely slow, that
costs one cheap extra sync; the interval between touches doubles while disagreements persist, so a
controller that is down is not hammered.

Sooner when the controller has written the Service's slices without a flip (``LagWatch.written``):
that write is the one whose absence from the controller's cache gets the flip's own sync refused.
Once it is back in the operator's watch it is, as a rule, back in the controller's cache too (the
API server sends it to both watches at once, and the controller decodes it sooner than this Python
process does), so a touch ``SETTLE`` after it is not refused; a flip the controller simply had not
reached yet costs one extra sync. In swaps, flips come in bursts (a step readmits up to
maxUnavailable pods at once) and the last of a burst was the one left waiting: ``AFTER`` after it.
``SETTLE`` is 0.02 s: against 0.1 s, in alternating 16-pod swaps, walls 1.78 against 1.95 s (mean)
for 3.2 against 1.8 touches per swap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache_operator.fleet.pods import pod_serves

AFTER = 0.3  # seconds; under load most flips reach the slice within 0.1-0.35 s, a refusal costs >= 1 s
SETTLE = 0.02  # seconds after a write of the slices that left a flip out
FIRST_INTERVAL = 0.3
MAX_INTERVAL = 8.0


def unpublished(pods: list[dict], endpoints: dict[str, bool]) -> dict[str, bool]:
    """Pod name -> the readiness its endpoint should show and does not (``endpoints``: pod IP ->
    ready, as the client Service's slices show it; a pod without an endpoint shows not ready, and
    one taken out of serving should have none). Pods being deleted or without an IP are the
    controller's own business."""
    out: dict[str, bool] = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        if meta.get("deletionTimestamp") or not ip or not meta.get("name"):
            continue
        ready = pod_serves(pod)
        if bool(endpoints.get(ip)) != ready:
            out[meta["name"]] = ready
    return out


@dataclass
class LagWatch:
    """One Service's unpublished flips over time (``since``: pod -> (readiness wanted, first
    seen, when a write of the slices first left it out or None)) and when it was last touched."""

    since: dict[str, tuple[bool, float, float | None]] = field(default_factory=dict)
    last_touch: float | None = None
    interval: float = FIRST_INTERVAL

    def written(self, now: float, current: dict[str, bool]) -> None:
        """The slices were just written (a watch event), and ``current`` is what is unpublished
        after it: each of those flips was left out of that write."""
        since = {}
        for pod, want in current.items():
            first, missed = self._clock(pod, want, now)
            since[pod] = (want, first, now if missed is None else missed)
        self.since = since

    def observe(self, now: float, current: dict[str, bool]) -> list[str]:
        """Record what is unpublished now; the pods overdue when the Service should be touched
        now (empty otherwise). A flip that changes direction starts its clock again."""
        self.since = {pod: (want, *self._clock(pod, want, now)) for pod, want in current.items()}
        overdue = sorted(pod for pod, (_, first, missed) in self.since.items()
                         if now - first >= AFTER or missed is not None and now - missed >= SETTLE)
        if not overdue:
            self.interval = FIRST_INTERVAL
            return []
        if self.last_touch is not None and now - self.last_touch < self.interval:
            return []
        if self.last_touch is not None:
            self.interval = min(MAX_INTERVAL, self.interval * 2)
        self.last_touch = now
        return overdue

    def _clock(self, pod: str, want: bool, now: float) -> tuple[float, float | None]:
        """(first seen, left out of a write since) of the pod's flip, new if it changed direction."""
        held = self.since.get(pod)
        return (held[1], held[2]) if held is not None and held[0] == want else (now, None)
