"""A fleet sized so that every tier of the hierarchy serves tokens, and the traffic that shows it.

Shared by the demo (scripts/demo.py) and its e2e test (tests/e2e/test_demo_tiers.py):

- L1 (``maxTotalTokens`` 768 tokens a pod) is smaller than the conversations' working set
  (6 documents of ~220 tokens), and L2 (``hostPool.ratio`` 4: 3,072 tokens) holds all of it
  even on one pod: when a conversation returns after the others have passed through, its prefix
  comes from L2.
- L3 is the file backend on a ReadWriteMany claim every pod mounts (here a hostPath
  PersistentVolume: the simulated nodes are one machine; on a real cluster an NFS/CephFS
  class): a prompt one pod served is found in L3 by another pod that never saw it. The claim is
  mounted at its own directory's path: the local cluster's pods are processes of this machine,
  and a live attach names the directory as the pods see it.
"""
from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from testbed import REPO

SAMPLE = REPO / "manifests" / "samples" / "bundled-minimal.yaml"
PORT = 30000
WORDS = ("cache", "tier", "host", "device", "page", "prefix", "radix", "token", "layer", "store", "fleet", "node",
         "router", "prefetch", "backup", "evict", "memory", "latency", "bandwidth", "kernel", "window", "batch")


@dataclass
class Tiers:
    """Cached prompt tokens by the tier that served them, summed over requests."""

    requests: int = 0
    failed: int = 0
    tokens: dict[str, int] = field(default_factory=dict)

    def add(self, details: dict[str, int] | None) -> None:
        self.requests += 1
        if details is None:
            self.failed += 1
            return
        for tier, n in details.items():
            self.tokens[tier] = self.tokens.get(tier, 0) + n

    def line(self) -> str:
        t = self.tokens
        return (f"{self.requests} requests, {self.failed} failed; cached tokens by tier: "
                f"device(L1)={t.get('device', 0)} host(L2)={t.get('host', 0)} storage(L3)={t.get('storage', 0)}")


def fleet(name: str, namespace: str, claim: str, mount: Path) -> dict:
    """The bundled sample, two pods, with L1 below the working set, L2 above it, and the claim
    every pod mounts at ``mount`` (unused until the fleet's L3 is the file backend there)."""
    import yaml

    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"].update(name=name, namespace=namespace)
    doc["spec"].update(replicas=2, pageSize=4, maxTotalTokens=768,
                       extraVolumes=[{"name": "l3", "persistentVolumeClaim": {"claimName": claim}}],
                       extraVolumeMounts=[{"name": "l3", "mountPath": str(mount)}])
    doc["spec"]["hicache"] = {"memLayout": "page_first", "hostPool": {"ratio": 4}}
    return doc


def shared_volume(namespace: str, claim: str, host_dir: Path) -> list[dict]:
    """A ReadWriteMany PersistentVolume (a directory of this machine) and the claim bound to it."""
    pv = f"{namespace}-{claim}"
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"],
                  "hostPath": {"path": str(host_dir), "type": "DirectoryOrCreate"}, "storageClassName": "manual",
                  "claimRef": {"namespace": namespace, "name": claim}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": namespace},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual", "volumeName": pv,
                  "resources": {"requests": {"storage": "10Gi"}}}}]


def file_l3(mount: Path) -> dict:
    """The merge patch that swaps the fleet's L3 to the file backend on the shared claim (mounted at
    ``mount``). The prefetch waits for its pages (wait_complete), and 16 tokens already ask L3."""
    return {"spec": {"hicache": {"storage": {
        "backend": "file", "prefetchPolicy": "wait_complete",
        "extraConfig": {"file_storage_path": f"{mount}/kv", "prefetch_threshold": 16}}}}}


def document(seed: int, words: int = 80) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def generate(http: httpx.Client, ip: str, text: str) -> dict[str, int] | None:
    """One greedy request; its cached tokens by tier, or None if it failed."""
    try:
        r = http.post(f"http://{ip}:{PORT}/generate",
                      json={"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return r.json().get("meta_info", {}).get("cached_tokens_details") or {}


def returning_conversations(ip: str, *, conversations: int = 6, rounds: int = 3, seed: int = 0,
                            headers: dict | None = None) -> list[Tiers]:
    """Each round sends every conversation's next turn, one request at a time, to ``ip`` (the
    router): by the time a conversation returns the others have pushed its prefix out of L1,
    and L2 serves it. Tiers per round (the first one is cold)."""
    texts = [f"conversation {seed}-{i}: {document(seed * 1000 + i)}" for i in range(conversations)]
    out = []
    with httpx.Client(timeout=120, headers=headers or {}) as http:
        for r in range(rounds):
            tiers = Tiers()
            for i in range(conversations):
                texts[i] += f" user turn {r}: tell me more about {document(seed * 1000 + i * 10 + r, 6)}."
                tiers.add(generate(http, ip, texts[i]))
            out.append(tiers)
    return out


def second_pod(first: str, second: str, *, prompts: int = 4, seed: int = 0, settle_s: float = 3.0,
               headers: dict | None = None) -> tuple[Tiers, Tiers]:
    """Sends prompts to pod ``first``, lets its write-through to L3 land, then the same prompts
    to pod ``second``, which has never seen them: what L3 serves there, the first pod wrote."""
    run = uuid.uuid4().hex[:8]  # prompts no earlier run has written to L3
    texts = [f"{run} shared document {i}: {document(seed * 7919 + i)}" for i in range(prompts)]
    a, b = Tiers(), Tiers()
    with httpx.Client(timeout=120, headers=headers or {}) as http:
        for text in texts:
            a.add(generate(http, first, text))
        time.sleep(settle_s)
        for text in texts:
            b.add(generate(http, second, text))
    return a, b
