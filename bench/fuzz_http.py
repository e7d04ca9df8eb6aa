"""Property-based HTTP fuzzing of the bundled runtime's every route.

Requests are generated with hypothesis: bad JSON, wrong types, invalid UTF-8, oversized prompts,
negative and huge lengths, NaN-like numbers, lone surrogates, missing, wrong and right keys on the
admin routes, unknown paths and methods. Every answer must be a 2xx, or a 4xx that carries a
message; never a 5xx; and a normal /generate still works afterwards.

Settings that would legitimately turn later answers into 503 (draining) or change the server's
storage are sent only without a valid key, or with bodies that are refused.

  python bench/fuzz_http.py --requests 5000 --json-out bench/results/fuzz_http.json

The CI test (tests/integration/reliability/test_rel_http_fuzz.py) runs the same checks on fewer.
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st


ADMIN_KEY = "fuzz-admin-key-0123456789"
# Small limits keep every generated request cheap on a CPU: any prompt + max_new_tokens beyond
# 512 is refused before it runs, and bodies over 64 KiB are refused with 413.
SERVER_FLAGS = ["--enable-hierarchical-cache", "--page-size", "4", "--max-total-tokens", "4096",
                "--context-length", "512", "--max-request-bytes", str(64 * 1024), "--admin-api-key", ADMIN_KEY]

NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 1, 8, 511, 512, 10**9, 2**63, -(2**63) - 1]),
                    st.floats(allow_nan=False, allow_infinity=False), st.just("12"), st.none())
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "a" * 600, "é" * 300, "\U0001F600" * 50, "\x00\x01"]))
JSON_ANY = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
                        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
                        max_leaves=12)
SAMPLING = st.fixed_dictionaries({}, optional={
    "max_new_tokens": NUMBERS, "temperature": NUMBERS, "top_p": NUMBERS, "top_k": NUMBERS,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), NUMBERS), "stop_token_ids": st.one_of(st.lists(NUMBERS, max_size=3), TEXT),
    "ignore_eos": st.one_of(st.booleans(), NUMBERS), "seed": NUMBERS, "unknown": JSON_ANY})
PROMPT_IDS = st.one_of(st.lists(st.integers(-3, 300), max_size=20), st.lists(st.lists(st.integers(0, 255), max_size=5), max_size=3),
                       st.lists(NUMBERS, max_size=4), st.just([]), st.just(list(range(256)) * 3))
GENERATE = st.fixed_dictionaries({}, optional={
    "text": st.one_of(TEXT, st.lists(TEXT, max_size=3), NUMBERS), "input_ids": PROMPT_IDS, "sampling_params": st.one_of(SAMPLING, JSON_ANY),
    "stream": st.one_of(st.booleans(), NUMBERS), "rid": st.one_of(TEXT, NUMBERS), "return_logprob": st.one_of(st.booleans(), TEXT)})
COMPLETION = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=3), PROMPT_IDS, NUMBERS), "model": st.one_of(TEXT, NUMBERS),
    "max_tokens": NUMBERS, "temperature": NUMBERS, "top_p": NUMBERS, "top_k": NUMBERS, "n": NUMBERS, "echo": st.booleans(),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=2)), "stream": st.booleans(), "seed": NUMBERS,
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), TEXT)}), JSON_ANY)})
ATTACH = st.fixed_dictionaries({}, optional={
    "hicache_storage_backend": st.one_of(st.sampled_from(["file", "mooncake", "dynamic", "hf3fs", ""]), NUMBERS),
    "hicache_storage_backend_extra_config_json": st.one_of(
        TEXT, st.sampled_from(["{}", "[]", "{bad", "@/etc/passwd", '{"file_storage_path": 5}', "null"])),
    "hicache_storage_prefetch_policy": st.one_of(TEXT, st.sampled_from(["best_effort", "timeout", "never"])),
    "hicache_write_policy": st.one_of(TEXT, st.sampled_from(["write_back", "write_through", "always"]))})


def _json_bytes(strategy):
    return strategy.map(lambda obj: json.dumps(obj).encode())


RAW_BODIES = st.one_of(
    st.binary(max_size=64),  # mostly invalid UTF-8 / not JSON
    st.sampled_from([b"", b"{", b"null", b"[]", b'"text"', b"NaN", b'{"text": "\\ud800"}',
                     b'{"text": "a", "sampling_params": {"temperature": NaN}}', b"[" * 5000 + b"]" * 5000,
                     b'{"text": "' + b"x" * 70000 + b'"}', b'{"text": "\xff\xfe"}']))

BODIES = {
    ("POST", "/generate"): st.one_of(_json_bytes(GENERATE), RAW_BODIES),
    ("POST", "/v1/completions"): st.one_of(_json_bytes(COMPLETION), RAW_BODIES),
    ("PUT", "/hicache/storage-backend"): st.one_of(_json_bytes(ATTACH), RAW_BODIES),
}
NO_BODY_ROUTES = [("GET", "/health"), ("GET", "/health_generate"), ("GET", "/metrics"), ("GET", "/server_info"),
                  ("GET", "/get_server_info"), ("GET", "/get_model_info"), ("GET", "/v1/models"),
                  ("GET", "/flush_cache"), ("POST", "/flush_cache"),
                  ("GET", "/hicache/storage-backend"), ("DELETE", "/hicache/storage-backend"),
                  ("POST", "/hicache/storage-backend/clear"), ("GET", "/clear_hicache_storage_backend"),
                  ("POST", "/clear_hicache_storage_backend"), ("PATCH", "/generate"), ("GET", "/nope/../generate"),
                  ("POST", "/does-not-exist")]
AUTH = st.sampled_from([None, "Bearer wrong", "Bearer", "bearer " + ADMIN_KEY, "Basic abc", "Bearer " + ADMIN_KEY + "x",
                        "x-api-key:" + ADMIN_KEY, "x-api-key:", "Bearer " + ADMIN_KEY])
# Bodies that, with the right key, would change what later requests see: sent only with a wrong key.
STATEFUL = {("PUT", "/hicache/storage-backend")}


@st.composite
def requests(draw) -> dict:
    routes = list(BODIES) + NO_BODY_ROUTES
    method, path = draw(st.sampled_from(routes))
    auth = draw(AUTH)
    if (method, path) in STATEFUL and auth and auth.endswith(ADMIN_KEY):
        auth = "Bearer wrong"
    headers = {}
    if auth and auth.startswith("x-api-key:"):
        headers["x-api-key"] = auth.split(":", 1)[1]
    elif auth:
        headers["Authorization"] = auth
    body = draw(BODIES[(method, path)]) if (method, path) in BODIES else draw(st.one_of(st.just(b""), RAW_BODIES))
    headers["Content-Type"] = draw(st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]))
    query = draw(st.sampled_from(["", "?timeout=abc", "?timeout=-5", "?timeout=1e999", "?timeout=nan", "?x=%ff"]))
    return {"method": method, "path": path + query, "headers": headers, "body": body}


def fire(client: httpx.Client, req: dict) -> dict:
    """Sends one request; the verdict says whether the answer is acceptable."""
    try:
        resp = client.request(req["method"], req["path"], headers=req["headers"], content=req["body"])
        text = resp.text
    except httpx.HTTPError as exc:
        return {"ok": False, "status": None, "why": f"transport error: {type(exc).__name__}: {exc}"}
    status = resp.status_code
    if status >= 500:
        return {"ok": False, "status": status, "why": text[:300]}
    if 400 <= status < 500 and not _has_message(resp):
        return {"ok": False, "status": status, "why": f"4xx without a message: {text[:200]!r}"}
    return {"ok": True, "status": status}


def _has_message(resp: httpx.Response) -> bool:
    try:
        body = resp.json()
    except ValueError:
        return bool(resp.text.strip())
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return bool(err.get("message"))
    return bool(err) or bool(isinstance(body, dict) and body.get("detail"))


def generate_works(client: httpx.Client) -> bool:
    r = client.post("/generate", json={"text": "still serving?", "sampling_params": {"max_new_tokens": 4}},
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    return r.status_code == 200 and len(r.json()["output_ids"]) == 4


class Tally:
    def __init__(self) -> None:
        self.statuses: collections.Counter = collections.Counter()
        self.failures: list[dict] = []

    def add(self, req: dict, verdict: dict) -> None:
        self.statuses[verdict["status"]] += 1
        if not verdict["ok"] and len(self.failures) < 20:
            self.failures.append({**verdict, "method": req["method"], "path": req["path"],
                                  "body": req["body"][:300].decode("utf-8", "backslashreplace")})

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s is None or s >= 500)

    @property
    def bad(self) -> int:
        return self.server_errors + sum(1 for f in self.failures if f["status"] and f["status"] < 500)


def run_fuzz(client: httpx.Client, n: int, tally: Tally) -> None:
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @given(req=requests())
    def one(req):
        tally.add(req, fire(client, req))
    one()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    from testbed.runtime_proc import start_runtime

    with tempfile.TemporaryDirectory(prefix="fuzz-http-") as tmp:
        server = start_runtime(SERVER_FLAGS, Path(tmp) / "server.log")
        try:
            tally = Tally()
            t0 = time.monotonic()
            with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
                run_fuzz(client, args.requests, tally)
                still = generate_works(client)
            elapsed = time.monotonic() - t0
            log = (Path(tmp) / "server.log").read_text(errors="replace")
        finally:
            server.stop()
    out = {"requests": sum(tally.statuses.values()), "server_errors_5xx": tally.server_errors,
           "4xx_without_message": sum(1 for f in tally.failures if f["status"] and f["status"] < 500),
           "statuses": {str(k): v for k, v in sorted(tally.statuses.items(), key=lambda kv: str(kv[0]))},
           "generate_works_after": still, "server_tracebacks": log.count("Traceback"),
           "seconds": round(elapsed, 1), "failures": tally.failures}
    print(json.dumps({k: v for k, v in out.items() if k != "failures"}, indent=2))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=2))
    return 0 if not tally.bad and still and not out["server_tracebacks"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
