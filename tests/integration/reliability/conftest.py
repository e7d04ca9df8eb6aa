"""Real runtime processes for the reliability tests: fuzzing, fault injection, security."""
from __future__ import annotations

import httpx
import pytest

from testbed.runtime_proc import RuntimeProcess, metric  # noqa: F401 (metric: for the tests)

PROMPTS = [f"{i:02d} reliability prompt: pages move between device, host and storage tiers. " * 2 for i in range(40)]


@pytest.fixture
def start_runtime(tmp_path):
    started: list[RuntimeProcess] = []

    def start(*flags: str, **kw) -> RuntimeProcess:
        rt = RuntimeProcess(list(flags), tmp_path / f"runtime-{len(started)}.log", **kw).start()
        started.append(rt)
        return rt

    yield start
    for rt in started:
        rt.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A runtime with no cache at all: what every cached answer must equal (greedy decoding)."""
    rt = RuntimeProcess(["--disable-radix-cache", "--max-total-tokens", "4096"],
                 tmp_path_factory.mktemp("reference") / "runtime.log").start()
    cache: dict[tuple[str, int], list[int]] = {}

    def outputs(prompt: str, max_new_tokens: int = 8) -> list[int]:
        key = (prompt, max_new_tokens)
        if key not in cache:
            with rt.client() as c:
                r = c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}})
                r.raise_for_status()
                cache[key] = r.json()["output_ids"]
        return cache[key]

    yield outputs
    rt.stop()


def generate(client: httpx.Client, prompt: str, max_new_tokens: int = 8) -> dict:
    r = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}})
    assert r.status_code == 200, r.text
    return r.json()
