"""What the operator reads of a runtime's L3 store, and the Degraded condition it derives, while
the real Mooncake master is killed and restarted under a real runtime: the bundled runtime's
``GET /hicache/storage-backend`` reports the store unavailable (so ``Degraded=StorageUnavailable``
names the pod) until its recovery probe reattaches, then nothing (``Degraded=False``). A runtime
in SGLang's compatibility mode answers that route as SGLang does, without the field: its outage
shows only in its own metric, never in the operator's reads."""
from __future__ import annotations

import asyncio
import json
import random

from hicache_operator.api import labels
from hicache_operator.api.flags import RUNTIME_PORT
from hicache_operator.control.pipeline import plan
from hicache_operator.rollout.act.runtime_client import shared_client
from hicache_operator.rollout.act.views import ViewCache, read_pod
from hicache_operator.fleet.gate import LABEL as SERVING
from hicache_operator.plan.status import Observed, derive
from testbed.kube import wait_for
from testbed.mooncake import MooncakeMaster, mooncake_env  # noqa: F401  (fixture)
from testbed.runtime_proc import metric
from tests.integration.reliability.conftest import PROMPTS, generate

ADMIN_KEY = "test-admin-key-0123456789"
FLEET = ("ns", "demo")
NODE = {"metadata": {"name": "n", "labels": {"kubernetes.io/hostname": "n"}}, "spec": {},
        "status": {"allocatable": {"memory": "1Ti", "nvidia.com/gpu": "8", "cpu": "64"}}}
DESIRED = plan({"metadata": {"name": "demo", "namespace": "ns", "uid": "u", "generation": 1}, "spec": {
    "image": "img", "replicas": 2, "router": {"enabled": False},
    "hicache": {"memLayout": "page_first", "storage": {"backend": "mooncake", "mooncake": {"managed": {}}}}}},
    [NODE]).desired


def loopback_ip() -> str:
    """A loopback address of the pod's own, so its runtime can listen on the operator's port."""
    return f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(1, 254)}"


def pod_of(name: str, ip: str) -> dict:
    """The pod as the watch shows it: Running, Ready, in serving."""
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": {SERVING: "true"},
                         "annotations": {labels.RESTART_HASH: DESIRED.restart_hash,
                                         labels.STORAGE_HASH: DESIRED.storage_hash}},
            "status": {"podIP": ip, "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "runtime", "started": True, "ready": True,
                                              "state": {"running": {}}}]}}


def read(views: ViewCache, pods: list[dict]) -> dict[str, str]:
    """One read of every pod's runtime, as a swap step makes it; what the status is derived from."""
    async def all_pods():
        async with shared_client() as http:
            return await asyncio.gather(*(read_pod(http, p, ADMIN_KEY) for p in pods))
    fresh = asyncio.run(all_pods())
    assert all(r.view.backend is not None for r in fresh), [r.view.error for r in fresh]
    views.update(FLEET, fresh)
    return views.l3_unavailable(FLEET, pods)


def degraded(pods: list[dict], l3: dict[str, str]) -> dict:
    status = derive(Observed(generation=1, previous={}, now="t", desired=DESIRED, pods=tuple(pods),
                             l3_unavailable=l3))
    return next(c for c in status["conditions"] if c["type"] == "Degraded")


def test_l3_unavailable_is_read_from_the_runtime_and_degrades_the_status_until_it_recovers(
        mooncake_env, start_runtime):
    master = MooncakeMaster().start()
    try:
        flags = ["--enable-hierarchical-cache", "--page-size", "4", "--max-total-tokens", "4096",
                 "--hicache-storage-backend", "mooncake", "--hicache-mem-layout", "page_first",
                 "--hicache-storage-backend-extra-config", json.dumps(master.extra_config()),
                 "--admin-api-key", ADMIN_KEY]
        bundled, compat = loopback_ip(), loopback_ip()
        runtimes = [start_runtime(*flags, host=bundled, port=RUNTIME_PORT, env=mooncake_env),
                    start_runtime(*flags, "--compat-mode", "sglang", host=compat, port=RUNTIME_PORT,
                                  env=mooncake_env)]
        pods, views = [pod_of("demo-0", bundled), pod_of("demo-1", compat)], ViewCache()
        assert read(views, pods) == {}
        assert degraded(pods, {})["status"] == "False", degraded(pods, {})

        master.kill()

        def both_degraded() -> bool:
            for i, rt in enumerate(runtimes):
                with rt.client() as c:
                    generate(c, PROMPTS[i])  # a store call notices the outage
                    if metric(c, "hicache_storage_degraded") != 1:
                        return False
            return True
        wait_for(both_degraded, timeout=60, what="both runtimes on L1+L2")
        l3 = read(views, pods)
        assert list(l3) == ["demo-0"] and "StorageUnavailable" in l3["demo-0"], l3  # SGLang's route says nothing
        assert views.reusable(FLEET, "uid-demo-0", bundled, views.last(FLEET, "uid-demo-0", bundled).observed_at) \
            is None  # read afresh by every step until it recovers
        cond = degraded(pods, l3)
        assert (cond["status"], cond["reason"]) == ("True", "StorageUnavailable")
        assert cond["message"].startswith(f"the L3 store is unavailable on demo-0 ({l3['demo-0']})"), cond

        master = MooncakeMaster(rpc_port=master.rpc_port, metrics_port=master.metrics_port,
                                http_port=master.http_port).start()
        wait_for(lambda: read(views, pods) == {}, timeout=90, what="the runtime's L3 back")
        assert degraded(pods, read(views, pods))["status"] == "False"
    finally:
        master.stop()
