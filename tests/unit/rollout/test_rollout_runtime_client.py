"""The runtime client against a real HTTP server on 127.0.0.1 that answers
like SGLang's admin API: plain-text attach results, JSON 401s, the idle
check's message, Prometheus text with one sample per DP rank."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hicache_operator.rollout import ActionOutcome, Detach, PodObservation
from hicache_operator.fleet.storage_config import attach_payload
from hicache_operator.rollout.act.runtime_client import BackendError, BadResponse, Load, NotIdle, RuntimeClient, Unauthorized, Unreachable, shared_client

KEY = "s3cret-admin"

METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",tp_rank="0"} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",tp_rank="0"} 1.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",tp_rank="0"} 0.0
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device"} 128.0
"""


class FakeAdmin(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), AdminHandler)
        self.status = {
            "hicache_storage_backend": "file",
            "hicache_storage_backend_extra_config": "{}",
            "hicache_storage_prefetch_policy": "best_effort",
            "hicache_write_policy": "write_through",
        }
        self.metrics = METRICS
        self.busy = False
        self.delay = 0.0
        self.fail_with: tuple[int, str] | None = None
        self.seen_auth: list[str | None] = []
        self.received: list[dict] = []

    def handle_error(self, request, client_address):
        """A client that gave up (the timeout test) is expected; anything else is reported."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class AdminHandler(BaseHTTPRequestHandler):
    server: FakeAdmin

    def log_message(self, *args):  # keep test output clean
        pass

    def _send(self, status: int, body: str, content_type: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _admin(self) -> bool:
        auth = self.headers.get("Authorization")
        self.server.seen_auth.append(auth)
        if auth != f"Bearer {KEY}":
            self._send(401, json.dumps({"error": "Unauthorized"}), "application/json")
            return False
        if self.server.fail_with:
            self._send(*self.server.fail_with)
            return False
        return True

    def do_GET(self):
        time.sleep(self.server.delay)
        if self.path == "/metrics":
            self._send(200, self.server.metrics, "text/plain; version=0.0.4")
        elif self.path == "/hicache/storage-backend" and self._admin():
            status = self.server.status
            self._send(200, status if isinstance(status, str) else json.dumps(status), "application/json")

    def do_PUT(self):
        if self.path != "/hicache/storage-backend" or not self._admin():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.received.append(body)
        if self.server.busy:
            self._send(400, "Reject attach: scheduler is not idle. #queue-req=2 #running-req=3")
        elif body["hicache_storage_backend"] == "dynamic":
            self._send(400, "Failed to attach HiCache storage backend.\nmodule_path 'nope' not importable\n")
        else:
            self._send(200, "HiCache storage backend attached.\n")

    def do_DELETE(self):
        if self.path == "/hicache/storage-backend" and self._admin():
            self._send(200, "HiCache storage backend detached.\n")


@pytest.fixture
def admin():
    server = FakeAdmin()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def call(url, method, *args, key=KEY, timeout=2.0):
    async def go():
        async with RuntimeClient(url, key, timeout=timeout) as client:
            return await getattr(client, method)(*args)
    return asyncio.run(go())


def test_load_sums_running_and_queued_over_dp_ranks(admin):
    assert call(admin.url, "load") == Load(in_flight=5, queued=1)


def test_load_needs_no_key(admin):
    assert call(admin.url, "load", key=None) == Load(in_flight=5, queued=1)


@pytest.mark.parametrize("text, match", [
    ("# TYPE sglang:cache_hit_rate gauge\nsglang:cache_hit_rate 0.5\n", "--enable-metrics"),
    ("sglang:num_running_reqs 1\n", "num_queue_reqs"),
    ("sglang:num_running_reqs{ 1\n", "not Prometheus text"),
    ("sglang:num_running_reqs NaN\nsglang:num_queue_reqs 0\n", "nonsensical"),
    ("sglang:num_running_reqs -1\nsglang:num_queue_reqs 0\n", "nonsensical"),
])
def test_bad_metrics_are_reported_not_guessed(admin, text, match):
    admin.metrics = text
    with pytest.raises(BadResponse, match=match):
        call(admin.url, "load")


def test_get_backend_sends_the_bearer_key_and_parses_the_status(admin):
    admin.status = {**admin.status, "hicache_storage_backend": "mooncake",
                    "hicache_storage_backend_extra_config": json.dumps({"master_server_address": "m:50051"}),
                    "hicache_storage_prefetch_policy": "timeout"}
    reported = call(admin.url, "get_backend")
    assert admin.seen_auth == [f"Bearer {KEY}"]
    assert (reported.backend, reported.extra_config, reported.prefetch_policy) == (
        "mooncake", {"master_server_address": "m:50051"}, "timeout")


def test_get_backend_when_detached(admin):
    admin.status = {"hicache_storage_backend": None, "hicache_storage_backend_extra_config": None}
    assert call(admin.url, "get_backend").backend is None


@pytest.mark.parametrize("status", ["not json", "[1, 2]"])
def test_get_backend_with_a_malformed_body_is_a_bad_response(admin, status):
    admin.status = status
    with pytest.raises(BadResponse):
        call(admin.url, "get_backend")


@pytest.mark.parametrize("key", [None, "wrong"])
def test_missing_or_wrong_key_is_unauthorized_and_not_retryable(admin, key):
    with pytest.raises(Unauthorized, match="Unauthorized.*admin API key") as caught:
        call(admin.url, "get_backend", key=key)
    assert caught.value.retryable is False
    assert admin.seen_auth == [None if key is None else f"Bearer {key}"]


def test_attach_sends_sglangs_body_verbatim(admin):
    payload = attach_payload({"backend": "mooncake", "prefetch_policy": "timeout",
                              "extra_config": {"master_server_address": "m:50051"}})
    assert call(admin.url, "attach", payload) == "HiCache storage backend attached."
    assert admin.received == [payload]
    assert isinstance(admin.received[0]["hicache_storage_backend_extra_config_json"], str)


def test_attach_while_busy_is_not_idle_with_the_counts(admin):
    admin.busy = True
    with pytest.raises(NotIdle) as caught:
        call(admin.url, "attach", attach_payload({"backend": "file"}))
    assert (caught.value.queued, caught.value.running, caught.value.retryable) == (2, 3, True)


def test_attach_refused_carries_the_servers_message_and_is_final(admin):
    with pytest.raises(BackendError, match="module_path 'nope' not importable") as caught:
        call(admin.url, "attach", attach_payload({"backend": "dynamic"}))
    assert (caught.value.status, caught.value.retryable) == (400, False)
    outcome = ActionOutcome.failed(Detach("p", "u"), caught.value)
    assert outcome.retryable is False and "not importable" in outcome.error


def test_detach(admin):
    assert call(admin.url, "detach") == "HiCache storage backend detached."


@pytest.mark.parametrize("status, body, message, retryable", [
    (500, "Internal Server Error", "500 Internal Server Error", True),
    (503, json.dumps({"error": {"message": "draining"}}), "503 draining", True),
    (400, json.dumps({"error": "This endpoint requires admin API key"}), "400 This endpoint requires admin", False),
])
def test_other_errors_are_backend_errors(admin, status, body, message, retryable):
    admin.fail_with = (status, body)
    with pytest.raises(BackendError, match=message) as caught:
        call(admin.url, "detach")
    assert caught.value.status == status and caught.value.retryable is retryable


def test_observe_fills_a_pod_observation(admin):
    view = call(admin.url, "observe")
    assert (view.backend.backend, view.in_flight, view.queued, view.error) == ("file", 5, 1, None)
    obs = PodObservation(name="p", uid="u", observed_at=datetime.now(timezone.utc), **view.observation_fields())
    assert obs.reachable and not obs.idle


def test_observe_reports_a_failing_half_instead_of_raising(admin):
    admin.metrics = "# nothing here\n"
    view = call(admin.url, "observe", key="wrong")
    assert view.backend is None and view.in_flight is None and view.queued is None
    assert "Unauthorized" in view.error and "--enable-metrics" in view.error


def test_closed_port_is_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Unreachable, match=f"127.0.0.1:{port}") as caught:
        call(f"http://127.0.0.1:{port}", "get_backend")
    assert caught.value.retryable is True


def test_a_runtime_slower_than_the_timeout_is_unreachable(admin):
    admin.delay = 1.0
    with pytest.raises(Unreachable, match="Timeout"):
        call(admin.url, "load", timeout=0.2)


def test_clients_on_a_shared_pool_leave_it_open_for_the_next_pod(admin):
    async def go():
        async with shared_client() as http:
            for _ in range(2):
                async with RuntimeClient(admin.url, KEY, timeout=2.0, http=http) as client:
                    assert await client.load() == Load(in_flight=5, queued=1)
            assert not http.is_closed
        return http.is_closed
    assert asyncio.run(go()) is True
