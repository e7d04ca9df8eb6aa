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

Run: python -m tests.cluster.podrunner --kubeconfig K --workdir D --cidr 10.244.128.0/17 --images-dir I
"""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import gc
import importlib
import ipaddress
import json
import logging
import os
import random
import re
import runpy
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from urllib.parse import quote

import httpx
import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from . import netns

ANNOTATION = "hicache.dev/process-backed"
TICK = 0.25  # seconds between looks at a pod's process
PROBE_CAP = 1.0  # readiness/startup probes run at least this often, whatever periodSeconds says
ZYGOTE_ENV = "HICACHE_PODRUNNER_ZYGOTE"  # "1": fork runtimes from a zygote (see the module docstring)
ZYGOTE_MODULES = {"cache_runtime": ("torch",)}  # module run with -m -> what its zygote imports first
log = logging.getLogger("podrunner")
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: unknown references stay literal, `$$` escapes."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, value)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def field_ref(pod: dict, path: str, host_ip: str, pod_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
              "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
              "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
              "status.hostIP": host_ip, "status.podIP": pod_ip, "status.podIPs": pod_ip,
              "status.hostIPs": host_ip}
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ValueError(f"unsupported fieldRef {path}")


IMAGE_MODELS = "/opt/hicache/models"  # where the runtime image keeps its embedded checkpoints


def local_models_dir() -> Path:
    return Path(os.environ.get("HICACHE_MODELS_DIR") or Path.home() / ".cache" / "hicache-operator" / "models")


def image_volume_dir(images_dir: Path, reference: str) -> Path:
    """Where an image volume's files are: one directory per image reference."""
    return Path(images_dir) / quote(reference, safe="")


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


class PodWorker(threading.Thread):
    """Owns one pod uid: its process, its probes and its status."""

    def __init__(self, runner: "Runner", pod: dict):
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.runner = runner
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.ns, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.dir = runner.workdir / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.ip = runner.pool.take() if not pod["spec"].get("hostNetwork") else runner.node_ip(pod)
        self.host_ip = runner.node_ip(pod)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.ready = False
        self.started_at = now()
        self.stop_event = threading.Event()
        self.wake = threading.Event()  # the pod object changed: look again now, not at the next tick
        self.last_status: tuple | None = None
        self.init_statuses: list[dict] = []  # initContainerStatuses, as a kubelet reports them
        self.initialized = not pod["spec"].get("initContainers")
        # condition -> (status, lastTransitionTime); not ready from before its container starts
        self.transitions: dict[str, tuple[bool, str]] = {"ContainersReady": (False, now()), "Ready": (False, now())}
        self.liveness_failures = 0
        self.readiness = {"ok": 0, "fail": 0}
        # One client for the pod's probes, a new connection each (as a kubelet probes): building
        # a client per probe (an SSL context each) cost twice the CPU of the probe itself
        self.prober = httpx.Client(verify=False, limits=httpx.Limits(max_keepalive_connections=0))

    # -- setup -----------------------------------------------------------------------
    def container(self) -> dict:
        return self.pod["spec"]["containers"][0]

    def _claim_dir(self, claim: str) -> Path:
        """The directory of the hostPath or local PersistentVolume the claim is bound to."""
        pvc = self.runner.core.read_namespaced_persistent_volume_claim(claim, self.ns)
        if not pvc.spec.volume_name or (pvc.status.phase or "") != "Bound":
            raise ValueError(f"PersistentVolumeClaim {claim} is not bound")
        pv = self.runner.core.read_persistent_volume(pvc.spec.volume_name)
        source = pv.spec.host_path or pv.spec.local
        if source is None:
            raise ValueError(f"PersistentVolume {pv.metadata.name} is neither hostPath nor local")
        return Path(source.path)

    def _node_dir(self, volume: dict) -> Path | None:
        """A volume that is a directory of the node itself (hostPath, a claim's volume, an image)."""
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        if "persistentVolumeClaim" in volume:
            return self._claim_dir(volume["persistentVolumeClaim"]["claimName"])
        if "image" in volume:
            found = image_volume_dir(self.runner.images_dir, volume["image"]["reference"])
            if not found.is_dir():
                raise ValueError(f"ErrImagePull: image {volume['image']['reference']} not found ({found})")
            return found
        return None

    def _mounts(self, container: dict) -> dict[str, Path]:
        vols = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        api = self.runner.core
        mounts: dict[str, Path] = {IMAGE_MODELS: local_models_dir()}
        for m in container.get("volumeMounts", []):
            v = vols.get(m["name"], {})
            host = self._node_dir(v)
            if host is not None:  # the node's own directory, as a kubelet mounts it
                mounts[m["mountPath"].rstrip("/")] = host / m["subPath"] if m.get("subPath") else host
                continue
            local = self.dir / "volumes" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in v:
                cm = api.read_namespaced_config_map(v["configMap"]["name"], self.ns)
                for k, val in (cm.data or {}).items():
                    (local / k).write_text(val)
            elif "secret" in v:
                sec = api.read_namespaced_secret(v["secret"]["secretName"], self.ns)
                for k, val in (sec.data or {}).items():
                    (local / k).write_bytes(base64.b64decode(val))
            elif "projected" in v and any("serviceAccountToken" in s for s in v["projected"]["sources"]):
                self._write_sa_kubeconfig(local)
            target = local / m["subPath"] if m.get("subPath") else local
            mounts[m["mountPath"].rstrip("/")] = target
        return mounts

    def _write_sa_kubeconfig(self, local: Path) -> None:
        sa = self.pod["spec"].get("serviceAccountName", "default")
        req = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=24 * 3600,
            bound_object_ref=client.V1BoundObjectReference(kind="Pod", name=self.name, uid=self.uid,
                                                           api_version="v1")))
        tok = self.runner.core.create_namespaced_service_account_token(sa, self.ns, req).status.token
        (local / "token").write_text(tok)
        (local / "namespace").write_text(self.ns)
        ca = Path(self.runner.ca_file)
        (local / "ca.crt").write_bytes(ca.read_bytes())
        kc = {"apiVersion": "v1", "kind": "Config", "current-context": "sa",
              "clusters": [{"name": "local", "cluster": {"server": self.runner.server,
                                                         "certificate-authority": str(local / "ca.crt")}}],
              "users": [{"name": sa, "user": {"tokenFile": str(local / "token")}}],
              "contexts": [{"name": "sa", "context": {"cluster": "local", "user": sa,
                                                      "namespace": self.ns}}]}
        (local / "kubeconfig").write_text(yaml.safe_dump(kc))
        self.sa_kubeconfig = local / "kubeconfig"

    def _env(self, c: dict, mounts: dict[str, Path]) -> dict[str, str]:
        env: dict[str, str] = {}
        api = self.runner.core
        for src in c.get("envFrom", []):
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                data = api.read_namespaced_config_map(src["configMapRef"]["name"], self.ns).data or {}
                env.update({prefix + k: v for k, v in data.items()})
            if "secretRef" in src:
                data = api.read_namespaced_secret(src["secretRef"]["name"], self.ns).data or {}
                env.update({prefix + k: base64.b64decode(v).decode() for k, v in data.items()})
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e.get("value") or "", env)
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "fieldRef" in vf:
                    env[e["name"]] = field_ref(self.pod, vf["fieldRef"]["fieldPath"], self.host_ip, self.ip)
                elif "secretKeyRef" in vf:
                    ref = vf["secretKeyRef"]
                    data = api.read_namespaced_secret(ref["name"], self.ns).data or {}
                    if ref["key"] in data:
                        env[e["name"]] = base64.b64decode(data[ref["key"]]).decode()
                elif "configMapKeyRef" in vf:
                    ref = vf["configMapKeyRef"]
                    data = api.read_namespaced_config_map(ref["name"], self.ns).data or {}
                    if ref["key"] in data:
                        env[e["name"]] = data[ref["key"]]
                elif "resourceFieldRef" in vf:
                    env[e["name"]] = "0"
            else:
                env[e["name"]] = ""
        return {k: self._rewrite(v, mounts) for k, v in env.items()}

    @staticmethod
    def _rewrite(value: str, mounts: dict[str, Path]) -> str:
        """One pass over all mount paths (longest first), so a rewritten path is never rewritten again."""
        if not mounts:
            return value
        alternatives = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
        return re.sub(rf"(?<![\w/])({alternatives})(?=/|$|\W)", lambda m: str(mounts[m.group(1)]), value)

    # -- process -------------------------------------------------------------------------
    def _service_hosts(self) -> list[str]:
        """/etc/hosts lines for the Services of the pod's namespace with a ready endpoint."""
        slices = client.DiscoveryV1Api(self.runner.core.api_client).list_namespaced_endpoint_slice(self.ns).items
        lines = {}
        for sl in slices:
            svc = (sl.metadata.labels or {}).get("kubernetes.io/service-name")
            ready = [a for ep in sl.endpoints or [] if ep.conditions and ep.conditions.ready for a in ep.addresses]
            if svc and ready and svc not in lines:
                names = (svc, f"{svc}.{self.ns}", f"{svc}.{self.ns}.svc", f"{svc}.{self.ns}.svc.cluster.local")
                lines[svc] = f"{sorted(ready)[0]}\t{' '.join(names)}"
        return list(lines.values())

    def _with_hosts(self, argv: list[str]) -> list[str]:
        """``argv`` run in a mount namespace whose /etc/hosts also names the namespace's Services."""
        entries = self._service_hosts()
        if not entries:
            return argv
        hosts = self.dir / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text() + "\n# Services (tests/cluster/podrunner.py)\n"
                         + "\n".join(entries) + "\n")
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]

    def _log(self, c: dict) -> Path:
        inits = {i["name"] for i in self.pod["spec"].get("initContainers") or []}
        return self.dir / (f"init-{c['name']}.log" if c["name"] in inits else "container.log")

    def _start_process(self, c: dict) -> None:
        mounts = self._mounts(c)
        pod_env = self._env(c, mounts)
        argv = [self._rewrite(expand(a, pod_env), mounts) for a in (c.get("command") or []) + (c.get("args") or [])]
        if not argv:
            raise ValueError("container has no command: process-backed pods need one")
        env = {**self.runner.base_env, **pod_env, "HOSTNAME": self.name,
               "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.runner.apiserver_port)}
        if getattr(self, "sa_kubeconfig", None):
            env["KUBECONFIG"] = str(self.sa_kubeconfig)
        self.dir.mkdir(parents=True, exist_ok=True)
        logf = open(self._log(c), "ab")
        logf.write(f"--- start {now()} (restart {self.restarts}): {argv}\n".encode())
        logf.flush()
        zygote = self.runner.zygote_for(argv, env)
        if zygote is not None:
            logf.close()
            self.proc = zygote.spawn(argv, env, self.dir, self._log(c))
        else:
            self.proc = subprocess.Popen(self._with_hosts(argv), env=env, cwd=self.dir, stdout=logf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0)
            logf.close()
        self.started_at = now()
        self.process_started = time.monotonic()
        self.started = False
        self.startup_failures = 0
        self.next_probe: dict[str, float] = {}
        self.liveness_failures = 0
        self.readiness = {"ok": 0, "fail": 0}
        self.ready = False
        log.info("started %s/%s pid=%s ip=%s: %s", self.ns, self.name, self.proc.pid, self.ip, " ".join(argv))

    def _kill_process(self, grace: float) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    # -- probes --------------------------------------------------------------------------
    def _probe(self, probe: dict | None) -> bool | None:
        if not probe or "httpGet" not in probe:
            return None
        hg = probe["httpGet"]
        port = hg.get("port")
        if isinstance(port, str) and not port.isdigit():
            port = next((p["containerPort"] for p in self.container().get("ports", []) if p.get("name") == port), None)
        url = f"{hg.get('scheme', 'HTTP').lower()}://{hg.get('host') or self.ip}:{port}{hg.get('path', '/')}"
        try:
            r = self.prober.get(url, timeout=probe.get("timeoutSeconds", 1))
            return 200 <= r.status_code < 400
        except httpx.HTTPError:
            return False

    def _gates_ok(self) -> bool:
        conds = {c["type"]: c["status"] for c in (self.pod.get("status") or {}).get("conditions") or []}
        return all(conds.get(g["conditionType"]) == "True" for g in self.pod["spec"].get("readinessGates") or [])

    # -- status ----------------------------------------------------------------------------
    def _termination_message(self, code: int, c: dict | None = None) -> str:
        """terminationMessagePolicy FallbackToLogsOnError, as a kubelet applies it: on a failed exit,
        the log's last 80 lines or 2048 bytes, whichever is less."""
        c = c or self.container()
        if not code or c.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return ""
        try:
            with open(self._log(c), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 2048))
                tail = f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(tail.splitlines()[-80:])

    def _patch_status(self, containers_ready: bool, running: bool, last_exit: int | None = None) -> None:
        ready = containers_ready and self._gates_ok()
        started = running and getattr(self, "started", False)  # the kubelet's: startup probe passed
        key = (containers_ready, ready, started, running, self.restarts, json.dumps(self.init_statuses))
        if key == self.last_status:
            return
        c = self.container()
        state = {"running": {"startedAt": self.started_at}} if running else \
            {"waiting": {"reason": "PodInitializing"}} if not self.initialized else \
            {"waiting": {"reason": "CrashLoopBackOff", "message": f"exited with {last_exit}"}}
        last_state = {}
        if not running and last_exit is not None:
            last_state = {"terminated": {"exitCode": last_exit, "reason": "Error" if last_exit else "Completed",
                                         "message": self._termination_message(last_exit)}}
        body = {"status": {
            "phase": "Running" if self.initialized else "Pending", "hostIP": self.host_ip,
            "hostIPs": [{"ip": self.host_ip}], "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "startTime": self.started_at, "initContainerStatuses": self.init_statuses,
            "conditions": [self._condition("Initialized", self.initialized),
                           self._condition("ContainersReady", containers_ready), self._condition("Ready", ready)],
            "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "imageID": "",
                                   "ready": containers_ready, "started": started,
                                   "restartCount": self.restarts, "state": state,
                                   "lastState": last_state}]}}
        try:
            # the reply is read, not turned into a V1Pod: with every pod's status patched from
            # this one process (a kubelet each on a real cluster), that decoding held the GIL the
            # other pods' patches waited on
            self.runner.core.patch_namespaced_pod_status(self.name, self.ns, body, _preload_content=False).drain_conn()
            self.last_status = key
        except ApiException as e:
            if e.status == 404:
                self.stop_event.set()
            else:
                log.warning("status patch for %s/%s failed: %s", self.ns, self.name, e.reason)

    def _condition(self, ctype: str, status: bool) -> dict:
        """As a kubelet writes it: lastTransitionTime moves only when the status flips (the
        operator reads "not ready since the container started" from it)."""
        if self.transitions.get(ctype, (None,))[0] != status:
            self.transitions[ctype] = (status, now())
        return {"type": ctype, "status": str(status), "lastTransitionTime": self.transitions[ctype][1]}

    # -- main loop --------------------------------------------------------------------------
    def _run_init(self) -> bool:
        """The init containers in order, each to a successful exit; a failed one is restarted with
        backoff. False when the pod is deleted meanwhile."""
        inits = self.pod["spec"].get("initContainers") or []
        self.init_statuses = [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
                               "started": False, "restartCount": 0, "state": {"waiting": {"reason": "PodInitializing"}},
                               "lastState": {}} for c in inits]
        for c, st in zip(inits, self.init_statuses):
            backoff = 1.0
            while True:
                self._start_process(c)
                st.update(started=True, state={"running": {"startedAt": self.started_at}})
                self._patch_status(False, False)
                code = self.proc.poll()
                while code is None:
                    if self.stop_event.wait(TICK):
                        return False
                    code = self.proc.poll()
                if code == 0:
                    st.update(ready=True, started=False, state={"terminated": {
                        "exitCode": 0, "reason": "Completed", "startedAt": self.started_at, "finishedAt": now()}})
                    break
                st.update(started=False, restartCount=st["restartCount"] + 1,
                          state={"waiting": {"reason": "CrashLoopBackOff", "message": f"exited with {code}"}},
                          lastState={"terminated": {"exitCode": code, "reason": "Error",
                                                    "message": self._termination_message(code, c)}})
                self._patch_status(False, False)
                if self.stop_event.wait(backoff):
                    return False
                backoff = min(backoff * 2, 10)
        self.initialized = True
        return True

    def run(self) -> None:
        try:
            if not self.pod["spec"].get("hostNetwork"):
                netns.add_address(self.ip)
            if not self._run_init():
                self._cleanup()
                return
            self._start_process(self.container())
        except Exception as e:  # a pod that cannot start stays not-ready, like a kubelet would
            log.exception("cannot start %s/%s", self.ns, self.name)
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "container.log").write_text(f"cannot start: {e}\n")
            self._patch_status(False, False, last_exit=-1)
            self.stop_event.wait()
            self._cleanup()
            return
        c = self.container()
        rp, lp, sp = c.get("readinessProbe"), c.get("livenessProbe"), c.get("startupProbe")
        backoff = 1.0
        woken = False
        while not self.stop_event.is_set():
            self.wake.clear()
            code = self.proc.poll()
            if woken and code is None:
                # the pod object changed (a readiness gate): its Ready follows at once, before
                # any probe that is due, as a kubelet's status manager does it
                self._patch_status(self.ready, True)
            if code is not None:
                self.ready = False
                self._patch_status(False, False, last_exit=code)
                if self.stop_event.wait(backoff):
                    break
                backoff = min(backoff * 2, 10)
                self.restarts += 1
                self._start_process(self.container())
                continue
            self._run_probes(rp, lp, sp)
            self._patch_status(self.ready, True)
            woken = self.wake.wait(TICK)
        self._cleanup()

    def _due(self, name: str, probe: dict, fast: bool) -> bool:
        """Kubelet timing: initialDelaySeconds, then every periodSeconds (readiness and startup
        are polled at most every PROBE_CAP seconds so tests see flips quickly)."""
        period = float(probe.get("periodSeconds") or 10)
        if fast:
            period = min(period, PROBE_CAP)
        t = time.monotonic()
        first = self.process_started + float(probe.get("initialDelaySeconds") or 0)
        nxt = self.next_probe.get(name, first)
        if t < nxt:
            return False
        self.next_probe[name] = t + period
        return True

    def _run_probes(self, rp: dict | None, lp: dict | None, sp: dict | None) -> None:
        if not self.started:
            if sp is None:
                self.started = True
            elif self._due("startup", sp, fast=True):
                if self._probe(sp):
                    self.started = True
                else:
                    self.startup_failures += 1
                    if self.startup_failures >= (sp.get("failureThreshold") or 3):
                        log.info("startup probe failed for %s/%s: restarting", self.ns, self.name)
                        self._kill_process(grace=2)
                return
            else:
                return
        if rp is None:
            self.ready = True
        elif self._due("readiness", rp, fast=True):
            ok = self._probe(rp)
            self.readiness["ok" if ok else "fail"] += 1
            self.readiness["fail" if ok else "ok"] = 0
            if ok and self.readiness["ok"] >= (rp.get("successThreshold") or 1):
                self.ready = True
            elif not ok and self.readiness["fail"] >= (rp.get("failureThreshold") or 3):
                self.ready = False
        if lp is not None and self._due("liveness", lp, fast=False):
            if self._probe(lp) is False:
                self.liveness_failures += 1
                if self.liveness_failures >= (lp.get("failureThreshold") or 3):
                    log.info("liveness probe failed for %s/%s: restarting", self.ns, self.name)
                    self._kill_process(grace=2)
            else:
                self.liveness_failures = 0

    def _cleanup(self) -> None:
        grace = min(float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)), 30.0)
        self._kill_process(grace)
        if not self.pod["spec"].get("hostNetwork"):
            netns.del_address(self.ip)
            self.runner.pool.give(self.ip)
        self.prober.close()
        try:  # the kubelet's last word: the pod object goes once its process is gone
            self.runner.core.delete_namespaced_pod(
                self.name, self.ns, body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)))
        except ApiException:
            pass
        log.info("stopped %s/%s", self.ns, self.name)


def _python_settings(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


class ForkedProcess:
    """What PodWorker needs of a Popen, for a process the zygote forked (not our child)."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.cond:
            if not self.zygote.cond.wait_for(lambda: self.poll() is not None, timeout):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        code = self.poll()
        assert code is not None
        return code


class Zygote:
    """Client side: one `--zygote` process per preload set, driven over its stdin/stdout
    (one JSON object a line: spawn requests in; pids and exit codes out)."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cluster.podrunner", "--zygote", ",".join(preload)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.cond = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.exits: dict[int, int] = {}  # pid -> exit code
        self.next_id = 0
        self.send_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "exit" in msg:
                    self.exits[msg["exit"]] = msg["code"]
                else:
                    self.pids[msg["id"]] = msg["pid"]
                self.cond.notify_all()
        with self.cond:  # the zygote died: its children were reparented and can no longer be reaped by it
            self.cond.notify_all()

    def exit_code(self, pid: int) -> int | None:
        with self.cond:
            if pid in self.exits:
                return self.exits[pid]
        if not self.alive() and not os.path.exists(f"/proc/{pid}"):
            return -1
        return None

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> ForkedProcess:
        assert self.proc.stdin is not None
        with self.send_lock:
            self.next_id += 1
            rid = self.next_id
            req = {"id": rid, "module": argv[2], "args": argv[3:], "env": env, "cwd": str(cwd), "log": str(log_path)}
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        with self.cond:
            if not self.cond.wait_for(lambda: rid in self.pids or not self.alive(), timeout=60):
                raise RuntimeError("zygote did not answer")
            if rid not in self.pids:
                raise RuntimeError("zygote died")
            return ForkedProcess(self, self.pids.pop(rid))


def zygote_main(preload: list[str]) -> None:
    """Server side: import ``preload``, then fork one child per request and report exits.
    Single-threaded, so forking is safe; gc.freeze keeps the collector from touching (and
    so un-sharing) the preloaded objects' pages."""
    for module in preload:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the podrunner is gone
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(wake_r)
                    os.close(wake_w)
                    out.close()
                    _zygote_child(req)  # does not return
                out.write(json.dumps({"id": req["id"], "pid": pid}).encode() + b"\n")


def _zygote_child(req: dict) -> None:
    """Become the container process: what exec'ing `python -m MODULE ARGS` would have given."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)
    log_fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    with open("/proc/self/comm", "w") as comm:  # what ps and top show (the command line stays the zygote's)
        comm.write(req["module"][:15])
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    random.seed()  # a new interpreter seeds from os.urandom; the zygote's state is shared
    sys.argv = [req["module"], *req["args"]]
    sys.path[0] = req["cwd"]  # as `python -m` puts the working directory first
    code: object = 0
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.exit(code)


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
        if _python_settings(env) != _python_settings(self.base_env):
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
        if (meta.get("annotations") or {}).get(ANNOTATION) != "true" or not pod["spec"].get("nodeName"):
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
