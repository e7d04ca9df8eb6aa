"""SGLang's auth levels for the HTTP API, with constant-time key comparison."""

from __future__ import annotations

import enum
import hmac

from starlette.requests import Request
from starlette.responses import JSONResponse


class Level(enum.Enum):
    OPEN = "open"  # health, readiness, metrics, load
    NORMAL = "normal"  # inference and info: --api-key when set
    ADMIN_OPTIONAL = "admin_optional"  # --admin-api-key if set, else --api-key if set, else open
    ADMIN_REQUIRED = "admin_required"  # storage attach/detach/status: ADMIN_OPTIONAL, then a configured --admin-api-key


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def key_matches(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def unauthorized() -> JSONResponse:
    return JSONResponse({"error": "Unauthorized"}, status_code=401)


def check(request: Request, level: Level, api_key: str | None, admin_key: str | None) -> JSONResponse | None:
    """None when the request may proceed, else the response to send."""
    if level is Level.OPEN:
        return None
    key = presented_key(request)
    if level is Level.NORMAL:
        if api_key is None:
            return None
        ok = key_matches(key, api_key) or (admin_key is not None and key_matches(key, admin_key))
        return None if ok else unauthorized()
    expected = admin_key if admin_key is not None else api_key
    if expected is not None and not key_matches(key, expected):
        return unauthorized()
    if level is Level.ADMIN_REQUIRED and admin_key is None:
        # SGLang: the caller passes the admin-optional check first, so a wrong key is 401 before this 400
        return JSONResponse(
            {"error": "This endpoint requires admin API key, but this server was started without one "
                      "(admin-api-key). Restart with --admin-api-key to enable."},
            status_code=400,
        )
    return None
