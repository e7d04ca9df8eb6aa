"""sglang-router (the binary from its wheel) on a loopback port in front of given workers, one
launcher for the tests and the benchmarks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.runtime_proc import free_port


class Router:
    """sglang-router on a loopback port in front of ``workers``, until ``stop``."""

    def __init__(self, workers: list[str], policy: str, extra: list[str], log_path: Path,
                 api_key: str | None = None) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        self.cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                    str(self.port), "--policy", policy, "--worker-urls", *workers, "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(self.metrics_port), "--log-level", "warn", *extra]
        # a router started with --api-key gives it to its workers and wants it on its own API too
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if api_key:
            self.cmd += ["--api-key", api_key]
        self.log = open(log_path, "wb")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "Router":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}; see {self.log.name}")
            try:
                listed = httpx.get(self.url + "/workers", headers=self.headers, timeout=2, trust_env=False).json()
                if {w["url"] for w in listed.get("workers", [])} == set(self.workers) and \
                        httpx.get(self.url + "/readiness", headers=self.headers, timeout=2,
                                  trust_env=False).status_code == 200:
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"sglang-router not ready with {len(self.workers)} workers in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
