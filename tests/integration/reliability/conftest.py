"""Real runtime processes for the reliability tests: fuzzing, fault injection, security.

A runtime here can be bound to any loopback address and restarted on the same port (the
"killed mid-request" test), which ``tests/integration/runtime``'s ServerProcess does not offer.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.runtime.conftest import free_port

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [f"{i:02d} reliability prompt: pages move between device, host and storage tiers. " * 2 for i in range(40)]


class Runtime:
    def __init__(self, flags: list[str], log_path: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 env: dict | None = None) -> None:
        self.host, self.port, self.flags, self.log_path = host, port or free_port(), list(flags), log_path
        self.url = f"http://{host}:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if k != "HICACHE_ADMIN_API_KEY"}
        self.env.update({"PYTHONPATH": str(REPO), **(env or {})})
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> "Runtime":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cache_runtime", "serve", "--host", self.host, "--port", str(self.port),
                 *self.flags], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"runtime exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"runtime did not become healthy:\n{self.log()}")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, trust_env=False, **kw)

    def log(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL by pid: what an OOM kill or a node failure does to the process."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def start_runtime(tmp_path):
    started: list[Runtime] = []

    def start(*flags: str, **kw) -> Runtime:
        rt = Runtime(list(flags), tmp_path / f"runtime-{len(started)}.log", **kw).start()
        started.append(rt)
        return rt

    yield start
    for rt in started:
        rt.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A runtime with no cache at all: what every cached answer must equal (greedy decoding)."""
    rt = Runtime(["--disable-radix-cache", "--max-total-tokens", "4096"],
                 tmp_path_factory.mktemp("reference") / "runtime.log").start()
    cache: dict[tuple[str, int], list[int]] = {}

    def outputs(prompt: str, max_new_tokens: int = 8) -> list[int]:
        key = (prompt, max_new_tokens)
        if key not in cache:
            with rt.client() as c:
                r = c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}})
                r.raise_for_status()
                cache[key] = r.json()["output_ids"]
        return cache[key]

    yield outputs
    rt.stop()


def generate(client: httpx.Client, prompt: str, max_new_tokens: int = 8) -> dict:
    r = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}})
    assert r.status_code == 200, r.text
    return r.json()


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample over the series whose labels contain ``labels``."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if (series == name or series.startswith(name + "{")) and labels in series:
            total += float(value)
    return total
