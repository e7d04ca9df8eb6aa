"""Runtime security: admin routes need the key (compared in constant time), keys never leak, and
the server listens only on the address it is given."""
from __future__ import annotations

import ast
import inspect

import httpx
import pytest

from cache_runtime import auth
from cache_runtime.args import ServerArgs

KEY = "sec-admin-key-5f0c1e"
ADMIN_ROUTES = [("PUT", "/hicache/storage-backend"), ("DELETE", "/hicache/storage-backend"),
                ("GET", "/hicache/storage-backend"), ("POST", "/hicache/storage-backend/clear"),
                ("GET", "/clear_hicache_storage_backend"), ("POST", "/flush_cache")]


@pytest.fixture
def server(start_runtime):
    return start_runtime("--enable-hierarchical-cache", "--max-total-tokens", "2048",
                         env={"HICACHE_ADMIN_API_KEY": KEY})  # from the environment, as pods get it


@pytest.mark.parametrize("method,path", ADMIN_ROUTES)
def test_admin_routes_refuse_missing_and_wrong_keys(server, method, path):
    with server.client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}, {"Authorization": KEY},
                        {"Authorization": f"Bearer {KEY}x"}, {"x-api-key": ""}):
            r = c.request(method, path, headers=headers, json={"drain": False})
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (headers, r.text)
        ok = c.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, json={"drain": False})
        assert ok.status_code != 401, ok.text
        assert c.request(method, path, headers={"x-api-key": KEY}, json={"drain": False}).status_code != 401


def test_keys_are_compared_in_constant_time():
    tree = ast.parse(inspect.getsource(auth))
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "hmac.compare_digest" in calls
    # No key is ever compared with == / != (which returns early on the first differing byte).
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            names = {ast.unparse(x) for x in [node.left, *node.comparators]}
            assert not any("key" in n.lower() for n in names), ast.unparse(node)


def test_the_key_never_appears_in_answers(server):
    with server.client() as c:
        info = c.get("/server_info").text
        metrics = c.get("/metrics").text
        status = c.get("/hicache/storage-backend", headers={"Authorization": f"Bearer {KEY}"}).text
    assert KEY not in info and KEY not in metrics and KEY not in status
    assert '"admin_api_key":"<redacted>"' in info.replace(" ", "")
    assert KEY not in server.log(10**7)


def test_binds_only_the_address_it_is_given(start_runtime):
    assert ServerArgs().host == "127.0.0.1"  # never every interface unless told
    rt = start_runtime("--max-total-tokens", "1024", host="127.0.0.2")
    assert httpx.get(f"http://127.0.0.2:{rt.port}/health", trust_env=False).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{rt.port}/health", trust_env=False, timeout=5)
