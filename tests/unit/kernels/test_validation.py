"""Bad arguments raise a clear TypeError/ValueError before anything is copied."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.reference import make_pools, same_bits

P = 2


@pytest.fixture
def pools():
    return make_pools(
        "page_first",
        False,
        layers=2,
        host_slots=4 * P,
        dev_slots=6 * P,
        page_size=P,
        heads=2,
        head_dim=4,
    )


def _load(
    host, dev_k, dev_v, h_idx=None, d_idx=None, layer=0, layout="page_first", page_size=P, **kw
):
    h_idx = torch.tensor([0, 1, 2]) if h_idx is None else h_idx
    d_idx = torch.tensor([3, 4, 5]) if d_idx is None else d_idx
    kernels.load_per_layer(host, dev_k, dev_v, h_idx, d_idx, layer, layout, page_size, **kw)


def _snapshot(host, dev_k, dev_v):
    return [t.clone() for t in [host, *dev_k, *dev_v]]


BAD_LOADS = [
    ("layout", dict(layout="row_major"), ValueError, "layout must be one of"),
    ("io_backend", dict(io_backend="nccl"), ValueError, "io_backend must be one of"),
    ("page_size type", dict(page_size=2.0), TypeError, "page_size must be an int"),
    ("page_size value", dict(page_size=0), ValueError, "page_size must be >= 1"),
    ("page_size mismatch", dict(page_size=3), ValueError, "not a multiple of page_size"),
    ("num_ctas", dict(num_ctas=0), ValueError, r"num_ctas must be in \[1, 65535\]"),
    ("layer", dict(layer=2), ValueError, r"layer_id must be in \[0, 1\]"),
    (
        "idx dtype",
        dict(h_idx=torch.tensor([0, 1, 2], dtype=torch.int32)),
        TypeError,
        "host_indices must be int64",
    ),
    ("idx dim", dict(d_idx=torch.tensor([[3, 4, 5]])), ValueError, "device_indices must be 1-D"),
    ("idx length", dict(d_idx=torch.tensor([3, 4])), ValueError, "must have equal length"),
    (
        "host range",
        dict(h_idx=torch.tensor([0, 8, -1])),
        ValueError,
        "host_indices has index 8 >= pool size 8",
    ),
    (
        "dev range",
        dict(d_idx=torch.tensor([3, 4, 12])),
        ValueError,
        "device_indices has index 12 >= pool size 12",
    ),
    ("idx type", dict(h_idx=[0, 1, 2]), TypeError, "host_indices must be a torch.Tensor"),
]


@pytest.mark.parametrize("kw,exc,msg", [c[1:] for c in BAD_LOADS], ids=[c[0] for c in BAD_LOADS])
def test_bad_load_arguments(pools, kw, exc, msg):
    host, dev_k, dev_v = pools
    before = _snapshot(host, dev_k, dev_v)
    with pytest.raises(exc, match=msg):
        _load(host, dev_k[0], dev_v[0], **kw)
    assert all(same_bits(a, b) for a, b in zip(before, _snapshot(host, dev_k, dev_v)))


def test_dtype_mismatch(pools):
    host, dev_k, dev_v = pools
    with pytest.raises(
        TypeError,
        match="device_k\\[0\\] dtype torch.float16 does not match host_kv dtype torch.bfloat16",
    ):
        _load(host, dev_k[0].half(), dev_v[0])


def test_unsupported_dtype():
    host = torch.zeros(2, 4, 2, 1, 2, dtype=torch.float64)
    dev = torch.zeros(4, 1, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match="host_kv dtype must be one of"):
        _load(host, dev, dev)


def test_non_contiguous(pools):
    host, dev_k, dev_v = pools
    with pytest.raises(ValueError, match="host_kv must be contiguous"):
        _load(host.transpose(1, 2), dev_k[0], dev_v[0])
    with pytest.raises(ValueError, match="device_v\\[0\\] must be contiguous"):
        _load(host, dev_k[0], dev_v[0].transpose(1, 2).contiguous().transpose(1, 2))


def test_shape_mismatches(pools):
    host, dev_k, dev_v = pools
    with pytest.raises(ValueError, match=r"must be \(slots, 2, 4\)"):
        _load(host, dev_k[0][:, :1].contiguous(), dev_v[0])
    with pytest.raises(ValueError, match="device_v must match device_k"):
        _load(host, dev_k[0], dev_v[0][:-1])
    with pytest.raises(
        ValueError, match=r"host_kv for MHA page_first must be \(2, size, L, H, D\)"
    ):
        _load(host[0], dev_k[0], dev_v[0])
    with pytest.raises(ValueError, match="leading dim must be 2"):
        _load(torch.cat([host, host[:1]]), dev_k[0], dev_v[0])
    with pytest.raises(ValueError, match="MLA .* expects H == 1"):
        _load(host[0], dev_k[0], None)


def test_device_type_checks(pools):
    host, dev_k, dev_v = pools
    with pytest.raises(ValueError, match="device_k must be on cpu or cuda"):
        _load(host, dev_k[0].to("meta"), dev_v[0].to("meta"))
    with pytest.raises(TypeError, match="device_k\\[0\\] must be a torch.Tensor"):
        _load(host, dev_k[0].tolist(), dev_v[0])


def test_backup_layer_count_and_list_type(pools):
    host, dev_k, dev_v = pools
    idx = torch.tensor([0])
    with pytest.raises(ValueError, match="host_kv has 2 layers, device pool 1"):
        kernels.backup_all_layers(dev_k[:1], dev_v[:1], host, idx, idx, "page_first", P)
    with pytest.raises(ValueError, match="device_v has 1 layers, device_k 2"):
        kernels.backup_all_layers(dev_k, dev_v[:1], host, idx, idx, "page_first", P)
    with pytest.raises(TypeError, match="device_k_layers must be a list"):
        kernels.backup_all_layers(dev_k[0], dev_v, host, idx, idx, "page_first", P)
    with pytest.raises(ValueError, match="device_k must name at least one layer"):
        kernels.backup_all_layers([], None, host[0], idx, idx, "page_first", P)


def test_negative_indices_are_not_range_errors(pools):
    host, dev_k, dev_v = pools
    _load(host, dev_k[0], dev_v[0], h_idx=torch.tensor([-7, 1, 2]), d_idx=torch.tensor([3, -1, 5]))


@pytest.mark.parametrize(
    "h_idx,d_idx,msg",
    [
        ([0, 1, 2], [3, 5, 3], "device_indices names destination slot 3 twice"),
        ([0, 1, 2, 3], [11, 4, 11, 4], "device_indices names destination slot 11 twice"),
    ],
)
def test_duplicate_destination_is_refused(pools, h_idx, d_idx, msg):
    """Two pairs writing one row would leave it to whichever copy lands last."""
    host, dev_k, dev_v = pools
    before = _snapshot(host, dev_k, dev_v)
    with pytest.raises(ValueError, match=msg):
        _load(host, dev_k[0], dev_v[0], h_idx=torch.tensor(h_idx), d_idx=torch.tensor(d_idx))
    assert all(same_bits(a, b) for a, b in zip(before, _snapshot(host, dev_k, dev_v)))


def test_duplicate_destination_on_backup_is_the_host_side(pools):
    host, dev_k, dev_v = pools
    with pytest.raises(ValueError, match="host_indices names destination slot 2 twice"):
        kernels.backup_all_layers(
            dev_k, dev_v, host, torch.tensor([0, 1]), torch.tensor([2, 2]), "page_first", P
        )


def test_repeated_sources_and_skipped_pairs_are_not_duplicates(pools):
    host, dev_k, dev_v = pools
    _load(host, dev_k[0], dev_v[0], h_idx=torch.tensor([1, 1, 1]), d_idx=torch.tensor([3, 4, 5]))
    _load(host, dev_k[0], dev_v[0], h_idx=torch.tensor([-1, 1, 2]), d_idx=torch.tensor([3, 3, -1]))
    assert same_bits(dev_k[0][3], host[0, 1, 0])
