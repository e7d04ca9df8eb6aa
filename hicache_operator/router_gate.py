"""The client gate in front of sglang-router: what the client Service reaches when the router is on.

sglang-router 0.3.2 forwards more than inference to its workers, with the workers' key: a
percent-encoded ``..%2F`` in ``GET /v1/responses/{id}`` reaches any worker path (``/server_info``,
whose body is SGLang's resolved arguments, the admin key among them), and ``/engine_metrics``,
``/get_loads`` and ``/flush_cache`` pass through too. So clients never talk to the router: the gate
takes their key (``HICACHE_CLIENT_API_KEY``; unset: no key asked), lets through only the exact
paths of ``ALLOWED`` (compared on the raw path, so no encoding can turn one into another), and
sends them on with the fleet's internal key (``HICACHE_API_KEY``: the router's ``--api-key``,
which it also gives the pods). Everything else is 404; a missing or wrong client key, 401. The
router's own port is for the operator alone (its worker API); responses stream through as they come.

Given a command after ``--``, the gate runs it (the router) as its child, in one container with it:
the gate ends when the router does (the container restarts), and on SIGTERM it stops taking
connections, lets the requests in flight finish (``--shutdown-grace-period-secs``), then stops the
router.

    python -m hicache_operator.router_gate --host H --port 30000 --upstream http://H:30001 \
        [-- python -m sglang_router.launch_router --port 30001 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import sys

import aiohttp
from aiohttp import web
from yarl import URL

log = logging.getLogger("hicache.router_gate")

# method -> raw paths clients may use: inference, the model list, and the probes
ALLOWED = {
    "POST": frozenset({"/generate", "/v1/chat/completions", "/v1/completions", "/v1/embeddings"}),
    "GET": frozenset({"/v1/models", "/get_model_info", "/health", "/health_generate", "/readiness", "/liveness"}),
}
OPEN = frozenset({"/health", "/health_generate", "/readiness", "/liveness"})  # probes carry no key
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "authorization", "x-api-key"})


def decide(method: str, raw_path: str, authorization: str | None, client_key: str | None) -> int:
    """200 to forward, 404 for a path clients may not use, 401 without the client key."""
    path = raw_path.split("?", 1)[0]
    if path not in ALLOWED.get(method, ()):
        return 404
    if client_key and path not in OPEN:
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), client_key.encode()):
            return 401
    return 200


class Gate:
    def __init__(self, upstream: str, client_key: str | None, internal_key: str | None) -> None:
        self.upstream = upstream.rstrip("/")
        self.client_key, self.internal_key = client_key or None, internal_key or None
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                             auto_decompress=False)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        verdict = decide(request.method, request.raw_path, request.headers.get("Authorization"), self.client_key)
        if verdict == 404:
            return web.json_response({"error": {"message": "Not Found", "code": 404}}, status=404)
        if verdict == 401:
            return web.json_response({"error": "Unauthorized"}, status=401)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.internal_key:
            headers["Authorization"] = f"Bearer {self.internal_key}"
        body = await request.read()
        assert self.session is not None
        try:
            async with self.session.request(request.method, URL(self.upstream + request.raw_path, encoded=True),
                                            headers=headers,
                                            data=body) as up:
                out = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP | {"content-encoding"}})
                if "Content-Encoding" in up.headers:
                    out.headers["Content-Encoding"] = up.headers["Content-Encoding"]
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("router unreachable for %s %s: %s", request.method, request.path, exc)
            return web.json_response({"error": {"message": "router unavailable", "code": 503}}, status=503)


class Child:
    """The router as the gate's child process: started with the app, stopped after it."""

    def __init__(self, argv: list[str], grace_s: float) -> None:
        self.argv, self.grace_s = argv, grace_s
        self.proc: asyncio.subprocess.Process | None = None
        self.watch: asyncio.Task | None = None

    async def start(self, app: web.Application) -> None:
        self.proc = await asyncio.create_subprocess_exec(*self.argv)
        self.watch = asyncio.create_task(self._exit_with_it())

    async def _exit_with_it(self) -> None:
        assert self.proc is not None
        code = await self.proc.wait()
        log.error("the router exited (%s): the gate exits with it", code)
        os.kill(os.getpid(), signal.SIGTERM)

    async def stop(self, app: web.Application) -> None:
        if self.watch is not None:
            self.watch.cancel()
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), self.grace_s + 5)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


def app(upstream: str, client_key: str | None, internal_key: str | None, child: Child | None = None
        ) -> web.Application:
    gate = Gate(upstream, client_key, internal_key)
    application = web.Application(client_max_size=64 * 2**20)
    if child is not None:
        application.on_startup.append(child.start)
        application.on_cleanup.append(child.stop)  # after the requests in flight
    application.on_startup.append(gate.start)
    application.on_cleanup.append(gate.stop)
    application.router.add_route("*", "/{tail:.*}", gate.handle)
    return application


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--upstream", required=True, help="the router's URL, e.g. http://10.0.0.5:30001")
    ap.add_argument("--shutdown-grace-period-secs", type=float, default=60.0,
                    help="on SIGTERM, how long requests in flight may take to finish")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    child = Child(command, a.shutdown_grace_period_secs) if command else None
    web.run_app(app(a.upstream, os.environ.get("HICACHE_CLIENT_API_KEY"), os.environ.get("HICACHE_API_KEY"), child),
                host=a.host, port=a.port, access_log=None, print=None, shutdown_timeout=a.shutdown_grace_period_secs)


if __name__ == "__main__":
    main()
