"""One L3, two engines: pages the bundled runtime writes are read by the real SGLang, and the other way round.

For every installed SGLang oracle version, both storage backends (file, and Mooncake against a real
mooncake_master), every host layout, MHA and MLA, two tensor-parallel ranks and salted and
unsalted requests, each engine writes a case's KV through its own pool, keys and storage classes
and the other engine reads it through its own; the KV read back must be the KV written, layer by
layer and token by token (``testbed/sglang_storage.py`` says how each end works). Reading
under another cache namespace must find nothing. The whole ``HiCache`` (insert -> L2 -> L3, and
prefetch L3 -> L2 -> L1) is exercised the same way on the file backend.

Where a version differs, the runtime is held to what that version does:
- a configuration SGLang itself refuses is skipped with SGLang's message (its Mooncake zero-copy
  path wants a page-first layout: always for MHA, in older versions for MLA too);
- a version whose L3 keys ignore ``extra_key`` / ``cache_salt`` keys a salted request's pages
  with the plain chain while the runtime seeds them, so the two share unsalted pages only and a
  salted tenant's pages never cross between them;
- a ``MooncakeStore`` that does not put the model name in its keys is given it as
  ``extra_backend_tag``, the configuration under which its keys are the runtime's (and newer SGLang's).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from cache_runtime.radix import namespace
from cache_runtime.storage import create_storage_backend
from cache_runtime.storage.hashing import namespace_seed, page_hashes
from testbed import sglang_oracle
from testbed.mooncake import CLIENT_ENV, mooncake_env, mooncake_master  # noqa: F401  (fixtures)
from testbed.sglang_storage import (
    LAYOUTS,
    MODEL,
    PAGE,
    SGLANG_SIDE,
    Case,
    RuntimeCache,
    decode,
    runtime_keys,
    runtime_read,
    runtime_write,
    sglang_request,
)

VERSIONS = sorted(p.name for p in sglang_oracle.ORACLE_ROOT.glob("*") if sglang_oracle.installed(p.name))
NAMESPACES = [(None, None), (None, "tenant-a"), ("lora-x", "tenant-a")]
TP = [(0, 1), (1, 2)]


def test_an_oracle_is_installed():
    assert "0.5.23" in VERSIONS, f"no sglang 0.5.23 under {sglang_oracle.ORACLE_ROOT}: run scripts/install-sglang.sh"


def cases(backend: str, first_seed: int) -> list[Case]:
    return [Case(backend, layout, mla, rank, size, extra_key, salt, first_seed + i)
            for i, (layout, mla, (rank, size), (extra_key, salt))
            in enumerate(itertools.product(LAYOUTS, (False, True), TP, NAMESPACES))]


def other_ns(case: Case):
    """A namespace whose keys for the same tokens must all miss: unsalted for a salted case and vice versa."""
    return (None, "someone-else") if case.ns is None else (None, None)


FILE_BY_RUNTIME, FILE_BY_SGLANG = cases("file", 1), cases("file", 200)
MOONCAKE_BY_RUNTIME, MOONCAKE_BY_SGLANG = cases("mooncake", 400), cases("mooncake", 600)
# the whole cache, on the file backend
CACHE_BY_RUNTIME = [Case("file", "page_first", False, 0, 1, None, "tenant-b", 800),
                    Case("file", "page_first_direct", True, 0, 1, "lora-y", None, 801)]
CACHE_BY_SGLANG = [Case("file", "page_first", False, 0, 1, None, "tenant-b", 850),
                   Case("file", "layer_first", True, 0, 1, None, None, 851)]
KEY_INPUTS = [
    {"tokens": list(range(1, 17)), "extra_key": None, "cache_salt": None, "page_size": 4},
    {"tokens": list(range(1, 17)), "extra_key": None, "cache_salt": "s\u00e9l", "page_size": 4},
    {"tokens": list(range(1, 17)), "extra_key": "k", "cache_salt": None, "page_size": 8},
    {"tokens": list(range(1, 17)), "extra_key": "", "cache_salt": "x", "page_size": 4},
    {"tokens": [5, 2**32 - 1, 2**32, 2**40, 7, 8], "extra_key": None, "cache_salt": None, "page_size": 2},
]


def _backends(cases_, extra: dict) -> dict:
    """One runtime backend per (rank, MLA) configuration, as the engine holds one per rank."""
    made = {}
    for c in cases_:
        ident = (c.tp_rank, c.tp_size, c.mla)
        if ident not in made:
            made[ident] = create_storage_backend(c.backend, c.storage_config(extra))
    return made


def _backend(backends: dict, case: Case):
    return backends[(case.tp_rank, case.tp_size, case.mla)]


def _assert_kv(case: Case, k_read: torch.Tensor, v_read: torch.Tensor | None) -> None:
    k, v = case.kv()
    assert torch.equal(k_read, k), f"{case.id}: K differs"
    if v is None:
        assert v_read is None
    else:
        assert torch.equal(v_read, v), f"{case.id}: V differs"


@pytest.fixture(scope="module", params=VERSIONS)
def file_exchange(request, tmp_path_factory):
    """The runtime writes its cases, then one SGLang child reads them and writes its own cases."""
    version = request.param
    directory = tmp_path_factory.mktemp(f"l3-file-{version}")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
        extra = {"file_storage_path": str(directory)}
        backends = _backends(FILE_BY_RUNTIME + FILE_BY_SGLANG + CACHE_BY_RUNTIME + CACHE_BY_SGLANG, extra)
        written = {c: runtime_write(c, _backend(backends, c)) for c in FILE_BY_RUNTIME}
        for c in CACHE_BY_RUNTIME:
            cache = RuntimeCache(c, _backend(backends, c))
            written[c] = cache.write() == len(c.tokens())
            cache.close()
        answer = sglang_oracle.run(version, SGLANG_SIDE, sglang_request(
            write=[c.for_sglang() for c in FILE_BY_SGLANG + CACHE_BY_SGLANG],
            read=[c.for_sglang(other_ns(c)) for c in FILE_BY_RUNTIME + CACHE_BY_RUNTIME],
            keys=KEY_INPUTS), env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(directory)})
        by_sglang = dict(zip(FILE_BY_SGLANG + CACHE_BY_SGLANG, answer["written"]))
        read_by_sglang = dict(zip(FILE_BY_RUNTIME + CACHE_BY_RUNTIME, answer["read"]))
        yield {"version": version, "dir": directory, "backends": backends, "written": written,
               "by_sglang": by_sglang, "read_by_sglang": read_by_sglang, "keys": answer["keys"],
               "seeds": answer["seeds"], "namespace_seeded": answer["namespace_seeded"]}


@pytest.fixture(scope="module", params=VERSIONS)
def mooncake_exchange(request, mooncake_master):
    """As ``file_exchange`` through one Mooncake store. SGLang's clients lend no memory (global segment 0), so
    the pages they put live in the runtime's segments and outlive the child."""
    version = request.param
    extra = mooncake_master.extra_config()
    backends = _backends(MOONCAKE_BY_RUNTIME + MOONCAKE_BY_SGLANG, extra)
    try:
        written = {c: runtime_write(c, _backend(backends, c)) for c in MOONCAKE_BY_RUNTIME}
        sglang_mooncake = {"master_server_address": mooncake_master.address, "local_hostname": "127.0.0.1",
                           "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "global_segment_size": 0}
        answer = sglang_oracle.run(version, SGLANG_SIDE, sglang_request(
            mooncake=sglang_mooncake, write=[c.for_sglang() for c in MOONCAKE_BY_SGLANG],
            read=[c.for_sglang(other_ns(c)) for c in MOONCAKE_BY_RUNTIME]), env=CLIENT_ENV)
        yield {"version": version, "backends": backends, "written": written,
               "by_sglang": dict(zip(MOONCAKE_BY_SGLANG, answer["written"])),
               "read_by_sglang": dict(zip(MOONCAKE_BY_RUNTIME, answer["read"])),
               "namespace_seeded": answer["namespace_seeded"]}
    finally:
        for b in backends.values():
            b.close()


def _unshared_namespace(exchange: dict, case: Case) -> bool:
    """A salted case against a version whose L3 keys ignore extra_key / cache_salt: it keys the pages with the
    plain chain, the runtime with the seeded one, so neither finds the other's (the tenant stays isolated)."""
    return case.ns is not None and not exchange["namespace_seeded"]


def _skip_if_sglang_refuses(exchange: dict, result: dict) -> None:
    if result["refused"]:
        pytest.skip(f"sglang {exchange['version']} refuses this configuration itself: {result['refused']}")


def _check_sglang_read(exchange: dict, case: Case) -> None:
    assert exchange["written"][case], f"{case.id}: the runtime could not store its pages"
    got = exchange["read_by_sglang"][case]
    _skip_if_sglang_refuses(exchange, got)
    if _unshared_namespace(exchange, case):
        assert got["keys"] == page_hashes(case.tokens(), PAGE) != runtime_keys(case)
        assert got["hits"] == 0
        return
    assert got["keys"] == runtime_keys(case), f"{case.id}: SGLang derives other keys"
    assert got["hits"] == len(got["keys"]), f"{case.id}: SGLang found {got['hits']} of {len(got['keys'])} pages"
    _assert_kv(case, decode(got["k"], case.shape), None if got["v"] is None else decode(got["v"], case.shape))
    if exchange["namespace_seeded"]:
        assert got["other_ns_hits"] == 0, f"{case.id}: another namespace reads this namespace's pages"


def _check_runtime_read(exchange: dict, case: Case) -> None:
    written = exchange["by_sglang"][case]
    _skip_if_sglang_refuses(exchange, written)
    assert written["ok"], f"{case.id}: SGLang could not store its pages"
    keys = runtime_keys(case)
    backend = _backend(exchange["backends"], case)
    if _unshared_namespace(exchange, case):
        assert written["keys"] == page_hashes(case.tokens(), PAGE) != keys
        assert runtime_read(case, backend, keys) == 0
        return
    assert keys == written["keys"], f"{case.id}: the runtime derives other keys"
    kv = runtime_read(case, backend, keys)
    assert not isinstance(kv, int), f"{case.id}: the runtime found {kv} of {len(keys)} pages"
    _assert_kv(case, *kv)
    other = page_hashes(case.tokens(), PAGE, namespace_seed(*other_ns(case)))
    assert runtime_read(case, backend, other) == 0


@pytest.mark.parametrize("case", FILE_BY_RUNTIME, ids=lambda c: c.id)
def test_file_sglang_reads_runtime_pages(file_exchange, case):
    _check_sglang_read(file_exchange, case)


@pytest.mark.parametrize("case", FILE_BY_SGLANG, ids=lambda c: c.id)
def test_file_runtime_reads_sglang_pages(file_exchange, case):
    _check_runtime_read(file_exchange, case)


@pytest.mark.parametrize("case", MOONCAKE_BY_RUNTIME, ids=lambda c: c.id)
def test_mooncake_sglang_reads_runtime_pages(mooncake_exchange, case):
    _check_sglang_read(mooncake_exchange, case)


@pytest.mark.parametrize("case", MOONCAKE_BY_SGLANG, ids=lambda c: c.id)
def test_mooncake_runtime_reads_sglang_pages(mooncake_exchange, case):
    _check_runtime_read(mooncake_exchange, case)


@pytest.mark.parametrize("case", CACHE_BY_RUNTIME, ids=lambda c: c.id)
def test_sglang_reads_what_the_runtime_cache_backed_up(file_exchange, case):
    """Keys come from the cache's own chain (namespace seed at the root), bytes from its L2 pool."""
    _check_sglang_read(file_exchange, case)


@pytest.mark.parametrize("case", CACHE_BY_SGLANG, ids=lambda c: c.id)
def test_runtime_cache_prefetches_sglang_pages_in_their_namespace(file_exchange, case):
    written = file_exchange["by_sglang"][case]
    assert written["ok"] and not written["refused"]
    cache = RuntimeCache(case, _backend(file_exchange["backends"], case))
    try:
        if _unshared_namespace(file_exchange, case):
            # this version stored a salted request's pages under the plain keys: only unsalted requests find them
            assert cache.fetched_tokens(case.ns) == 0
            assert cache.fetched_tokens(None) == len(case.tokens())
            return
        assert cache.fetched_tokens(namespace(*other_ns(case))) == 0
        assert cache.fetched_tokens(case.ns) == len(case.tokens())
        _assert_kv(case, *cache.loaded_kv())
    finally:
        cache.close()


def test_file_names_are_sglangs(file_exchange):
    """Every page file SGLang wrote sits under the name the runtime looks for, and the other way round."""
    names = set(os.listdir(file_exchange["dir"]))
    for case, written in file_exchange["by_sglang"].items():
        suffix = _backend(file_exchange["backends"], case).suffix
        assert {f"{k}{suffix}.bin" for k in written["keys"]} <= names
    model = MODEL.replace("/", "-")
    assert any(n.endswith(f"_{model}_1_2.bin") for n in names) and any(n.endswith(f"_{model}.bin") for n in names)


def test_page_keys_and_namespace_seeds_are_sglangs(file_exchange):
    seeded = file_exchange["namespace_seeded"]
    for q, keys, seed in zip(KEY_INPUTS, file_exchange["keys"], file_exchange["seeds"]):
        if seeded:
            assert namespace_seed(q["extra_key"], q["cache_salt"]) == seed
        if keys is None:  # this version cannot hash token ids above 2**32-1; the runtime hashes them as newer ones do
            assert max(q["tokens"]) >= 2**32
            continue
        assert page_hashes(q["tokens"], q["page_size"], seed) == keys
