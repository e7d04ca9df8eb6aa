"""bench/transfer.py runs end to end on the CPU and writes ratios to the limit."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[3] / "bench" / "transfer.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_transfer", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_cpu_bench_writes_every_variant(bench, tmp_path, fresh_backend, capsys):
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        rc = bench.main(
            [
                "--device",
                "cpu",
                "--page-sizes",
                "1,4",
                "--layers",
                "2",
                "--item-bytes",
                "16",
                "--head-dim",
                "8",
                "--tokens",
                "8",
                "--repeats",
                "2",
                "--warmup",
                "0",
                "--threads",
                "1",
                "--json-out",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    combos = {(r["direction"], r["layout"], r["page_size"]) for r in rows}
    assert len(combos) == 2 * 3 * 2
    for combo in combos:
        variants = {
            r["variant"]: r for r in rows if (r["direction"], r["layout"], r["page_size"]) == combo
        }
        assert set(variants) == {"limit", "ours-fallback", "page-loop", "naive-per-index"}
        assert variants["limit"]["ratio"] == 1.0
        for r in variants.values():
            assert r["gbps"] > 0 and r["ratio"] == pytest.approx(
                r["gbps"] / variants["limit"]["gbps"]
            )
            assert r["host_ms"] > 0 and r["vs_sgl"] is None  # no sgl-kernel on a CPU
    for r in rows:  # a load and a write-back both move K+V of every layer
        assert (r["item_bytes"], r["tokens"], r["bytes"]) == (16, 8, 8 * 16 * 2 * 2)
    assert data["env"]["kernels"]["backend"] in ("cpu-fallback", "cuda")
    assert "ratio = GB/s / limit GB/s" in capsys.readouterr().out
