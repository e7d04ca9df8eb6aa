"""The operator sizes host pools with the bytes per token the runtime really allocates: one
formula, read from the same config.json, for every architecture, dtype and TP degree."""

from __future__ import annotations

import pytest

from cache_runtime.models.config import load_config
from hicache_operator.plan.model import shapes as model_shapes
from testbed.checkpoints import ORACLE_KINDS


def _allocated_bytes_per_token(engine) -> list[float]:
    return [h.kv_buffer.numel() * h.kv_buffer.element_size() / h.size for h in engine.runner.host_pools]


@pytest.mark.parametrize("kind,tp,dtype", [(k, 1, "float32") for k in ORACLE_KINDS]
                         + [("llama-gqa", 1, "bfloat16"), ("llama-gqa", 2, "bfloat16"), ("llama-gqa", 4, "float32"),
                            ("deepseek-v3", 2, "float32")])
def test_operator_bytes_per_token_equals_the_runtime_allocation(engines, oracles, kind, tp, dtype):
    path, _ = oracles(kind)
    engine = engines(model_path=str(path), dtype=dtype, tp_size=tp, page_size=4, max_total_tokens=256,
                     enable_hierarchical_cache=True)
    shape = model_shapes.from_config(load_config(path), dtype)
    assert _allocated_bytes_per_token(engine) == [model_shapes.bytes_per_token(shape, tp, 1)] * tp
