"""What a client tries against a fleet's front door to reach SGLang's /server_info (and with it the
admin key): every route sglang-router 0.3.2 forwards to workers, and encodings of its
``/v1/responses/{id}`` path traversal. ``send`` keeps the raw path as written."""

from __future__ import annotations

import httpx

TRAVERSALS = ["/v1/responses/..%2F..%2Fserver_info", "/v1/responses/..%2F..%2Fget_server_info",
              "/v1/responses/%2E%2E%2F%2E%2E%2Fserver_info", "/v1/responses/..%5C..%5Cserver_info",
              "/v1/responses/x%2F..%2F..%2F..%2Fserver_info", "/v1/responses/../../server_info"]
PROBES = [("GET", p) for p in TRAVERSALS] + [
    ("POST", "/v1/responses/..%2F..%2Fflush_cache%3F/cancel"), ("GET", "/server_info"), ("GET", "/get_server_info"),
    ("GET", "/engine_metrics"), ("GET", "/get_loads"), ("POST", "/flush_cache"), ("GET", "/workers"),
    ("POST", "/workers"), ("GET", "/v1/responses/abc"), ("POST", "/v1/responses"), ("GET", "/metrics"),
    ("GET", "/hicache/storage-backend"), ("DELETE", "/hicache/storage-backend"), ("GET", "//server_info"),
    ("GET", "/v1/models/../../server_info"), ("GET", "/get_model_info"), ("GET", "/v1/models")]
ALLOWED = {("GET", "/get_model_info"), ("GET", "/v1/models")}  # of PROBES, what the gate lets clients use


def send(base: str, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(trust_env=False, timeout=30) as http:
        req = http.build_request(method, base, headers=headers, json={} if method == "POST" else None)
        req.url = req.url.copy_with(raw_path=path.encode())  # httpx must not normalise the dots and escapes away
        return http.send(req)
