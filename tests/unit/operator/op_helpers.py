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

