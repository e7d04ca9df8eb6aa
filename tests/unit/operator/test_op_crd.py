"""The committed CRD is the generated one, structural, with the CEL rules and columns."""

from __future__ import annotations

import yaml

from hicache_operator.tools import crdgen
from hicache_operator.api import rules


def walk(node, path="schema"):
    yield path, node
    for key in ("properties", "additionalProperties"):
        sub = node.get(key)
        if isinstance(sub, dict):
            if key == "properties":
                for name, child in sub.items():
                    yield from walk(child, f"{path}.{name}")
            else:
                yield from walk(sub, f"{path}[*]")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")


def test_committed_crd_matches_the_models():
    assert crdgen.main(["--check"]) == 0, "run: python -m hicache_operator.tools.crdgen"
    assert yaml.safe_load(crdgen.CRD_PATH.read_text()) == crdgen.build_crd()


def test_check_mode_detects_drift(tmp_path):
    stale = tmp_path / "crd.yaml"
    stale.write_text(crdgen.render_yaml().replace("hcd", "hd"))
    assert crdgen.main(["--check", "--output", str(stale)]) == 1


def test_schema_is_structural():
    schema = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert not {"$ref", "anyOf", "allOf", "oneOf", "title", "$defs"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if node.get("type") == "object" and path != "schema.metadata":  # metadata: the API server owns it
            assert ("properties" in node or "additionalProperties" in node
                    or node.get("x-kubernetes-preserve-unknown-fields")), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
        if "default" in node:
            assert not isinstance(node["default"], (dict, list)), path


def test_cel_rules_sit_on_their_scopes_with_the_operator_messages():
    schema = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    where = {"root": schema, "spec": spec, "parallelism": spec["properties"]["parallelism"],
             "hicache": spec["properties"]["hicache"],
             "hostPool": spec["properties"]["hicache"]["properties"]["hostPool"],
             "rollout": spec["properties"]["rollout"], "modelSource": spec["properties"]["modelSource"],
             "podTemplateMetadata": spec["properties"]["podTemplate"]["properties"]["metadata"],
             "rdma": spec["properties"]["rdma"]}
    mooncake = spec["properties"]["hicache"]["properties"]["storage"]["properties"]["mooncake"]
    where.update(mooncake=mooncake, mooncakeManaged=mooncake["properties"]["managed"])
    cel = [r for r in rules.RULES if r.cel]
    assert {r.name for r in cel} >= {"host-ratio", "host-pool-mode", "write-back-not-allowed", "pp-with-storage"}
    for r in cel:
        assert {"rule": r.cel, "message": r.message} in where[r.scope]["x-kubernetes-validations"], r.name


def test_names_subresources_and_columns():
    crd = crdgen.build_crd()
    assert crd["metadata"]["name"] == "hicachedeployments.hicache.dev"
    assert crd["spec"]["names"]["shortNames"] == ["hcd"]
    v = crd["spec"]["versions"][0]
    assert v["name"] == "v1alpha1" and v["subresources"]["status"] == {}
    assert v["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert [c["name"].upper() for c in v["additionalPrinterColumns"] if not c.get("priority")] == [
        "READY", "ROUTER", "ENGINE", "BACKEND", "TARGET", "SWAP", "HOST-POOL", "AGE"]
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["backendSwap"]["x-kubernetes-preserve-unknown-fields"] is True
    for col in v["additionalPrinterColumns"]:
        parts = col["jsonPath"].split(".")
        if parts[1] == "status":
            assert parts[2].split("[")[0] in status, col
