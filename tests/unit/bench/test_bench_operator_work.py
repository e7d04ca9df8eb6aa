"""bench/operator_scale.py reads the operator's own metrics; the parse must match what
prometheus-client writes for them (label order included), or the bench reports nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest

REPO = Path(__file__).resolve().parents[3]


def load_bench():
    spec = importlib.util.spec_from_file_location("operator_scale", REPO / "bench" / "operator_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_reads_the_operators_metrics_as_exported():
    from hicache_operator.io import metrics
    reg = CollectorRegistry()
    # the operator's own metric definitions, in a registry of their own
    wait = Histogram(metrics.QUEUE_WAIT_SECONDS._name, "w", ["trigger"], registry=reg)
    rec = Histogram(metrics.RECONCILE_SECONDS._name, "r", ["trigger"], registry=reg)
    api = Histogram(metrics.API_SECONDS._name, "a", list(metrics.API_SECONDS._labelnames), registry=reg)
    pool = Histogram(metrics.API_POOL_WAIT_SECONDS._name, "p", registry=reg)
    for w in (1.0, 3.0):
        wait.labels("spec").observe(w)
        rec.labels("spec").observe(w / 2)
    api.labels("apply", "Service").observe(0.5)
    api.labels("apply", "Service").observe(1.5)
    pool.observe(0.02)
    out = load_bench().parse_operator_work(generate_latest(reg).decode())
    assert out["spec"] == {"reconciles": 2, "mean_queue_wait_s": 2.0, "mean_reconcile_s": 1.0}
    assert out["api_requests"] == {"apply Service": {"count": 2, "mean_s": 1.0}}
    assert out["api_pool_wait"] == {"count": 1, "mean_s": 0.02}
