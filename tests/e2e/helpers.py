"""Shared helpers for e2e tests that need pytest or a running fleet's pods."""
from __future__ import annotations

import time

from testbed.kube import kget, wait_for


def skip_without_pod_network_or_mooncake(cluster) -> None:
    """Process-backed pods need the run's own network namespace; L3 tests need Mooncake."""
    import pytest

    from testbed.mooncake import master_binary

    if not cluster.network.endpoints_work:
        pytest.skip("needs a private network namespace (run as root)")
    if master_binary() is None:
        pytest.skip("mooncake is not installed (scripts/install-mooncake.sh)")


def l3_hit_across_pods(cluster, namespace: str, name: str) -> int:
    """A prompt served by one pod is found in L3 by another (cache hits resume from L3): the
    first request to pod B for a prompt only pod A has served reports storage-tier hits.

    Only that first request counts, and every attempt's prompt differs from its first byte: a
    B that asked before A's write landed computes the prompt itself, so any later hit on B
    could be its own pages. Use it with the prefetch policies that wait for the prefetch
    (wait_complete, timeout); with best_effort an idle pod starts the request at once and ends
    the prefetch before a page has arrived, as SGLang does, so a hit there is down to timing."""
    import random

    import httpx

    pods = kget(cluster, "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name},"
                "app.kubernetes.io/name=hicache")["items"]
    ps = sorted(pods, key=lambda p: p["metadata"]["name"])
    a, b = ps[0]["status"]["podIP"], ps[1]["status"]["podIP"]

    def attempt() -> int:
        prompt = f"{random.random()} shared by two pods " + "lorem ipsum dolor sit amet " * 30
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert httpx.post(f"http://{a}:30000/generate", json=body, timeout=60).status_code == 200
        time.sleep(2.0)  # let A's write-through to L3 land (0.5 s was sometimes short on a loaded machine)
        r = httpx.post(f"http://{b}:30000/generate", json=body, timeout=60)
        return (r.json()["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)
    return wait_for(attempt, timeout=60, interval=0.5, what="L3 hit on another pod")
