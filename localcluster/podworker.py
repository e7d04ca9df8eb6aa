"""One process-backed pod as a kubelet runs it: init containers in order, the container process
(exec'd, or forked from a zygote), httpGet probes on kubelet timing, restarts with backoff, the
pod's status patched as a kubelet writes it, and the pod object deleted once its process is gone."""
from __future__ import annotations

import base64
import json
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from . import netns
from .podspec import (IMAGE_MODELS, expand, field_ref, image_volume_dir, local_models_dir, now, rewrite_mounts,
                      service_hosts, with_hosts)

TICK = 0.25  # seconds between looks at a pod's process
PROBE_CAP = 1.0  # readiness/startup probes run at least this often, whatever periodSeconds says
log = logging.getLogger("podrunner")


class PodWorker(threading.Thread):
    """Owns one pod uid: its process, its probes and its status, for the podrunner's ``Runner``
    (its API client, address pool, zygotes and base environment)."""

    def __init__(self, runner, pod: dict):
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
        return {k: rewrite_mounts(v, mounts) for k, v in env.items()}

    # -- process -------------------------------------------------------------------------
    def _log(self, c: dict) -> Path:
        inits = {i["name"] for i in self.pod["spec"].get("initContainers") or []}
        return self.dir / (f"init-{c['name']}.log" if c["name"] in inits else "container.log")

    def _start_process(self, c: dict) -> None:
        mounts = self._mounts(c)
        pod_env = self._env(c, mounts)
        argv = [rewrite_mounts(expand(a, pod_env), mounts) for a in (c.get("command") or []) + (c.get("args") or [])]
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
            hosts = service_hosts(self.runner.core, self.ns)
            self.proc = subprocess.Popen(with_hosts(argv, hosts, self.dir / "hosts"), env=env, cwd=self.dir,
                                         stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         process_group=0)
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
