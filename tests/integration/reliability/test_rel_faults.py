"""Faults underneath a running runtime: corrupted L3 pages, an exhausted host pool, a killed process.

The property in every case: requests keep succeeding, and what the runtime generates equals what a
runtime with no cache at all generates for the same prompt (greedy decoding is deterministic), so
a fault can cost a cache hit but never produce wrong KV.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from testbed.runtime_proc import RuntimeProcess, metric
from tests.integration.reliability.conftest import PROMPTS, generate


def _wait(cond, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _file_l3_flags(storage_dir) -> list[str]:
    extra = {"file_storage_path": str(storage_dir), "prefetch_threshold": 4}
    return ["--enable-hierarchical-cache", "--page-size", "4", "--max-total-tokens", "4096",
            "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]


def _pages(storage_dir) -> set:
    return {p for p in storage_dir.glob("*.bin")}


def test_corrupted_file_pages_are_misses_never_wrong_kv(start_runtime, reference, tmp_path):
    l3 = tmp_path / "l3"
    rt = start_runtime(*_file_l3_flags(l3))
    damaged, intact = PROMPTS[:6], PROMPTS[6:9]
    with rt.client() as c:
        for p in damaged:
            generate(c, p)
        _wait(lambda: len(_pages(l3)) >= 6 * (len(damaged[0]) // 4) - 6, what="pages of the first prompts on disk")
        first = _pages(l3)
        for i, page in enumerate(sorted(first)):
            data = page.read_bytes()
            if i % 3 == 0:
                page.write_bytes(data[: len(data) // 2])  # truncated
            elif i % 3 == 1:
                flipped = bytearray(data)
                flipped[len(data) // 3] ^= 0x10  # one bit flipped inside the KV bytes
                page.write_bytes(bytes(flipped))
            else:
                page.unlink()  # deleted
        for p in intact:
            generate(c, p)
        _wait(lambda: len(_pages(l3) - first) >= 3 * (len(intact[0]) // 4) - 3, what="pages of the later prompts")
        assert c.post("/flush_cache?timeout=60").status_code == 200  # L1 and L2 gone: only L3 can serve a prefix now

        for p in damaged + intact:
            out = generate(c, p)
            assert out["output_ids"] == reference(p), f"wrong output for {p[:12]!r}"
            storage = out["meta_info"]["cached_tokens_details"]["storage"]
            if p in damaged:
                # Every page of these prompts was truncated, flipped or deleted: none may be loaded.
                assert storage == 0, (p[:12], out["meta_info"])
            else:
                assert storage > 0, (p[:12], out["meta_info"])


def test_exhausted_host_pool_still_answers_correctly(start_runtime, reference):
    # 512 device tokens and a 1.5x host pool: 40 distinct ~150-token prompts overflow both many times.
    rt = start_runtime("--enable-hierarchical-cache", "--page-size", "4", "--max-total-tokens", "512",
                       "--hicache-ratio", "1.5", "--max-running-requests", "4")
    results: dict[str, list[int]] = {}
    errors: list[str] = []

    def worker(prompts):
        with rt.client() as c:
            for p in prompts:
                r = c.post("/generate", json={"text": p, "sampling_params": {"max_new_tokens": 8}})
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                else:
                    results[p] = r.json()["output_ids"]

    for _round in range(2):
        threads = [threading.Thread(target=worker, args=(PROMPTS[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for p in PROMPTS:
            assert results[p] == reference(p), f"wrong output for {p[:12]!r}"
    with rt.client() as c:
        assert metric(c, "hicache_l2_evicted_tokens_total") > 0, "the host pool was never full: the test proves nothing"


def test_runtime_killed_mid_request_then_restarted(start_runtime, reference, tmp_path):
    rt = start_runtime("--enable-hierarchical-cache", "--max-total-tokens", "4096")
    prompt = PROMPTS[10]
    got: dict = {}

    def stream():
        try:
            with rt.client() as c, c.stream("POST", "/generate", json={
                    "text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 2000}}) as r:
                got["status"] = r.status_code
                got["lines"] = []
                for line in r.iter_lines():
                    got["lines"].append(line)
        except httpx.HTTPError as exc:
            got["error"] = exc

    t = threading.Thread(target=stream)
    t.start()
    _wait(lambda: len(got.get("lines", [])) >= 2, what="the stream to start")
    rt.kill()
    t.join(timeout=30)
    assert not t.is_alive()
    # The client learns it: a transport error, or a stream that ends without its [DONE] marker.
    assert "error" in got or "data: [DONE]" not in got["lines"], got.get("lines", [])[-3:]

    again = RuntimeProcess(rt.flags, tmp_path / "restarted.log", port=rt.port).start()
    try:
        with again.client() as c:
            assert generate(c, prompt)["output_ids"] == reference(prompt)
    finally:
        again.stop()
