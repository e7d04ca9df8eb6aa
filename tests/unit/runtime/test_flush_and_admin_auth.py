"""/flush_cache refuses while copies are in flight (SGLang's is_fully_idle), and the storage routes
authenticate before they ask for an admin key (SGLang's order: 401 first, then 400)."""

from __future__ import annotations

import threading

from starlette.requests import Request

from cache_runtime.auth import Level, check
from tests.unit.runtime.conftest import generate, on_engine, prompt, settle


def _gate_l3_writes(engine) -> threading.Event:
    """Holds every L3 write of the engine's (real, file) backend until the returned event is set."""
    gate = threading.Event()
    backend = engine.cache.storage.ranks.backends[0]
    write = backend.batch_set

    def held(keys, values):
        gate.wait()
        return write(keys, values)

    backend.batch_set = held
    return gate


def test_flush_refuses_while_a_backup_is_on_its_way_to_l3(engines, tmp_path):
    engine = engines(enable_hierarchical_cache=True, page_size=4, max_total_tokens=2048,
                     hicache_storage_backend="file", extra_config={"file_storage_path": str(tmp_path)})
    gate = _gate_l3_writes(engine)
    try:
        generate(engine, prompt(1, 128), n=1)
        assert on_engine(engine, engine.flush) is False  # the 32 pages are still on their way to L3
        assert engine.cache.counters.backuped_tokens == 0
    finally:
        gate.set()
    settle(engine)
    assert engine.cache.counters.backuped_tokens == 128  # every page reached L3
    assert on_engine(engine, engine.flush) is True
    assert engine.cache.cached_tokens() == (0, 0)


def _req(headers: dict) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "headers": raw, "method": "GET", "path": "/"})


def test_storage_routes_on_an_api_key_only_server_authenticate_first():
    # no key or a wrong one: 401, as SGLang's middleware answers before the route runs
    assert check(_req({}), Level.ADMIN_REQUIRED, "api", None).status_code == 401
    assert check(_req({"Authorization": "Bearer nope"}), Level.ADMIN_REQUIRED, "api", None).status_code == 401
    # the API key passes authentication; the route then needs a configured admin key
    refused = check(_req({"Authorization": "Bearer api"}), Level.ADMIN_REQUIRED, "api", None)
    assert refused.status_code == 400 and b"requires admin API key" in refused.body
    # with an admin key, only it opens the route
    assert check(_req({"Authorization": "Bearer api"}), Level.ADMIN_REQUIRED, "api", "adm").status_code == 401
    assert check(_req({"Authorization": "Bearer adm"}), Level.ADMIN_REQUIRED, "api", "adm") is None
