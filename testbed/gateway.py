"""A load client that routes like a gateway: only to endpoints the EndpointSlices mark ready.

It watches the Service's EndpointSlices (as kube-proxy or an ingress controller would),
sends multi-turn /generate traffic to a random ready endpoint, retries nothing, and records
every outcome. Used by the swap e2e tests, bench/swap.py and the demo.
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from kubernetes import client, watch


@dataclass
class Outcome:
    ok: bool
    endpoint: str
    status: int | None
    error: str | None
    cached: dict
    latency_s: float
    at: float = 0.0  # wall clock when sent (to place a failure on a swap's timeline)


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def summary(self) -> dict:
        tiers = Counter()
        for o in self.outcomes:
            for k, v in (o.cached or {}).items():
                tiers[k] += int(v or 0)
        return {"requests": len(self.outcomes), "failed": len(self.failures),
                "endpoints": len({o.endpoint for o in self.outcomes}), "cached_tokens_by_tier": dict(tiers)}


class Gateway:
    def __init__(self, api: client.ApiClient, namespace: str, service: str, port: int = 30000,
                 *, concurrency: int = 3, max_new_tokens: int = 8, turns: int = 4, seed: int = 0,
                 api_key: str | None = None):
        self.discovery = client.DiscoveryV1Api(api)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ns, self.service, self.port = namespace, service, port
        self.ready: dict[str, set[str]] = {}  # slice name -> ready IPs
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.report = LoadReport()
        self.concurrency, self.max_new_tokens, self.turns = concurrency, max_new_tokens, turns
        self.rng = random.Random(seed)
        self.threads: list[threading.Thread] = []

    # ---- endpoint view ----------------------------------------------------------------
    def endpoints(self) -> list[str]:
        with self.lock:
            return sorted(set().union(*self.ready.values())) if self.ready else []

    def _watch(self) -> None:
        sel = f"kubernetes.io/service-name={self.service}"
        while not self.stop_event.is_set():
            try:
                lst = self.discovery.list_namespaced_endpoint_slice(self.ns, label_selector=sel)
                with self.lock:
                    self.ready = {s.metadata.name: _ready_ips(s) for s in lst.items}
                for ev in watch.Watch().stream(self.discovery.list_namespaced_endpoint_slice, self.ns,
                                               label_selector=sel, resource_version=lst.metadata.resource_version,
                                               timeout_seconds=10):
                    s = ev["object"]
                    with self.lock:
                        if ev["type"] == "DELETED":
                            self.ready.pop(s.metadata.name, None)
                        else:
                            self.ready[s.metadata.name] = _ready_ips(s)
                    if self.stop_event.is_set():
                        return
            except Exception:
                time.sleep(0.2)

    # ---- traffic ----------------------------------------------------------------------
    def _client_loop(self, idx: int) -> None:
        rng = random.Random(idx)
        with httpx.Client(timeout=60, headers=self.headers) as http:
            while not self.stop_event.is_set():
                convo = f"conversation {idx}-{rng.randrange(10**6)}: " + "the quick brown fox " * 20
                for turn in range(self.turns):
                    if self.stop_event.is_set():
                        return
                    eps = self.endpoints()
                    if not eps:
                        time.sleep(0.05)
                        continue
                    ep = rng.choice(eps)
                    convo += f" user turn {turn}: tell me more about item {rng.randrange(1000)}."
                    self.report.outcomes.append(self.send(http, ep, convo))
                    time.sleep(rng.uniform(0.0, 0.1))

    def send(self, http: httpx.Client, ep: str, prompt: str) -> Outcome:
        t0, at = time.monotonic(), time.time()
        try:
            r = http.post(f"http://{ep}:{self.port}/generate", json={
                "text": prompt, "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0}})
            ok = r.status_code == 200
            meta = r.json().get("meta_info", {}) if ok else {}
            return Outcome(ok, ep, r.status_code, None if ok else r.text[:200],
                           meta.get("cached_tokens_details") or {}, time.monotonic() - t0, at)
        except Exception as exc:
            return Outcome(False, ep, None, f"{type(exc).__name__}: {exc}", {}, time.monotonic() - t0, at)

    def start(self) -> "Gateway":
        self.threads = [threading.Thread(target=self._watch, daemon=True)]
        self.threads += [threading.Thread(target=self._client_loop, args=(i,), daemon=True)
                         for i in range(self.concurrency)]
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> LoadReport:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=70)
        return self.report


def _ready_ips(s) -> set[str]:
    return {a for e in (s.endpoints or []) if e.conditions and e.conditions.ready for a in (e.addresses or [])}
