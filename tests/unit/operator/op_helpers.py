"""Shared builders for the operator unit tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import copy
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
