"""The operator's router client against the real sglang-router (0.3.2, the binary from its wheel)
started as the operator renders it for a fleet whose pods want an API key (``engine: sglang``):
``--api-key`` is both what the router gives its workers and what it wants on its own API."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from hicache_operator.rollout.act.router_client import RouterClient, RouterError

from testbed.router_proc import Router
from tests.integration.runtime.conftest import API_KEY

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def worker(start_server):
    return start_server("--model-path", "builtin:tiny", "--compat-mode", "sglang", "--api-key", API_KEY)


@pytest.fixture(scope="module")
def router(worker, tmp_path_factory):
    r = Router([worker.url], "cache_aware", [], tmp_path_factory.mktemp("router") / "router.log",
               api_key=API_KEY).start()
    yield r.port
    r.stop()


def client(port: int, key: str | None, http: httpx.AsyncClient) -> RouterClient:
    rc = RouterClient("127.0.0.1", http, key)
    rc.base = f"http://127.0.0.1:{port}"  # the loopback port, not the pods' port
    return rc


def test_the_router_refuses_its_worker_api_without_the_key(router):
    async def run():
        async with httpx.AsyncClient(trust_env=False) as http:
            await client(router, None, http).workers()
    with pytest.raises(RouterError, match="401"):
        asyncio.run(run())


def test_with_the_key_a_worker_leaves_and_rejoins_the_router(router, worker):
    async def run():
        async with httpx.AsyncClient(trust_env=False) as http:
            rc = client(router, API_KEY, http)
            assert worker.url in await rc.listed()
            await rc.remove(worker.url)
            assert worker.url not in await rc.listed()
            await rc.add(worker.url)  # checked by the router with the key before it lists it healthy
            workers = await rc.workers()
            assert workers[worker.url]["is_healthy"]
    asyncio.run(run())
    r = httpx.post(f"http://127.0.0.1:{router}/generate", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"text": "hello", "sampling_params": {"max_new_tokens": 4}}, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text  # routed to the re-added worker, which wants the key
