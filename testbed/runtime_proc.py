"""Real ``python -m cache_runtime serve`` processes, one launcher for the tests and the benchmarks.

A runtime is started on a loopback address and port (again on the same port after a kill: the
"killed mid-request" tests), waited for until ``/health`` answers, and stopped through its
process group. Its load is read from ``/metrics`` the way the operator reads it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import httpx

from testbed import REPO
from testbed.procs import free_port, stop_process, wait_ready


def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set (VmHWM), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RuntimeProcess:
    """``flags`` go to ``serve`` after ``--host``/``--port``; its output is appended to ``log_path``.
    The environment is this process's without ``HICACHE_ADMIN_API_KEY`` (a key is given by flag)."""

    def __init__(self, flags: list[str], log_path: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 env: dict | None = None, ready_timeout: float = 90.0) -> None:
        self.host, self.port, self.flags, self.log_path = host, port or free_port(), list(flags), Path(log_path)
        self.url = f"http://{host}:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if k != "HICACHE_ADMIN_API_KEY"}
        self.env.update({"PYTHONPATH": str(REPO), **(env or {})})
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RuntimeProcess":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cache_runtime", "serve", "--host", self.host, "--port", str(self.port),
                 *self.flags], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        why = wait_ready(self.proc, lambda: httpx.get(f"{self.url}/health", timeout=1, trust_env=False).status_code
                         == 200, self.ready_timeout, 0.2)
        if why is not None:
            self.stop()
            raise RuntimeError(f"runtime {why} (/health):\n{self.log()}")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, timeout: float = 120, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, trust_env=False, **kw)

    def log(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def peak_rss_bytes(self) -> int | None:
        return peak_rss_bytes(self.pid)

    def kill(self) -> None:
        """SIGKILL: what an OOM kill or a node failure does to the process."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc, 20, group=True)


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample over the series whose labels contain ``labels``."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if (series == name or series.startswith(name + "{")) and labels in series:
            total += float(value)
    return total


def load(client: httpx.Client) -> dict[str, int]:
    """Requests running and queued, from SGLang's gauges (what the operator waits on to drain)."""
    return {"in_flight": int(metric(client, "sglang:num_running_reqs")),
            "queued": int(metric(client, "sglang:num_queue_reqs"))}


def start_runtime(flags: list[str], log_path: Path, env: dict | None = None) -> RuntimeProcess:
    """A runtime on a free loopback port, healthy (a real checkpoint loads in seconds, but 2 busy
    cores stretch that: up to 300 s)."""
    return RuntimeProcess(flags, log_path, env=env, ready_timeout=300).start()


async def stream_generate(client: httpx.AsyncClient, body: dict) -> AsyncIterator[tuple[float, dict]]:
    """The events of a streamed ``/generate`` (``body`` with ``"stream": True``), each with its arrival time."""
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"])
            yield time.perf_counter(), ev
