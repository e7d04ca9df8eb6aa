"""The client gate in front of the real sglang-router (0.3.2, the binary from its wheel), in front of
a runtime in SGLang mode whose /server_info carries both keys in clear, as SGLang's does.

A client holding the clients' key reaches inference through the gate and nothing else: every route
the router forwards to workers and every encoding of its ``/v1/responses/{id}`` path traversal
ends at the gate; the admin key never comes back. The same traversal sent to the router itself,
with the key the router holds, returns the admin key: what the gate is there for."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from testbed.gate_probes import ALLOWED, PROBES, TRAVERSALS, send
from testbed.procs import free_port, stop_process, wait_ready
from testbed.router_proc import Router
from tests.integration.runtime.conftest import ADMIN_KEY

pytest.importorskip("sglang_router")
CLIENT_KEY, INTERNAL_KEY = "client-key-0123456789", "internal-key-0123456789"


@pytest.fixture(scope="module")
def fleet(start_server, tmp_path_factory):
    worker = start_server("--model-path", "builtin:tiny", "--compat-mode", "sglang", "--api-key", INTERNAL_KEY,
                          "--admin-api-key", ADMIN_KEY)
    work = tmp_path_factory.mktemp("gate")
    # not started here: the gate runs the router as its child, as in the router's pods
    router = Router([worker.url], "cache_aware", [], work / "router.log", api_key=INTERNAL_KEY)
    port = free_port()
    log = open(work / "gate.log", "wb")
    env = {"HICACHE_CLIENT_API_KEY": CLIENT_KEY, "HICACHE_API_KEY": INTERNAL_KEY, "PATH": os.environ["PATH"]}
    gate = subprocess.Popen([sys.executable, "-m", "hicache_operator.router_gate", "--host", "127.0.0.1", "--port",
                             str(port), "--upstream", router.url, "--", *router.cmd],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    why = wait_ready(gate, lambda: httpx.get(url + "/readiness", timeout=2, trust_env=False).status_code == 200,
                     120, 0.3)
    assert why is None, f"gate {why}: {(work / 'gate.log').read_text()}"
    yield {"gate": url, "router": router.url, "worker": worker}
    stop_process(gate, 30)
    log.close()


def test_the_worker_gives_its_admin_key_to_any_holder_of_its_api_key(fleet):
    """The premise: SGLang's /server_info carries the admin key for the api key's holder."""
    r = httpx.get(fleet["worker"].url + "/server_info", headers={"Authorization": f"Bearer {INTERNAL_KEY}"},
                  trust_env=False, timeout=10)
    assert ADMIN_KEY in r.text


def test_the_router_alone_leaks_the_admin_key_through_its_responses_route(fleet):
    """Why the gate exists: the router forwards a decoded traversal to its worker with the worker's key."""
    leaked = [p for p in TRAVERSALS[:2] if ADMIN_KEY in send(fleet["router"], "GET", p, INTERNAL_KEY).text]
    assert leaked, "sglang-router no longer forwards the traversal: the gate's reason is gone, revisit it"


def test_a_client_key_gets_inference_and_never_the_admin_key(fleet):
    gate = fleet["gate"]
    with httpx.Client(trust_env=False, timeout=60, headers={"Authorization": f"Bearer {CLIENT_KEY}"}) as http:
        ok = http.post(gate + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        assert ok.status_code == 200 and ok.json()["text"], ok.text
        chat = http.post(gate + "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 3,
                                                         "stream": True})
        assert chat.status_code == 200 and "data: [DONE]" in chat.text, chat.text
    for key in (CLIENT_KEY, None, INTERNAL_KEY):
        for method, path in PROBES:
            r = send(gate, method, path, key)
            assert ADMIN_KEY not in r.text, (method, path, key)
            assert INTERNAL_KEY not in r.text, (method, path, key)
            assert r.status_code in ((200, 401) if (method, path) in ALLOWED else (404,)), (method, path, key)


def test_the_gate_wants_the_client_key_and_not_the_internal_one(fleet):
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    for key, want in ((None, 401), ("wrong", 401), (INTERNAL_KEY, 401), (CLIENT_KEY, 200)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(fleet["gate"] + "/generate", json=body, headers=headers, trust_env=False, timeout=60)
        assert r.status_code == want, (key, r.status_code, r.text)
    assert httpx.get(fleet["gate"] + "/health", trust_env=False, timeout=10).status_code == 200  # probes: no key
    # the router itself refuses the clients' key: it is no way around the gate
    r = httpx.post(fleet["router"] + "/generate", json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                   trust_env=False, timeout=60)
    assert r.status_code == 401
