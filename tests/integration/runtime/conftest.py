"""Real ``python -m cache_runtime serve`` processes on 127.0.0.1, talked to over HTTP with httpx."""

from __future__ import annotations

import json

import httpx
import pytest

from testbed.runtime_proc import RuntimeProcess, free_port  # noqa: F401 (free_port: for the tests)

ADMIN_KEY = "test-admin-key-0123456789"
API_KEY = "test-api-key"


def sse_events(resp: httpx.Response) -> list:
    """The ``data:`` payloads of a server-sent-events response, JSON-decoded ("[DONE]" kept as is)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    started: list[RuntimeProcess] = []

    def start(*flags: str, env: dict | None = None, host: str = "127.0.0.1", port: int | None = None) -> RuntimeProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = RuntimeProcess(list(flags), log, env=env, host=host, port=port).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()
