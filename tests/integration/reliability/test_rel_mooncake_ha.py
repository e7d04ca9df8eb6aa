"""Highly available Mooncake masters (the installed wheel's ``--enable_ha`` through a real etcd):
the runtime's backend finds the leader through ``etcd://`` and carries on through the standby
when the leader is killed, as a managed master with ``ha`` runs them."""

from __future__ import annotations

import time

import pytest
import torch

from cache_runtime.storage import HiCacheStorageConfig, StorageUnavailable, create_storage_backend, page_hashes
from testbed.etcd import Etcd, etcd_binary
from testbed.mooncake import MooncakeMaster, mooncake_env  # noqa: F401  (fixture)

KEYS = page_hashes(list(range(64)), 16)
CLUSTER_ID = "ns.fleet"  # render.mooncake_cluster_id's form


def page(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def stored(b, key: str, value: torch.Tensor) -> bool:
    try:
        return b.set(key, value)
    except StorageUnavailable:
        return False


@pytest.fixture
def ha(mooncake_env, monkeypatch):
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd: localcluster/tools/build.sh builds it")
    etcd = Etcd().start(binary)
    masters = [MooncakeMaster(etcd=etcd.endpoint, cluster_id=CLUSTER_ID).start() for _ in range(2)]
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER_ID)  # the fleet pods' env (render.mooncake_env)
    yield etcd, masters
    for m in masters:
        m.stop()
        m.log_path.unlink(missing_ok=True)
    etcd.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_backend_follows_the_leader_through_etcd(ha):
    etcd, masters = ha
    leader = wait_for(lambda: next((m for m in masters if m.health().get("ha_state") == "serving"), None),
                      30, "a leader serving")
    standby = next(m for m in masters if m is not leader)
    assert standby.health()["role"] == "standby"
    extra = {"master_server_address": f"etcd://{etcd.endpoint}", "local_hostname": "127.0.0.1",
             "global_segment_size": 64 << 20, "master_wait_s": 5.0, "retry_interval_s": 0.2}
    b = create_storage_backend("mooncake", HiCacheStorageConfig(extra_config=extra, model_name="m"))
    try:
        assert b.batch_set(KEYS[:2], [page(0), page(1)]) and torch.equal(b.get(KEYS[1]), page(1))
        leader.kill()
        wait_for(lambda: standby.health().get("ha_state") == "serving", 60, "the standby to take over")
        wait_for(lambda: stored(b, KEYS[2], page(2)), 60, "a write through the new leader")
        assert torch.equal(b.get(KEYS[2]), page(2))
    finally:
        b.close()
