"""``spec.podTemplate`` onto the rendered pod template: a strategic merge, and what it may not touch.

``merge`` follows Kubernetes' strategic merge patch for a PodTemplateSpec: maps merge key by key,
``null`` deletes a key, the lists below merge item by item on their ``patchMergeKey`` (as in
k8s.io/api core/v1), every other list is replaced whole.

``conflicts`` says where an overlay would change what the operator rendered for its own purposes,
read from the rendered template itself: an overlay may add map keys and list items beside the
rendered ones at the open levels (the template, its labels and annotations, the pod spec, the
keyed lists, the operator's container and its keyed lists) and may override ``OVERRIDABLE``
fields; touching anything else the operator rendered is a conflict, and so is a field that a
spec field owns (``SPEC_OWNED``, ``CONTAINER_OWNED``), rendered or not.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Keyed:
    """A list merged item by item on ``key``; ``item`` is the merge schema of one item."""

    key: str
    item: dict[str, Any] | None = None


CONTAINER: dict[str, Any] = {"ports": Keyed("containerPort"), "env": Keyed("name"),
                             "volumeMounts": Keyed("mountPath"), "volumeDevices": Keyed("devicePath")}
POD_SPEC: dict[str, Any] = {
    "containers": Keyed("name", CONTAINER), "initContainers": Keyed("name", CONTAINER),
    "ephemeralContainers": Keyed("name", CONTAINER), "volumes": Keyed("name"),
    "imagePullSecrets": Keyed("name"), "hostAliases": Keyed("ip"),
    "topologySpreadConstraints": Keyed("topologyKey"), "resourceClaims": Keyed("name"),
    "schedulingGates": Keyed("name"),
}
TEMPLATE: dict[str, Any] = {"metadata": {}, "spec": POD_SPEC}

# Fields a spec field owns: the operator's sizing and rendering read the spec field, so the overlay
# may not set them even where nothing is rendered.
SPEC_OWNED = {"nodeSelector": "spec.nodeSelector", "tolerations": "spec.tolerations",
              "affinity": "spec.affinity and spec.placement", "hostNetwork": "spec.hostNetwork"}
CONTAINER_OWNED = {"image": "spec.image", "imagePullPolicy": "spec.imagePullPolicy",
                   "resources": "spec.resources", "command": "spec.engine", "args": "spec.extraArgs",
                   "env": "spec.env", "envFrom": "spec.envFrom"}
# Rendered hardening an overlay may relax or extend (merged as maps).
OVERRIDABLE = {("spec", "securityContext"), ("spec", "automountServiceAccountToken"),
               ("container", "securityContext")}


class OverlayError(ValueError):
    """An overlay that cannot be merged (a keyed list item without its key)."""


def merge(base: dict[str, Any], patch: dict[str, Any], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """``patch`` merged onto a copy of ``base`` (``schema``: merge keys below this map; TEMPLATE at the top)."""
    schema = TEMPLATE if schema is None else schema
    out = copy.deepcopy(base)
    for key, value in patch.items():
        rule = schema.get(key)
        if value is None:
            out.pop(key, None)
        elif isinstance(rule, Keyed) and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, rule, key)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value, rule if isinstance(rule, dict) else {})
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(base: list[Any], patch: list[Any], rule: Keyed, where: str) -> list[Any]:
    out = copy.deepcopy(base)
    for i, item in enumerate(patch):
        if not isinstance(item, dict) or rule.key not in item:
            raise OverlayError(f"{where}[{i}] needs its {rule.key}")
        at = next((j for j, old in enumerate(out) if isinstance(old, dict) and old.get(rule.key) == item[rule.key]), None)
        if at is None:
            out.append(copy.deepcopy(item))
        else:
            out[at] = merge(out[at], item, rule.item or {})
    return out


def conflicts(rendered: dict[str, Any], overlay: dict[str, Any], container: str) -> list[tuple[str, str]]:
    """(path, why) for each place ``overlay`` would change the operator's ``rendered`` template;
    ``container`` names the operator's container. Paths read as the user wrote them, under podTemplate."""
    out: list[tuple[str, str]] = []
    meta, spec = rendered.get("metadata") or {}, rendered.get("spec") or {}
    for section in ("labels", "annotations"):
        for key in (overlay.get("metadata") or {}).get(section) or {}:
            if key in (meta.get(section) or {}):
                out.append((f"podTemplate.metadata.{section}.{key}", "the operator sets it"))
    for key, value in (overlay.get("spec") or {}).items():
        path = f"podTemplate.spec.{key}"
        if key in SPEC_OWNED:
            out.append((path, f"set {SPEC_OWNED[key]} instead (the operator's sizing and rendering read it)"))
        elif isinstance(POD_SPEC.get(key), Keyed) and isinstance(value, list):
            rule = POD_SPEC[key]
            for item in value:
                if not isinstance(item, dict) or rule.key not in item:
                    out.append((path, f"every item needs its {rule.key}"))
                    continue
                ours = _item(spec.get(key), rule.key, item[rule.key])
                where = f"{path}[{rule.key}={item[rule.key]}]"
                if ours is None:
                    continue
                if key == "containers" and item[rule.key] == container:
                    out += _container_conflicts(ours, item, where, rule.key)
                else:
                    out.append((where, f"already in the pod the operator renders; use another {rule.key}"))
        elif key in spec and ("spec", key) not in OVERRIDABLE:
            out.append((path, "the operator sets it"))
    return out


def _container_conflicts(ours: dict[str, Any], patch: dict[str, Any], where: str,
                         merge_key: str) -> list[tuple[str, str]]:
    out = []
    for key, value in patch.items():
        path = f"{where}.{key}"
        if key == merge_key:
            continue
        if key in CONTAINER_OWNED:
            out.append((path, f"set {CONTAINER_OWNED[key]} instead"))
        elif isinstance(CONTAINER.get(key), Keyed) and isinstance(value, list):
            rule = CONTAINER[key]
            for item in value:
                if not isinstance(item, dict) or rule.key not in item:
                    out.append((path, f"every item needs its {rule.key}"))
                elif _item(ours.get(key), rule.key, item[rule.key]) is not None:
                    out.append((f"{path}[{rule.key}={item[rule.key]}]",
                                f"already in the container the operator renders; use another {rule.key}"))
        elif key in ours and ("container", key) not in OVERRIDABLE:
            out.append((path, "the operator sets it"))
    return out


def _item(items: Any, key: str, value: Any) -> dict[str, Any] | None:
    return next((i for i in items or [] if isinstance(i, dict) and i.get(key) == value), None)
