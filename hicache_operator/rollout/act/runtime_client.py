"""Async client for one pod's runtime admin API.

The bundled runtime and ``sglang.launch_server`` expose the same routes and
auth (``Authorization: Bearer <admin key>``), so one client serves both. Load
comes from ``GET /metrics`` (SGLang's gauges; the sglang engine must run with
``--enable-metrics``), which both engines serve. Timeouts are short: the planner re-observes every few seconds, so a
slow pod is better reported Unreachable than waited on.

The same GET tells whether the pod's L3 store is reachable: the bundled runtime adds
``hicache_storage_degraded`` (its reason, null while L3 works); SGLang has no such field (nor a
metric), so its pods report nothing and are never seen as L3-unavailable.

Errors map to a few exception types whose ``retryable`` tells the planner
(via ``ActionOutcome.failed``) whether another try can help.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import ssl
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hicache_operator.fleet.storage_config import ReportedBackend, clip_message

STORAGE_BACKEND_PATH = "/hicache/storage-backend"
STORAGE_DEGRADED_FIELD = "hicache_storage_degraded"
RUNNING_METRIC = "sglang:num_running_reqs"
QUEUED_METRIC = "sglang:num_queue_reqs"
DEFAULT_TIMEOUT = httpx.Timeout(5.0, connect=2.0)


class RuntimeClientError(Exception):
    retryable = True


class Unreachable(RuntimeClientError):
    """No HTTP answer: connection refused/reset, timeout, DNS."""


class Unauthorized(RuntimeClientError):
    """401: the admin key is missing or wrong."""

    retryable = False


class NotIdle(RuntimeClientError):
    """400 'scheduler is not idle': requests still running or queued."""

    def __init__(self, message: str, queued: int | None, running: int | None) -> None:
        super().__init__(message)
        self.queued = queued
        self.running = running


class BackendError(RuntimeClientError):
    """The runtime answered but refused or failed; ``message`` is its text.
    A 4xx will not change on retry; a 5xx might."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retryable = status >= 500


class BadResponse(BackendError):
    """A 2xx whose body is not what the API promises."""

    def __init__(self, message: str, status: int = 200) -> None:
        super().__init__(message, status)
        self.retryable = False


@dataclass(frozen=True)
class Load:
    in_flight: int
    queued: int


@dataclass(frozen=True)
class StorageStatus:
    """A runtime's ``GET /hicache/storage-backend``: the config it runs, and why its L3 store is
    unavailable (None: available, or not reported)."""

    backend: ReportedBackend
    unavailable: str | None = None


@dataclass(frozen=True)
class RuntimeView:
    """The runtime half of a ``PodObservation``; None where a GET failed. ``storage_unavailable``
    (``StorageStatus.unavailable``) is not the planner's: the status reads it (``views``)."""

    backend: ReportedBackend | None
    in_flight: int | None
    queued: int | None
    error: str | None
    storage_unavailable: str | None = None

    def observation_fields(self) -> dict[str, Any]:
        return {"backend": self.backend, "in_flight": self.in_flight, "queued": self.queued,
                "runtime_error": self.error}


_NOT_IDLE = re.compile(r"#queue-req=(\d+)\D+#running-req=(\d+)")


class RuntimeClient:
    """One pod's runtime at ``base_url`` (e.g. ``http://10.0.0.7:30000``).

    ``http``: a client to borrow (not closed here). A swap step talks to every pod of a
    fleet; one shared client builds its TLS context once instead of once per pod, which
    on a small machine costs tens of milliseconds each."""

    def __init__(self, base_url: str, admin_key: str | None = None, *,
                 timeout: httpx.Timeout | float = DEFAULT_TIMEOUT, http: httpx.AsyncClient | None = None) -> None:
        self._base = httpx.URL(base_url)
        self._headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._timeout = timeout
        self._owned = http is None
        self._http = http if http is not None else shared_client()

    async def __aenter__(self) -> RuntimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def get_backend(self) -> ReportedBackend:
        return (await self.storage_status()).backend

    async def storage_status(self) -> StorageStatus:
        response = await self._request("GET", STORAGE_BACKEND_PATH)
        try:
            body = response.json()
            backend = ReportedBackend.from_response(body)
        except ValueError as exc:
            raise BadResponse(f"GET {STORAGE_BACKEND_PATH}: {clip_message(str(exc))}") from None
        degraded = body.get(STORAGE_DEGRADED_FIELD)
        return StorageStatus(backend, clip_message(degraded) if isinstance(degraded, str) and degraded else None)

    async def attach(self, payload: dict[str, Any]) -> str:
        """Returns the runtime's success message."""
        return (await self._request("PUT", STORAGE_BACKEND_PATH, json=payload)).text.strip()

    async def detach(self) -> str:
        return (await self._request("DELETE", STORAGE_BACKEND_PATH)).text.strip()

    async def load(self) -> Load:
        """Running and queued requests, each summed over label sets (DP ranks)."""
        text = (await self._request("GET", "/metrics")).text
        totals: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in (RUNNING_METRIC, QUEUED_METRIC):
                        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        except ValueError as exc:
            raise BadResponse(f"GET /metrics is not Prometheus text: {clip_message(str(exc))}") from None
        missing = [m for m in (RUNNING_METRIC, QUEUED_METRIC) if m not in totals]
        if missing:
            raise BadResponse(f"GET /metrics lacks {', '.join(missing)} (sglang: start with --enable-metrics)")
        values = [totals[RUNNING_METRIC], totals[QUEUED_METRIC]]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise BadResponse(f"GET /metrics has nonsensical request counts {values}")
        return Load(in_flight=round(values[0]), queued=round(values[1]))

    async def observe(self) -> RuntimeView:
        """Storage status and load fetched together; a runtime that fails either is
        reported in ``error`` rather than raised, so one bad pod never stops
        the operator from seeing the rest."""
        storage, load = await asyncio.gather(self.storage_status(), self.load(), return_exceptions=True)
        errors = [r for r in (storage, load) if isinstance(r, BaseException)]
        for error in errors:
            if not isinstance(error, RuntimeClientError):
                raise error
        read = None if isinstance(storage, BaseException) else storage
        return RuntimeView(
            backend=read.backend if read else None,
            in_flight=None if isinstance(load, BaseException) else load.in_flight,
            queued=None if isinstance(load, BaseException) else load.queued,
            error="; ".join(str(e) for e in errors) or None,
            storage_unavailable=read.unavailable if read else None,
        )

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url = self._base.join(path)
        where = f"{method} {url}"
        try:
            response = await self._http.request(method, url, headers=self._headers, timeout=self._timeout, **kwargs)
        except httpx.TransportError as exc:
            raise Unreachable(f"{where}: {type(exc).__name__}: {exc}".rstrip(": ")) from None
        if response.is_success:
            return response
        message = clip_message(_error_text(response))
        if response.status_code == 401:
            raise Unauthorized(f"{where}: 401 {message or 'Unauthorized'} (check the admin API key)")
        if response.status_code == 400 and "#queue-req" in message:
            match = _NOT_IDLE.search(message)
            queued, running = (int(match.group(1)), int(match.group(2))) if match else (None, None)
            raise NotIdle(f"{where}: {message}", queued=queued, running=running)
        raise BackendError(f"{where}: {response.status_code} {message}".rstrip(), status=response.status_code)


def shared_client() -> httpx.AsyncClient:
    """A client for many runtimes' admin APIs. Its TLS context (building one loads the CA
    bundle: tens of milliseconds) is built once per process, not once per swap step."""
    return httpx.AsyncClient(timeout=DEFAULT_TIMEOUT, follow_redirects=False, verify=_tls_context())


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def _error_text(response: httpx.Response) -> str:
    """SGLang answers errors as plain text or JSON ``{"error"|"message"|"detail": ...}``."""
    try:
        body = response.json()
    except ValueError:
        return " ".join(response.text.split())
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            if isinstance(body.get(key), str):
                return body[key]
        if isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str):
            return body["error"]["message"]
    return " ".join(response.text.split())
