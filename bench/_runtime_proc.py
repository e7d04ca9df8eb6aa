"""Starting and stopping a real ``python -m cache_runtime serve`` for the runtime benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runtime:
    def __init__(self, flags: list[str], log_path: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cache_runtime", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             *flags],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"runtime exited ({self.proc.returncode}); see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"runtime did not become healthy; see {log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
