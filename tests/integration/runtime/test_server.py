"""The runtime's HTTP API end to end: real server processes, real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from testbed.runtime_proc import load
from tests.integration.runtime.conftest import ADMIN_KEY, API_KEY, sse_events

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "The hierarchical cache keeps KV pages in device memory, host memory and storage. " * 4


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    return start_server("--enable-hierarchical-cache", "--page-size", "4", "--max-total-tokens", "32768",
                        "--enable-cache-report", "--admin-api-key", ADMIN_KEY)


@pytest.fixture(scope="module")
def sglang_server(start_server):
    """SGLang compat mode, with an API key and no admin key."""
    return start_server("--compat-mode", "sglang", "--api-key", API_KEY, "--max-total-tokens", "2048")


def _events(resp: httpx.Response) -> list:
    return sse_events(resp)


def test_generate_reports_cached_tokens_on_repeated_prefix(server):
    with server.client() as c:
        c.post("/flush_cache?timeout=60", headers=ADMIN).raise_for_status()
        first = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 8}}).json()
        again = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 8}}).json()
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["meta_info"]["prompt_tokens"] == len(PROMPT.encode())
    assert first["meta_info"]["completion_tokens"] == 8
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert again["meta_info"]["cached_tokens"] > len(PROMPT) - 8
    assert set(again["meta_info"]["cached_tokens_details"]) == {"device", "host", "storage"}
    assert again["text"] == first["text"] and again["output_ids"] == first["output_ids"]


def test_generate_accepts_input_ids_and_batches(server):
    with server.client() as c:
        one = c.post("/generate", json={"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 3}})
        batch = c.post("/generate", json={"text": ["abc", "def"], "sampling_params": {"max_new_tokens": 2}})
    assert one.status_code == 200 and len(one.json()["output_ids"]) == 3
    assert batch.status_code == 200 and len(batch.json()) == 2


def test_completions_usage_reports_cached_tokens(server):
    body = {"model": "builtin:tiny", "prompt": PROMPT + "completions", "max_tokens": 5}
    with server.client() as c:
        c.post("/v1/completions", json=body).raise_for_status()
        r = c.post("/v1/completions", json=body).json()
    assert r["object"] == "text_completion" and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 5
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_streaming_generate_and_completions(server):
    with server.client() as c:
        plain = c.post("/generate", json={"text": "stream me", "sampling_params": {"max_new_tokens": 6}}).json()
        with c.stream("POST", "/generate", json={"text": "stream me", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 6}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events(r)
        assert events[-1] == "[DONE]" and len(events) >= 3
        assert events[-2]["text"] == plain["text"]
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"

        body = {"prompt": "stream me", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/completions", json=body) as r:
            chunks = _events(r)
        plain_c = c.post("/v1/completions", json={"prompt": "stream me", "max_tokens": 6}).json()
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]["usage"]
    assert usage["completion_tokens"] == 6 and "prompt_tokens_details" in usage
    text = "".join(ch["choices"][0]["text"] for ch in chunks[:-2])
    assert text == plain_c["choices"][0]["text"]
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"


def test_admin_routes_require_the_admin_key(server):
    with server.client() as c:
        for method, path in (("GET", "/hicache/storage-backend"), ("PUT", "/hicache/storage-backend"),
                             ("DELETE", "/hicache/storage-backend"), ("POST", "/hicache/storage-backend/clear"),
                             ("POST", "/flush_cache")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "nope"}):
                r = c.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers)
                assert r.json() == {"error": "Unauthorized"}
        assert c.get("/hicache/storage-backend", headers={"x-api-key": ADMIN_KEY}).status_code == 200


def test_attach_status_policies_clear_detach(server, tmp_path):
    extra = json.dumps({"file_storage_path": str(tmp_path), "prefetch_threshold": 8})
    with server.client(headers=ADMIN) as c:
        r = c.put("/hicache/storage-backend", json={"hicache_storage_backend": "file",
                                                    "hicache_storage_backend_extra_config_json": extra,
                                                    "hicache_storage_prefetch_policy": "wait_complete"})
        assert r.status_code == 200 and r.text == "HiCache storage backend attached.\n"
        status = c.get("/hicache/storage-backend").json()
        assert status["hicache_storage_backend"] == "file"
        assert status["hicache_storage_prefetch_policy"] == "wait_complete"
        assert json.loads(status["hicache_storage_backend_extra_config"])["file_storage_path"] == str(tmp_path)

        r = c.put("/hicache/storage-backend", json={"hicache_storage_backend": "file",
                                                    "hicache_write_policy": "write_back"})
        assert r.status_code == 200 and "policies updated" in r.text
        assert c.get("/hicache/storage-backend").json()["hicache_write_policy"] == "write_back"
        r = c.put("/hicache/storage-backend", json={"hicache_storage_backend": "mooncake"})
        assert r.status_code == 400 and "Detach first." in r.text
        r = c.put("/hicache/storage-backend", json={"hicache_storage_backend": "file",
                                                    "hicache_write_policy": "sometimes"})
        assert r.status_code == 400 and r.text.startswith("Failed to attach HiCache storage backend.")
        c.put("/hicache/storage-backend", json={"hicache_storage_backend": "file",
                                                "hicache_write_policy": "write_through"}).raise_for_status()

        # pages written to L3 survive a flush of L1+L2 and are served from storage
        prompt = "L3 round trip through the file backend. " * 8
        c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 4}}).raise_for_status()
        for _ in range(100):
            if list(tmp_path.iterdir()):
                break
            threading.Event().wait(0.05)
        assert list(tmp_path.iterdir())
        c.post("/flush_cache?timeout=60").raise_for_status()  # once every page is in L3
        r = c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 4}}).json()
        assert r["meta_info"]["cached_tokens_details"]["storage"] > 0

        r = c.delete("/hicache/storage-backend")
        assert r.status_code == 200 and "detached" in r.text
        assert c.get("/hicache/storage-backend").json()["hicache_storage_backend"] is None
        assert list(tmp_path.iterdir()), "detach must never delete L3 data"

        c.put("/hicache/storage-backend", json={"hicache_storage_backend": "file",
                                                "hicache_storage_backend_extra_config_json": extra}).raise_for_status()
        r = c.post("/hicache/storage-backend/clear")
        assert r.status_code == 200
        assert not [p for p in tmp_path.iterdir() if p.suffix == ".bin"]
        c.delete("/hicache/storage-backend").raise_for_status()


def test_attach_is_rejected_while_busy_and_the_metrics_count_the_request(server, tmp_path):
    with server.client() as c:
        body = {"text": "long running", "stream": True, "sampling_params": {"max_new_tokens": 30000}}
        with c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            first = next(lines)  # the request is running now
            assert "error" not in first, first
            assert load(c) == {"in_flight": 1, "queued": 0}
            attach = c.put("/hicache/storage-backend", headers=ADMIN,
                           json={"hicache_storage_backend": "file",
                                 "hicache_storage_backend_extra_config_json": json.dumps({"file_storage_path": str(tmp_path)})})
            assert attach.status_code == 400, (attach.text, load(c), [next(lines)[:80] for _ in range(4)])
            assert "Reject attach: scheduler is not idle. #queue-req=0 #running-req=1" in attach.text
            flush = c.post("/flush_cache", headers=ADMIN)
            assert (flush.status_code, flush.text) == (400, "Flush cache failed.\n")
        # closing the stream aborts the request
        for _ in range(200):
            if load(c)["in_flight"] == 0:
                break
            threading.Event().wait(0.05)
        assert load(c) == {"in_flight": 0, "queued": 0}


def test_metrics_names(server):
    with server.client() as c:
        c.post("/generate", json={"text": "metrics", "sampling_params": {"max_new_tokens": 2}}).raise_for_status()
        text = c.get("/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:cache_hit_rate",
                 "sglang:gen_throughput", "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens",
                 'cache_source="device"', 'cache_source="host"', 'cache_source="storage"', "hicache_storage_degraded",
                 "sglang:time_to_first_token_seconds_bucket"):
        assert name in text, name


@pytest.mark.parametrize("content,headers,expect", [
    (b"{not json", {}, 400),
    (b"\xff\xfe\x00garbage", {}, 400),
    (b"", {}, 400),
    (b"[1, 2]", {}, 400),
    (json.dumps({"text": 123}).encode(), {}, 400),
    (json.dumps({"text": "x", "sampling_params": {"max_new_tokens": -1}}).encode(), {}, 400),
    (json.dumps({"text": "x", "sampling_params": {"max_new_tokens": "many"}}).encode(), {}, 400),
    (json.dumps({"text": "x", "sampling_params": {"temperature": -2}}).encode(), {}, 400),
    (json.dumps({"text": "x" * 40000}).encode(), {}, 400),
    (json.dumps({"text": ""}).encode(), {}, 400),
    (json.dumps({"input_ids": [1, 2, 999]}).encode(), {}, 400),
    (json.dumps({"input_ids": [1, -2]}).encode(), {}, 400),
    (json.dumps({}).encode(), {}, 400),
    (json.dumps({"text": "x", "input_ids": [1]}).encode(), {}, 400),
    (b"{" + b" " * (17 << 20) + b"}", {}, 413),
])
def test_bad_generate_requests_get_4xx_and_server_survives(server, content, headers, expect):
    with server.client() as c:
        r = c.post("/generate", content=content, headers={"content-type": "application/json", **headers})
        assert r.status_code == expect, r.text
        assert "message" in r.json()["error"]
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": -5}, {"prompt": "x", "n": 3}, {"prompt": None}, {"prompt": "x", "top_p": 7},
    {"prompt": [[1, 2], [3, 400]]}, {"max_tokens": 3},
])
def test_bad_completions_requests_get_400(server, body):
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text


def test_server_info_redacts_keys(server):
    with server.client() as c:
        info = c.get("/server_info").json()
        assert c.get("/get_server_info").status_code == 200
    assert info["admin_api_key"] == "<redacted>" and ADMIN_KEY not in json.dumps(info)
    assert info["enable_hierarchical_cache"] is True and info["hicache"]["host_pool_tokens"] > 32768
    assert info["kernels"]["backend"]


def test_sglang_compat_mode_enforces_the_api_key(sglang_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with sglang_server.client() as c:
        assert c.post("/generate", json={"text": "hi"}).status_code == 401
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, headers=auth)
        assert r.status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        # storage admin routes need a configured admin key, which this server lacks
        r = c.get("/hicache/storage-backend", headers=auth)
        assert r.status_code == 400 and "requires admin API key" in r.json()["error"]
        # without --admin-api-key, flush falls back to the API key
        assert c.post("/flush_cache").status_code == 401
        assert c.post("/flush_cache", headers=auth).status_code == 200


def test_an_idle_keep_alive_connection_is_still_served(server):
    """A gateway keeps connections to each pod and may leave one idle for a while (a pod out of
    serving during a swap); the next request on it must get a response, not a closed socket. The
    server keeps idle connections longer than clients do (httpx expires them after 5 s)."""
    import socket
    import time

    def get(sock) -> bytes:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        return sock.recv(4096)

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        assert get(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)  # past the 5 s that both uvicorn's default and httpx's expiry use
        assert get(sock).startswith(b"HTTP/1.1 200")
