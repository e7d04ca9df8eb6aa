"""Prometheus metrics of the operator process (served by ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RECONCILES = Counter("hicache_operator_reconciles_total", "Reconciles of a HiCacheDeployment.",
                     ["trigger", "result"])
RECONCILE_SECONDS = Histogram("hicache_operator_reconcile_duration_seconds", "Time spent in one reconcile.",
                              ["trigger"])
VALIDATION_FAILURES = Counter("hicache_operator_validation_failures_total",
                              "Specs refused, by the rule that refused them.", ["rule"])
NORMALISATIONS = Counter("hicache_operator_normalisations_total", "Spec rewrites applied, by rule.", ["rule"])
POD_RESTARTS = Counter("hicache_operator_pod_restarts_total", "Pods deleted to pick up a new pod template.")
SERVING_PATCHES = Counter("hicache_operator_serving_gate_patches_total",
                          "hicache.dev/serving condition changes written to pods.", ["status"])
