"""Whether a store's endpoints (a Mooncake master, or the etcd members it is found through) accept
TCP connections: a cheap probe made before calls that would otherwise block for seconds on a
store that is gone."""

from __future__ import annotations

import socket
import time


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def any_open(endpoints: list[tuple[str, int]], timeout: float = 0.5) -> bool:
    return any(port_open(host, port, timeout=timeout) for host, port in endpoints)


def wait_for_port(endpoints: list[tuple[str, int]], deadline_s: float) -> bool:
    """Whether one of ``endpoints`` (the master, or the etcd members it is found through) accepts
    a connection within ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        if any_open(endpoints, timeout=min(0.5, max(0.05, end - time.monotonic()))):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)
