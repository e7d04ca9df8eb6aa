"""In-process engines for the runtime unit tests (no HTTP): real model, pools, kernels and L3 backends."""

from __future__ import annotations

import json
import queue
import time

import pytest

from cache_runtime.args import ServerArgs, normalise
from cache_runtime.sampling import SamplingParams
from cache_runtime.engine.loop import Engine
from cache_runtime.engine.requests import Output, Request
from testbed.checkpoints import build_oracle_checkpoint


def make_engine(**overrides) -> Engine:
    extra = overrides.pop("extra_config", None)
    if extra is not None:
        overrides["hicache_storage_backend_extra_config"] = json.dumps(extra)
    args = normalise(ServerArgs(**overrides))
    engine = Engine(args)
    engine.start()
    return engine


def generate(engine: Engine, ids: list[int], n: int = 6, **params) -> Output:
    q: queue.Queue = queue.Queue()
    engine.submit(Request(list(ids), SamplingParams(max_new_tokens=n, **params), q.put))
    while True:
        out = q.get(timeout=120)
        if out.finished:
            assert out.error is None, out.error
            return out


def on_engine(engine: Engine, fn):
    return engine.call(fn).result(timeout=60)


def settle(engine: Engine, timeout: float = 30.0) -> None:
    """Waits until every L1->L2 copy and L2->L3 backup has been acknowledged."""
    deadline = time.monotonic() + timeout
    while True:
        def check():
            cache = engine.cache
            if cache.transfer is not None:
                cache.wait_transfers(5)
            cache.poll()
            return cache.busy_ops() == 0
        if on_engine(engine, check):
            return
        assert time.monotonic() < deadline, "copies did not settle"
        time.sleep(0.02)


def page_by_layer(host, flat):
    """An L3 page of ``host`` (SGLang's get_data_page order for its layout) as (2, layer, token, head, dim)."""
    L, ps, H, D = host.num_layers, host.page_size, host.num_heads, host.head_dim
    if host.layout == "page_first":
        return flat.view(2, ps, L, H, D).transpose(1, 2)
    return flat.view(2, L, ps, H, D)


def accounting_ok(cache) -> None:
    """With nothing in flight, every used L1/L2 slot belongs to the tree and nothing is locked or pinned."""
    dev, host = cache.cached_tokens()
    assert dev == cache.device.allocator.used_tokens
    if cache.host is not None:
        assert host == cache.host.allocator.used_tokens
    assert all(n.lock_ref == 0 and n.host_ref == 0 for n in cache.tree.nodes())


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 251 for i in range(n)]


@pytest.fixture
def engines():
    made: list[Engine] = []

    def factory(**overrides) -> Engine:
        e = make_engine(**overrides)
        made.append(e)
        return e

    yield factory
    for e in made:
        e.shutdown()


@pytest.fixture(scope="session")
def oracles(tmp_path_factory):
    """kind -> (checkpoint dir, transformers float32 model), each built once per session."""
    root = tmp_path_factory.mktemp("oracles")
    built: dict = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build_oracle_checkpoint(kind, root)
        return built[kind]

    return get
