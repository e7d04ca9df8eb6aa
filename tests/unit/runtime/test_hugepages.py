"""A CPU model's weight matrices on transparent huge pages: same values, tied tensors still shared,
the arena advised for huge pages, nothing moved where the kernel has them off."""

from __future__ import annotations

import pytest
import torch

from cache_runtime.models import hugepages, load_model
from cache_runtime.models.weights import CheckpointWeights

CPU = torch.device("cpu")


def _vma(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


@pytest.mark.skipif(hugepages.thp_mode() in (None, "never"), reason="transparent huge pages are off here")
def test_weights_move_into_one_advised_arena_with_their_values(oracles, monkeypatch):
    monkeypatch.setattr(hugepages, "_MIN_BYTES", 1)  # the oracle model's tensors are all small
    path, _ = oracles("llama-mha-bias-tied")
    model = load_model(str(path), torch.float32, CPU, max_positions=512).model
    src = CheckpointWeights(path)
    try:
        layer = model.layers[0]
        want = src.get("model.layers.0.mlp.down_proj.weight", tuple(layer.w_down.shape), torch.float32, CPU)
        assert torch.equal(layer.w_down, want)
    finally:
        src.close()
    assert model.lm_head.data_ptr() == model.embed.data_ptr()  # tied: moved once, still one tensor
    for t in (model.embed, layer.wqkv, layer.w_gate_up, layer.w_down, model.rotary.cos):
        assert _vma(t.data_ptr()).get("THPeligible") == "1", "the arena was not advised MADV_HUGEPAGE"


def test_nothing_moves_where_huge_pages_are_off(oracles, monkeypatch):
    monkeypatch.setattr(hugepages, "_MIN_BYTES", 1)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    path, _ = oracles("llama-mha-bias-tied")
    model = load_model(str(path), torch.float32, CPU, max_positions=512).model
    assert hugepages.move_weights(model) == 0
    assert model.lm_head.data_ptr() == model.embed.data_ptr()
