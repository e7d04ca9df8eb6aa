"""--tp-size N runs N ranks (gloo on CPU): the same greedy tokens as one rank, every rank's KV
through L2 and its own L3 keys, MLA's replicated latent under one set of keys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cache_runtime.models.base import Shard
from cache_runtime.models.config import CheckpointError
from tests.unit.runtime.conftest import generate, on_engine, settle

IDS = [(7 * i + 3) % 1000 + 3 for i in range(61)]


def _through_every_tier(engines, path, tmp_path, tp: int):
    engine = engines(model_path=str(path), dtype="float32", tp_size=tp, page_size=4, max_total_tokens=512,
                     enable_hierarchical_cache=True, hicache_storage_backend="file",
                     hicache_storage_prefetch_policy="wait_complete",
                     extra_config={"file_storage_path": str(tmp_path), "prefetch_threshold": 8})
    cold = generate(engine, IDS, n=16, ignore_eos=True)
    settle(engine)
    on_engine(engine, lambda: engine.cache.evict(10**9))
    l2 = generate(engine, IDS, n=16, ignore_eos=True)
    assert l2.meta["cached_tokens_details"]["host"] == 60
    settle(engine)
    assert on_engine(engine, engine.flush)
    l3 = generate(engine, IDS, n=16, ignore_eos=True)
    assert l3.meta["cached_tokens_details"]["storage"] == 60
    assert cold.output_ids == l2.output_ids == l3.output_ids
    return cold.output_ids, sorted(p.name for p in tmp_path.glob("*.bin"))


@pytest.mark.parametrize("kind,tp", [("llama-gqa", 2), ("llama-gqa", 4), ("qwen3", 2), ("llama-mha-bias-tied", 2),
                                     ("deepseek-v3", 2)],
                         ids=["gqa-split", "gqa-kv-replicated", "qwen3", "mha-bias", "mla"])
def test_tp_gives_one_ranks_tokens_through_every_tier(engines, oracles, tmp_path, kind, tp):
    path, _ = oracles(kind)
    one, _ = _through_every_tier(engines, path, tmp_path / "tp1", 1)
    many, files = _through_every_tier(engines, path, tmp_path / f"tp{tp}", tp)
    assert many == one
    if kind.startswith("deepseek"):  # the latent is the same on every rank: one set of keys
        assert len(files) >= len(IDS) // 4 and not any(f"_{tp}.bin" in f for f in files)
    else:  # SGLang's per-rank file names, every rank's pages written
        per_rank = [sum(f.endswith(f"_{r}_{tp}.bin") for f in files) for r in range(tp)]
        assert per_rank == [per_rank[0]] * tp and per_rank[0] >= len(IDS) // 4


def test_head_counts_tp_cannot_split_are_refused():
    with pytest.raises(CheckpointError, match="--tp-size 3 does not divide num_attention_heads 16"):
        Shard(0, 3).span(16, "num_attention_heads")
    with pytest.raises(CheckpointError, match="neither a divisor nor a multiple of num_key_value_heads 3"):
        Shard(0, 4).kv_span(3)
    assert [Shard(r, 8).kv_span(2) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4


def test_a_dead_follower_stops_the_server(oracles, tmp_path):
    """The ranks fail as one unit: rank 0 exits (the pod restarts) instead of serving half a model."""
    path, _ = oracles("llama-gqa")
    proc = subprocess.Popen([sys.executable, "-m", "cache_runtime", "serve", "--model-path", str(path),
                             "--tp-size", "2", "--port", "0", "--max-total-tokens", "256", "--dtype", "float32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        follower = None
        while follower is None and time.monotonic() < deadline:
            out = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "cache_runtime.engine.tp"], capture_output=True,
                                 text=True).stdout.split()
            follower = int(out[0]) if out else None
            time.sleep(0.2)
        assert follower is not None, "no follower process"
        os.kill(follower, signal.SIGKILL)  # whatever rank 0 is doing then (loading, serving)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
