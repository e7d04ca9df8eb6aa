import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cache_runtime.storage import HiCacheStorageConfig, StorageUnavailable, create_storage_backend, page_hashes
from cache_runtime.storage import file_backend
from cache_runtime.storage.file_backend import HiCacheFile
from cache_runtime.storage.file_eviction import parse_size
from cache_runtime.storage.page_trailer import TRAILER_SIZE

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _no_dir_env(monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)


def make(tmp_path, **kw):
    extra = {"file_storage_path": str(tmp_path), **kw.pop("extra", {})}
    return create_storage_backend("file", HiCacheStorageConfig(extra_config=extra, **kw))


def page(seed, n=256, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def path_of(backend, key):
    return Path(backend.file_path) / f"{key}{backend.suffix}.bin"


KEYS = page_hashes(list(range(64)), 16)  # 4 chained SGLang page keys


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_round_trip_bytes_exact(tmp_path, dtype):
    b = make(tmp_path)
    value = page(1, dtype=dtype) if dtype != torch.uint8 else torch.arange(256, dtype=torch.uint8)
    assert b.set(KEYS[0], value)
    got = b.get(KEYS[0])
    assert got.dtype == torch.uint8 and torch.equal(got.view(dtype), value)
    target = torch.empty_like(value)
    assert b.get(KEYS[0], target) is target and torch.equal(target, value)


def test_file_naming_matches_sglang(tmp_path):
    def name(**kw):
        return HiCacheFile(HiCacheStorageConfig(extra_config={"file_storage_path": str(tmp_path)}, **kw)).suffix
    assert name(model_name="meta-llama/Llama-3.1-8B", tp_rank=1, tp_size=4) == "_meta-llama-Llama-3.1-8B_1_4"
    assert name(model_name="org/m", is_mla_model=True, tp_rank=3, tp_size=4) == "_org-m"
    assert name(model_name="m", tp_rank=0, tp_size=2, pp_rank=1, pp_size=2) == "_m_0_2_2_1"
    b = make(tmp_path, model_name="a/b", tp_rank=0, tp_size=2)
    b.set("abc", page(0))
    assert (tmp_path / "abc_a-b_0_2.bin").is_file()


def test_dir_precedence_is_sglangs(tmp_path, monkeypatch):
    """The env var, then extra_config file_storage_path, then /tmp/hicache; SGLang has no storage_dir key."""
    env_dir, extra_dir = tmp_path / "env", tmp_path / "extra"
    extra = HiCacheStorageConfig(extra_config={"file_storage_path": str(extra_dir)})
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(env_dir))
    assert HiCacheFile(HiCacheStorageConfig()).file_path == str(env_dir)
    assert HiCacheFile(extra).file_path == str(env_dir)
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
    assert HiCacheFile(extra).file_path == str(extra_dir)
    assert HiCacheFile(HiCacheStorageConfig()).file_path == "/tmp/hicache"
    assert HiCacheFile(HiCacheStorageConfig(extra_config={"storage_dir": str(extra_dir)})).file_path == "/tmp/hicache"


def test_existing_key_is_skipped(tmp_path):
    b = make(tmp_path)
    assert b.set(KEYS[0], page(1))
    assert b.set(KEYS[0], page(2))  # True, as SGLang: the page is there
    assert torch.equal(b.get(KEYS[0]).view(torch.float16), page(1))
    assert b.get_stats()["writes_skipped_existing"] == 1


def flip_bit(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["payload_start", "payload_end", "crc", "length"])
def test_bit_flip_is_a_miss_and_the_file_is_left_alone(tmp_path, where):
    b = make(tmp_path)
    b.set(KEYS[0], page(1))
    p = path_of(b, KEYS[0])
    size = p.stat().st_size
    offset = {"payload_start": 0, "payload_end": size - TRAILER_SIZE - 1, "crc": size - 1, "length": size - 12}[where]
    flip_bit(p, offset)
    damaged = p.read_bytes()
    assert b.get(KEYS[0]) is None
    assert b.get(KEYS[0], torch.empty(256, dtype=torch.float16)) is None
    assert b.get(KEYS[0], target_sizes=512) is None
    assert b.get_stats()["unusable_pages"] == 3
    # never deleted nor rewritten: it cannot be told from another engine's page under the same name
    assert b.set(KEYS[0], page(1)) and p.read_bytes() == damaged
    assert b.get(KEYS[0], target_sizes=512) is None


@pytest.mark.parametrize("keep", [1, 100, 511, 512 + 1, 512 + TRAILER_SIZE - 1])
def test_truncated_page_is_a_miss(tmp_path, keep):
    b = make(tmp_path)
    b.set(KEYS[0], page(1))
    p = path_of(b, KEYS[0])
    with open(p, "r+b") as f:
        f.truncate(keep)
    assert b.get(KEYS[0]) is None
    assert b.get(KEYS[0], torch.empty(256, dtype=torch.float16)) is None
    assert b.batch_get(KEYS[:1], target_sizes=[512]) == [None]
    assert p.stat().st_size == keep


def test_page_cut_exactly_at_its_trailer_is_a_whole_bare_page(tmp_path):
    b = make(tmp_path)
    b.set(KEYS[0], page(1))
    with open(path_of(b, KEYS[0]), "r+b") as f:
        f.truncate(512)
    assert b.get(KEYS[0]) is None  # no size stated: nothing to check a bare page against
    assert torch.equal(b.get(KEYS[0], target_sizes=512).view(torch.float16), page(1))


def test_empty_or_deleted_page_does_not_exist(tmp_path):
    b = make(tmp_path)
    b.batch_set(KEYS[:2], [page(0), page(1)])
    with open(path_of(b, KEYS[0]), "r+b") as f:
        f.truncate(0)
    path_of(b, KEYS[1]).unlink()
    assert not b.exists(KEYS[0]) and not b.exists(KEYS[1])
    assert b.get(KEYS[0], target_sizes=512) is None and b.get(KEYS[1], target_sizes=512) is None


def test_sglang_bare_page_is_served_when_its_size_is_the_stated_one(tmp_path):
    """SGLang's HiCacheFile writes the raw page bytes only; a read that states that size gets them."""
    b = make(tmp_path)
    raw = page(7).view(torch.uint8).numpy().tobytes()
    path_of(b, KEYS[0]).write_bytes(raw)
    assert b.exists(KEYS[0]) and b.batch_exists(KEYS[:1]) == 1
    target = torch.empty(256, dtype=torch.float16)
    assert b.get(KEYS[0], target) is target and torch.equal(target, page(7))
    assert torch.equal(b.batch_get(KEYS[:1], target_sizes=[512])[0].view(torch.float16), page(7))
    assert b.get(KEYS[0]) is None  # without a stated size a bare page cannot be checked
    assert b.get(KEYS[0], target_sizes=510) is None and b.get(KEYS[0], target_sizes=1024) is None
    assert b.get_stats()["bare_page_hits"] == 2
    assert b.set(KEYS[0], page(8)) and path_of(b, KEYS[0]).read_bytes() == raw  # SGLang's page stays


def test_garbage_and_foreign_files_are_misses(tmp_path):
    b = make(tmp_path)
    # random bytes of a plausible size (a page plus a trailer's length)
    path_of(b, KEYS[0]).write_bytes(os.urandom(512 + TRAILER_SIZE))
    # a bare page of another size
    path_of(b, KEYS[1]).write_bytes(os.urandom(256))
    # a valid page of another key copied under this key's name
    b.set(KEYS[3], page(3))
    path_of(b, KEYS[2]).write_bytes(path_of(b, KEYS[3]).read_bytes())
    for k in KEYS[:3]:
        assert b.get(k) is None and b.get(k, target_sizes=512) is None
    assert b.get(KEYS[3], target_sizes=512) is not None


def test_a_page_published_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    """Another engine writes the same key between our existence check and our publish: its page stays."""
    b = make(tmp_path)
    theirs = page(9).view(torch.uint8).numpy().tobytes()
    real_link = os.link

    def racing_link(src, dst):
        Path(dst).write_bytes(theirs)
        return real_link(src, dst)

    monkeypatch.setattr(file_backend.os, "link", racing_link)
    assert b.set(KEYS[0], page(1))
    assert path_of(b, KEYS[0]).read_bytes() == theirs
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


def test_filesystem_without_hard_links_still_publishes(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(file_backend.os, "link", no_link)
    b = make(tmp_path)
    assert b.set(KEYS[0], page(1))
    assert torch.equal(b.get(KEYS[0]).view(torch.float16), page(1))
    assert os.listdir(tmp_path) == [path_of(b, KEYS[0]).name]


def test_wrong_size_target_is_a_miss_but_keeps_the_page(tmp_path):
    b = make(tmp_path)
    b.set(KEYS[0], page(1))
    assert b.get(KEYS[0], torch.empty(255, dtype=torch.float16)) is None
    assert b.get(KEYS[0], target_sizes=100) is None
    assert b.get(KEYS[0], target_sizes=512) is not None
    assert path_of(b, KEYS[0]).exists()


def test_batch_exists_is_longest_prefix(tmp_path):
    b = make(tmp_path)
    assert b.batch_set(KEYS, [page(i) for i in range(4)])
    assert b.batch_exists(KEYS) == 4
    path_of(b, KEYS[2]).unlink()
    assert b.batch_exists(KEYS) == 2  # page 3 exists but after a gap
    flip_bit(path_of(b, KEYS[1]), path_of(b, KEYS[1]).stat().st_size - 12)  # its trailer no longer fits the file
    assert b.batch_exists(KEYS) == 1
    assert b.batch_exists([]) == 0


def test_batch_get_mixed_and_targets(tmp_path):
    b = make(tmp_path)
    b.batch_set(KEYS[:2], [page(0), page(1)])
    got = b.batch_get(KEYS[:3])
    assert torch.equal(got[0].view(torch.float16), page(0)) and got[2] is None
    targets = [torch.empty(256, dtype=torch.float16) for _ in range(3)]
    got = b.batch_get(KEYS[:3], targets)
    assert got[1] is targets[1] and torch.equal(targets[1], page(1)) and got[2] is None
    with pytest.raises(ValueError, match="entries"):
        b.batch_get(KEYS[:3], targets[:2])


def test_caller_errors_are_clear(tmp_path):
    b = make(tmp_path)
    with pytest.raises(ValueError, match="contiguous"):
        b.set(KEYS[0], torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="key"):
        b.set("../escape", page(0))
    with pytest.raises(ValueError, match="empty"):
        b.set(KEYS[0], torch.empty(0))
    with pytest.raises(TypeError):
        b.set(KEYS[0], b"bytes")
    with pytest.raises(ValueError):
        b.batch_set(KEYS[:2], [page(0)])


def test_no_temp_files_left_and_concurrent_readers_see_whole_pages(tmp_path):
    b = make(tmp_path)
    big = [page(i, n=1 << 18) for i in range(4)]  # 512 KiB pages
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            for i, k in enumerate(KEYS):
                v = b.get(k)
                if v is not None:
                    seen.append(torch.equal(v.view(torch.float16), big[i]))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    writers = [threading.Thread(target=b.batch_set, args=(KEYS, big)) for _ in range(3)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in threads:
        t.join()
    assert all(seen)
    assert b.batch_exists(KEYS) == 4
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


WRITER = """
import resource, signal, sys, torch
from cache_runtime.storage import HiCacheStorageConfig, create_storage_backend
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
b = create_storage_backend("file", HiCacheStorageConfig(extra_config={"file_storage_path": sys.argv[1]}))
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
print(b.set("k", torch.ones(1 << 16, dtype=torch.uint8)), b.get_stats().get("write_failures"))
"""


def test_write_failing_midway_leaves_no_page(tmp_path):
    """The OS cuts the write after 4 KiB of a 64 KiB page: no file may appear under the page's name."""
    out = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "1"]
    assert os.listdir(tmp_path) == []
    assert not make(tmp_path).exists("k")


def test_lru_cap_evicts_oldest_and_keeps_recently_read(tmp_path):
    file_bytes = 512 + TRAILER_SIZE
    b = make(tmp_path, extra={"max_size": 3 * file_bytes, "eviction_ratio": 1.0})
    keys = page_hashes(list(range(80)), 16)
    for i in range(3):
        assert b.set(keys[i], page(i))
    assert b.get(keys[0]) is not None  # now most recently used
    assert b.set(keys[3], page(3))
    assert [b.exists(k) for k in keys[:4]] == [True, False, True, True]
    assert b.get_stats()["bytes_used"] <= 3 * file_bytes
    assert not b.set(keys[4], page(4, n=4096))  # larger than the whole cap
    assert b.get_stats()["evictions"] == 1


def test_lru_eviction_ratio_and_env_and_restart_scan(tmp_path, monkeypatch):
    file_bytes = 512 + TRAILER_SIZE
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", str(4 * file_bytes))
    b = make(tmp_path, extra={"eviction_ratio": 0.5})
    keys = page_hashes(list(range(80)), 16)
    for i in range(4):
        b.set(keys[i], page(i))
    b.set(keys[4], page(4))  # over the cap: evict down to 0.5*cap - incoming -> 1 old page survives
    assert sum(b.exists(k) for k in keys[:4]) == 1 and b.exists(keys[4])
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", str(file_bytes))
    b2 = make(tmp_path)  # a restart with a smaller cap trims what is on disk
    assert b2.get_stats()["bytes_used"] <= file_bytes


@pytest.mark.parametrize("value,expected", [(0, 0), ("1048576", 1 << 20), ("2Ki", 2048), ("2k", 2000), ("1.5G", 1_500_000_000),
                                            ("3Gi", 3 << 30), ("3G", 3 * 10**9), (None, 0), ("2K", 0), ("lots", 0), (-1, 0)])
def test_parse_size(value, expected):
    """SGLang's reading (tests/unit/storage/test_sglang_size_strings.py checks it against SGLang): what it
    cannot read, and a negative size, mean no bound."""
    assert parse_size(value, "max_size") == expected


@pytest.mark.parametrize("extra", [{"eviction_ratio": 0}, {"eviction_ratio": "x"}])
def test_bad_eviction_config_is_rejected(tmp_path, extra):
    with pytest.raises(ValueError):
        make(tmp_path, extra=extra)


def test_clear_removes_only_this_ranks_pages(tmp_path):
    b = make(tmp_path, model_name="m")
    other = make(tmp_path, model_name="other")
    b.set(KEYS[0], page(0))
    other.set(KEYS[0], page(0))
    (tmp_path / "unrelated.txt").write_text("keep me")
    b.clear()
    assert not b.exists(KEYS[0]) and other.exists(KEYS[0]) and (tmp_path / "unrelated.txt").exists()


def test_unusable_dir_raises_storage_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageUnavailable):
        make(blocker / "sub")
    d = tmp_path / "dir"
    b = make(d)
    b.set(KEYS[0], page(0))
    for p in d.iterdir():
        p.unlink()
    d.rmdir()
    d.write_text("the mount went away")
    with pytest.raises(StorageUnavailable):
        b.batch_exists(KEYS)
    with pytest.raises(StorageUnavailable):
        b.batch_get(KEYS)
