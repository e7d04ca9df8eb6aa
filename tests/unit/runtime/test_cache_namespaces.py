"""Cache namespaces (SGLang's ``extra_key`` / ``cache_salt``): requests in different namespaces share no cached
prefix, neither in L1/L2 (the radix tree) nor in L3 (page keys seeded by the namespace); requests in the same
namespace share as before. Byte-for-byte agreement of the seeded keys with SGLang's own is checked against the
real SGLang in tests/unit/storage/test_sglang_interop.py."""

from __future__ import annotations

import time

import pytest
import torch
from fastapi.testclient import TestClient

from cache_runtime.args import ServerArgs, normalise
from cache_runtime.hicache import HiCache
from cache_runtime.memory import DevicePool, HostPool
from cache_runtime.policies import PrefetchConfig
from cache_runtime.protocol import BadRequest, CompletionIn, GenerateIn, validate
from cache_runtime.radix import namespace
from cache_runtime.server.app import Server
from cache_runtime.storage import HiCacheStorageConfig, create_storage_backend
from cache_runtime.storage.hashing import namespace_seed, page_hashes
from cache_runtime.storage_io import RankedStorage
from tests.unit.runtime.conftest import accounting_ok

L, H, D, PS = 2, 2, 4, 2
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
SALTED = namespace(None, "tenant-a")
OTHER = namespace(None, "tenant-b")
KEYED = namespace("lora-x", "tenant-a")


def test_namespace_is_none_without_either_field():
    assert namespace() is None and namespace("", "") is None
    assert namespace("", "s") == (None, "s") and namespace("k", None) == ("k", None)


def _cache(storage_dir=None) -> HiCache:
    dev = DevicePool(64, PS, L, H, D, torch.float32, torch.device("cpu"))
    for t in dev.k + dev.v:
        t.copy_(torch.randn_like(t))
    host = HostPool(128, PS, L, H, D, torch.float32, "page_first", pin=False)
    cache = HiCache(dev, host, PS, "write_through", "kernel", wake=lambda: None)
    if storage_dir is not None:
        backend = create_storage_backend("file", HiCacheStorageConfig(
            model_name="m", extra_config={"file_storage_path": str(storage_dir)}))
        cache.attach_storage("file", RankedStorage([backend], [host]), PrefetchConfig(policy="wait_complete",
                                                                                      threshold=PS), {})
    return cache


def _settle(cache: HiCache) -> None:
    deadline = time.monotonic() + 30
    while cache.busy_ops():
        assert cache.wait_transfers(5)
        cache.poll()
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _put(cache: HiCache, tokens, ns):
    prefix = cache.acquire_prefix(tokens, ns)
    own = cache.alloc_device(len(tokens) - prefix.length)
    cache.insert(tokens, torch.cat([prefix.slots, own]), prefix.length, ns)
    cache.release_prefix(prefix)
    _settle(cache)
    return prefix


def _hit(cache: HiCache, tokens, ns) -> int:
    prefix = cache.acquire_prefix(tokens, ns)
    _settle(cache)
    cache.release_prefix(prefix)
    return prefix.length


def test_tree_matches_only_within_a_namespace():
    cache = _cache()
    _put(cache, TOKENS, SALTED)
    assert _hit(cache, TOKENS, None) == 0
    assert _hit(cache, TOKENS, OTHER) == 0 and _hit(cache, TOKENS, KEYED) == 0
    assert _hit(cache, TOKENS, SALTED) == len(TOKENS)
    _put(cache, TOKENS, None)  # the same tokens unsalted: a node of their own
    assert len(cache.root.children) == 2
    _put(cache, TOKENS[:4] + [99, 98], SALTED)  # splits the salted node; the split keeps its namespace
    assert {n.ns for n in cache.tree.nodes()} == {None, SALTED}
    assert _hit(cache, TOKENS[:4] + [99, 98], SALTED) == 6 and _hit(cache, TOKENS[:4] + [99, 98], None) == 4
    cache.evict(10**6)  # L1 gone: the L2 copies keep the namespaces apart the same way
    assert _hit(cache, TOKENS, OTHER) == 0 and _hit(cache, TOKENS, SALTED) == len(TOKENS)
    accounting_ok(cache)
    cache.transfer.stop()


def test_l3_pages_are_keyed_and_found_per_namespace(tmp_path):
    cache = _cache(tmp_path)
    backend = cache.storage.ranks.backends[0]
    _put(cache, TOKENS, KEYED)
    _put(cache, TOKENS[:4] + [99, 98], KEYED)  # a split node continues its parent's chain
    seed = namespace_seed("lora-x", "tenant-a")
    assert backend.batch_exists(page_hashes(TOKENS, PS, seed)) == 4
    assert backend.batch_exists(page_hashes(TOKENS[:4] + [99, 98], PS, seed)) == 3
    assert backend.batch_exists(page_hashes(TOKENS, PS)) == 0  # not under the unsalted keys
    cache.reset()  # L1 and L2 empty: only L3 remembers
    for ns, expected in ((None, 0), (SALTED, 0), (namespace("lora-x", None), 0), (KEYED, len(TOKENS))):
        op = cache.maybe_prefetch(TOKENS, ns)
        deadline = time.monotonic() + 30
        while not op.finished:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert cache.terminate_prefetch(op) == expected, ns
    assert _hit(cache, TOKENS, KEYED) == len(TOKENS) and _hit(cache, TOKENS, None) == 0
    accounting_ok(cache)
    cache.detach_storage()
    cache.transfer.stop()


def test_request_fields_follow_sglangs_rules():
    assert GenerateIn(input_ids=[1], cache_salt="", extra_key="k").cache_keys(None) == [("k", None)]
    batch = GenerateIn(input_ids=[[1], [2]], cache_salt=["a", ""], extra_key="k")
    assert batch.cache_keys(2) == [("k", "a"), ("k", None)]
    with pytest.raises(BadRequest, match="single request"):
        GenerateIn(input_ids=[1], cache_salt=["a"]).cache_keys(None)
    with pytest.raises(BadRequest, match="batch size"):
        CompletionIn(prompt=["a", "b"], extra_key=["k"]).cache_keys(2)
    with pytest.raises(BadRequest, match="cache_salt"):
        validate(GenerateIn, {"input_ids": [1], "cache_salt": 7})


PROMPT = list(range(3, 24))  # 21 tokens: 20 cacheable with page size 4


@pytest.fixture(scope="module")
def client():
    server = Server(normalise(ServerArgs(page_size=4, max_total_tokens=2048, enable_cache_report=True)))
    with TestClient(server.app) as c:
        yield c


def _generate(client, **fields) -> dict:
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_isolates_salts_and_extra_keys(client):
    _generate(client, cache_salt="g-a")
    assert _generate(client, cache_salt="g-a")["meta_info"]["cached_tokens"] == 20
    assert _generate(client, cache_salt="g-b")["meta_info"]["cached_tokens"] == 0
    assert _generate(client, cache_salt="g-a", extra_key="k")["meta_info"]["cached_tokens"] == 0
    assert _generate(client, extra_key="g-a")["meta_info"]["cached_tokens"] == 0  # a field is part of the namespace


def test_generate_batch_takes_one_salt_per_prompt(client):
    body = {"input_ids": [PROMPT, PROMPT], "sampling_params": {"max_new_tokens": 1}}
    client.post("/generate", json={**body, "cache_salt": "batch-a"})
    out = client.post("/generate", json={**body, "cache_salt": ["batch-a", "batch-z"]}).json()
    assert [o["meta_info"]["cached_tokens"] for o in out] == [20, 0]
    bad = client.post("/generate", json={**body, "cache_salt": ["batch-a"]})
    assert bad.status_code == 400 and "batch size" in bad.text


def test_completions_isolate_salts(client):
    def cached(**fields) -> int:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **fields})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="c-a")
    assert cached(cache_salt="c-a") == 20
    assert cached(cache_salt="c-b") == 0
    assert cached(cache_salt="c-a", extra_key="c-k") == 0
    bad = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "cache_salt": ["c-a"]})
    assert bad.status_code == 400 and "single request" in bad.text


def test_chat_completions_isolate_salts(oracles):
    path, _ = oracles("llama-gqa")
    server = Server(normalise(ServerArgs(model_path=str(path), page_size=4, enable_cache_report=True)))
    messages = [{"role": "user", "content": "a fairly long question so that the prompt spans several pages"}]

    def cached(c, **fields) -> int:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **fields})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with TestClient(server.app) as c:
        cached(c, cache_salt="chat-a")
        assert cached(c, cache_salt="chat-a") > 0
        assert cached(c, cache_salt="chat-b") == 0
        assert cached(c) == 0
