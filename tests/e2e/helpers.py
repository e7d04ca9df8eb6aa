"""Shared helpers for e2e tests: polling, kubectl JSON, and the operator as a real process."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _die_with_parent() -> None:
    """Linux PR_SET_PDEATHSIG: an operator whose test or benchmark was killed must not live on,
    retrying a vanished API server and eating CPU (it runs in its own session, so a group kill
    does not reach it)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


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


class OperatorProcess:
    """`python -m hicache_operator` as a child process, as it would run in its pod."""

    def __init__(self, cluster, workdir: Path, *, reconcile_interval: float = 2, extra_env: dict | None = None,
                 args: tuple[str, ...] = ("--all-namespaces",), metrics_port: int = 0):
        self.cluster = cluster
        self.log = Path(workdir) / "operator.log"
        self.env = {**cluster.env(), "HICACHE_RECONCILE_INTERVAL": str(reconcile_interval),
                    "PYTHONPATH": str(REPO), **(extra_env or {})}
        self.args = args
        self.metrics_port = metrics_port  # 0: none; else served on 127.0.0.1
        self.proc: subprocess.Popen | None = None

    def start(self) -> "OperatorProcess":
        offset = self.log.stat().st_size if self.log.exists() else 0
        f = open(self.log, "ab")
        metrics = ["--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1"]
        self.proc = subprocess.Popen([sys.executable, "-m", "hicache_operator", *self.args, *metrics],
                                     env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=REPO, preexec_fn=_die_with_parent)
        f.close()
        wait_for(lambda: "Initial authentication has finished" in self.log.read_text(errors="replace")[offset:]
                 or not self.alive(), timeout=60, what="operator started")
        assert self.alive(), self.tail()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye, as a node failure or OOM kill would do."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then the log's verdict: an error the operator handles (a refused spec, a lost API
        server, a failed reconcile) is one line; a traceback in the log means a bug surfaced."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        if "Traceback" in text:
            at = text.index("Traceback")
            raise AssertionError(f"traceback in the operator log {self.log}:\n{text[max(0, at - 300):at + 3000]}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_operator(cluster, workdir: Path, *, reconcile_interval: float = 2) -> OperatorProcess:
    """The CRD applied (server-side) and established, then the operator started against it."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    cluster.wait_established("hicachedeployments.hicache.dev")
    return OperatorProcess(cluster, workdir, reconcile_interval=reconcile_interval).start()


def skip_without_pod_network_or_mooncake(cluster) -> None:
    """Process-backed pods need the run's own network namespace; L3 tests need Mooncake."""
    import pytest

    from tests.support.mooncake import master_binary

    if not cluster.network.endpoints_work:
        pytest.skip("needs a private network namespace (run as root)")
    if master_binary() is None:
        pytest.skip("mooncake is not installed (scripts/install-mooncake.sh)")


def namespace_for(prefix: str, test_name: str) -> str:
    """A namespace name per test (a DNS label), distinct for every parametrized case."""
    import hashlib
    import re

    slug = re.sub(r"[^a-z0-9-]", "-", test_name.lower())
    return f"{prefix}-{slug[5:30].strip('-')}-{hashlib.sha1(slug.encode()).hexdigest()[:6]}"


def l3_hit_across_pods(cluster, namespace: str, name: str) -> int:
    """A prompt served by one pod is found in L3 by another (cache hits resume from L3): the
    first request to pod B for a prompt only pod A has served reports storage-tier hits.

    Only that first request counts, and every attempt's prompt differs from its first byte: a
    B that asked before A's write landed computes the prompt itself, so any later hit on B
    could be its own pages. Use it with the prefetch policies that wait for the prefetch
    (wait_complete, timeout); with best_effort an idle pod starts the request at once and ends
    the prefetch before a page has arrived, as SGLang does, so a hit there is down to timing."""
    import random

    import httpx

    pods = kget(cluster, "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name},"
                "app.kubernetes.io/name=hicache")["items"]
    ps = sorted(pods, key=lambda p: p["metadata"]["name"])
    a, b = ps[0]["status"]["podIP"], ps[1]["status"]["podIP"]

    def attempt() -> int:
        prompt = f"{random.random()} shared by two pods " + "lorem ipsum dolor sit amet " * 30
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert httpx.post(f"http://{a}:30000/generate", json=body, timeout=60).status_code == 200
        time.sleep(2.0)  # let A's write-through to L3 land (0.5 s was sometimes short on a loaded machine)
        r = httpx.post(f"http://{b}:30000/generate", json=body, timeout=60)
        return (r.json()["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)
    return wait_for(attempt, timeout=60, interval=0.5, what="L3 hit on another pod")
