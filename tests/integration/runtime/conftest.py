"""Real ``python -m cache_runtime serve`` processes on 127.0.0.1, talked to over HTTP with httpx."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
ADMIN_KEY = "test-admin-key-0123456789"
API_KEY = "test-api-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_events(resp: httpx.Response) -> list:
    """The ``data:`` payloads of a server-sent-events response, JSON-decoded ("[DONE]" kept as is)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


class ServerProcess:
    def __init__(self, flags: list[str], log_path: Path, env: dict | None = None, host: str = "127.0.0.1",
                 port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONPATH": str(REPO)}
        full_env.pop("HICACHE_ADMIN_API_KEY", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cache_runtime", "serve", "--host", host, "--port", str(self.port), *flags],
            cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, trust_env=False, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    started: list[ServerProcess] = []

    def start(*flags: str, env: dict | None = None, host: str = "127.0.0.1", port: int | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(list(flags), log, env, host, port)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()
