"""Reading a cluster as the tests and benchmarks do: polling for a condition, kubectl's JSON, an
object's status conditions, and a namespace name per test."""
from __future__ import annotations

import json
import time


def wait_for(cond, timeout: float = 60, what: str = "condition", interval: float = 0.3):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def kget(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def condition(obj: dict, ctype: str) -> str | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c["status"]
    return None


def namespace_for(prefix: str, test_name: str) -> str:
    """A namespace name per test (a DNS label), distinct for every parametrized case."""
    import hashlib
    import re

    slug = re.sub(r"[^a-z0-9-]", "-", test_name.lower())
    return f"{prefix}-{slug[5:30].strip('-')}-{hashlib.sha1(slug.encode()).hexdigest()[:6]}"
