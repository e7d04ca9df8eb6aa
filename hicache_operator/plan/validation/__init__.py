"""Validation and normalisation of a HiCacheDeployment spec.

``validate`` parses the spec, collects every error (never stops at the first), applies the
normalisations SGLang would otherwise do silently at boot (``normalise``), and sizes the host
pool; once the pod is rendered, ``check_rendered`` reads from it what spec.podTemplate may not
change. Each finding names its rule (see ``rules``) so the handler can put it in
``status.effectiveConfig`` and a Warning Event. The checks are grouped by what they read:
``spec_rules`` (the spec alone), ``file_storage``, ``pod_fields`` (what goes into the pod), and
here the node-dependent ones.
"""

from __future__ import annotations

from typing import Any

from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.api.status import SizingRecord
from hicache_operator.plan import sizing
from hicache_operator.plan.engine import features as engine, versions as engine_versions
from hicache_operator.plan.validation.findings import Finding, Outcome, finding, parse
from hicache_operator.plan.validation.normalise import normalise
from hicache_operator.plan.validation.pod_fields import check_env, check_memory_request, check_pod_fields, check_rendered
from hicache_operator.plan.validation.spec_rules import check_extra_args, check_static
from hicache_operator.plan.validation.file_storage import file_size_problem

__all__ = ["Finding", "Outcome", "check_extra_args", "check_page_size", "check_rendered", "file_size_problem",
           "normalise", "parse", "validate"]


def check_page_size(spec: HiCacheDeploymentSpec, eligible: list[sizing.NodeInfo] | None) -> list[Finding]:
    """SGLang serves spec.pageSize as written on every GPU the pods may land on (``eligible``; None:
    the nodes were not read), since status, sizing and the L3 keys all use it: an error where it
    would be rewritten, a warning where it may be (the GPU kind or the model's attention is unknown)."""
    given, release = spec.page_size, engine.version(spec)
    if release is None:
        return []
    every = engine.page_outcomes(spec, None)
    if every and all(o.size == every[0].size != given for o in every):  # whatever the GPU
        o = every[0]
        return [finding("page-size-rewritten", version=release, given=given, served=o.size, backend=o.backend,
                        where="on any GPU")]
    if eligible is None:
        return []
    nodes = {}
    for node in eligible:
        nodes.setdefault(engine.gpu_kind(node.labels), node.name)
    for kind, node in nodes.items():
        outcomes = engine.page_outcomes(spec, kind)
        if kind is not None and outcomes and all(o.size == outcomes[0].size != given for o in outcomes):
            return [finding("page-size-rewritten", version=release, given=given, served=outcomes[0].size,
                            backend=outcomes[0].backend, where=f"on the {engine.GPU_NAMES.get(kind, f'SM{kind}x')} "
                            f"GPUs of node {node}")]
    for kind, node in nodes.items():
        rewritten = [o for o in engine.page_outcomes(spec, kind) if o.size != given]
        if rewritten:
            o = rewritten[0]
            why = (f"node {node} does not say its GPU kind (label {engine.GPU_PRODUCT_LABEL} or "
                   f"{engine.GPU_COMPUTE_MAJOR_LABEL})" if kind is None else
                   f"the attention SGLang picks for {spec.model} on node {node} is not known here")
            return [finding("page-size-may-be-rewritten", version=release, given=given, served=o.size,
                            gpu=engine.GPU_NAMES.get(o.gpu, f"SM{o.gpu}x"), backend=o.backend, why=why,
                            safe=engine.safe_page_size(spec) or "a size every backend keeps")]
    return []


def validate(raw_spec: dict[str, Any], *, name: str | None = None, namespace: str = "default",
             nodes: list[dict] | None = None, pinned_sizing: Any = None) -> Outcome:
    """Parse, check, normalise and size one spec.

    ``nodes``: the cluster's nodes as API dicts, or None when unknown (then node-dependent rules
    are skipped and fromNodeMemory is not sized). ``pinned_sizing``: the sizing record from the
    last status (as written there); reused while its inputs hash matches so node changes never
    re-size by themselves.
    """
    spec, findings = parse(raw_spec)
    if spec is None:
        return Outcome(None, findings)
    findings += check_static(spec, name)
    effective, notes = normalise(spec, name, namespace)
    findings += notes
    outcome = Outcome(effective, findings)
    if outcome.errors:
        return outcome
    # a pinned record is reused only if it fitted: a fleet no node could hold is sized afresh
    # each time, so a node that arrives later is found
    pinned = SizingRecord.read(pinned_sizing)
    if pinned is not None and pinned.inputs_hash == sizing.inputs_hash(effective) and pinned.ineligible is None:
        outcome.sizing = pinned
    elif nodes is not None or effective.hicache.host_pool.from_node_memory is None:
        try:
            outcome.sizing = sizing.compute(effective, nodes)
        except sizing.SizingError as exc:
            findings.append(finding(exc.rule, **exc.params))
            return outcome
        if outcome.sizing.ineligible is not None:
            findings.append(finding("no-eligible-nodes-yet", gpus=effective.ranks_per_pod,
                                    why=outcome.sizing.ineligible))
    memory = check_memory_request(effective, outcome.sizing) if outcome.sizing else []
    findings += memory
    rec = outcome.sizing
    if rec is not None and rec.pods_per_node is not None and rec.pods_per_node < (rec.pods_per_node_by_gpus or 0):
        findings.append(finding("pods-per-node-memory-bound", node=rec.sizing_node, by_gpus=rec.pods_per_node_by_gpus,
                                by_memory=rec.pods_per_node_by_memory,
                                need=sizing.fmt_bytes((rec.pod_memory_bytes or 0) + (rec.sidecar_bytes or 0)),
                                idle=(rec.pods_per_node_by_gpus - rec.pods_per_node) * rec.ranks_per_pod))
    if rec is not None and rec.pod_memory_bytes and sizing.page_cache_bytes(effective) is None:
        findings.append(finding("engine-page-cache-unknown", version=engine.version(effective), model=effective.model,
                                fixed=engine_versions.FEATURES["host_headroom_page_cache_free"].min_version))
    if outcome.sizing and outcome.sizing.note and "memory" not in effective.resources.requests:
        findings.append(finding("no-memory-request", why=outcome.sizing.note))
    findings += check_page_size(effective, None if nodes is None else sizing.eligible_nodes(effective, nodes)[0])
    findings += check_pod_fields(effective, outcome.sizing, compare_memory=not memory)
    findings += check_env(effective, name)
    return outcome
