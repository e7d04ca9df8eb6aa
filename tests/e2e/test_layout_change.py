"""A fleet on a shared file L3 changes its host memory layout under load: the restarted pods miss
the old layout's pages and answer exactly as a cold fleet does.

Real control plane, real runtime processes at their pod IPs, one file L3 directory shared by every
pod; the load client routes like a gateway and retries nothing. Page bytes are in host-layout
order, so reading the old pages after the change would be wrong KV: the operator's page namespace
(``render.effective_extra_config``) puts each layout's pages in a directory of its own.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from testbed.gateway import Gateway
from testbed.kube import kget, wait_for
from testbed.operator_proc import start_operator
from tests.e2e.helpers import l3_hit_across_pods

pytestmark = pytest.mark.e2e
NS = "layout-e2e"
NAME, COLD = "layout", "cold"
REPLICAS = 2
PROMPTS = [f"question {i}: what follows from " + "lorem ipsum dolor sit amet " * 12 for i in range(3)]


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    if not cluster.network.endpoints_work:
        pytest.skip("needs a private network namespace (run as root)")
    workdir = tmp_path_factory.mktemp("layout")
    op = start_operator(cluster, workdir, reconcile_interval=5)
    cluster.kubectl("create", "namespace", NS)
    yield {"cluster": cluster, "l3": workdir / "l3"}
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    op.stop()


def deployment(env, name: str, layout: str, replicas: int, l3: bool) -> dict:
    storage = ({"backend": "file", "prefetchPolicy": "wait_complete",
                "extraConfig": {"file_storage_path": str(env["l3"])}} if l3 else {"backend": "none"})
    return {"apiVersion": "hicache.dev/v1alpha1", "kind": "HiCacheDeployment",
            "metadata": {"name": name, "namespace": NS, "annotations": {"hicache.dev/process-backed": "true"}},
            "spec": {"image": "hicache-runtime:test", "replicas": replicas, "pageSize": 4, "maxTotalTokens": 4096,
                     "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 60},
                     "router": {"enabled": False},
                     "hicache": {"memLayout": layout, "storage": storage}}}


def pods(c, name: str) -> list[dict]:
    return sorted((p for p in kget(c, "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={name}")["items"]
                   if not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"])


def serving_ips(c, name: str) -> set[str]:
    slices = kget(c, "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={name}")["items"]
    return {a for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")
            for a in e.get("addresses") or []}


def all_serving(c, name: str, count: int, layout: str) -> bool:
    ps = pods(c, name)
    ready = [any(x["type"] == "Ready" and x["status"] == "True" for x in p["status"].get("conditions") or [])
             for p in ps]
    on_layout = [layout in p["spec"]["containers"][0]["args"] for p in ps]
    return (len(ps) == count and all(ready) and all(on_layout)
            and {p["status"].get("podIP") for p in ps} == serving_ips(c, name))


def generate(ip: str, prompt: str) -> tuple[list[int], int]:
    """Greedy output ids, and the prompt tokens this request found in L3."""
    r = httpx.post(f"http://{ip}:30000/generate", timeout=60, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    return body["output_ids"], (body["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)


def page_files(root: Path, order: str) -> list[Path]:
    return [f for d in root.glob(f"kv-{order}-*") for f in d.glob("*.bin")]


def test_layout_change_misses_old_pages_and_matches_a_cold_fleet(env):
    c = env["cluster"]
    c.kubectl_apply([deployment(env, NAME, "page_first", REPLICAS, l3=True)])
    wait_for(lambda: all_serving(c, NAME, REPLICAS, "page_first"), timeout=180, what="page_first fleet serving")
    first = pods(c, NAME)[0]["status"]["podIP"]
    for prompt in PROMPTS:
        generate(first, prompt)
    assert l3_hit_across_pods(c, NS, NAME) > 0  # the shared L3 serves pages across pods
    wait_for(lambda: len(page_files(env["l3"], "pl")) > 0, timeout=30, what="page_first pages in L3")
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(c, NAME)}

    gw = Gateway(c.api_client(), NS, NAME, concurrency=2).start()
    try:
        wait_for(lambda: len(gw.report.outcomes) > 10, timeout=60, what="load flowing")
        c.kubectl("patch", "hcd", NAME, "-n", NS, "--type=merge",
                  "-p", json.dumps({"spec": {"hicache": {"memLayout": "layer_first"}}}))
        wait_for(lambda: all_serving(c, NAME, REPLICAS, "layer_first")
                 and all(p["metadata"]["uid"] != before[p["metadata"]["name"]] for p in pods(c, NAME)),
                 timeout=300, interval=0.5, what="every pod restarted on layer_first, serving")
    finally:
        report = gw.stop()
    print("load during the layout change:", report.summary())
    assert not report.failures, report.failures[:3]

    c.kubectl_apply([deployment(env, COLD, "layer_first", 1, l3=False)])
    wait_for(lambda: all_serving(c, COLD, 1, "layer_first"), timeout=180, what="cold fleet serving")
    cold_ip = pods(c, COLD)[0]["status"]["podIP"]
    cold = {prompt: generate(cold_ip, prompt)[0] for prompt in PROMPTS}

    restarted = [p["status"]["podIP"] for p in pods(c, NAME)]
    for prompt in PROMPTS:  # the first restarted pod to see a prompt finds none of the old pages
        out, from_l3 = generate(restarted[0], prompt)
        assert from_l3 == 0, f"a layer_first pod read {from_l3} tokens of page_first pages"
        assert out == cold[prompt]
    for ip in restarted[1:]:  # later pods may read the new layout's pages: the same answers
        for prompt in PROMPTS:
            assert generate(ip, prompt)[0] == cold[prompt]
    assert page_files(env["l3"], "lp"), "the new layout's pages have a directory of their own"
    assert page_files(env["l3"], "pl"), "the old layout's pages are left as they were"
