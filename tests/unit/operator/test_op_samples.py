"""Every sample manifest: valid ones pass, each invalid one fails with its documented message."""

from __future__ import annotations

import re

import pytest
import yaml
from op_helpers import SAMPLES, sample_nodes

from hicache_operator.api import rules
from hicache_operator.control.pipeline import plan
from hicache_operator.plan.validation import validate

VALID = sorted(SAMPLES.glob("*.yaml"))
INVALID = sorted((SAMPLES / "invalid").glob("*.yaml"))


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_samples_validate_and_render(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "hicache.dev/v1alpha1" and doc["kind"] == "HiCacheDeployment"
    body = {**doc, "metadata": {**doc["metadata"], "uid": "u", "namespace": doc["metadata"].get("namespace", "d")}}
    p = plan(body, sample_nodes())
    assert p.outcome.ok, p.outcome.findings
    assert not p.outcome.of("warning"), p.outcome.findings
    assert p.children[-1]["kind"] == "StatefulSet"


def test_the_dram_sample_is_sized_for_the_node_with_least_memory_per_pod():
    doc = yaml.safe_load((SAMPLES / "node-dram-sized.yaml").read_text())
    out = validate(doc["spec"], name=doc["metadata"]["name"], nodes=sample_nodes())
    assert out.sizing.mode == "fromNodeMemory" and out.sizing.sizing_node == "gpu-1"


def test_every_error_rule_has_an_invalid_sample():
    errors = {r.name for r in rules.RULES if r.severity == "error"}
    assert {p.stem for p in INVALID} == errors


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_sample_fails_with_its_documented_message(path):
    text = path.read_text()
    expected = re.search(r"^# expected-error: (.+)$", text, re.M).group(1)
    doc = yaml.safe_load(text)
    out = plan({**doc, "metadata": {**doc["metadata"], "uid": "u", "namespace": "d"}}, sample_nodes()).outcome
    assert not out.ok
    assert [(f.rule, f.message) for f in out.errors] == [(path.stem, expected)]
