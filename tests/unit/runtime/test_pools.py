"""Page allocator, host-pool sizing, and each layout's page round trip through L1 -> L2 -> L1 and L3 bytes."""

from __future__ import annotations

import pytest
import torch

import kernels
from cache_runtime.memory import DevicePool, HostPool, PageAllocator, host_pool_tokens
from cache_runtime.models.config import kv_cell_bytes
from tests.unit.runtime.conftest import page_by_layer

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
L, H, D = 3, 2, 8


def test_allocator_rounds_up_to_pages_and_rejects_double_free():
    a = PageAllocator(num_pages=4, page_size=4)
    slots = a.alloc(5)
    assert slots.tolist() == list(range(8))
    assert a.free_tokens == 8
    assert a.alloc(9) is None
    a.free(slots)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(slots)
    with pytest.raises(RuntimeError, match="whole number of pages"):
        a.free(torch.tensor([0, 1]))


def test_host_pool_size_follows_sglang_formula():
    tb = kv_cell_bytes(num_layers=4, num_kv_heads=4, head_dim=32, dtype_bytes=2)
    assert tb == 32 * 4 * 4 * 2 * 2
    # ratio: device * ratio, then page_num = size // page + 1
    assert host_pool_tokens(1000, 16, 2.0, 0, tb) == (2000 // 16 + 1) * 16
    # --hicache-size is GB (1e9) per rank and wins over the ratio
    assert host_pool_tokens(1000, 1, 2.0, 0.01, tb) == (int(0.01 * 1e9 // tb) // 1 + 1)
    with pytest.raises(ValueError, match="must be > 1"):
        host_pool_tokens(1000, 1, 1.0, 0, tb)
    with pytest.raises(ValueError, match="larger than the device pool"):
        host_pool_tokens(10**6, 1, 2.0, 0.0001, tb)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_shapes_are_sglangs(layout):
    host = HostPool(32, 4, L, H, D, torch.float32, layout, pin=False)
    expected = {"layer_first": (2, L, 32, H, D), "page_first": (2, 32, L, H, D),
                "page_first_direct": (2, 8, L, 4, H, D)}[layout]
    assert tuple(host.kv_buffer.shape) == expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_round_trip_through_every_tier(layout):
    ps = 4
    io = "direct" if layout == "page_first_direct" else "kernel"
    dev = DevicePool(64, ps, L, H, D, torch.float32, torch.device("cpu"))
    for t in dev.k + dev.v:
        t.copy_(torch.randn_like(t))
    host = HostPool(64, ps, L, H, D, torch.float32, layout, pin=False)
    src = torch.arange(8, 16)  # pages 2 and 3 of L1
    dst = torch.arange(32, 40)  # pages 8 and 9 of L2
    kernels.backup_all_layers(dev.k, dev.v, host.kv_buffer, src, dst, layout, ps, io_backend=io)
    # L3 bytes in SGLang's order for the layout: K then V, each (token, layer, head, dim) for page_first,
    # (layer, token, head, dim) for layer_first and page_first_direct
    page = page_by_layer(host, host.get_page(32))
    for layer in range(L):
        assert torch.equal(page[0, layer], dev.k[layer][8:12])
        assert torch.equal(page[1, layer], dev.v[layer][8:12])
    # L3 bytes back into a different L2 page, then L2 -> L1 into fresh slots
    host.set_page(48, host.get_page(32).view(torch.uint8))
    back = torch.arange(40, 48)
    for layer in range(L):
        kernels.load_per_layer(host.kv_buffer, dev.k[layer], dev.v[layer], torch.cat([torch.arange(48, 52),
                               torch.arange(36, 40)]), back, layer, layout, ps, io_backend=io)
        assert torch.equal(dev.k[layer][40:48], dev.k[layer][8:16])
        assert torch.equal(dev.v[layer][40:48], dev.v[layer][8:16])


def test_set_page_rejects_wrong_size():
    host = HostPool(16, 4, L, H, D, torch.float32, "layer_first", pin=False)
    with pytest.raises(ValueError, match="expected"):
        host.set_page(0, torch.zeros(3, dtype=torch.uint8))
