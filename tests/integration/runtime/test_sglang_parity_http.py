"""What a client of real SGLang sees, over HTTP from a real runtime process: /flush_cache waits
for (or refuses on) copies in flight, /model_info's keys, the storage routes' status codes, and
the labels of every ``sglang:*`` metric family."""

from __future__ import annotations

import ast
import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testbed import sglang_oracle
from testbed.runtime_proc import metric
from tests.integration.runtime.conftest import ADMIN_KEY, API_KEY

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. "
           "(When there are running or waiting requests, the operation will not be performed.)\n")
# SGLang 0.5.21+ /model_info
MODEL_INFO_KEYS = {"model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
                   "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
                   "has_image_understanding", "has_audio_understanding", "model_type", "architectures"}
SCHEDULER = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
TOKENIZER = {"model_name", "engine_type"}
RADIX = {"cache_type", "tp_rank", "pp_rank", "dp_rank"}
STORAGE = {"storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size"}
# each family's labels in SGLang's collectors (newest release)
FAMILY_LABELS = {
    "sglang:num_running_reqs": SCHEDULER, "sglang:num_queue_reqs": SCHEDULER, "sglang:gen_throughput": SCHEDULER,
    "sglang:cache_hit_rate": SCHEDULER, "sglang:token_usage": SCHEDULER,
    "sglang:hicache_host_used_tokens": SCHEDULER, "sglang:hicache_host_total_tokens": SCHEDULER,
    "sglang:prompt_tokens": TOKENIZER | {"is_streaming"}, "sglang:generation_tokens": TOKENIZER | {"is_streaming"},
    "sglang:num_requests": TOKENIZER | {"is_streaming"}, "sglang:cached_tokens": TOKENIZER | {"cache_source"},
    "sglang:time_to_first_token_seconds": TOKENIZER | {"is_streaming"},
    "sglang:e2e_request_latency_seconds": TOKENIZER | {"is_streaming"},
    "sglang:evicted_tokens": RADIX, "sglang:load_back_tokens": RADIX | {"pool"},
    "sglang:prefetched_tokens": STORAGE, "sglang:backuped_tokens": STORAGE,
}


@pytest.fixture(scope="module")
def l3_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def server(start_server, l3_dir):
    return start_server("--enable-hierarchical-cache", "--page-size", "4", "--max-total-tokens", "4096",
                        "--hicache-storage-backend", "file", "--served-model-name", "parity",
                        "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(l3_dir)}),
                        "--admin-api-key", ADMIN_KEY)


@pytest.fixture(scope="module")
def api_key_server(start_server):
    return start_server("--enable-hierarchical-cache", "--api-key", API_KEY, "--max-total-tokens", "2048")


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 251 for i in range(n)]


def _gen(c: httpx.Client, ids: list[int], n: int = 1, **params) -> dict:
    r = c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": n, **params}})
    r.raise_for_status()
    return r.json()


def test_a_flush_right_after_a_request_waits_for_its_l3_backup(server):
    with server.client(headers=ADMIN) as c:
        c.post("/flush_cache?timeout=60").raise_for_status()
        before = metric(c, "sglang:backuped_tokens_total")
        _gen(c, _ids(11, 128))  # 32 pages of 4: L1 -> L2 -> L3 after the answer
        r = c.post("/flush_cache?timeout=60")
        assert (r.status_code, r.text) == (200, FLUSHED)
        assert metric(c, "sglang:backuped_tokens_total") - before == 128  # all 32 pages reached L3


def test_a_flush_that_cannot_go_idle_is_refused_as_sglang_refuses_it(server):
    with server.client(headers=ADMIN) as c:
        body = {"input_ids": _ids(12, 16), "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            assert "error" not in next(lines)  # running now
            assert (c.post("/flush_cache").status_code, c.post("/flush_cache").text) == (400, "Flush cache failed.\n")
            late = c.post("/flush_cache?timeout=0.2")
            assert (late.status_code, late.text) == (400, "Timed out waiting for idle state.")
            waiting: list[httpx.Response] = []

            def deferred() -> None:
                with server.client(headers=ADMIN) as other:
                    waiting.append(other.post("/flush_cache?timeout=120"))

            t = threading.Thread(target=deferred)
            t.start()
            for _ in range(600):
                second = c.post("/flush_cache")
                if second.text == "Another flush_cache is already in progress.":
                    break
                threading.Event().wait(0.05)
            assert (second.status_code, second.text) == (400, "Another flush_cache is already in progress.")
        t.join()  # closing the stream aborted the request: the deferred flush runs
        assert (waiting[0].status_code, waiting[0].text) == (200, FLUSHED)
        for bad in ("-1", "soon", "nan"):
            assert c.post(f"/flush_cache?timeout={bad}").status_code == 400


def _newest_oracle_model_info_keys() -> set[str] | None:
    """The keys of /model_info's answer in the newest installed sglang (read from its source), if any."""
    versions = sorted((p.name for p in sglang_oracle.ORACLE_ROOT.glob("*") if sglang_oracle.installed(p.name)),
                      key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()))
    if not versions:
        return None
    source = (sglang_oracle.ORACLE_ROOT / versions[-1] / "sglang/srt/entrypoints/http_server.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.AsyncFunctionDef) and n.name == "model_info")
    result = next(n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict))
    return {k.value for k in result.keys}


def test_model_info_has_sglangs_keys(server):
    with server.client() as c:
        for path in ("/model_info", "/get_model_info"):
            info = c.get(path).json()
            assert set(info) == MODEL_INFO_KEYS, path
    assert _newest_oracle_model_info_keys() in (None, set(info))
    assert info["model_path"] == "builtin:tiny" and info["served_model_name"] == "parity"
    assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
    assert info["disaggregation_mode"] == "null" and info["weight_version"] == "default"
    assert info["has_image_understanding"] is False and info["has_audio_understanding"] is False


@pytest.mark.parametrize("method,path", [("GET", "/hicache/storage-backend"), ("PUT", "/hicache/storage-backend"),
                                         ("DELETE", "/hicache/storage-backend"),
                                         ("POST", "/hicache/storage-backend/clear"),
                                         ("POST", "/clear_hicache_storage_backend")])
def test_storage_routes_on_an_api_key_only_server(api_key_server, method, path):
    with api_key_server.client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = c.request(method, path, headers=headers, json={"hicache_storage_backend": "file"})
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), headers
        r = c.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"hicache_storage_backend": "file"})
    missing = r.status_code == 400 and "requires admin API key" in r.text
    assert missing == ("clear" not in path), r.text  # SGLang's clear needs no admin key


def test_every_sglang_family_carries_sglangs_labels(server):
    with server.client() as c:
        a, b = _ids(21, 64), _ids(22, 64)
        _gen(c, a)
        _gen(c, a)
        hit = metric(c, "sglang:cache_hit_rate")
        _gen(c, b)  # nothing of it is cached: SGLang reports each batch's own hit rate
        miss = metric(c, "sglang:cache_hit_rate")
        _gen(c, _ids(23, 8), n=100, ignore_eos=True)
        with c.stream("POST", "/generate", json={"input_ids": _ids(24, 8), "stream": True,
                                                 "sampling_params": {"max_new_tokens": 2}}) as r:
            r.read()
        text = c.get("/metrics").text
    assert hit == 60 / 64 and miss == 0.0
    families = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("sglang:")}
    assert set(FAMILY_LABELS) <= set(families), set(FAMILY_LABELS) - set(families)
    for name, family in families.items():
        want = FAMILY_LABELS[name.removesuffix("_created")]  # the client library's creation-time samples
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            assert labels == want, (sample.name, sample.labels)
            assert sample.labels.get("model_name", "parity") == "parity"
            assert sample.labels.get("engine_type", "unified") == "unified"
            assert sample.labels.get("storage_backend", "file") == "file"
    throughput = [s.value for s in families["sglang:gen_throughput"].samples]
    assert len(throughput) == 1 and throughput[0] > 0  # 100 tokens decoded: two reports of 40 steps
    streamed = {s.labels["is_streaming"]: s.value for s in families["sglang:num_requests"].samples}
    assert streamed["true"] >= 1 and streamed["false"] >= 4
