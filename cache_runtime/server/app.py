"""The FastAPI app of the runtime: its route groups (``inference``, ``info``, ``admin``) over one
``Engine``, the error bodies every route answers with, and ``run`` (uvicorn).

HTTP only: handlers run on uvicorn's event loop and reach the engine through its thread-safe
entry points (``submit``, ``abort``, ``call``); the engine thread starts with the app's lifespan
and stops with it.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cache_runtime import __version__
from cache_runtime.args import ServerArgs
from cache_runtime.engine.loop import Engine
from cache_runtime.metrics import Metrics
from cache_runtime.protocol import BadRequest
from cache_runtime.server.admin import AdminRoutes
from cache_runtime.server.handlers import TooLarge, error
from cache_runtime.server.inference import InferenceRoutes
from cache_runtime.server.info import InfoRoutes

log = logging.getLogger(__name__)


class Server:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.engine = Engine(args)
        self.metrics = Metrics(self.engine)
        self.engine.on_first_token = self.metrics.first_token
        self.engine.on_finish = self.metrics.finished
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app):
            self.engine.start()
            yield
            await asyncio.to_thread(self.engine.shutdown)

        app = FastAPI(title="cache_runtime", version=__version__, lifespan=lifespan, docs_url=None,
                      redoc_url=None, openapi_url=None)

        @app.exception_handler(BadRequest)
        async def _bad(_r, exc):
            return error(400, str(exc))

        @app.exception_handler(TooLarge)
        async def _large(_r, _exc):
            return error(413, f"request body exceeds {self.args.max_request_bytes} bytes", "RequestTooLarge")

        @app.exception_handler(ClientDisconnect)
        async def _gone(_r, _exc):
            # the client left while its body was arriving: there is no one to answer
            return Response(status_code=499)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_r, exc):
            return error(400, f"invalid request: {exc.errors()[:3]}")

        @app.exception_handler(StarletteHTTPException)
        async def _http(_r, exc):
            return error(exc.status_code, str(exc.detail), "NotFound" if exc.status_code == 404 else "HTTPError")

        @app.exception_handler(Exception)
        async def _internal(_r, exc):
            log.exception("unhandled error")
            return error(500, f"internal error: {type(exc).__name__}", "InternalServerError")

        InferenceRoutes(self.args, self.engine).register(app)
        InfoRoutes(self.args, self.engine, self.metrics).register(app)
        AdminRoutes(self.args, self.engine).register(app)
        return app


# How long an idle client connection stays open. Clients and gateways must close idle
# connections before the server does: uvicorn's default (5 s) equals httpx's keep-alive expiry,
# so a request sent on a connection idle for ~5 s could cross the server's close and fail with no
# response (seen once under the swap bench, where pods sit out of serving for seconds). Longer
# than common proxy idle timeouts (nginx upstream 60 s), as nginx's and aiohttp's own 75 s.
KEEP_ALIVE_SECONDS = 75


def run(args: ServerArgs) -> None:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = Server(args)
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_SECONDS)
