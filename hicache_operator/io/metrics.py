"""Prometheus metrics of the operator process (served by ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("hicache_operator_reconciles_total", "Reconciles of a HiCacheDeployment.",
                     ["trigger", "result"])
RECONCILE_SECONDS = Histogram("hicache_operator_reconcile_duration_seconds", "Time spent in one reconcile.",
                              ["trigger"])
VALIDATION_FAILURES = Counter("hicache_operator_validation_failures_total",
                              "Specs refused, by the rule that refused them.", ["rule"])
NORMALISATIONS = Counter("hicache_operator_normalisations_total", "Spec rewrites applied, by rule.", ["rule"])
POD_RESTARTS = Counter("hicache_operator_pod_restarts_total", "Pods deleted to pick up a new pod template.")
SWAP_ACTIONS = Counter("hicache_operator_swap_actions_total",
                       "Backend-swap actions run (SetServingGate, Detach, Attach), by result.", ["action", "result"])
SWAP_STEP_SECONDS = Histogram("hicache_operator_swap_step_duration_seconds",
                              "One observe-plan-act pass of a backend swap.")
SWAP_EVENTS = Counter("hicache_operator_swap_events_total", "Backend-swap events, by reason (PodDraining, "
                      "PodSwapped, PodRolledBack, BackendSwapComplete, ...).", ["reason"])
QUEUE_DEPTH = Gauge("hicache_operator_workqueue_depth", "HiCacheDeployments waiting to be reconciled.")
QUEUE_WAIT_SECONDS = Histogram("hicache_operator_workqueue_wait_seconds",
                               "Time from a trigger to the start of its reconcile (a backlog shows here first).",
                               ["trigger"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
API_SECONDS = Histogram("hicache_operator_api_request_duration_seconds",
                        "Kubernetes API requests made by the operator, by verb and kind, as the operator "
                        "waits for them (long ones with an idle operator: the API server is the bottleneck).",
                        ["verb", "kind"])
API_POOL_WAIT_SECONDS = Histogram("hicache_operator_api_pool_wait_seconds",
                                  "Time a concurrent API call (a new deployment's children, a status write "
                                  "beside the StatefulSet) waited for a free thread of the operator's pool.",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
ENDPOINT_RESYNCS = Counter("hicache_operator_endpoint_resyncs_total",
                           "Client Services touched because their EndpointSlice sat on a pod's readiness flip "
                           "during a swap (the EndpointSlice controller's backoff after a stale-cache refusal).")
SWAP_PROGRESS = Gauge("hicache_operator_swap_progress_ratio",
                      "Running pods on the target storage config / spec.replicas (status.swapProgress), per "
                      "HiCacheDeployment; 1 when no swap is under way.", ["hicache_namespace", "hicache_deployment"])


def record_swap_progress(namespace: str, name: str, progress: str | None) -> None:
    """``status.swapProgress`` ("on target/replicas") as the gauge; unset while it is unknown."""
    done, _, total = (progress or "").partition("/")
    if done.isdigit() and total.isdigit():
        SWAP_PROGRESS.labels(namespace, name).set(int(done) / int(total) if int(total) else 1.0)
    else:
        forget(namespace, name)


def forget(namespace: str, name: str) -> None:
    """The deployment is gone: drop its series."""
    try:
        SWAP_PROGRESS.remove(namespace, name)
    except KeyError:
        pass
