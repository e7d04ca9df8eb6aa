"""The operator as a real process (`python -m hicache_operator`), as it would run in its pod, for the
e2e tests, the benchmarks and the demo."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from testbed import REPO
from testbed.kube import wait_for


def _die_with_parent() -> None:
    """Linux PR_SET_PDEATHSIG: an operator whose test or benchmark was killed must not live on,
    retrying a vanished API server and eating CPU (it runs in its own session, so a group kill
    does not reach it)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


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
