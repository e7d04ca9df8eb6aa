"""The demo's fleet and traffic (testbed/tiers.py) show every tier serving tokens: returning
conversations through the router are served from L2, and after a live swap to the file L3 on a
shared claim a pod that never saw a prompt is served from L3, with no failed request and no
warning about an unshared L3."""
from __future__ import annotations

import json

import pytest

from testbed import tiers
from testbed.kube import kget, wait_for
from tests.e2e.helpers import skip_without_pod_network_or_mooncake

pytestmark = pytest.mark.e2e
NAME = "tiers"


def _ips(cluster, ns: str, *args: str) -> list[str]:
    if args[0] == "svc":
        slices = kget(cluster, "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={args[1]}")["items"]
        return sorted({a for s in slices for e in s.get("endpoints") or []
                       if (e.get("conditions") or {}).get("ready") for a in e.get("addresses") or []})
    pods = kget(cluster, "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={args[1]},app.kubernetes.io/name=hicache")
    return [p["status"]["podIP"] for p in sorted(pods["items"], key=lambda p: p["metadata"]["name"])]


def test_each_tier_serves_tokens_the_client_can_see(cluster, operator, ns, tmp_path):
    skip_without_pod_network_or_mooncake(cluster)
    l3 = tmp_path / "l3"
    doc = tiers.fleet(NAME, ns, "l3", l3)
    doc["metadata"]["annotations"] = {"hicache.dev/process-backed": "true"}
    cluster.kubectl_apply([*tiers.shared_volume(ns, "l3", l3), doc])

    def ready() -> bool:
        status = kget(cluster, "hcd", NAME, "-n", ns).get("status", {})
        return status.get("readyReplicas") == 2 and bool(_ips(cluster, ns, "svc", NAME))
    wait_for(ready, timeout=300, interval=1, what="2 pods and the router ready")

    rounds = tiers.returning_conversations(_ips(cluster, ns, "svc", NAME)[0])
    print("rounds:", [t.line() for t in rounds])
    assert not any(t.failed for t in rounds)
    assert sum(t.tokens.get("host", 0) for t in rounds[1:]) > 0, "no returning conversation was served from L2"

    cluster.kubectl("patch", "hcd", NAME, "-n", ns, "--type=merge", "-p", json.dumps(tiers.file_l3(l3)))

    def swapped() -> bool:
        bs = kget(cluster, "hcd", NAME, "-n", ns).get("status", {}).get("backendSwap") or {}
        return bs.get("phase") == "Complete" and not bs.get("pods") and bs.get("targetBackend") == "file"
    wait_for(swapped, timeout=300, interval=1, what="swap to the file L3 complete")

    first, second = _ips(cluster, ns, "pod", NAME)[:2]
    a, b = tiers.second_pod(first, second)
    print("first pod:", a.line(), "second pod:", b.line())
    assert not a.failed and not b.failed
    assert a.tokens.get("storage", 0) == 0, "new prompts were already in L3"
    assert b.tokens.get("storage", 0) > 0, "the second pod found nothing in the shared L3"
    events = kget(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")["items"]
    assert not [e for e in events if e["reason"] == "FileStorageNotShared"]
