"""Both engines' ends of an L3 page exchange, for ``tests/unit/storage/test_sglang_interop.py``.

A :class:`Case` names one configuration (backend, host layout, MHA or MLA, tensor-parallel rank,
cache namespace) and the KV its pages hold: for every layer and token a K and a V row (MHA) or a
latent row (MLA), random but fixed by the case. Each engine puts that KV into its own host pool by
meaning (layer, token), writes pages through its own code, and the other engine reads them through
its own code and hands the KV back by meaning. A page in another byte order, under another key or
in a file the reader refuses therefore fails the comparison instead of passing silently.

SGLang's end (``sglang_storage_child.py``, run as :data:`SGLANG_SIDE`) is a child process under
one installed sglang version (``sglang_oracle.run``). It builds SGLang's real host pools
(``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) and storage classes (``HiCacheFile``,
``MooncakeStore`` against the test's mooncake_master), computes keys with ``get_storage_hash_str``
on a ``RadixKey`` carrying the request's ``extra_key`` / ``cache_salt`` (what its prefetch and
backup paths hash; versions without it chain ``get_hash_str`` as their controller does), and moves pages with the
cache controller's own page functions: ``_generic_page_set`` / ``_generic_page_get`` for the file
backend, ``_page_set_zero_copy`` / ``_page_get_zero_copy`` for Mooncake. The only layout knowledge
the child adds is which host-buffer index holds (layer, token): the axes SGLang's ``init_kv_buffer``
names, checked against the shape of the buffer SGLang allocated.

The runtime's end uses its real pools and copy kernels (``DevicePool`` -> ``kernels`` ->
``HostPool.get_page`` -> backend, and back), or the whole ``HiCache`` with an attached backend.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from cache_runtime.hicache import HiCache
from cache_runtime.memory import DevicePool, HostPool
from cache_runtime.policies import PrefetchConfig
from cache_runtime.radix import namespace
from cache_runtime.storage import HiCacheStorageConfig
from cache_runtime.storage.hashing import namespace_seed, page_hashes
from cache_runtime.storage_io import RankedStorage

LAYERS, PAGE, PAGES = 2, 4, 3
TOKENS = PAGE * PAGES
MHA_HEADS, MHA_DIM = 2, 8
MLA_KV_LORA_RANK, MLA_ROPE_DIM = 8, 4
DTYPE = torch.bfloat16
MODEL = "org/interop-model"  # a '/' in the name, which both engines turn into '-'
HOST_FIRST = PAGE  # pages sit from host page 1 on, so an engine reading page 0 instead shows
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def io_backend(layout: str) -> str:
    return "direct" if layout == "page_first_direct" else "kernel"


def encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()


def decode(text: str, shape) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=DTYPE).view(shape)


@dataclass(frozen=True)
class Case:
    backend: str  # "file" | "mooncake"
    layout: str
    mla: bool
    tp_rank: int
    tp_size: int
    extra_key: str | None
    cache_salt: str | None
    seed: int  # tokens and KV; distinct per case, so cases never share a key

    @property
    def id(self) -> str:
        ns = "-".join(x for x in (self.extra_key, self.cache_salt) if x) or "unsalted"
        return (f"{self.backend}-{self.layout}-{'mla' if self.mla else 'mha'}-tp{self.tp_rank}of{self.tp_size}"
                f"-{ns}")

    @property
    def heads(self) -> int:
        return 1 if self.mla else MHA_HEADS

    @property
    def dim(self) -> int:
        return MLA_KV_LORA_RANK + MLA_ROPE_DIM if self.mla else MHA_DIM

    @property
    def shape(self) -> tuple[int, ...]:
        """(layer, token, head, dim) of the KV the case's pages hold."""
        return (LAYERS, TOKENS, self.heads, self.dim)

    @property
    def ns(self):
        return namespace(self.extra_key, self.cache_salt)

    def tokens(self) -> list[int]:
        return [self.seed * 1000 + i for i in range(TOKENS)]

    def kv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = torch.Generator().manual_seed(self.seed)
        k = torch.randn(self.shape, generator=g).to(DTYPE)
        v = None if self.mla else torch.randn(self.shape, generator=g).to(DTYPE)
        return k, v

    def storage_config(self, extra_config: dict) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(tp_rank=self.tp_rank, tp_size=self.tp_size, is_mla_model=self.mla,
                                    is_page_first_layout=self.layout != "layer_first", model_name=MODEL,
                                    extra_config=dict(extra_config))

    def for_sglang(self, other_ns: tuple[str | None, str | None] | None = None) -> dict:
        """What the child needs to write (kv) or read (other_ns: a namespace whose keys must all miss)."""
        k, v = self.kv()
        return {"backend": self.backend, "layout": self.layout, "mla": self.mla, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "extra_key": self.extra_key, "cache_salt": self.cache_salt,
                "tokens": self.tokens(), "heads": self.heads, "dim": self.dim, "pages": PAGES,
                "k": encode(k), "v": None if v is None else encode(v), "other_ns": other_ns}


def runtime_keys(case: Case) -> list[str]:
    return page_hashes(case.tokens(), PAGE, namespace_seed(case.extra_key, case.cache_salt))


def _pools(case: Case, device_tokens: int = TOKENS, host_tokens: int = HOST_FIRST + TOKENS + PAGE
           ) -> tuple[DevicePool, HostPool]:
    dev = DevicePool(device_tokens, PAGE, LAYERS, case.heads, case.dim, DTYPE, torch.device("cpu"), mla=case.mla)
    host = HostPool(host_tokens, PAGE, LAYERS, case.heads, case.dim, DTYPE, case.layout, pin=False, mla=case.mla)
    return dev, host


def _fill_device(dev: DevicePool, slots: torch.Tensor, case: Case) -> None:
    k, v = case.kv()
    for layer in range(LAYERS):
        dev.k[layer][slots] = k[layer]
        if v is not None:
            dev.v[layer][slots] = v[layer]


def _device_kv(dev: DevicePool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    k = torch.stack([dev.k[layer][slots] for layer in range(LAYERS)])
    v = None if dev.v is None else torch.stack([dev.v[layer][slots] for layer in range(LAYERS)])
    return k, v


def runtime_write(case: Case, backend) -> bool:
    """The case's KV through L1 -> L2 (the runtime's copy kernels) -> L3 (``HostPool.get_page``, the backend)."""
    dev, host = _pools(case)
    slots = torch.arange(TOKENS)
    _fill_device(dev, slots, case)
    host_slots = torch.arange(HOST_FIRST, HOST_FIRST + TOKENS)
    kernels.backup_all_layers(dev.k, dev.v, host.kv_buffer, slots, host_slots, case.layout, PAGE,
                              io_backend=io_backend(case.layout))
    pages = [host.get_page(HOST_FIRST + p * PAGE) for p in range(PAGES)]
    return backend.batch_set(runtime_keys(case), pages)


def runtime_read(case: Case, backend, keys: list[str]):
    """L3 -> L2 (backend, ``HostPool.set_page``) -> L1 (copy kernels); the KV by meaning, or the number of
    pages found when some are missing."""
    dev, host = _pools(case)
    pages = backend.batch_get(keys, target_sizes=[host.page_bytes] * len(keys))
    found = next((i for i, p in enumerate(pages) if p is None), len(pages))
    if found < len(keys):
        return found
    for p, page in enumerate(pages):
        host.set_page(HOST_FIRST + p * PAGE, page)
    slots = torch.arange(TOKENS)
    host_slots = torch.arange(HOST_FIRST, HOST_FIRST + TOKENS)
    for layer in range(LAYERS):
        kernels.load_per_layer(host.kv_buffer, dev.k[layer], None if dev.v is None else dev.v[layer], host_slots,
                               slots, layer, case.layout, PAGE, io_backend=io_backend(case.layout))
    return _device_kv(dev, slots)


class RuntimeCache:
    """A whole ``HiCache`` (write_through, wait_complete prefetch) over one L3 backend, as the engine runs it."""

    def __init__(self, case: Case, backend) -> None:
        self.case = case
        # room for the prefetch budget (half of L2, as SGLang) to admit a whole case
        self.dev, self.host = _pools(case, device_tokens=4 * TOKENS, host_tokens=4 * TOKENS)
        self.cache = HiCache(self.dev, self.host, PAGE, "write_through", io_backend(case.layout), wake=lambda: None)
        self.cache.attach_storage("file", RankedStorage([backend], [self.host]),
                                  PrefetchConfig(policy="wait_complete", threshold=PAGE), {})

    def _settle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.cache.busy_ops():
            assert self.cache.wait_transfers(5)
            self.cache.poll()
            assert time.monotonic() < deadline, "L2/L3 copies did not settle"
            time.sleep(0.01)

    def write(self) -> int:
        """A finished request's KV inserted in its namespace: L1 -> L2 -> L3 with the keys the cache computes.
        Returns the tokens written to L3."""
        slots = self.cache.alloc_device(TOKENS)
        _fill_device(self.dev, slots, self.case)
        self.cache.insert(self.case.tokens(), slots, 0, self.case.ns)
        self._settle()
        return self.cache.counters.backuped_tokens

    def fetched_tokens(self, ns) -> int:
        """Prefetches the case's tokens from L3 in namespace ``ns``; the tokens that arrived in L2."""
        op = self.cache.maybe_prefetch(self.case.tokens(), ns)
        assert op is not None
        deadline = time.monotonic() + 30
        while not op.finished:
            assert time.monotonic() < deadline, "prefetch did not finish"
            time.sleep(0.01)
        return self.cache.terminate_prefetch(op)

    def loaded_kv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The case's prefix, now in L2, loaded back into L1; its KV by meaning."""
        prefix = self.cache.acquire_prefix(self.case.tokens(), self.case.ns)
        assert prefix.length == TOKENS and prefix.host_tokens == TOKENS
        self._settle()
        kv = _device_kv(self.dev, prefix.slots)
        self.cache.release_prefix(prefix)
        return kv

    def close(self) -> None:
        self.cache.detach_storage()
        self.cache.transfer.stop()


# Runs in the child under one sglang version (never imported here): see that file's docstring.
SGLANG_SIDE = (Path(__file__).with_name("sglang_storage_child.py")).read_text()


def sglang_request(model: str = MODEL, mooncake: dict | None = None, write=(), read=(), keys=()) -> dict:
    return {"dtype": "bfloat16", "layers": LAYERS, "page_size": PAGE, "host_first": HOST_FIRST, "model": model,
            "kv_lora_rank": MLA_KV_LORA_RANK, "qk_rope_head_dim": MLA_ROPE_DIM, "mooncake": mooncake,
            "write": list(write), "read": list(read), "keys": list(keys)}
