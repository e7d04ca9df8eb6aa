"""SGLang's end of the L3 page exchange; run as a child under one sglang version (``sglang_oracle.run``).

Never imported by the test process. Reads the request ``testbed/sglang_storage.py`` builds:
cases to write (their KV by layer and token) and to read back, and inputs to key. For each case it
builds SGLang's host pool for the layout, puts the KV at the (layer, token) rows SGLang's
``init_kv_buffer`` axes name (checked against the allocated shape), and moves pages with the cache
controller's own page functions and SGLang's storage classes; keys come from the hash functions the
controller uses. Differences between versions are detected by what the version provides, never by
its number: the namespace-seeded key function, the host-pool constructor, the controller's
counting, whether MooncakeStore prefixes the model name. A storage call SGLang itself refuses
for a configuration comes back as its message, so the test can tell that apart from a mismatch.
"""

import base64
import dataclasses
import json
import sys
import types
from array import array

import torch

from testbed.sglang_child import stand_in_transfer_kernels  # noqa: E402

stand_in_transfer_kernels()  # older releases import them with the host pools; the page paths here never call them

from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

try:  # versions that seed a namespace's first L3 page with its extra_key / cache_salt
    from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed
except ImportError:
    get_storage_hash_str = storage_namespace_seed = None
    from sglang.srt.mem_cache.hicache_storage import get_hash_str
try:
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
except ImportError:
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
try:  # host pools built from a description of the device buffers
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    POOL_INFO = True
except ImportError:  # host pools built from a device pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    POOL_INFO = False

req = json.load(sys.stdin)
DTYPE = getattr(torch, req["dtype"])
L, P, FIRST = req["layers"], req["page_size"], req["host_first"]
CPU = torch.device("cpu")
MODEL_PREFIX = "-".join(req["model"].split("/"))
keep_alive = []  # host buffers stay registered with Mooncake until exit


class Operation:
    """What the controller's page functions read of a prefetch operation (older versions count through it)."""

    request_id = "interop"

    def __init__(self):
        self.completed = 0

    def is_terminated(self):
        return False

    def increment(self, n):
        self.completed += n
        return True


def b64(t):
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()


def tensor(text, shape):
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=DTYPE).view(shape)


def new_host_pool(case, size):
    H, D, layout = case["heads"], case["dim"], case["layout"]
    if POOL_INFO and case["mla"]:
        dev = tuple(torch.zeros(size, 1, D, dtype=DTYPE) for _ in range(L))
        info = MLABufferInfo(buffers=dev, data_ptrs=torch.tensor([t.data_ptr() for t in dev]),
                             layer_indices=tuple(range(L)), device_layer_num=L, page_size=P,
                             kv_lora_rank=req["kv_lora_rank"], qk_rope_head_dim=req["qk_rope_head_dim"],
                             kv_cache_dim=D, dtype=DTYPE, device=CPU)
        return MLATokenToKVPoolHost(info, 2.0, 0, P, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=size, start_layer=0, end_layer=L, target_layer_num=L,
                                    host_token_capacity=size)
    if POOL_INFO:
        k = tuple(torch.zeros(size, H, D, dtype=DTYPE) for _ in range(L))
        v = tuple(torch.zeros(size, H, D, dtype=DTYPE) for _ in range(L))
        bufs = KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                         v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD)
        info = MHABufferInfo(buffers=bufs, page_size=P, head_num=H, head_dim=D, v_head_dim=D, dtype=DTYPE,
                             device=CPU)
        return MHATokenToKVPoolHost(info, 2.0, 0, P, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=size, start_layer=0, end_layer=L,
                                    host_token_capacity=size)
    if case["mla"]:
        device_pool = MLATokenToKVPool(size, P, DTYPE, req["kv_lora_rank"], req["qk_rope_head_dim"], L, "cpu", False)
        return MLATokenToKVPoolHost(device_pool, 2.0, 0, P, layout, pin_memory=False, device="cpu")
    device_pool = MHATokenToKVPool(size, P, DTYPE, H, D, L, "cpu", False, enable_alt_stream=False)
    return MHATokenToKVPoolHost(device_pool, 2.0, 0, P, layout, pin_memory=False, device="cpu")


def host_pool(case):
    pool = new_host_pool(case, (case["pages"] + 2) * P)
    n, H, D = pool.size, case["heads"], case["dim"]
    declared = {  # init_kv_buffer's axes
        (False, "layer_first"): (2, L, n, H, D), (False, "page_first"): (2, n, L, H, D),
        (False, "page_first_direct"): (2, n // P, L, P, H, D),
        (True, "layer_first"): (L, n, 1, D), (True, "page_first"): (n, L, 1, D),
        (True, "page_first_direct"): (n // P, L, P, 1, D),
    }[(case["mla"], case["layout"])]
    assert tuple(pool.kv_buffer.shape) == declared, (tuple(pool.kv_buffer.shape), declared)
    assert n >= FIRST + len(case["tokens"])
    keep_alive.append(pool)
    return pool


def row(pool, case, layer, i):
    """The host row of (layer, token slot i): K and V (2, H, D) for MHA, the latent (1, D) for MLA."""
    kv, layout = pool.kv_buffer, case["layout"]
    if case["mla"]:
        return {"layer_first": lambda: kv[layer, i], "page_first": lambda: kv[i, layer],
                "page_first_direct": lambda: kv[i // P, layer, i % P]}[layout]()
    return {"layer_first": lambda: kv[:, layer, i], "page_first": lambda: kv[:, i, layer],
            "page_first_direct": lambda: kv[:, i // P, layer, i % P]}[layout]()


def keys_for(tokens, extra_key, cache_salt, page_size):
    """The keys this version's prefetch and backup paths give a request's pages, chained from the root."""
    if get_storage_hash_str is not None:
        key = RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)
        return get_storage_hash_str(key, None, page_size=page_size)
    keys, last = [], None
    for start in range(0, len(tokens), page_size):
        last = get_hash_str(tokens[start : start + page_size], last)
        keys.append(last)
    return keys


def storage_config(case, extra):
    wanted = dict(tp_rank=case["tp_rank"], tp_size=case["tp_size"], pp_rank=0, pp_size=1, attn_cp_rank=0,
                  attn_cp_size=1, is_mla_model=case["mla"], enable_storage_metrics=False,
                  is_page_first_layout=case["layout"] == "page_first", model_name=req["model"],
                  extra_config=extra)
    return HiCacheStorageConfig(**{f.name: wanted[f.name] for f in dataclasses.fields(HiCacheStorageConfig)
                                   if f.name in wanted})


def mooncake_store(case):
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    store = MooncakeStore(storage_config(case, dict(req["mooncake"])))
    if not hasattr(store, "config_prefix"):  # this version keys objects without the model name: lend it as the tag
        store.store.close()
        store = MooncakeStore(storage_config(case, dict(req["mooncake"], extra_backend_tag=MODEL_PREFIX)))
    return store


stores = {}


def storage(case):
    ident = (case["backend"], case["tp_rank"], case["tp_size"], case["mla"])
    if ident not in stores:
        # the file backend's directory comes from SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR
        stores[ident] = HiCacheFile(storage_config(case, {})) if case["backend"] == "file" else mooncake_store(case)
    return stores[ident]


def controller(case, pool):
    store = storage(case)
    if case["backend"] == "mooncake":
        store.register_mem_pool_host(pool)
    return types.SimpleNamespace(storage_host_pool=pool, mem_pool_host=pool, page_size=P, storage_backend=store)


def indices(case):
    return torch.arange(FIRST, FIRST + len(case["tokens"]), dtype=torch.int64)


def sglang_call(call):
    """(result, None), or (None, SGLang's message) when SGLang refuses the configuration."""
    try:
        return call(), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def write(case):
    pool = host_pool(case)
    T = len(case["tokens"])
    k = tensor(case["k"], (L, T, case["heads"], case["dim"]))
    v = None if case["v"] is None else tensor(case["v"], (L, T, case["heads"], case["dim"]))
    for layer in range(L):
        for t in range(T):
            kv = k[layer, t] if v is None else torch.stack([k[layer, t], v[layer, t]])
            row(pool, case, layer, FIRST + t).copy_(kv)
    keys = keys_for(case["tokens"], case["extra_key"], case["cache_salt"], P)
    page_set = (HiCacheController._generic_page_set if case["backend"] == "file"
                else HiCacheController._page_set_zero_copy)
    ok, refused = sglang_call(lambda: page_set(controller(case, pool), keys, indices(case)))
    return {"keys": keys, "ok": bool(ok), "refused": refused}


def read_into(case, pool, keys):
    op = Operation()
    page_get = (HiCacheController._generic_page_get if case["backend"] == "file"
                else HiCacheController._page_get_zero_copy)
    got, refused = sglang_call(lambda: page_get(controller(case, pool), op, keys, indices(case)))
    return (got if isinstance(got, int) else op.completed // P), refused


def read(case):
    pool = host_pool(case)
    keys = keys_for(case["tokens"], case["extra_key"], case["cache_salt"], P)
    hits, refused = read_into(case, pool, keys)
    T = len(case["tokens"])
    rows = torch.stack([torch.stack([row(pool, case, layer, FIRST + t) for t in range(T)]) for layer in range(L)])
    k, v = (rows, None) if case["mla"] else (rows[:, :, 0], rows[:, :, 1])
    other_keys = keys_for(case["tokens"], case["other_ns"][0], case["other_ns"][1], P)
    # a version whose keys ignore the namespace has nothing to isolate here
    other_hits = None if other_keys == keys or refused else read_into(case, host_pool(case), other_keys)[0]
    return {"keys": keys, "hits": hits, "refused": refused, "k": b64(k), "v": None if v is None else b64(v),
            "other_ns_hits": other_hits}


def reference_keys(q):
    try:
        return keys_for(q["tokens"], q["extra_key"], q["cache_salt"], q["page_size"])
    except (OverflowError, ValueError, IndexError):  # token ids this version cannot hash
        return None


answer = {
    "written": [write(case) for case in req["write"]],
    "read": [read(case) for case in req["read"]],
    "keys": [reference_keys(q) for q in req["keys"]],
    "seeds": [None if storage_namespace_seed is None else storage_namespace_seed(q["extra_key"], q["cache_salt"])
              for q in req["keys"]],
}
answer["namespace_seeded"] = get_storage_hash_str is not None
for store in stores.values():
    if hasattr(store, "store"):
        store.store.close()
print(json.dumps(answer))
