"""A real Kubernetes control plane on this machine, without Docker.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as child
processes; KWOK plays the kubelet for simulated GPU nodes; `podrunner` plays the
kubelet for pods that opt in with the `hicache.dev/process-backed` annotation and runs
their container command as a real local process. Every child is started in its own
process group, recorded in `pids.json`, and stopped by PID on teardown.

Pod addresses: inside a private network namespace (see `netns.py`) pods get
10.244.0.0/16 addresses that live on that namespace's `lo`, so EndpointSlices accept
them. Outside one (no root), pods fall back to 127.1.0.0/16 and Services get no
endpoints; tests that need endpoints skip in that mode.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from . import netns, pki as pkimod
from .nodes import GPU_RESOURCE, LOOPBACK_NET, PRIVATE_NET, RDMA_RESOURCE, Network, NodeSpec, default_nodes
from .podspec import PROCESS_BACKED_ANNOTATION, image_volume_dir

REPO = Path(__file__).resolve().parents[1]  # pods run the checkout's code (PYTHONPATH)
HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "tools" / "build.sh"
SGLANG_SHIM = HERE / "sglang_shim"  # `python -m sglang.launch_server` in pods: our runtime in SGLang mode
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "podrunner")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_binaries() -> Path:
    """Build whatever is missing (a no-op when cached) and return the bin dir."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


class ClusterError(RuntimeError):
    pass


NODE_APPLY_CHUNK = 250
NODE_LEASE_SECONDS = 600
FAVOURED_NICE = -10  # about 9x the CPU weight of a group at nice 0


def autogroup_nice(pid: int) -> int | None:
    """The nice value of the process's scheduling autogroup, or None when the kernel does not
    schedule it by autogroup (the file reads empty when the task sits in a non-root CPU cgroup,
    as in many containers)."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()  # "/autogroup-N nice K"
    except OSError:
        return None
    return int(fields[-1]) if fields else None


class LocalCluster:
    def __init__(self, workdir: Path, nodes: list[NodeSpec] | None = None,
                 bin_dir: Path | None = None, network: Network | None = None, profiling: bool = False,
                 favoured: tuple[str, ...] = ()):
        self.workdir = Path(workdir)
        self.profiling = profiling  # the API server serves /debug/pprof (benches that ask where its CPU goes)
        # Components whose CPU group gets nice FAVOURED_NICE: on a 2-core machine every process
        # competes for the same cores, where a real cluster gives its control plane nodes of its own.
        self.favoured = favoured
        self.favour_failures: dict[str, str] = {}
        self.nodes = nodes if nodes is not None else default_nodes()
        self.bin_dir = bin_dir
        self.network = network
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    # ---- paths -------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def logdir(self) -> Path:
        return self.workdir / "logs"

    @property
    def images_dir(self) -> Path:
        """Image volumes' files (see ``podspec.image_volume_dir``)."""
        return self.workdir / "images"

    def image_volume(self, reference: str) -> Path:
        """The directory a process-backed pod's image volume of ``reference`` mounts."""
        return image_volume_dir(self.images_dir, reference)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def env(self) -> dict[str, str]:
        """Environment for kubectl, helm, kopf and tests: our binaries first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["HELM_CACHE_HOME"] = str(self.workdir / "helm" / "cache")
        env["HELM_CONFIG_HOME"] = str(self.workdir / "helm" / "config")
        env["HELM_DATA_HOME"] = str(self.workdir / "helm" / "data")
        return env

    # ---- lifecycle -----------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> "LocalCluster":
        t0 = time.monotonic()
        if self.bin_dir is None:
            self.bin_dir = ensure_binaries()
        if self.network is None:
            self.network = PRIVATE_NET if netns.is_private_netns() else LOOPBACK_NET
        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.logdir.mkdir(parents=True)
        for name in ("etcd", "etcd_peer", "apiserver", "scheduler"):
            self.ports[name] = free_port()
        self.pki = pkimod.generate(self.workdir / "pki", ["localhost", "127.0.0.1", "10.96.0.1",
                                                          "kubernetes", "kubernetes.default.svc"])
        pkimod.write_kubeconfig(self.kubeconfig, self.pki, self.server)
        try:
            self._start_etcd()
            self._start_apiserver()
            self._wait(lambda: self._get("/readyz") == 200, timeout, "kube-apiserver /readyz")
            self._start_controller_manager()
            self._start_scheduler()
            self._start_kwok()
            self._start_podrunner()
            self._write_state()
            self._create_nodes()
            self._wait(self._nodes_ready, timeout, "nodes Ready and untainted")
            self._wait(self._default_sa_exists, timeout, "default ServiceAccount")
        except BaseException:
            self.print_logs()
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        stop_pids({name: p.pid for name, p in self.procs.items()})
        self.procs.clear()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- components ----------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        log = open(self.logdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env=env or self.env(), cwd=self.workdir)
        log.close()
        if name in self.favoured:
            self._favour(name, self.procs[name].pid)

    def _favour(self, name: str, pid: int) -> None:
        """Raise the CPU weight of the component's scheduling group (its own session's autogroup:
        nice values of single processes do not count across autogroups). Needs CAP_SYS_NICE and
        autogroups; without them the run goes on unfavoured and says so."""
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(FAVOURED_NICE))
        except OSError as e:
            self.favour_failures[name] = str(e)
            return
        if autogroup_nice(pid) != FAVOURED_NICE:
            self.favour_failures[name] = ("not scheduled by an autogroup (a CPU cgroup of its own, "
                                          "e.g. in a container): the nice value has no effect")

    def _bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    def _start_etcd(self) -> None:
        p, pp = self.ports["etcd"], self.ports["etcd_peer"]
        self._spawn("etcd", [
            self._bin("etcd"), f"--data-dir={self.workdir / 'etcd'}", "--name=local",
            f"--listen-client-urls=http://127.0.0.1:{p}", f"--advertise-client-urls=http://127.0.0.1:{p}",
            f"--listen-peer-urls=http://127.0.0.1:{pp}", f"--initial-advertise-peer-urls=http://127.0.0.1:{pp}",
            f"--initial-cluster=local=http://127.0.0.1:{pp}", "--unsafe-no-fsync=true",
            "--quota-backend-bytes=8589934592", "--log-level=warn"])

    def _start_apiserver(self) -> None:
        k = self.pki
        self._spawn("kube-apiserver", [
            self._bin("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['apiserver']}",
            f"--cert-dir={self.workdir / 'pki'}",
            f"--tls-cert-file={k.serving_crt}", f"--tls-private-key-file={k.serving_key}",
            f"--client-ca-file={k.ca_crt}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={k.sa_pub}",
            f"--service-account-signing-key-file={k.sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            "--enable-priority-and-fairness=false", f"--profiling={str(self.profiling).lower()}",
            "--endpoint-reconciler-type=none",
            # image volumes (volumes[].image): beta and off by default in 1.34, on from 1.35
            "--feature-gates=ImageVolume=true",
            "--max-requests-inflight=2000", "--max-mutating-requests-inflight=1000",
            "--v=1"])

    def _start_controller_manager(self) -> None:
        self._spawn("kube-controller-manager", [
            self._bin("kube-controller-manager"), f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}", f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--controllers=*", "--use-service-account-credentials=false",
            f"--service-account-private-key-file={self.pki.sa_key}", f"--root-ca-file={self.pki.ca_crt}",
            "--bind-address=127.0.0.1", "--secure-port=0",
            "--kube-api-qps=500", "--kube-api-burst=1000",
            "--concurrent-statefulset-syncs=20", "--concurrent-deployment-syncs=20",
            "--concurrent-replicaset-syncs=20", "--concurrent-gc-syncs=40",
            # Simulated nodes never fail, and at 2000 nodes short leases were most of the API
            # server's load (a renewal per node every 10 s): long leases, matching grace period.
            f"--node-monitor-grace-period={NODE_LEASE_SECONDS * 3 // 2}s", "--v=1"])

    def _start_scheduler(self) -> None:
        cfg = self.workdir / "scheduler.yaml"
        cfg.write_text(yaml.safe_dump({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(self.kubeconfig), "qps": 500, "burst": 1000},
            "leaderElection": {"leaderElect": False}}))
        self._spawn("kube-scheduler", [
            self._bin("kube-scheduler"), f"--config={cfg}", "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['scheduler']}", f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}", "--v=1"])

    def _start_kwok(self) -> None:
        stages = self._write_kwok_stages()
        argv = [self._bin("kwok"), f"--kubeconfig={self.kubeconfig}", "--manage-all-nodes=true",
                f"--cidr={self.network.kwok_cidr}", f"--node-ip={self.node_ip(0)}",
                f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}", "--server-address=127.0.0.1:0"]
        for s in stages:
            argv += ["-c", str(s)]
        self._spawn("kwok", argv)

    def _write_kwok_stages(self) -> list[Path]:
        """KWOK's own fast stages, with pod stages told to leave process-backed pods alone.

        Those pods are podrunner's: it assigns their IPs, runs their probes and decides
        when they are Ready, just as a kubelet would.
        """
        out_dir = self.workdir / "kwok-stages"
        out_dir.mkdir()
        skip = {"key": f'.metadata.annotations["{PROCESS_BACKED_ANNOTATION}"]', "operator": "DoesNotExist"}
        paths = []
        for src in sorted((self.bin_dir / "stages").glob("*.yaml")):
            stage = yaml.safe_load(src.read_text())
            if stage["spec"]["resourceRef"]["kind"] == "Pod":
                stage["spec"]["selector"].setdefault("matchExpressions", []).append(skip)
            dst = out_dir / src.name
            dst.write_text(yaml.safe_dump(stage, sort_keys=False))
            paths.append(dst)
        return paths

    def _start_podrunner(self) -> None:
        self._spawn("podrunner", [
            sys.executable, "-m", "localcluster.podrunner", f"--kubeconfig={self.kubeconfig}",
            f"--workdir={self.workdir / 'pods'}", f"--cidr={self.network.runner_cidr}",
            f"--apiserver-port={self.ports['apiserver']}", f"--images-dir={self.images_dir}"],
            # the sglang shim: `python -m sglang.launch_server` runs our runtime in SGLang mode
            env={**self.env(), "PYTHONPATH": f"{REPO}{os.pathsep}{SGLANG_SHIM}"})

    def _write_state(self) -> None:
        (self.workdir / "cluster.json").write_text(json.dumps({
            "pids": {n: p.pid for n, p in self.procs.items()}, "ports": self.ports,
            "kubeconfig": str(self.kubeconfig), "bin_dir": str(self.bin_dir),
            "network": self.network.__dict__}, indent=2))

    # ---- nodes -----------------------------------------------------------------------
    def node_manifest(self, i: int, spec: NodeSpec) -> dict:
        res = {"cpu": spec.cpu, "memory": spec.memory, "pods": "110"}
        if spec.gpus:
            res[GPU_RESOURCE] = str(spec.gpus)
        if spec.rdma:
            res[RDMA_RESOURCE] = str(spec.rdma)
        labels = {"type": "kwok", "kubernetes.io/hostname": spec.name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", **spec.labels}
        ip = self.node_ip(i) if self.network.endpoints_work else "127.0.0.1"
        return {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": spec.name, "labels": labels,
                             "annotations": {"kwok.x-k8s.io/node": "fake"}},
                "spec": {"taints": spec.taints} if spec.taints else {},
                "status": {"capacity": res, "allocatable": res,
                           "addresses": [{"type": "InternalIP", "address": ip},
                                         {"type": "Hostname", "address": spec.name}]}}

    def node_ip(self, i: int) -> str:
        return str(ipaddress.ip_network(self.network.node_net)[i + 1])

    def _create_nodes(self) -> None:
        docs = [self.node_manifest(i, n) for i, n in enumerate(self.nodes)]
        for d in docs:
            ip = d["status"]["addresses"][0]["address"]
            if self.network.endpoints_work:
                netns.add_address(ip)  # host-network pods and node-local hostnames bind here
        for i in range(0, len(docs), NODE_APPLY_CHUNK):  # chunks: thousands of nodes outlast one call's timeout
            self.kubectl_apply(docs[i:i + NODE_APPLY_CHUNK])

    def add_nodes(self, nodes: list[NodeSpec]) -> None:
        start = len(self.nodes)
        self.nodes.extend(nodes)
        docs = [self.node_manifest(start + i, n) for i, n in enumerate(nodes)]
        self.kubectl_apply(docs)

    def _nodes_ready(self) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        if out.returncode:
            return False
        items = json.loads(out.stdout)["items"]
        if len(items) < len(self.nodes):
            return False
        for n in items:
            ready = any(c["type"] == "Ready" and c["status"] == "True"
                        for c in n.get("status", {}).get("conditions", []))
            tainted = any(t["key"].startswith("node.kubernetes.io/") for t in n["spec"].get("taints", []))
            if not ready or tainted:
                return False
        return True

    def _default_sa_exists(self) -> bool:
        return self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0

    # ---- helpers ------------------------------------------------------------------------
    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Until the CRD is Established. ``kubectl wait --for=condition=Established`` fails at
        once, instead of waiting, while a just-created CRD has no status.conditions yet
        ("accessor error: <nil>"), which made test setups flaky."""
        deadline = time.monotonic() + timeout
        query = 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
        while True:
            res = self.kubectl("get", f"crd/{crd}", "-o", query, check=False)
            if res.returncode == 0 and res.stdout.strip() == "True":
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"CRD {crd} not Established after {timeout:.0f}s: {res.stdout or res.stderr}")
            time.sleep(0.2)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        res = subprocess.run([self._bin("kubectl"), *args], env=self.env(), text=True, input=input,
                             capture_output=True, timeout=timeout)
        if check and res.returncode:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def kubectl_apply(self, docs: list[dict], *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.kubectl("apply", "-f", "-", *extra, input=yaml.safe_dump_all(docs), check=check)

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        res = subprocess.run([self._bin("helm"), *args], env=self.env(), text=True,
                             capture_output=True, timeout=timeout)
        if check and res.returncode:
            raise ClusterError(f"helm {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def api_client(self):
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def _get(self, path: str) -> int:
        import ssl
        import urllib.request
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_crt))
        ctx.load_cert_chain(str(self.pki.admin_crt), str(self.pki.admin_key))
        try:
            with urllib.request.urlopen(self.server + path, context=ctx, timeout=2) as r:
                return r.status
        except Exception:
            return 0

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise ClusterError(f"{name} exited with {p.returncode} while waiting for {what}")
            if cond():
                return
            time.sleep(0.25)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")

    def print_logs(self, lines: int = 40, file=sys.stderr) -> None:
        for log in sorted(self.logdir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"----- {log.name} (last {len(tail)} lines) -----", file=file)
            print("\n".join(tail), file=file)


def stop_pids(pids: dict[str, int], grace: float = 5.0) -> None:
    """SIGTERM each child's process group (podrunner first, etcd last), then SIGKILL."""
    order = sorted(pids, key=lambda n: COMPONENTS.index(n) if n in COMPONENTS else -1, reverse=True)
    for name in order:
        _signal_group(pids[name], signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pids[name]):
            time.sleep(0.05)
        _signal_group(pids[name], signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
