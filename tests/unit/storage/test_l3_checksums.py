"""A damaged L3 page reads as a miss, never as wrong KV, where the page format carries a checksum.

Mooncake objects are raw K / V bytes (SGLang's format), so this runtime stores a check object
next to every page it writes; the file backend appends a trailer. Pages SGLang wrote carry
neither, and are served unverified: the documented limit, counted in the stats.
"""

import os

import pytest
import torch

from cache_runtime.storage import HiCacheStorageConfig, create_storage_backend, page_hashes
from testbed.mooncake import mooncake_env, mooncake_master, mooncake_raw  # noqa: F401  (fixtures)

KEYS = page_hashes(list(range(64)), 16)  # 4 chained page keys
PAGE = 4096
MODEL = "org/model"


def page(seed, nbytes=PAGE):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x10
    return bytes(out)


@pytest.fixture(scope="module")
def raw(mooncake_raw):
    return mooncake_raw


@pytest.fixture(autouse=True)
def _clean(request):
    yield
    if "raw" in request.fixturenames:
        request.getfixturevalue("raw").remove_all(True)


def mooncake(master, **cfg):
    return create_storage_backend("mooncake", HiCacheStorageConfig(
        extra_config=master.extra_config(), model_name=MODEL, **cfg))


def damage(raw, key: str, at: int) -> None:
    value = raw.get(key)
    assert value, f"{key} is not in the store"
    assert raw.remove(key, True) == 0
    assert raw.put(key, flipped(value, at)) == 0


@pytest.mark.parametrize("half", ["k", "v"])
def test_mooncake_flipped_bit_in_a_runtime_page_is_a_miss(mooncake_master, raw, half):
    b = mooncake(mooncake_master)
    try:
        assert b.batch_set(KEYS[:2], [page(0), page(1)])
        damage(raw, f"org-model_{KEYS[0]}_0_{half}", 17)
        assert b.get(KEYS[0]) is None
        assert b.get(KEYS[0], target_sizes=PAGE) is None
        target = torch.empty(PAGE, dtype=torch.uint8)
        assert b.batch_get(KEYS[:2], [target, torch.empty(PAGE, dtype=torch.uint8)])[0] is None
        assert torch.equal(b.get(KEYS[1]), page(1))
        assert b.get_stats()["unusable_pages"] >= 3
    finally:
        b.close()


def test_mooncake_mla_page_and_damaged_check_object(mooncake_master, raw):
    mla = mooncake(mooncake_master, is_mla_model=True)
    try:
        assert mla.batch_set(KEYS[:2], [page(5, 1000), page(6, 1000)])
        damage(raw, f"org-model_{KEYS[0]}__k", 999)
        damage(raw, f"org-model_{KEYS[1]}__crc", 12)  # the check itself damaged: still no wrong KV served
        assert mla.batch_get(KEYS[:2], target_sizes=[1000, 1000]) == [None, None]
        assert mla.set(KEYS[2], page(7, 1000))
        assert raw.remove(f"org-model_{KEYS[2]}__crc", True) == 0
        assert raw.put(f"org-model_{KEYS[2]}__crc", b"x" * 32) == 0  # a check object of another size
        assert mla.get(KEYS[2], target_sizes=1000) is None
    finally:
        mla.close()


def test_mooncake_halves_from_two_writers_are_a_miss(mooncake_master, raw):
    """A page whose V half a second writer re-stored with other bytes is not served as one page."""
    b = mooncake(mooncake_master)
    try:
        assert b.set(KEYS[0], page(0))
        assert raw.remove(f"org-model_{KEYS[0]}_0_v", True) == 0
        assert b.set(KEYS[0], page(100))  # only the missing half is written; the check object stays
        assert b.get(KEYS[0]) is None
    finally:
        b.close()


def test_mooncake_pages_without_check_object_are_served_unverified(mooncake_master, raw):
    """SGLang's pages (K and V objects, nothing else) still read; they are counted as unverified."""
    b = mooncake(mooncake_master)
    try:
        value = page(7).numpy().tobytes()
        assert raw.put(f"org-model_{KEYS[0]}_0_k", value[: PAGE // 2]) == 0
        assert raw.put(f"org-model_{KEYS[0]}_0_v", value[PAGE // 2 :]) == 0
        assert torch.equal(b.get(KEYS[0], target_sizes=PAGE), page(7))
        assert b.get_stats()["unverified_hits"] == 1
        assert b.set(KEYS[0], page(8))  # an existing page gets no check object from a later writer
        assert raw.is_exist(f"org-model_{KEYS[0]}_0_crc") == 0
    finally:
        b.close()


def test_mooncake_check_objects_are_written_and_cleared(mooncake_master, raw):
    b = mooncake(mooncake_master, tp_rank=1, tp_size=2)
    try:
        assert b.batch_set(KEYS[:2], [page(0), page(1)])
        assert raw.is_exist(f"org-model_{KEYS[0]}_1_crc") == 1
        assert b.get_stats()["writes"] == 4
        b.clear()
        assert raw.is_exist(f"org-model_{KEYS[0]}_1_crc") == 0
        assert raw.is_exist(f"org-model_{KEYS[0]}_1_k") == 0
    finally:
        b.close()


def test_file_flipped_bit_in_a_runtime_page_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    b = create_storage_backend("file", HiCacheStorageConfig(model_name=MODEL,
                                                            extra_config={"file_storage_path": str(tmp_path)}))
    assert b.set(KEYS[0], page(0))
    path = os.path.join(tmp_path, f"{KEYS[0]}{b.suffix}.bin")
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(flipped(data, 5))
    assert b.get(KEYS[0], target_sizes=PAGE) is None
    assert b.get_stats()["unusable_pages"] == 1
