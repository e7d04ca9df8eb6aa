"""One plan builds the operator's pod template once: validation reads the rendered template,
and the restart hash comes from the same render."""

from __future__ import annotations

import pytest
from op_helpers import body, gpu_node

from hicache_operator.control import pipeline
from hicache_operator.plan import render

MOONCAKE = {"backend": "mooncake", "mooncake": {"masterAddress": "mc:50051", "globalSegmentSize": 4 << 30}}


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """Every call of the operator-template builder, wherever it comes from."""
    calls: list[str] = []
    real = render.statefulset.operator_template

    def counted(*args, **kwargs):
        calls.append(args[2].name)
        return real(*args, **kwargs)
    monkeypatch.setattr(render.statefulset, "operator_template", counted)
    return calls


@pytest.mark.parametrize("spec", [
    {},
    {"hicache": {"storage": MOONCAKE}, "replicas": 3},
    {"hicache": {"storage": MOONCAKE, "hostPool": {"fromNodeMemory": {}}}},
    {"podTemplate": {"spec": {"priorityClassName": "high"}}},
])
def test_one_plan_renders_the_pod_template_once(builds, spec):
    p = pipeline.plan(body({"image": "img", **spec}), [gpu_node("n")])
    assert p.outcome.ok and p.desired is not None
    assert builds == ["demo"]
    assert p.children[-1]["spec"]["template"]["metadata"]["annotations"]["hicache.dev/restart-hash"] == \
        p.desired.restart_hash


def test_a_conflicting_overlay_is_found_in_that_one_render(builds):
    p = pipeline.plan(body({"image": "img", "podTemplate": {"spec": {"terminationGracePeriodSeconds": 5}}}),
                      [gpu_node("n")])
    assert [f.rule for f in p.outcome.errors] == ["pod-template-conflict"]
    assert p.desired is None and p.children == []
    assert builds == ["demo"]


def test_an_invalid_spec_renders_nothing(builds):
    p = pipeline.plan(body({"image": "img", "replicas": -1}), [gpu_node("n")])
    assert not p.outcome.ok and builds == []
