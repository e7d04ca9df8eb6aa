"""What the tests' launchers of child processes share: a free loopback port, waiting until a
child is ready (or has died), and stopping it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import Callable

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float, interval: float) -> str | None:
    """Polls ``ready()`` until it holds (None), the child exits or ``timeout`` passes (why not, in
    words). ``ready`` raising a connection or decoding error counts as not ready yet."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            if ready():
                return None
        except (OSError, ValueError, httpx.HTTPError):
            pass
        if time.monotonic() > deadline:
            return f"not ready in {timeout:g} s"
        time.sleep(interval)


def stop_process(proc: subprocess.Popen | None, timeout: float, group: bool = False) -> None:
    """SIGTERM (to its process group with ``group``), SIGKILL after ``timeout``; reaped."""
    if proc is None or proc.poll() is not None:
        return
    send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    send(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()
