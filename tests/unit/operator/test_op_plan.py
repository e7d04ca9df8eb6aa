"""The pure reconcile plan: pinned sizing, effective config, Events; the CLI surface."""

from __future__ import annotations

import pytest
from op_helpers import body, gpu_node

from hicache_operator import __main__ as cli
from hicache_operator.control.informers import nodes as nodecache
from hicache_operator.control.pipeline import plan
from hicache_operator.control.problems import event_reason, finding_events

DRAM = {"image": "img", "parallelism": {"tp": 8},
        "hicache": {"hostPool": {"fromNodeMemory": {"fraction": 0.5, "reserveGiB": 0}}}}


def test_pinned_sizing_is_reused_across_node_changes_so_pods_do_not_restart():
    first = plan(body(DRAM), [gpu_node("a", "1Ti")])
    status = {"sizing": first.desired.sizing.dump()}
    # A bigger node joins and the small one is replaced: same spec, same sizing, same restart hash.
    later = plan(body(DRAM, status=status), [gpu_node("b", "2Ti")])
    assert later.desired.sizing == first.desired.sizing
    assert later.desired.restart_hash == first.desired.restart_hash
    # A storage-only edit keeps the pinned sizing too.
    swapped = plan(body({**DRAM, "hicache": {**DRAM["hicache"], "storage": {"backend": "file"}}}, status=status),
                   [gpu_node("b", "2Ti")])
    assert swapped.desired.sizing == first.desired.sizing
    # Changing what sizing depends on re-sizes from the current nodes.
    resized = plan(body({**DRAM, "parallelism": {"tp": 4}}, status=status), [gpu_node("b", "2Ti")])
    assert resized.desired.sizing.sizing_node == "b"


def test_effective_config_lists_args_hashes_and_rules():
    p = plan(body({"image": "img", "hicache": {"memLayout": "page_first", "ioBackend": "direct"}}), [gpu_node("n")])
    eff = p.desired.effective_config
    assert eff.hicache["memLayout"] == "page_first_direct"
    assert eff.normalisations[0].rule == "page-first-direct-io"
    assert "--hicache-mem-layout" in eff.args and eff.restart_hash == p.desired.restart_hash
    assert eff.command == ["python", "-m", "cache_runtime", "serve"]
    assert eff.dump()["restartHash"] == p.desired.restart_hash  # what status.effectiveConfig carries


def test_invalid_plan_renders_nothing_and_events_name_the_rule():
    p = plan(body({"image": "img", "hicache": {"hostPool": {"ratio": 0.5}}}), [gpu_node("n")])
    assert p.desired is None and p.children == []
    (etype, reason, message), = finding_events(p.outcome)
    assert (etype, reason) == ("Warning", "HostRatio") and message.startswith("[host-ratio] ")
    assert event_reason("mooncake-layer-first") == "MooncakeLayerFirst"


def test_node_essence_ignores_heartbeats():
    node = gpu_node("n")
    beat = {**node, "status": {**node["status"], "conditions": [{"type": "Ready", "lastHeartbeatTime": "t"}]}}
    assert nodecache.node_essence(node) == nodecache.node_essence(beat)
    relabeled = {**node, "metadata": {**node["metadata"], "labels": {"x": "y"}}}
    assert nodecache.node_essence(node) != nodecache.node_essence(relabeled)


def test_cli_requires_a_scope():
    with pytest.raises(SystemExit):
        cli.parse_args([])
    args = cli.parse_args(["-n", "a", "-n", "b", "--metrics-port", "0"])
    assert args.namespace == ["a", "b"] and not args.all_namespaces and args.metrics_port == 0
    assert cli.parse_args(["--all-namespaces", "--liveness", "http://127.0.0.1:8081/healthz"]).all_namespaces
