"""Memory in bytes: units and Kubernetes quantities, and every term of a pod's memory beside its
host pools (see the package docstring for how they add up)."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from hicache_operator.api.spec import RUNTIME_CONTAINER, HiCacheDeploymentSpec
from hicache_operator.plan.engine import features as engine
from hicache_operator.plan.model import shapes as model_shapes

GB = 10**9
GIB = 2**30
MIB = 2**20
# What a Mooncake client lends when global_segment_size is unset (SGLang's and the runtime's default).
DEFAULT_SEGMENT_BYTES = 4 * GIB
# Each rank's Mooncake transfer buffer: the bundled runtime's local_buffer_size default; SGLang
# ignores the key and always takes this much.
DEFAULT_LOCAL_BUFFER_BYTES = 16 * 2**20
# What SGLang's host headroom check leaves each rank beyond its pool: room for the processes to hold
# up to this much more each than overheadGiB / ranks when the last rank allocates (memory held
# beyond the terms comes out of that rank's budget, 1/ranks of it).
ADMISSION_SLACK_PER_RANK_BYTES = GIB
# Size of the checkpoints SGLang loads (their safetensors: parameters x dtype bytes), whole GiB
# rounded up, for the models model_shapes knows: the page cache the ranks leave behind.
CHECKPOINT_GIB = {
    "meta-llama/Llama-3.1-8B-Instruct": 15,
    "meta-llama/Llama-3.1-70B-Instruct": 132,
    "Qwen/Qwen2.5-7B-Instruct": 15,
    "Qwen/Qwen3-8B": 16,
    "Qwen/Qwen3-32B": 62,
    "mistralai/Mistral-7B-Instruct-v0.3": 14,
    "deepseek-ai/DeepSeek-V3": 642,
}


class SizingError(Exception):
    """The spec cannot be sized against these nodes; ``rule`` and ``params`` fill a rules.Rule."""

    def __init__(self, rule: str, **params: Any) -> None:
        super().__init__(rule)
        self.rule = rule
        self.params = params



def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity in base units, None when unreadable."""
    try:
        return parse_quantity(value)
    except (ValueError, TypeError, ArithmeticError):
        return None


def shape_for(spec: HiCacheDeploymentSpec) -> model_shapes.Shape | None:
    override = model_shapes.Shape(**spec.model_shape.model_dump()) if spec.model_shape else None
    return model_shapes.lookup(spec.model, override)


def pool_bytes_for_tokens(tokens: int, page_size: int, bpt: int) -> tuple[int, int]:
    """(pages, bytes) SGLang allocates for a pool of ``tokens``: page_num = tokens // page + 1."""
    pages = tokens // page_size + 1
    return pages, pages * page_size * bpt


def fmt_bytes(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def memory_quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity, rounded up to whole MiB."""
    return f"{-(-n // MIB)}Mi"


def request_bytes(n: int) -> int:
    """What ``memory_quantity(n)`` requests, in bytes."""
    return -(-n // MIB) * MIB


# A size as people write it, whatever the engine reads: number, unit letter, "i" for powers of 2.
LOOSE_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt])(i?)b?", re.I)
UNIT_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def segment_bytes(value: Any, key: str = "global_segment_size") -> int:
    """A Mooncake size (``global_segment_size``, ``local_buffer_size``) as SGLang reads it
    (``mooncake_store._parse_global_segment_size``, the same in every release checked): an int as
    is, a float truncated, a string of bytes or ``"<N>gb"`` meaning N GiB, any case. What SGLang
    cannot read fails its start, and a negative size or a boolean lends nothing: SizingError."""
    if isinstance(value, bool):
        raise SizingError("mooncake-segment-size", key=key, value=value, problem="is a boolean",
                          fix="a byte count, e.g. 68719476736 or '64gb'")
    try:
        if isinstance(value, str):
            text = value.strip().lower()
            number = text[:-2].strip() if text.endswith("gb") else None
            if number == "":
                raise ValueError(value)
            size = int(number) * GIB if number is not None else int(text)
        else:
            size = int(value)
    except (TypeError, ValueError):
        raise SizingError("mooncake-segment-size", key=key, value=value,
                          problem="is not a size SGLang's Mooncake backend reads (the engine would fail to start)",
                          fix=_segment_fix(value)) from None
    if size < 0:
        raise SizingError("mooncake-segment-size", key=key, value=value, problem="is negative",
                          fix="a byte count, e.g. 68719476736 or '64gb'")
    return size


def _segment_fix(value: Any) -> str:
    """What to write for a Mooncake size SGLang cannot read, in its own spelling."""
    m = LOOSE_SIZE.fullmatch(str(value).strip())
    if not m:
        return "a byte count, e.g. 68719476736, or '<N>gb' for N GiB, e.g. '64gb'"
    size = int(Decimal(m.group(1)) * 1024 ** UNIT_POWER[m.group(2).lower()])
    exact = f"'{size // GIB}gb'" if size % GIB == 0 else str(size)
    return f"{exact} ({m.group(1)} x 2^{10 * UNIT_POWER[m.group(2).lower()]} bytes; Mooncake reads '<N>gb' as N GiB)"


def fixed_terms(spec: HiCacheDeploymentSpec) -> dict[str, int]:
    """Pod memory beside the host pools, by term (bytes)."""
    pool, st = spec.hicache.host_pool, spec.hicache.storage
    terms = {"overheadBytes": int(pool.overhead_gib * GIB), "shmBytes": int(pool.shm_gib * GIB)}
    if st.backend == "mooncake":
        size = st.extra_config.get("global_segment_size")
        terms["mooncakeSegmentBytes"] = DEFAULT_SEGMENT_BYTES if size is None else segment_bytes(size)
        buffer = st.extra_config.get("local_buffer_size") if spec.engine == "bundled" else None
        terms["mooncakeLocalBufferBytes"] = spec.ranks_per_pod * (
            DEFAULT_LOCAL_BUFFER_BYTES if buffer is None else segment_bytes(buffer, "local_buffer_size"))
    terms["engineReserveBytes"] = engine.host_reserve_bytes(spec)
    if terms["engineReserveBytes"]:
        if page_cache := page_cache_bytes(spec):
            terms["pageCacheBytes"] = page_cache
        terms["admissionSlackBytes"] = spec.ranks_per_pod * ADMISSION_SLACK_PER_RANK_BYTES
    return terms


def page_cache_bytes(spec: HiCacheDeploymentSpec) -> int | None:
    """Page cache SGLang's headroom check counts as used when the ranks allocate their pools: the
    checkpoint they just read, in releases that count the cgroup's file cache as used (0.5.21); 0
    where the release counts it free or has no check; None when counted but of unknown size."""
    if not engine.has(spec, "host_pool_headroom_check") or engine.has(spec, "host_headroom_page_cache_free"):
        return 0
    gib = CHECKPOINT_GIB.get(spec.model)
    return None if gib is None else gib * GIB


def pool_multiplier(spec: HiCacheDeploymentSpec) -> int:
    """How many pools' worth of memory the limit must hold (see the module docstring)."""
    ranks = spec.ranks_per_pod
    return 2 * ranks - 1 if engine.host_reserve_bytes(spec) else ranks


def sidecar_bytes(spec: HiCacheDeploymentSpec) -> int:
    """Memory the containers ``podTemplate`` adds request (a limit alone is also the request): its
    containers and restartable init containers, beside the operator's."""
    ps = spec.pod_template.spec
    added = [c for c in ps.get("containers") or [] if isinstance(c, dict) and c.get("name") != RUNTIME_CONTAINER]
    added += [c for c in ps.get("initContainers") or [] if isinstance(c, dict) and c.get("restartPolicy") == "Always"]
    total = 0
    for c in added:
        res = c.get("resources") if isinstance(c.get("resources"), dict) else {}
        memory = as_dict(res.get("requests")).get("memory") or as_dict(res.get("limits")).get("memory")
        total += int(quantity(memory) or 0) if memory is not None else 0
    return total

