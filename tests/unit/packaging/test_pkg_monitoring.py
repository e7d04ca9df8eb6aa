"""The chart's monitoring: the PodMonitor for the fleets' pods and the Grafana dashboard, whose
every query names a metric the runtime, the operator or the Mooncake master really exposes."""
from __future__ import annotations

import json
import re
import urllib.request

import pytest
from pkg_helpers import CHART, only
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hicache_operator.io import metrics as operator_metrics
from hicache_operator.api import labels as api_labels
from hicache_operator.control.pipeline import plan

DASHBOARD = CHART / "dashboards" / "hicache.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, keywords,
    label names (inside {...} or a by/without/on/ignoring clause) or strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    out = set()
    # not after a digit (a duration's unit), "$" (a Grafana variable) or part of a longer name
    for m in re.finditer(r"(?<![\w:.$])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[m.end():].lstrip().startswith("(") or m.group() in PROMQL_WORDS:
            continue
        out.add(m.group())
    return out


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(re.fullmatch(r"label_values\((.*), *\w+\)", var["query"]["query"]).group(1))
    return exprs


def exposed(families) -> set[str]:
    """Sample names a scrape shows for these metric families (counters' _total, histograms' series)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    return {f.name + s for f in families for s in suffixes.get(f.type, ("",))}


@pytest.fixture(scope="module")
def runtime_names(tmp_path_factory):
    from tests.unit.runtime.conftest import make_engine

    from cache_runtime.metrics import Metrics

    # with an L3 backend: SGLang's storage families exist once one is attached
    engine = make_engine(enable_hierarchical_cache=True, page_size=4, max_total_tokens=1024,
                         hicache_storage_backend="file",
                         extra_config={"file_storage_path": str(tmp_path_factory.mktemp("l3"))})
    try:
        return exposed(Metrics(engine).registry.collect())
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def master_names():
    from testbed.mooncake import master_binary, start_master

    if master_binary() is None:
        pytest.skip("mooncake is not installed (scripts/install-mooncake.sh)")
    master = start_master()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        master.stop()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def operator_names() -> set[str]:
    collectors = [v for v in vars(operator_metrics).values() if hasattr(v, "describe") and hasattr(v, "_name")]
    return exposed(f for c in collectors for f in c.describe())


def test_the_query_parser_finds_metric_names_and_nothing_else():
    expr = ('histogram_quantile(0.99, sum by (le, pod) (rate(a:b_bucket{namespace="$ns", x=~"y.*"}[$__rate_interval])))'
            ' / ignoring(cache_source) group_left sum(c_total offset 5m) and on(pod) d')
    assert metric_names(expr) == {"a:b_bucket", "c_total", "d"}


def test_every_dashboard_query_names_a_metric_that_is_exposed(runtime_names, master_names):
    names = set().union(*(metric_names(e) for e in dashboard_queries()))
    assert len(names) >= 20, names
    known = runtime_names | operator_names() | master_names
    assert not names - known, f"dashboard queries name metrics nothing exposes: {sorted(names - known)}"
    # each source is on the dashboard: the runtime's tiers, the operator's swaps, the master's store
    for required in ("sglang:cached_tokens_total", "hicache_storage_read_bytes_total",
                     "hicache_prefetch_duration_seconds_bucket", "hicache_backup_duration_seconds_bucket",
                     "hicache_operator_swap_progress_ratio", "master_allocated_bytes"):
        assert required in names, required


def test_dashboard_labels_are_the_ones_the_series_carry():
    swap_labels = operator_metrics.SWAP_PROGRESS._labelnames
    assert swap_labels == ("hicache_namespace", "hicache_deployment")
    for expr in dashboard_queries():
        if "hicache_operator_swap_progress_ratio" in expr:
            assert 'hicache_namespace="$namespace"' in expr
    assert sum('hicache_deployment="$deployment"' in e for e in dashboard_queries()) >= 20


def test_no_monitoring_objects_by_default(helm):
    kinds = {o["kind"] for o in helm.render()}
    assert "PodMonitor" not in kinds and "ConfigMap" not in kinds


def pod_labels_and_ports() -> list[tuple[dict, set[str]]]:
    """The runtime pod and the managed master pod, as the operator renders them."""
    body = {"metadata": {"name": "f", "namespace": "ns", "uid": "u"},
            "spec": {"image": "img", "hicache": {"memLayout": "page_first", "storage": {
                "backend": "mooncake", "mooncake": {"managed": {}}}}}}
    p = plan(body, [{"metadata": {"name": "n"}, "status": {"allocatable": {"memory": "1Ti", "nvidia.com/gpu": "8"}}}])
    out = []
    for kind in ("StatefulSet", "Deployment"):
        template = next(c for c in p.children if c["kind"] == kind)["spec"]["template"]
        out.append((template["metadata"]["labels"], {port["name"] for port in template["spec"]["containers"][0]["ports"]}))
    return out


def selects(selector: dict, pod_labels: dict) -> bool:
    if any(pod_labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(pod_labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def test_pod_monitor_scrapes_runtime_and_master_pods(helm):
    objs = helm.render("monitoring.podMonitor.enabled=true", "monitoring.podMonitor.labels.release=prom")
    pm = only(objs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    endpoints = {e["port"]: e for e in pm["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"http", "metrics"}
    for e in endpoints.values():
        assert e["path"] == "/metrics" and e["interval"] == "15s"
        assert e["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
                                     "targetLabel": "hicache_deployment"}]
    for labels, ports in pod_labels_and_ports():
        assert selects(pm["spec"]["selector"], labels), labels
        assert ports & set(endpoints), ports
        assert labels[api_labels.INSTANCE] == "f"  # what hicache_deployment becomes
    operator_pod = only(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not selects(pm["spec"]["selector"], operator_pod)  # the operator has its ServiceMonitor

    namespaced = only(helm.render("monitoring.podMonitor.enabled=true", "watchNamespaces={a,b}"), "PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}


def test_dashboard_config_map_carries_the_dashboard(helm):
    cm = only(helm.render("monitoring.grafanaDashboard.enabled=true"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "hicache-system"
    assert json.loads(cm["data"]["hicache.json"]) == json.loads(DASHBOARD.read_text())
    moved = only(helm.render("monitoring.grafanaDashboard.enabled=true", "monitoring.grafanaDashboard.namespace=grafana",
                             "monitoring.grafanaDashboard.labels.team=ml"), "ConfigMap")
    assert moved["metadata"]["namespace"] == "grafana" and moved["metadata"]["labels"]["team"] == "ml"


@pytest.mark.parametrize("sets,message", [
    (("monitoring.podMonitor.interval=often",), "interval"),
    (("monitoring.grafanaDashboard.namespace=Not_A_Namespace",), "namespace"),
    (("monitoring.podmonitor.enabled=true",), "podmonitor"),
])
def test_bad_monitoring_values_are_refused(helm, sets, message):
    assert message in helm.render_error(*sets)
