"""A minimal kubelet for simulated nodes: runs opted-in pods as real local processes.

Pods annotated `hicache.dev/process-backed: "true"` and bound to a node are started
here instead of by KWOK: the init containers run first, in order, each to a successful exit
(a failed one is restarted with backoff, as restartPolicy Always has it, and reported in
initContainerStatuses), then the first container's command and args run with the pod's
environment (downward-API fields, Secret and ConfigMap references and `$(VAR)`
expansion resolved as a kubelet would), at an address from `--cidr` added to the
private namespace's `lo`. Probes (httpGet) follow kubelet rules: the startupProbe gates the others, the
readinessProbe decides ContainersReady, and
Ready is ContainersReady AND every readinessGate condition, so EndpointSlices show
ready/not-ready exactly as they would on a real node. A livenessProbe failure or an
exit restarts the process (restartPolicy Always), counting restarts. Deleting the pod
stops the process (SIGTERM, grace period, SIGKILL) and then removes the pod object.

CPU: each pod process gets a process group of its own (to stop it with its children), but no
session of its own. Linux schedules each session as one group (autogroup): with a session
per pod, 64 pods had 64 times the CPU share of etcd or the API server, which on a real
cluster run on machines of their own, and a kubelet puts all pods under one `kubepods`
cgroup. During a 64-pod backend swap that made every etcd request take ~50 ms (10 ms with
the pods in one group) and every API call ~0.15 s.

Service names: there is no cluster DNS or kube-proxy, so a pod's process gets an /etc/hosts
of its own (bind-mounted in a mount namespace of its own, as a kubelet manages a pod's
/etc/hosts) that maps `<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc` and `<svc>.<ns>.svc.cluster.local`
of every Service in its namespace that has a ready endpoint when the process starts to that
endpoint's address (a ClusterIP would lead to a ready endpoint too). Services that get their first
ready endpoint later are not in it until the process restarts; forked (zygote) processes get none.

Volumes: configMap, secret, emptyDir and the service-account token are materialised
under the pod's own directory, hostPath is the machine's own directory, a persistentVolumeClaim
is the directory of the hostPath (or local) PersistentVolume it is bound to, an image volume is
`--images-dir`/<the reference, URL-quoted> (`image_volume_dir`: a test puts the image's files
there, as a registry would hold them), and mount paths that appear in args or env values are
rewritten to them, since pods share this machine's filesystem.
The runtime image's checkpoint directory (/opt/hicache/models) is this machine's model cache
(HICACHE_MODELS_DIR, else ~/.cache/hicache-operator/models, filled by scripts/setup.sh), as
the local code stands in for the image's. The token volume becomes
a kubeconfig (env KUBECONFIG) for the pod's own ServiceAccount, so in-cluster clients
such as the operator run with exactly the RBAC the chart gives them.

With HICACHE_PODRUNNER_ZYGOTE=1 (bench/swap.py sets it for its 64-pod fleets), pods whose
command is `python -m cache_runtime ...` are forked from a zygote: a process that
has already imported torch (and nothing of the pod) forks, and the child becomes the container
process (own pid, process group, environment, working directory, log), running the module as
`python -m` would. Importing torch leaves ~270 MB of initialised state per process that is
never written again; forked children share it copy-on-write, so a 64-pod fleet fits in the
memory that 24 separately started runtimes took. Any other command is started with exec. Not
yet the default: the e2e suite has not been run with it enough to trust it there.

Run: python -m localcluster.podrunner --kubeconfig K --workdir D --cidr 10.244.128.0/17 --images-dir I
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from .podspec import PROCESS_BACKED_ANNOTATION
from .podworker import PodWorker
from .zygote import ZYGOTE_ENV, ZYGOTE_MODULES, Zygote, python_settings, zygote_main

log = logging.getLogger("podrunner")


class IpPool:
    def __init__(self, cidr: str):
        self.hosts = ipaddress.ip_network(cidr).hosts()
        self.free: list[str] = []
        self.lock = threading.Lock()

    def take(self) -> str:
        with self.lock:
            return self.free.pop() if self.free else str(next(self.hosts))

    def give(self, ip: str) -> None:
        with self.lock:
            self.free.append(ip)


class Runner:
    def __init__(self, kubeconfig: str, workdir: Path, cidr: str, apiserver_port: int, images_dir: Path):
        api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(api)
        self.server = api.configuration.host
        self.ca_file = api.configuration.ssl_ca_cert
        self.workdir = workdir
        self.images_dir = images_dir
        self.pool = IpPool(cidr)
        self.apiserver_port = apiserver_port
        self.workers: dict[str, PodWorker] = {}
        self.node_ips: dict[str, str] = {}
        self.base_env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG",)}
        self.zygotes: dict[str, Zygote] = {}
        self.zygote_lock = threading.Lock()

    def zygote_for(self, argv: list[str], env: dict[str, str]) -> "Zygote | None":
        """The zygote that can stand in for exec'ing ``argv``: `python -m M ...` with M in
        ZYGOTE_MODULES, `python` being this interpreter, and the interpreter's own settings
        (PYTHON* variables) the same as the zygote's, since they took effect when it started."""
        if os.environ.get(ZYGOTE_ENV) != "1":
            return None
        if len(argv) < 3 or argv[1] != "-m" or argv[2] not in ZYGOTE_MODULES:
            return None
        exe = shutil.which(argv[0], path=env.get("PATH"))
        if exe is None or os.path.dirname(os.path.abspath(exe)) != os.path.dirname(os.path.abspath(sys.executable)) \
                or os.path.realpath(exe) != os.path.realpath(sys.executable):
            return None  # another interpreter or virtual environment
        if python_settings(env) != python_settings(self.base_env):
            return None
        with self.zygote_lock:
            z = self.zygotes.get(argv[2])
            if z is None or not z.alive():
                z = self.zygotes[argv[2]] = Zygote(ZYGOTE_MODULES[argv[2]], self.base_env)
            return z

    def node_ip(self, pod: dict) -> str:
        node = pod["spec"]["nodeName"]
        if node not in self.node_ips:
            n = self.core.read_node(node)
            self.node_ips[node] = next(a.address for a in n.status.addresses if a.type == "InternalIP")
        return self.node_ips[node]

    def handle(self, kind: str, pod: dict) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        if (meta.get("annotations") or {}).get(PROCESS_BACKED_ANNOTATION) != "true" or not pod["spec"].get("nodeName"):
            return
        w = self.workers.get(uid)
        if kind == "DELETED" or meta.get("deletionTimestamp"):
            if w:
                w.pod = pod
                w.stop_event.set()
                w.wake.set()
                self.workers.pop(uid, None)
            elif kind != "DELETED":
                # deleted before we started it (or by a previous runner): finish the deletion
                try:
                    self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=client.V1DeleteOptions(
                        grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)))
                except ApiException:
                    pass
            return
        if w is None:
            w = self.workers[uid] = PodWorker(self, pod)
            w.start()
        else:
            # A readiness-gate change must reach Ready at once, as on a kubelet; the worker
            # patches (in parallel with the other pods' workers, not one by one in this thread).
            w.pod = pod
            w.wake.set()

    def run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        rv = None
        while True:
            try:
                if rv is None:
                    lst = self.core.list_pod_for_all_namespaces()
                    rv = lst.metadata.resource_version
                    for p in lst.items:
                        self.handle("ADDED", self.core.api_client.sanitize_for_serialization(p))
                # deserialize=False: plain dicts; a V1Pod per event of every pod cost this
                # process (the kubelet of every node) CPU it needs for status patches
                for ev in watch.Watch().stream(self.core.list_pod_for_all_namespaces, resource_version=rv,
                                               timeout_seconds=60, allow_watch_bookmarks=True, deserialize=False):
                    obj = ev["object"]
                    rv = obj["metadata"].get("resourceVersion", rv)
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.handle(ev["type"], obj)
            except ApiException as e:
                if e.status == 410:
                    rv = None
                else:
                    log.warning("watch error: %s", e.reason)
                    time.sleep(1)
            except Exception as e:  # apiserver restarts must not kill the kubelet
                log.warning("watch interrupted: %s", e)
                time.sleep(1)
                rv = None

    def shutdown(self, *_: object) -> None:
        for w in list(self.workers.values()):
            w.pod["spec"]["terminationGracePeriodSeconds"] = 2
            w.stop_event.set()
        for w in list(self.workers.values()):
            w.join(timeout=10)
        sys.exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zygote", metavar="MODULES", help="(internal) be a zygote preloading these modules")
    ap.add_argument("--kubeconfig")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--cidr")
    ap.add_argument("--apiserver-port", type=int)
    ap.add_argument("--images-dir", type=Path, help="image volumes: <dir>/<reference, URL-quoted>")
    args = ap.parse_args()
    if args.zygote is not None:
        zygote_main([m for m in args.zygote.split(",") if m])
        return
    if None in (args.kubeconfig, args.workdir, args.cidr, args.apiserver_port, args.images_dir):
        ap.error("--kubeconfig, --workdir, --cidr, --apiserver-port and --images-dir are required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    runner = Runner(args.kubeconfig, args.workdir, args.cidr, args.apiserver_port, args.images_dir)
    signal.signal(signal.SIGTERM, runner.shutdown)
    runner.run()


if __name__ == "__main__":
    main()
