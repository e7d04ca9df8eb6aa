"""Async client for one router pod's worker API (sglang-router 0.3.2).

``GET /workers`` lists the workers (``{"workers": [{"id", "url", "is_healthy", ...}]}``);
``POST /workers {"url", "api_key"}`` and ``DELETE /workers/{id}`` are queued by the router
(202) and done in the background, so ``add`` and ``remove`` return once the list shows the
change. The router checks a new worker (``/health``, ``/server_info``, ``/model_info``) before
it lists it as healthy; the API key a worker needs travels with it (discovery gives the
router's ``--api-key`` to the workers it finds itself). A router started with ``--api-key`` also
wants that key on its own API, so every call carries it. The router listens on ``ROUTER_API_PORT``;
clients reach it only through its gate (``hicache_operator/router_gate.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from hicache_operator.api.flags import ROUTER_API_PORT
from hicache_operator.fleet.pods import pod_is_ready

from ..routing import RouterRead

log = logging.getLogger("hicache_operator.rollout")

TIMEOUT = httpx.Timeout(5.0, connect=2.0)
POLL_SECONDS = 0.02
ADD_SECONDS = 15.0  # a new worker is checked (health, server and model info) before it is listed
REMOVE_SECONDS = 5.0


class RouterError(Exception):
    retryable = True


class RouterClient:
    def __init__(self, ip: str, http: httpx.AsyncClient, api_key: str | None = None) -> None:
        self.base = f"http://{ip}:{ROUTER_API_PORT}"  # the router's own port, behind its client gate
        self.http = http
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def workers(self) -> dict[str, dict]:
        """Worker URL -> its entry."""
        try:
            r = await self.http.get(f"{self.base}/workers", headers=self.headers, timeout=TIMEOUT)
        except httpx.HTTPError as exc:
            raise RouterError(f"router {self.base} unreachable: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise RouterError(f"router {self.base}: GET /workers answered {r.status_code}: {r.text[:200]}")
        try:
            return {w["url"]: w for w in r.json()["workers"]}
        except (ValueError, KeyError, TypeError):
            raise RouterError(f"router {self.base}: GET /workers answered {r.text[:200]!r}") from None

    async def listed(self) -> frozenset[str]:
        return frozenset(await self.workers())

    async def remove(self, url: str) -> None:
        """Remove the worker, and return once the router no longer lists it."""
        entry = (await self.workers()).get(url)
        if entry is None:
            return
        try:
            r = await self.http.delete(f"{self.base}/workers/{entry['id']}", headers=self.headers,
                                       timeout=TIMEOUT)
        except httpx.HTTPError as exc:
            raise RouterError(f"router {self.base}: removing {url}: {type(exc).__name__}: {exc}") from None
        if r.status_code not in (200, 202, 404):
            raise RouterError(f"router {self.base}: removing {url} answered {r.status_code}: {r.text[:200]}")
        await self._until(lambda workers: url not in workers, time.monotonic() + REMOVE_SECONDS, f"removing {url}")

    async def add(self, url: str) -> None:
        """Add the worker (with the key the pods want), and return once the router lists it healthy."""
        workers = await self.workers()
        if url in workers and workers[url].get("is_healthy"):
            return
        body: dict = {"url": url}
        if self.api_key:
            body["api_key"] = self.api_key
        if url not in workers:
            try:
                r = await self.http.post(f"{self.base}/workers", json=body, headers=self.headers, timeout=TIMEOUT)
            except httpx.HTTPError as exc:
                raise RouterError(f"router {self.base}: adding {url}: {type(exc).__name__}: {exc}") from None
            if r.status_code not in (200, 201, 202):
                raise RouterError(f"router {self.base}: adding {url} answered {r.status_code}: {r.text[:200]}")
        await self._until(lambda w: url in w and bool(w[url].get("is_healthy")), time.monotonic() + ADD_SECONDS,
                          f"adding {url}")

    async def _until(self, done, deadline: float, what: str) -> None:
        while True:
            if done(await self.workers()):
                return
            if time.monotonic() > deadline:
                raise RouterError(f"router {self.base}: {what}: not done after the router queued it")
            await asyncio.sleep(POLL_SECONDS)


async def read_routers(http: httpx.AsyncClient, routers: list[dict], api_key: str | None) -> list[RouterRead]:
    """Each router pod's worker list (None where it could not be read)."""
    async def one(pod: dict) -> RouterRead:
        try:
            listed: frozenset[str] | None = await RouterClient(pod["status"]["podIP"], http, api_key).listed()
        except Exception as exc:  # noqa: BLE001: an unreadable router is an observation
            log.info("router pod %s: %s", pod["metadata"]["name"], exc)
            listed = None
        return RouterRead(pod["metadata"]["name"], listed, pod_is_ready(pod))
    return list(await asyncio.gather(*(one(p) for p in routers)))


async def route(http: httpx.AsyncClient, routers: list[dict], url: str, routed: bool, api_key: str | None) -> None:
    """Add the worker to (or remove it from) every router pod; a router pod that is not Ready and
    cannot be reached is left alone (starting or gone, it has only what its discovery finds)."""
    async def one(pod: dict) -> None:
        rc = RouterClient(pod["status"]["podIP"], http, api_key)
        try:
            await (rc.add(url) if routed else rc.remove(url))
        except Exception:
            if pod_is_ready(pod):
                raise
    results = await asyncio.gather(*(one(p) for p in routers), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
