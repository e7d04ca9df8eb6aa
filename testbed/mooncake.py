"""A real ``mooncake_master`` on free loopback ports, for tests that need a Mooncake store.

Usage in a test module::

    from testbed.mooncake import mooncake_env, mooncake_master  # noqa: F401  (pytest fixtures)

``mooncake_master`` is module-scoped (one master per test module); tests that kill or restart a
master build their own with :func:`start_master`. Gotchas handled here:
all three master ports are passed explicitly (the HTTP metadata and metrics servers otherwise bind
8080/9003 on all interfaces), readiness is the RPC port accepting *and* our process still being
alive (so another process that happens to hold the port is not mistaken for ours), the client env
(``MC_TCP_BIND_ADDRESS`` etc.) is exported, and the master is killed by its pid.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from testbed.procs import free_port, stop_process, wait_ready  # noqa: F401  (free_port: for the tests)

CLIENT_ENV = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",  # else the transfer engine advertises the eth0 address
    "MC_LOG_LEVEL": "ERROR",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",  # a failed setup takes ~4.5 s instead of ~90 s
}
READY_TIMEOUT_S = 15.0


def master_binary() -> Path | None:
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    return path if path.exists() else None


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@dataclass
class MooncakeMaster:
    rpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    lease_ttl_ms: int = 200  # short leases so tests can remove objects they just read
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="mooncake_master_", suffix=".log")[1]))
    proc: subprocess.Popen | None = None
    etcd: str | None = None  # HA: host:port of etcd, where the masters elect a leader
    cluster_id: str = "mooncake_cluster"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def health(self) -> dict:
        """The master's /health: role (leader, standby), ha_state, service_ready."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=2) as resp:
            return json.loads(resp.read())

    def _answers(self) -> bool:
        """Ready to be used: its RPC port accepts (an HA standby has none: its /health answers)."""
        if self.etcd is None:
            return _port_open(self.rpc_port)
        try:
            return bool(self.health())
        except OSError:
            return False

    def start(self) -> "MooncakeMaster":
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake is not installed (scripts/install-mooncake.sh)")
        if _port_open(self.rpc_port):
            raise RuntimeError(f"port {self.rpc_port} is already taken")
        ha = [] if self.etcd is None else ["--enable_ha=true", f"--etcd_endpoints={self.etcd}",
                                           f"--cluster_id={self.cluster_id}"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), "--enable_http_metadata_server=false", f"--http_metadata_server_port={self.http_port}",
                 "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}", *ha],
                stdout=log, stderr=subprocess.STDOUT)
        why = wait_ready(self.proc, self._answers, READY_TIMEOUT_S, 0.05)
        if why is not None:
            self.kill()
            raise RuntimeError(f"mooncake_master {why}: {self.log_tail()}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"mooncake_master died after binding: {self.log_tail()}")
        return self

    def kill(self) -> None:
        """SIGKILL by pid and reap: the abrupt death a crashed master pod looks like."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        stop_process(self.proc, 5)

    def segments(self) -> list[str]:
        """Segment names the master knows (``<local_hostname>:<port>`` per client), from its admin HTTP API."""
        url = f"http://127.0.0.1:{self.metrics_port}/get_all_segments"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return [line.strip() for line in resp.read().decode().splitlines() if line.strip()]

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def extra_config(self, **overrides) -> dict:
        """Backend extra_config pointing at this master, sized for tests."""
        cfg = {"master_server_address": self.address, "local_hostname": "127.0.0.1",
               "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
               "global_segment_size": 64 * 1024**2, "local_buffer_size": 16 * 1024**2,
               "master_metrics_port": self.metrics_port, "master_wait_s": 5.0, "retry_interval_s": 0.2}
        cfg.update(overrides)
        return cfg

    def config_json(self, **overrides) -> str:
        return json.dumps(self.extra_config(**overrides))


@pytest.fixture(scope="session")
def mooncake_env():
    """Export the Mooncake client env for the whole session (restored afterwards)."""
    if master_binary() is None:
        pytest.skip("mooncake not installed: run scripts/install-mooncake.sh")
    saved = {k: os.environ.get(k) for k in CLIENT_ENV}
    os.environ.update(CLIENT_ENV)
    yield dict(CLIENT_ENV)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def mooncake_master(mooncake_env):
    master = MooncakeMaster().start()
    yield master
    master.stop()
    master.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def mooncake_raw(mooncake_master):
    """A plain Mooncake client of the module's master: the store as SGLang, another pod or damage sees it."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_master.address) == 0
    yield client
    client.close()


def start_master(**kwargs) -> MooncakeMaster:
    return MooncakeMaster(**kwargs).start()
