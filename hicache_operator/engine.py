"""What the engine a spec runs can do.

engine sglang runs one SGLang release: ``spec.engineVersion``, else the version in the image tag
(``lmsysorg/sglang:v0.5.23-cu129`` -> 0.5.23). Its features come from the table in
``engine_versions`` (read from each release's source). The bundled runtime is built with this
operator and has every feature it uses, so nothing here ever restricts it.
"""

from __future__ import annotations

from hicache_operator import engine_versions
from hicache_operator.spec import HiCacheDeploymentSpec

# SGLang keeps this much host RAM free when it checks a host pool (HICACHE_HOST_MEMORY_RESERVE_BYTES).
SGLANG_HOST_RESERVE_BYTES = 10 * 2**30
# The bundled runtime's device pool without --max-total-tokens (cache_runtime.args.ServerArgs);
# SGLang instead derives its pool from the GPU's free memory at start, which nothing here can know.
BUNDLED_DEVICE_TOKENS = 16384


def version(spec: HiCacheDeploymentSpec) -> str | None:
    """The SGLang release of an sglang-engine spec; None for bundled or when it cannot be told."""
    if spec.engine != "sglang":
        return None
    return spec.engine_version or engine_versions.version_from_image(spec.image)


def lacks(spec: HiCacheDeploymentSpec, feature: str) -> bool:
    """True when the spec runs an SGLang release known to lack ``feature``."""
    v = version(spec)
    return v is not None and not engine_versions.has(v, feature)


def has(spec: HiCacheDeploymentSpec, feature: str) -> bool:
    """True when the spec runs an SGLang release known to have ``feature``."""
    v = version(spec)
    return v is not None and engine_versions.has(v, feature)


def host_reserve_bytes(spec: HiCacheDeploymentSpec) -> int:
    """Host RAM the engine insists stays free beside a host pool it allocates."""
    return SGLANG_HOST_RESERVE_BYTES if has(spec, "host_pool_headroom_check") else 0


def device_tokens(spec: HiCacheDeploymentSpec) -> int | None:
    """The L1 pool in tokens the pods will have, when it can be known before they start."""
    if spec.max_total_tokens:
        return spec.max_total_tokens
    return BUNDLED_DEVICE_TOKENS if spec.engine == "bundled" else None
