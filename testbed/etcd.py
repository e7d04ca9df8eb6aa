"""A real etcd (the local control plane's binary) on free loopback ports, for Mooncake HA tests."""

from __future__ import annotations

import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from testbed.procs import free_port, stop_process, wait_ready

READY_TIMEOUT_S = 30.0


def etcd_binary() -> Path | None:
    """The etcd localcluster builds (a no-op when cached); None when it cannot be had."""
    from localcluster.cluster import ensure_binaries

    try:
        path = ensure_binaries() / "etcd"
    except (OSError, subprocess.SubprocessError):
        return None
    return path if path.is_file() else None


@dataclass
class Etcd:
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="etcd_")))
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, binary: Path) -> "Etcd":
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        with open(self.workdir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), "--data-dir", str(self.workdir / "data"), "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"default={peer}", "--unsafe-no-fsync"],
                stdout=log, stderr=subprocess.STDOUT)

        def ready() -> bool:
            with urllib.request.urlopen(f"{client}/health", timeout=1) as resp:
                return b'"health":"true"' in resp.read()

        why = wait_ready(self.proc, ready, READY_TIMEOUT_S, 0.1)
        if why is not None:
            self.stop()
            raise RuntimeError(f"etcd {why}: {(self.workdir / 'etcd.log').read_text()[-2000:]}")
        return self

    def stop(self) -> None:
        stop_process(self.proc, 10)
