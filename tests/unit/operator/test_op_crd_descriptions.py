"""What ``kubectl explain hcd`` and ``kubectl get hcd -o wide`` show: every field and every object
of the CRD schema has a description (from the models' docstrings and Field descriptions), and
the wide columns add what the default ones leave out."""

from __future__ import annotations

from hicache_operator.tools import crdgen


def version() -> dict:
    return crdgen.build_crd()["spec"]["versions"][0]


def undescribed(node: dict, path: str) -> list[str]:
    """Paths of fields and objects without a description. Array items and map values are
    described by their field, unless they are objects with fields of their own."""
    out = [] if node.get("description") else [path]
    for name, child in (node.get("properties") or {}).items():
        out += undescribed(child, f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("additionalProperties", "[*]")):
        sub = node.get(key)
        if isinstance(sub, dict):
            found = undescribed(sub, path + suffix)
            if "properties" not in sub and found[:1] == [path + suffix]:
                found = found[1:]  # a scalar or free-form item: its field says what it is
            out += found
    return out


def test_every_field_and_object_of_the_schema_is_described():
    schema = version()["schema"]["openAPIV3Schema"]
    assert schema["properties"]["metadata"] == {"type": "object"}  # the API server allows nothing more there
    missing = [p for p in undescribed(schema, "hcd") if p != "hcd.metadata"]
    assert not missing, f"no description (a Field description or model docstring): {missing}"


def test_the_walk_finds_what_lacks_a_description():
    node = {"type": "object", "description": "x", "properties": {
        "a": {"type": "string"},
        "b": {"type": "array", "description": "b",
              "items": {"type": "object", "properties": {"c": {"type": "string"}}}},
        "d": {"type": "object", "description": "d", "additionalProperties": {"type": "string"}}}}
    assert undescribed(node, "r") == ["r.a", "r.b[]", "r.b[].c"]


def test_wide_columns_show_the_conditions_and_what_the_pods_run():
    columns = version()["additionalPrinterColumns"]
    assert all(c.get("description") for c in columns), [c["name"] for c in columns if not c.get("description")]
    wide = {c["name"]: c["jsonPath"] for c in columns if c.get("priority") == 1}
    assert wide == {
        "ConfigValid": '.status.conditions[?(@.type=="ConfigValid")].status',
        "Progressing": '.status.conditions[?(@.type=="Progressing")].reason',
        "Degraded": '.status.conditions[?(@.type=="Degraded")].status',
        "Model": ".spec.model",
        "Image": ".spec.image",
    }
    assert [c["name"] for c in columns if not c.get("priority")][-1] == "Age"  # wide ones follow AGE, as for Pods
