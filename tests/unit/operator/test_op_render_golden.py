"""Renders that must not move: an operator upgrade that changed a fleet's restart hash would
restart every pod of it, and one that changed any child would rewrite it.

``render_golden.json`` holds fuzzed specs (``bench/fuzz_specs.spec_docs`` plus router, env,
RDMA, podTemplate and storage variants; the samples; with and without nodes, process-backed or
not), each with what ``plan`` made of it: the findings, the restart and storage hashes, the
effective config and a digest of every child. Regenerate it only for a change meant to restart
pods (``python tests/unit/operator/test_op_render_golden.py``), and say so.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

import pytest
from op_helpers import gpu_node, sample_nodes

from hicache_operator.control.pipeline import plan

GOLDEN = Path(__file__).with_name("render_golden.json")
NODES = [gpu_node("n", "1Ti"), gpu_node("m", "512Gi", gpus=4)]
CASES = json.loads(GOLDEN.read_text())


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def planned(case: dict) -> dict:
    body = {"metadata": {"name": case["name"], "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": copy.deepcopy(case["spec"])}
    nodes = (sample_nodes() if case["sample"] else NODES) if case["nodes"] else None
    p = plan(body, nodes, process_backed=case["process_backed"])
    d = p.desired
    return {**case, "rules": [f.rule for f in p.outcome.findings],
            "findings": digest([[f.rule, f.severity, f.message] for f in p.outcome.findings]),
            "restart_hash": d.restart_hash if d else None, "storage_hash": d.storage_hash if d else None,
            "effective": digest(d.effective_config.model_dump(mode="json")) if d else None,
            "children": digest(p.children) if d else None}


def test_the_golden_set_covers_what_the_restart_hash_leaves_out():
    rendered = [c for c in CASES if c["restart_hash"]]
    assert len(rendered) >= 300
    storage = [c for c in rendered if ((c["spec"].get("hicache") or {}).get("storage") or {}).get("backend")
               in ("mooncake", "file")]
    assert len(storage) >= 30
    assert any("pod-template-conflict" in c["rules"] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['name'][:12]}" for i, c in enumerate(CASES)])
def test_plan_renders_what_it_rendered_before(case):
    assert planned(case) == case


if __name__ == "__main__":  # regenerate from the code as it is
    GOLDEN.write_text(json.dumps([planned(c) for c in CASES], sort_keys=True, separators=(",", ":")))
    sys.exit(0)
