"""What the engine a spec runs can do.

engine sglang runs one SGLang release: ``spec.engineVersion``, else the version in the image tag
(``lmsysorg/sglang:v0.5.23-cu129`` -> 0.5.23). Its features come from the table in
``engine_versions`` (read from each release's source). The bundled runtime is built with this
operator and has every feature it uses, so nothing here ever restricts it.

The page size SGLang serves may differ from ``--page-size``: ``page_outcomes`` says, per GPU kind
(read from the nodes' GPU feature discovery labels) and attention backend, what it becomes; validation
refuses a spec whose pageSize SGLang would rewrite, so status, sizing and the L3 keys, which all use
``pageSize``, name what SGLang serves. ``tests/unit/sglang/test_page_size.py`` checks it against
SGLang's own resolution on faked GPU kinds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hicache_operator.plan.engine import cli as engine_cli, versions as engine_versions
from hicache_operator.plan.model import shapes as model_shapes
from hicache_operator.api.spec import HiCacheDeploymentSpec

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


# ---- the page size SGLang really serves ----
# SGLang rewrites --page-size for attention backends that only take some page sizes, and picks the
# attention backend itself, by GPU, when --attention-backend is not given. A GPU kind here is the
# CUDA compute capability's major version, which is what SGLang's platform checks tell apart:
# 9 Hopper (fa3 by default), 10 SM100/SM103 B200/GB200/B300 (trtllm_mha for MHA models, flashinfer or,
# for DeepSeek-V3, trtllm_mla for MLA models), anything else flashinfer/triton (no rewrite).
HOPPER, SM100 = 9, 10
GPU_KINDS = (8, HOPPER, SM100, 12)
GPU_NAMES = {8: "Ampere/Ada", HOPPER: "Hopper (SM90)", SM100: "Blackwell SM100", 12: "Blackwell SM12x"}
GPU_COMPUTE_MAJOR_LABEL = "nvidia.com/gpu.compute.major"  # GPU feature discovery's labels
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
_PRODUCTS = ((re.compile(r"(^|-)G?B(200|300)(-|$)"), SM100),
             (re.compile(r"(^|-)G?H(100|200|800|20)(-|$)"), HOPPER),
             (re.compile(r"(^|-)GB10(-|$)|RTX-(PRO-)?\w*-?Blackwell|RTX-50[6-9]0"), 12),
             (re.compile(r"(^|-)(A100|A800|A10|A30|A40|L4|L40S?|L20|RTX-A\d000|RTX-[34]0[6-9]0)(-|$)"), 8))


def gpu_kind(labels: dict[str, str]) -> int | None:
    """A node's GPU kind from its GPU feature discovery labels; None when they do not say."""
    major = str(labels.get(GPU_COMPUTE_MAJOR_LABEL, ""))
    if major.isdigit():
        return int(major)
    product = str(labels.get(GPU_PRODUCT_LABEL, ""))
    return next((kind for pattern, kind in _PRODUCTS if pattern.search(product)), None)


@dataclass(frozen=True)
class PageRule:
    """``backend`` serves page sizes in ``keeps`` and rewrites any other to ``to``. Evidence: 0.5.9
    server_args.py _handle_attention_backend_compatibility; 0.5.21/0.5.23 arg_groups/overrides.py
    _mla_backend_page_constraints and _fa4_page_constraint."""

    backend: str
    keeps: frozenset[int]
    to: int
    roles: tuple[str, ...] = ("attention", "decode")  # which --*attention-backend flags it reads
    mha_only: bool = False
    sm100_only: bool = False
    since: str = "0.5.1"
    before: str | None = None  # the first release without it


_ALL_ROLES = ("attention", "decode", "prefill")
PAGE_RULES = (
    PageRule("flashmla", frozenset({64}), 64),
    PageRule("cutlass_mla", frozenset({128}), 128, before="0.5.21"),
    PageRule("trtllm_mla", frozenset({32, 64}), 64),
    PageRule("tokenspeed_mla", frozenset({32, 64}), 64, since="0.5.21", before="0.5.23"),
    PageRule("cutedsl_mla", frozenset({32, 64}), 64, _ALL_ROLES, since="0.5.21"),
    PageRule("trtllm_mha", frozenset({16, 32, 64}), 64, _ALL_ROLES, before="0.5.21"),
    PageRule("trtllm_mha", frozenset({16, 32, 64, 128}), 64, _ALL_ROLES, since="0.5.21"),
    PageRule("hpc_ops", frozenset({64}), 64, _ALL_ROLES, since="0.5.21"),
    PageRule("fa4", frozenset({128}), 128, ("prefill",), mha_only=True, before="0.5.21"),
    PageRule("fa4", frozenset({128}), 128, _ALL_ROLES, mha_only=True, sm100_only=True, since="0.5.21"),
)
BACKEND_FLAGS = {"attention": "--attention-backend", "decode": "--decode-attention-backend",
                 "prefill": "--prefill-attention-backend"}


def _applies(rule: PageRule, release: str) -> bool:
    v = engine_versions.parse_version(release)
    return v >= engine_versions.parse_version(rule.since) and (
        rule.before is None or v < engine_versions.parse_version(rule.before))


def default_backends(gpu: int, mla: bool) -> tuple[str, ...]:
    """The attention backends SGLang may pick by itself on ``gpu`` (one, or the model-specific choices)."""
    if gpu == HOPPER:
        return ("fa3",)
    if gpu == SM100:
        return ("flashinfer", "trtllm_mla") if mla else ("trtllm_mha",)
    return ("triton",) if mla else ("flashinfer",)


def served_page_size(release: str, page_size: int, backends: dict[str, str | None], gpu: int, mla: bool) -> int:
    """The page size SGLang ``release`` serves ``--page-size page_size`` with, given the attention
    backends it runs (role -> backend, after its default) on a GPU of kind ``gpu``."""
    size = page_size
    for rule in PAGE_RULES:
        if not _applies(rule, release) or (rule.mha_only and mla) or (rule.sm100_only and gpu != SM100):
            continue
        if any(backends.get(role) == rule.backend for role in rule.roles) and size not in rule.keeps:
            size = rule.to
    return size


@dataclass(frozen=True)
class PageOutcome:
    gpu: int
    mla: bool
    backend: str  # the attention backend (or "prefill/decode" pair) that decided
    size: int


def page_outcomes(spec: HiCacheDeploymentSpec, gpu: int | None, page_size: int | None = None) -> list[PageOutcome]:
    """Every page size SGLang may serve the spec's (or ``page_size``) with on a GPU of kind ``gpu``
    (None: any kind): one per GPU kind, model kind (MLA or not, both when the model's shape is
    unknown) and default backend it may pick. Empty for the bundled runtime and unknown releases."""
    release = version(spec)
    if release is None:
        return []
    given = spec.page_size if page_size is None else page_size
    override = model_shapes.Shape(**spec.model_shape.model_dump()) if spec.model_shape else None
    shape = model_shapes.lookup(spec.model, override)
    chosen: dict[str, str | None] = {role: None for role in BACKEND_FLAGS}
    for _option, names, value in engine_cli.values(spec.extra_args, "sglang", release):
        for role, flag in BACKEND_FLAGS.items():
            if flag in names:
                chosen[role] = value
    if chosen["prefill"] is not None and chosen["prefill"] == chosen["decode"]:
        chosen["attention"] = chosen["prefill"]
    out = []
    for kind in (GPU_KINDS if gpu is None else (gpu,)):
        for mla in ((False, True) if shape is None else (shape.mla,)):
            for default in ((chosen["attention"],) if chosen["attention"] else default_backends(kind, mla)):
                backends = {**chosen, "attention": default}
                named = "/".join(dict.fromkeys(b for b in backends.values() if b))
                out.append(PageOutcome(kind, mla, named, served_page_size(release, given, backends, kind, mla)))
    return out


def safe_page_size(spec: HiCacheDeploymentSpec) -> int | None:
    """A page size SGLang serves as given whatever the GPU kind and model kind; None when none is."""
    return next((size for size in (64, 32, 128, 16) if all(o.size == size for o in page_outcomes(spec, None, size))),
                None)
