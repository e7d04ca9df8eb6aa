"""The fields copied into the pod template, checked with the API server's own rules (so a mistake
is a ConfigValid=False naming the field instead of a StatefulSet the API server refuses), spec.env
against the operator's env, the memory request against the sizing, and spec.podTemplate against
the rendered pod."""

from __future__ import annotations

import re
from typing import Any

from hicache_operator.api import flags
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.api.status import SizingRecord
from hicache_operator.plan import overlay, render, sizing
from hicache_operator.plan.engine import cli as engine_cli
from hicache_operator.plan.validation.findings import Finding, finding

# Kubernetes' own syntax (apimachinery validation), for the fields copied into the pod template.
RFC1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME_PART = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
QUALIFIED_NAME = re.compile(rf"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_NAME_PART}")
LABEL_VALUE = re.compile(rf"({_NAME_PART})?")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


def check_env(spec: HiCacheDeploymentSpec, name: str | None) -> list[Finding]:
    """spec.env against the env vars the operator sets and those that override what it sets."""
    ours = {e["name"]: e for e in render.operator_env(spec, render.Owner(name or "<name>", "", ""))}
    out = [finding("env-owned", index=i, var=e.name, source=_env_source(ours[e.name]))
           for i, e in enumerate(spec.env) if e.name in ours]
    return out + [finding("env-engine-override", index=i, var=e.name, why=engine_cli.ENGINE_ENV[e.name])
                  for i, e in enumerate(spec.env) if e.name in engine_cli.ENGINE_ENV and e.name not in ours]


def check_rendered(spec: HiCacheDeploymentSpec, rendered: render.Rendered) -> list[Finding]:
    """spec.podTemplate against the pod the operator rendered (what it may not change is read from it)."""
    return [finding("pod-template-conflict", path=path, why=why)
            for path, why in overlay.conflicts(rendered.base_template, spec.pod_template.dump(), render.CONTAINER)]


def _env_source(item: dict[str, Any]) -> str:
    ref = item.get("valueFrom") or {}
    mooncake = {var: fld for fld, _key, var in flags.MOONCAKE_SETTINGS if var}
    if "fieldRef" in ref:
        return f" (the pod's {ref['fieldRef']['fieldPath']})"
    if "secretKeyRef" in ref:
        return f" (key {ref['secretKeyRef']['key']} of Secret {ref['secretKeyRef']['name']})"
    if item["name"] in mooncake:
        return f" (from hicache.storage.mooncake.{mooncake[item['name']]})"
    return ""


def _qualified(key: Any) -> bool:
    if not isinstance(key, str) or not QUALIFIED_NAME.fullmatch(key):
        return False
    prefix, _, part = key.rpartition("/")
    return len(part) <= 63 and len(prefix) <= 253


def _label_value(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 63 and bool(LABEL_VALUE.fullmatch(value))


def _check_tolerations(tolerations: list[dict[str, Any]]) -> list[tuple[str, str]]:
    out = []
    for i, tol in enumerate(tolerations):
        at = f"tolerations[{i}]"
        key, op, value = tol.get("key") or "", tol.get("operator") or "Equal", tol.get("value") or ""
        if key and not _qualified(key):
            out.append((f"{at}.key", f"{key!r} is not a valid label key"))
        if op not in TOLERATION_OPERATORS:
            out.append((f"{at}.operator", f"{op!r} must be Exists or Equal"))
        elif op == "Exists" and value:
            out.append((f"{at}.value", "must be empty when operator is Exists"))
        elif not key and op != "Exists":
            out.append((f"{at}.operator", "must be Exists when key is empty"))
        if op == "Equal" and not _label_value(value):
            out.append((f"{at}.value", f"{value!r} is not a valid label value"))
        if tol.get("effect", "") not in TAINT_EFFECTS:
            out.append((f"{at}.effect", f"{tol.get('effect')!r} must be one of NoSchedule, PreferNoSchedule, NoExecute"))
        if tol.get("tolerationSeconds") is not None and tol.get("effect") != "NoExecute":
            out.append((f"{at}.tolerationSeconds", "needs effect NoExecute"))
    return out


def _check_volumes(spec: HiCacheDeploymentSpec) -> list[tuple[str, str]]:
    out = []
    ours = set(render.operator_volumes(spec))
    names: set[str] = set(ours)
    for i, vol in enumerate(spec.extra_volumes):
        name = vol.get("name")
        if not isinstance(name, str) or len(name) > 63 or not RFC1123_LABEL.fullmatch(name):
            out.append((f"extraVolumes[{i}].name", f"{name!r} must be a lower-case DNS label"))
        elif name in names:
            taken = "the operator's own volume" if name in ours else "another extra volume"
            out.append((f"extraVolumes[{i}].name", f"{name!r} is already used by {taken}"))
        names.add(name)
    paths = set(render.operator_volumes(spec).values())
    for i, mount in enumerate(spec.extra_volume_mounts):
        if mount.get("name") not in names:
            out.append((f"extraVolumeMounts[{i}].name", f"{mount.get('name')!r} is not a volume of the pod "
                        "(add it to extraVolumes)"))
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path:
            out.append((f"extraVolumeMounts[{i}].mountPath", "is required"))
        elif path.rstrip("/") in paths:
            out.append((f"extraVolumeMounts[{i}].mountPath", f"{path!r} is already mounted by the operator"))
        else:
            paths.add(path.rstrip("/"))
    return out


def _check_resources(spec: HiCacheDeploymentSpec, rendered: dict[str, dict[str, str]],
                     compare_memory: bool) -> list[tuple[str, str]]:
    out = []
    for which in ("requests", "limits"):
        for name, value in getattr(spec.resources, which).items():
            if not _qualified(name):
                out.append((f"resources.{which}", f"{name!r} is not a valid resource name"))
            q = sizing.quantity(value)
            if q is None:
                out.append((f"resources.{which}.{name}", f"{value!r} is not a quantity"))
            elif q < 0:
                out.append((f"resources.{which}.{name}", f"{value!r} must not be negative"))
    if out:
        return out
    requests, limits = rendered["requests"], rendered["limits"]
    for name, req in requests.items():
        if name == "memory" and not compare_memory:  # memory-request-too-small already says it
            continue
        hugepages = name.startswith("hugepages-")
        extended = hugepages or ("/" in name and not name.split("/")[0].endswith("kubernetes.io"))
        if extended and name not in limits:
            out.append((f"resources.limits.{name}", "is required: requests of this resource need an equal limit"))
        elif extended and sizing.quantity(req) != sizing.quantity(limits[name]):
            out.append((f"resources.requests.{name}", "must equal its limit for this resource"))
        elif name in limits and sizing.quantity(req) > sizing.quantity(limits[name]):
            out.append((f"resources.requests.{name}", f"{req} exceeds the limit {limits[name]}"))
    for name, value in {**requests, **limits}.items():
        page = sizing.quantity(name[len("hugepages-"):]) if name.startswith("hugepages-") else None
        if page and sizing.quantity(value) % page:
            out.append((f"resources.{name}", f"{value} is not a whole number of {name[len('hugepages-'):]} pages"))
        if page is not None and not {"cpu", "memory"} & (set(requests) | set(limits)):
            out.append(("resources", "hugepages need a cpu or memory request or limit"))
    return out


def _check_router_resources(spec: HiCacheDeploymentSpec) -> list[tuple[str, str]]:
    out = []
    res = spec.router.resources
    for which in ("requests", "limits"):
        for name, value in getattr(res, which).items():
            q = sizing.quantity(value)
            if not _qualified(name):
                out.append((f"router.resources.{which}", f"{name!r} is not a valid resource name"))
            elif q is None or q < 0:
                out.append((f"router.resources.{which}.{name}", f"{value!r} is not a quantity >= 0"))
    if not out:
        for name, req in res.requests.items():
            if name in res.limits and sizing.quantity(req) > sizing.quantity(res.limits[name]):
                out.append((f"router.resources.requests.{name}", f"{req} exceeds the limit {res.limits[name]}"))
    return out


def check_pod_fields(spec: HiCacheDeploymentSpec, sizing_record: dict[str, Any] | None, *,
                     compare_memory: bool = True) -> list[Finding]:
    """Fields copied into the pod template, checked with the API server's own rules so that a
    mistake is a ConfigValid=False naming the field instead of a StatefulSet the API server refuses."""
    problems: list[tuple[str, str]] = []
    for key, value in spec.node_selector.items():
        if not _qualified(key):
            problems.append(("nodeSelector", f"{key!r} is not a valid label key"))
        elif not _label_value(value):
            problems.append((f"nodeSelector.{key}", f"{value!r} is not a valid label value"))
    problems += _check_tolerations(spec.tolerations)
    for section, terms, what in (
            ("podAntiAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "placement spread's one pod per node"),
            ("podAffinity", "preferredDuringSchedulingIgnoredDuringExecution", "placement pack's co-location")):
        given = (spec.affinity or {}).get(section, {})
        if not isinstance(given, dict) or not isinstance(given.get(terms, []), list):
            problems.append((f"affinity.{section}", f"must be an object whose {terms} is a list (the operator adds "
                             f"{what} to it)"))
    if not isinstance((spec.affinity or {}).get("nodeAffinity", {}), dict):
        problems.append(("affinity.nodeAffinity", "must be an object"))
    problems += _check_volumes(spec)
    problems += _check_resources(spec, render.resources(spec, sizing_record), compare_memory)
    problems += _check_router_resources(spec)
    return [finding("invalid-pod-field", field=f, problem=p) for f, p in problems]


def check_memory_request(spec: HiCacheDeploymentSpec, record: SizingRecord) -> list[Finding]:
    need = record.pod_memory_bytes
    out = []
    for which in ("requests", "limits"):
        given = getattr(spec.resources, which).get("memory")
        quantity = sizing.quantity(given)  # an unreadable one is reported by check_pod_fields
        if need and quantity is not None and int(quantity) < need:
            out.append(finding("memory-request-too-small", which=which, given=given,
                               needed=sizing.fmt_bytes(need)))
    return out
