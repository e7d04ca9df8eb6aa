"""sglang-router (the binary from its wheel) on a loopback port in front of given workers, one
launcher for the tests and the benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from testbed.procs import free_port, stop_process, wait_ready


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

        def ready() -> bool:
            listed = httpx.get(self.url + "/workers", headers=self.headers, timeout=2, trust_env=False).json()
            return {w["url"] for w in listed.get("workers", [])} == set(self.workers) and httpx.get(
                self.url + "/readiness", headers=self.headers, timeout=2, trust_env=False).status_code == 200

        why = wait_ready(self.proc, ready, timeout, 0.5)
        if why is not None:
            self.stop()
            raise RuntimeError(f"sglang-router {why} with {len(self.workers)} workers; see {self.log.name}")
        return self

    def stop(self) -> None:
        stop_process(self.proc, 15)
        self.log.close()
