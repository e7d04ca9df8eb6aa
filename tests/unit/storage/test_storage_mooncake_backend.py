"""The mooncake backend against a real mooncake_master process on loopback."""

import time

import pytest
import torch

from cache_runtime.storage import HiCacheStorageConfig, StorageUnavailable, create_storage_backend, page_hashes
from testbed.mooncake import (MooncakeMaster, mooncake_env, mooncake_master,  # noqa: F401  (fixtures)
                                    mooncake_raw)

KEYS = page_hashes(list(range(96)), 16)  # 6 chained page keys
PAGE = 4096  # bytes per page (K half + V half for MHA)
MODEL = "org/model"  # keys start with it, '/' -> '-', as SGLang's


def page(seed, nbytes=PAGE):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def backend(master, **cfg):
    extra = master.extra_config(**cfg.pop("extra", {}))
    return create_storage_backend("mooncake", HiCacheStorageConfig(extra_config=extra, **cfg))


@pytest.fixture(scope="module")
def raw(mooncake_raw):
    return mooncake_raw


@pytest.fixture(scope="module")
def mha(mooncake_master):
    b = backend(mooncake_master, model_name=MODEL, tp_rank=0, tp_size=1)
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _clean(raw):
    yield
    raw.remove_all(True)


def test_round_trip_and_sglang_key_layout(mha, raw):
    value = page(1)
    assert mha.set(KEYS[0], value)
    assert raw.get(f"org-model_{KEYS[0]}_0_k") == value[: PAGE // 2].numpy().tobytes()
    assert raw.get(f"org-model_{KEYS[0]}_0_v") == value[PAGE // 2 :].numpy().tobytes()
    assert torch.equal(mha.get(KEYS[0]), value)
    assert torch.equal(mha.get(KEYS[0], target_sizes=PAGE), value)
    target = torch.empty(PAGE // 2, dtype=torch.float16)
    assert mha.get(KEYS[0], target) is target and torch.equal(target.view(torch.uint8), value)
    assert mha.exists(KEYS[0]) and not mha.exists(KEYS[1])
    assert mha.get(KEYS[1]) is None


def test_wrong_size_is_a_miss(mha):
    mha.set(KEYS[0], page(1))
    assert mha.get(KEYS[0], torch.empty(PAGE - 2, dtype=torch.uint8)) is None
    assert mha.get(KEYS[0], torch.empty(PAGE + 2, dtype=torch.uint8)) is None
    assert mha.get(KEYS[0], target_sizes=PAGE * 2) is None


def test_batch_ops_and_longest_prefix(mha, raw):
    values = [page(i) for i in range(6)]
    assert mha.batch_set(KEYS, values)
    assert mha.batch_exists(KEYS) == 6
    targets = [torch.empty(PAGE, dtype=torch.uint8) for _ in KEYS]
    got = mha.batch_get(KEYS, targets)
    assert all(g is t and torch.equal(t, v) for g, t, v in zip(got, targets, values))
    assert raw.remove(f"org-model_{KEYS[3]}_0_v", True) == 0  # half a page: the page is gone
    assert mha.batch_exists(KEYS) == 3
    assert mha.batch_get(KEYS[2:5])[1] is None
    # only the missing object is written: what the store holds is never replaced, whoever wrote it
    assert mha.batch_set(KEYS, [page(100 + i) for i in range(6)])
    assert torch.equal(mha.get(KEYS[0]), values[0])
    assert mha.get(KEYS[3]) is None  # halves of two writers fail the page's check: a miss, never mixed KV
    assert mha.get_stats()["writes_skipped_existing"] >= 5
    assert mha.batch_exists([]) == 0


def test_registered_pool_zero_copy(mooncake_master):
    b = backend(mooncake_master)
    try:
        pool = torch.zeros(8, PAGE, dtype=torch.uint8)
        b.register_buffer(pool)
        for i in range(4):
            pool[i] = page(i)
        assert b.batch_set(KEYS[:4], [pool[i] for i in range(4)])
        assert b.batch_get(KEYS[:4], [pool[4 + i] for i in range(4)])[3] is not None
        assert torch.equal(pool[4:], pool[:4])
    finally:
        b.close()


def test_mla_pp_and_tag_key_layout(mooncake_master, raw):
    """SGLang's keys: [tag_]model_hash, then _{tp}_k|v (MHA), __k (MLA: an empty rank part), with PP _{tp}_{pp}_k|v
    and _{pp}_k."""
    mla = backend(mooncake_master, model_name=MODEL, is_mla_model=True, tp_rank=2, tp_size=4)
    mla_pp = backend(mooncake_master, model_name=MODEL, is_mla_model=True, pp_rank=1, pp_size=2)
    pp = backend(mooncake_master, model_name=MODEL, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2,
                 extra={"extra_backend_tag": "blue"})
    bare = backend(mooncake_master, model_name="", tp_rank=3, tp_size=4)
    try:
        assert mla.set(KEYS[0], page(0, 1000))  # MLA pages need not split in halves
        assert raw.is_exist(f"org-model_{KEYS[0]}__k") == 1 and raw.is_exist(f"org-model_{KEYS[0]}_2_k") == 0
        assert mla_pp.set(KEYS[0], page(2, 1000)) and raw.is_exist(f"org-model_{KEYS[0]}_1_k") == 1
        assert pp.set(KEYS[0], page(1))
        assert raw.is_exist(f"blue_org-model_{KEYS[0]}_1_1_k") == 1
        assert raw.is_exist(f"blue_org-model_{KEYS[0]}_1_1_v") == 1
        assert bare.set(KEYS[0], page(3)) and raw.is_exist(f"{KEYS[0]}_3_k") == 1
        assert torch.equal(mla.get(KEYS[0]), page(0, 1000)) and torch.equal(pp.get(KEYS[0]), page(1))
        assert torch.equal(mla_pp.get(KEYS[0]), page(2, 1000))
        with pytest.raises(ValueError, match="even"):
            pp.set(KEYS[1], page(0, 1001))
    finally:
        for b in (mla, mla_pp, pp, bare):
            b.close()


def test_clear_removes_only_this_tag_model_and_rank(mooncake_master, raw):
    a = backend(mooncake_master, extra={"extra_backend_tag": "a"})
    others = [backend(mooncake_master, extra={"extra_backend_tag": "b"}),
              backend(mooncake_master, model_name="builtin:tiny_x", extra={"extra_backend_tag": "a"}),
              backend(mooncake_master, tp_rank=1, tp_size=2, extra={"extra_backend_tag": "a"}),
              backend(mooncake_master, is_mla_model=True, extra={"extra_backend_tag": "a"})]
    try:
        for b in [a, *others]:
            assert b.batch_set(KEYS[:2], [page(0), page(1)])
        a.clear()
        assert a.batch_exists(KEYS[:2]) == 0
        assert [b.batch_exists(KEYS[:2]) for b in others] == [2, 2, 2, 2]
    finally:
        for b in [a, *others]:
            b.close()


@pytest.mark.parametrize("env_hostname", [None, "127.0.0.1"])
def test_pod_hostname_env_wins_over_config(mooncake_master, monkeypatch, env_hostname):
    """The master registers the client's segment under the hostname it was set up with."""
    if env_hostname:
        monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", env_hostname)
    else:
        monkeypatch.delenv("MOONCAKE_LOCAL_HOSTNAME", raising=False)
        monkeypatch.delenv("LOCAL_HOSTNAME", raising=False)
    b = backend(mooncake_master, extra={"local_hostname": "localhost"})
    try:
        segment = b.get_stats()["segment_name"]
        expected = env_hostname or "localhost"
        assert segment.startswith(expected + ":")
        assert segment in mooncake_master.segments()
        assert b.set(KEYS[0], page(0)) and torch.equal(b.get(KEYS[0]), page(0))
    finally:
        b.close()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_master_killed_then_restarted(mooncake_env):
    """Kill -9 the master mid-run: calls raise StorageUnavailable within seconds and keep doing so at once;
    a master restarted on the same port brings the same backend back."""
    master = MooncakeMaster().start()
    b = backend(master)
    try:
        assert b.batch_set(KEYS[:2], [page(0), page(1)]) and b.batch_exists(KEYS) == 2
        master.kill()
        deadline = time.monotonic() + 30
        while not b.degraded and time.monotonic() < deadline:
            try:
                assert b.batch_exists(KEYS) in (0, 2)  # until the client notices, answers stay truthful
            except StorageUnavailable:
                break
            time.sleep(0.2)
        assert b.degraded and b.get_stats()["degraded"]
        for call in (lambda: b.batch_exists(KEYS), lambda: b.batch_get(KEYS[:1]),
                     lambda: b.batch_set(KEYS[2:3], [page(2)]), lambda: b.get(KEYS[0])):
            with pytest.raises(StorageUnavailable):
                call()

        master.start()  # same ports
        deadline = time.monotonic() + 30
        recovered = False
        while not recovered and time.monotonic() < deadline:
            try:
                recovered = b.set(KEYS[4], page(4))  # False while the client re-mounts its segment
            except StorageUnavailable:
                pass
            time.sleep(0.2)
        assert recovered and not b.degraded
        assert torch.equal(b.get(KEYS[4]), page(4))
        assert b.batch_exists(KEYS) == 0  # the old master's objects died with it
        assert b.get_stats()["degraded_events"] >= 1
    finally:
        b.close()
        master.stop()
        master.log_path.unlink(missing_ok=True)
