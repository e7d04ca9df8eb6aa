"""What a failed reconcile leaves behind: a condition, an Event and one log line.

A reconcile that raises (an API error, a bug) sets Degraded=True with reason ReconcileFailed
and the error, Progressing=False, and posts a Warning Event when the error is new; the queue
retries with a per-deployment backoff. A child the API server refuses (its admission said no)
sets ConfigValid=False with the API server's message. Neither ever crashes the operator.
"""

from __future__ import annotations

import json
import logging
import re
import kopf
import urllib3
from kubernetes.client.exceptions import ApiException

from hicache_operator.plan import status as status_
from hicache_operator.api.conditions import now
from hicache_operator.control.informers import Key
from hicache_operator.control.informers.bodies import BodyCache
from hicache_operator.io.kube import ChildRefused, Kube

FAILED_REASON = "ReconcileFailed"
# Errors from the API server or the way to it: the message says all, a traceback would not help.
TRANSIENT = (ApiException, urllib3.exceptions.HTTPError, OSError)
log = logging.getLogger("hicache_operator")


def failure_message(exc: BaseException, limit: int = 600) -> str:
    """One line for a condition and an Event: the API server's own message for an API error,
    else the exception's type and text (a pydantic error's lines joined, without its links)."""
    if isinstance(exc, ApiException):
        try:
            said = json.loads(exc.body or "{}").get("message") or ""
        except (ValueError, AttributeError):
            said = str(exc.body or "")
        text = f"Kubernetes API error {exc.status} {exc.reason}" + (f": {said}" if said else "")
    else:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
        text = f"{type(exc).__name__}: {' '.join(lines)}" if lines else type(exc).__name__
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def report_failure(kube: Kube, bodies: BodyCache, failing: dict[Key, int], key: Key, exc: Exception,
                   delay: float) -> None:
    """A reconcile raised: Degraded and Progressing in the status and a Warning Event, when that
    is news; the log says it once with the traceback (a bug) or in one line (an API error), and
    later repeats in one line. ``failing`` (deployment -> the generation whose reconcile last
    failed) records it before the status write, whose own event then queues nothing; a new
    generation of the spec is tried at once."""
    message = failure_message(exc)
    raw = bodies.get(key)
    if raw is None:
        try:
            raw = kube.get_deployment(*key)
        except Exception as read_exc:  # the API server may be what failed
            log.warning("reconcile of %s/%s failed (%s); retrying in %.0fs; status not updated: %s",
                        *key, message, delay, failure_message(read_exc))
            return
        if raw is None:
            return
    previous = raw.get("status") or {}
    generation = int(raw["metadata"].get("generation") or 0)
    failing[key] = generation
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == "Degraded"), {})
    news = (old.get("reason"), old.get("message")) != (FAILED_REASON, message)
    if news and not isinstance(exc, TRANSIENT):
        log.error("reconcile of %s/%s failed; retrying in %.0fs", *key, delay, exc_info=exc)
    else:
        log.warning("reconcile of %s/%s failed%s: %s; retrying in %.0fs", *key, "" if news else " again", message,
                    delay)
    if not news:
        return
    try:
        bodies.offer(key, kube.replace_deployment_status(
            *key, status_.failed(previous, generation, (FAILED_REASON, message), now())))
    except Exception as write_exc:
        log.warning("%s/%s: writing the failure to the status failed: %s", *key, failure_message(write_exc))
    kopf.event(raw, type="Warning", reason=FAILED_REASON, message=message)


def report_refused(kube: Kube, bodies: BodyCache, key: Key, raw: dict, refused: ChildRefused) -> None:
    """ConfigValid=False with the API server's message, and a Warning Event when that is news;
    the rest of the status stands. The periodic resync tries again (an unchanged spec fails the
    same way, quietly); a spec edit is reconciled at once."""
    previous = raw.get("status") or {}
    generation = int(raw["metadata"].get("generation") or 0)
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == "ConfigValid"), {})
    status = status_.refused(previous, generation, str(refused), now())
    if status != previous:
        bodies.offer(key, kube.replace_deployment_status(*key, status))
    if (old.get("reason"), old.get("message")) != (status_.REFUSED_REASON, str(refused)):
        log.warning("%s/%s: %s", *key, refused)
        kopf.event(raw, type="Warning", reason=status_.REFUSED_REASON, message=str(refused))
