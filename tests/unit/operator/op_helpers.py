"""Shared builders for the operator unit tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "manifests" / "samples"


def gpu_node(name: str, memory: str = "1Ti", gpus: int = 8, labels: dict | None = None,
             taints: list | None = None, unschedulable: bool = False) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "spec": {"taints": taints or [], "unschedulable": unschedulable},
            "status": {"allocatable": {"memory": memory, "nvidia.com/gpu": str(gpus), "cpu": "64"}}}


def sample_nodes() -> list[dict]:
    return list(yaml.safe_load_all((SAMPLES / "nodes" / "gpu-nodes.yaml").read_text()))


def body(spec: dict, name: str = "demo", namespace: str = "ns", generation: int = 1, status: dict | None = None) -> dict:
    out = {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
           "metadata": {"name": name, "namespace": namespace, "uid": "uid-1", "generation": generation},
           "spec": copy.deepcopy(spec)}
    if status is not None:
        out["status"] = status
    return out


class RecordingKube:
    """Applies block until released, so a test can see what ran while they were in flight."""

    def __init__(self, template_hash: str | None, pods: list[dict] | None = None) -> None:
        self.calls: list[str] = []
        self.listed = pods
        self.applying = threading.Event()
        self.release = threading.Event()
        self._template_hash = template_hash
        self._pool = ThreadPoolExecutor(max_workers=8)
        self._lock = threading.Lock()

    def _note(self, what: str) -> None:
        with self._lock:
            self.calls.append(what)

    def apply(self, obj: dict) -> dict:
        self.applying.set()
        assert self.release.wait(10)
        self._note(f"apply {obj['kind']}")
        return obj

    def ensure_secret(self, obj: dict) -> bool:
        self._note("secret")
        return False

    def concurrently(self, *calls):
        futures = [self._pool.submit(c) for c in calls]
        wait(futures)
        return [f.result() for f in futures]

    def submit(self, call):
        return self._pool.submit(call)

    def secret_exists(self, namespace: str, name: str) -> bool:
        return True

    def template_hash(self, namespace: str, name: str) -> str | None:
        return self._template_hash

    def pods(self, namespace: str, deployment: str) -> list[dict]:
        assert self.listed is not None, "cached pods are used"
        return self.listed


    def replace_deployment_status(self, namespace: str, name: str, status: dict) -> dict:
        self._note("status")
        self.written = status
        return {"metadata": {"namespace": namespace, "name": name, "resourceVersion": "2"}, "status": status}

    def secret_key(self, namespace: str, secret: str, field: str) -> str | None:
        return "admin-key"

    api = None  # the step below makes no Kubernetes call


class StepRecorder:
    """A swapper whose step records what it was given and returns ``on_step(given)`` (or an empty
    step): these tests are about when a reconcile steps; the step itself is tested in
    tests/unit/rollout and against a real API server in tests/e2e."""

    def __init__(self, on_step=None) -> None:
        from hicache_operator.rollout.act.views import ViewCache

        self.routes: dict = {}
        self.views = ViewCache()
        self.given: list = []
        self.on_step = on_step

    def step(self, api, given):
        from hicache_operator.rollout.act import StepResult

        self.given.append(given)
        return self.on_step(given) if self.on_step is not None else StepResult({})


def seen(kube_body: dict, nodes: list[dict], pods: list[dict] | None = None, **more):
    """The pipeline's ``Observation`` of ``kube_body`` (a resync unless ``trigger`` says)."""
    from hicache_operator.control.context import Observation

    meta = kube_body["metadata"]
    return Observation((meta.get("namespace", "default"), meta["name"]), kube_body, nodes=nodes, pods=pods, **more)


def context(kube, swapper=None, posted: list | None = None, **more):
    """A pipeline ``Context`` whose Events go to ``posted`` as (type, reason, message)."""
    from hicache_operator.control.context import Context

    kept = posted if posted is not None else []
    return Context(kube=kube, swapper=swapper, clock=lambda: "2026-01-01T00:00:00Z",
                   post=lambda body, *event: kept.append(event), **more)
