"""Generate crds/hicache.dev_hicachedeployments.yaml from the spec and status models.

Pydantic emits JSON Schema 2020-12; the API server wants a structural OpenAPI v3.0 schema. The
conversion inlines ``$ref``s, turns ``X | None`` into an optional X, ``int | str`` into
int-or-string, free-form dicts into preserve-unknown-fields objects, and numeric exclusive bounds
into the v3.0 boolean form. Every object and field carries a description (what ``kubectl explain``
shows): a field's Field description, else its model's docstring. ``PRINTER_COLUMNS`` are what
``kubectl get hcd`` shows, priority 1 only with ``-o wide``. ``python -m hicache_operator.tools.crdgen
--check`` fails when the committed file drifts from the models.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from hicache_operator.api import spec as s
from hicache_operator.api.rules import cel_rules
from hicache_operator.api.status import HiCacheDeploymentStatus

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "hicache.dev_hicachedeployments.yaml"

_DROP = {"title", "additionalProperties", "$defs"}


def _condition(ctype: str, key: str) -> str:
    """JSONPath of one key of the condition of type ``ctype``."""
    return f'.status.conditions[?(@.type=="{ctype}")].{key}'


PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready", "description": "Ready pods / spec.replicas"},
    {"name": "Router", "type": "string", "jsonPath": ".status.routerReady",
     "description": "Ready router pods / spec.router.replicas (empty without the router)"},
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine", "description": "spec.engine: bundled or sglang"},
    {"name": "Backend", "type": "string", "jsonPath": ".status.currentBackend",
     "description": "L3 backend the running pods run: the target once all do (empty while no pod runs)"},
    {"name": "Target", "type": "string", "jsonPath": ".status.targetBackend",
     "description": "L3 backend the spec asks for"},
    {"name": "Swap", "type": "string", "jsonPath": ".status.swapProgress",
     "description": "Running pods on the target storage config / spec.replicas"},
    {"name": "Host-Pool", "type": "string", "jsonPath": ".status.hostPool",
     "description": "Host (L2) pool per rank"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp",
     "description": "Time since the HiCacheDeployment was created"},
    # priority 1: only with `kubectl get -o wide`, after AGE as for the built-in kinds
    {"name": "ConfigValid", "type": "string", "priority": 1, "jsonPath": _condition("ConfigValid", "status"),
     "description": "Whether the spec passed validation (False: the ConfigValid condition says what to change)"},
    {"name": "Progressing", "type": "string", "priority": 1, "jsonPath": _condition("Progressing", "reason"),
     "description": "What the pods are converging to (Reconciled when nothing is)"},
    {"name": "Degraded", "type": "string", "priority": 1, "jsonPath": _condition("Degraded", "status"),
     "description": "Whether something needs a look (the Degraded condition says what)"},
    {"name": "Model", "type": "string", "priority": 1, "jsonPath": ".spec.model", "description": "spec.model"},
    {"name": "Image", "type": "string", "priority": 1, "jsonPath": ".spec.image", "description": "spec.image"},
]


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node as a structural OpenAPI v3.0 node."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return structural(merged, defs)
    if "anyOf" in node:
        outer = {k: v for k, v in node.items() if k != "anyOf"}
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) == 1:
            return structural({**branches[0], **outer}, defs)
        if sorted(b.get("type") for b in branches) == ["integer", "string"]:
            out = _scalars(outer)
            out["x-kubernetes-int-or-string"] = True
            return out
        raise ValueError(f"cannot express {node} in a structural schema")

    out = _scalars(node)
    kind = node.get("type")
    if kind == "object":
        props = node.get("properties")
        extra = node.get("additionalProperties")
        if props is not None:
            out["properties"] = {name: structural(sub, defs) for name, sub in props.items()}
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        items = structural(node.get("items", {}), defs)
        if items.get("type") is None:
            items = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        out["items"] = items
    return out


def _scalars(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key in ("properties", "items", "anyOf", "$ref"):
            continue
        if key == "default" and (value is None or isinstance(value, (dict, list))):
            continue  # objects are defaulted by the operator, never by the API server
        if key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            value = True
        if key == "const":
            key, value = "enum", [value]
        if key == "description":
            value = " ".join(value.split())  # a docstring's line breaks; kubectl explain wraps by itself
        out[key] = value
    if "required" in out and not out["required"]:
        del out["required"]
    return out


def model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    spec_schema = model_schema(s.HiCacheDeploymentSpec)
    status_schema = model_schema(HiCacheDeploymentStatus)
    root = {
        "type": "object",
        "description": "A fleet of GPU pods serving a model with a hierarchical KV cache (GPU / host DRAM / L3).",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": f"API version of this object: {s.GROUP}/{s.VERSION}."},
            "kind": {"type": "string", "description": f"Kind of this object: {s.KIND}."},
            # the API server refuses anything under metadata (kubectl explain shows ObjectMeta's own text)
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        "x-kubernetes-validations": cel_rules("root"),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{s.PLURAL}.{s.GROUP}"},
        "spec": {
            "group": s.GROUP,
            "scope": "Namespaced",
            "names": {"kind": s.KIND, "listKind": f"{s.KIND}List", "plural": s.PLURAL,
                      "singular": s.SINGULAR, "shortNames": [s.SHORT_NAME], "categories": ["hicache"]},
            "versions": [{
                "name": s.VERSION,
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


def render_yaml() -> str:
    header = "# GENERATED by `python -m hicache_operator.tools.crdgen` from hicache_operator/api/spec.py and status.py. Do not edit.\n"
    # a JSON round trip: a schema used twice shares its lists, which YAML would write as anchors
    return header + yaml.safe_dump(json.loads(json.dumps(build_crd())), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_operator.tools.crdgen", description=__doc__.splitlines()[0])
    parser.add_argument("--output", "-o", type=Path, default=CRD_PATH, help="where to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the models")
    args = parser.parse_args(argv)
    text = render_yaml()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python -m hicache_operator.tools.crdgen", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
