"""Drain-aware rolling swaps of the L3 storage backend, and restarts of stale pods.

The package has one seam. The modules here decide and do no I/O: they turn observations
(pods, endpoints, runtime reads) and the persisted state into the next actions. Everything that
talks to the API server or to a runtime lives in ``act/`` and decides nothing.

Decide (pure): ``observation`` (one pod seen once), ``state`` (``status.backendSwap``),
``actions``, ``planner`` (``plan_step``: one pass; the moves of one pod's record in
``transitions``), ``passes`` (a step of several passes, through injected
``execute``/``reobserve``), ``routing`` (router membership, read off the routers' worker
lists), ``due`` (is a step due?), ``endpoint_lag`` (when a Service needs a touch). The target
and what runtimes report (``fleet.storage_config``) and the serving gate (``fleet.gate``) are
the fleet's vocabulary, one layer down. Restarts of pods on an older pod template are the
planner's too: drained like a swap, then deleted.

Act (I/O, ``act/``): ``executor.Swapper`` (what outlives a step; ``step.StepRun``: one step's
observe, passes and actions), ``pod_writes`` (gate patches, pod deletions),
``runtime_client`` (one pod's admin API), ``router_client`` (one router pod's worker API),
``views`` (reads and which to reuse), ``drains`` (background reads of drained pods),
``endpoint_touch`` (touching a lagging Service).

See README.md for the state machine.
"""

from .actions import (
    Action,
    ActionOutcome,
    Attach,
    DeletePod,
    Detach,
    Event,
    SetRouted,
    SetServingGate,
    SwapPlan,
    apply_outcomes,
)
from .observation import PodObservation, RolloutSettings
from .planner import plan_step
from .state import Failure, InvalidSwapState, Phase, PodSwap, Stage, SwapState
from hicache_operator.fleet.storage_config import TARGET_BACKENDS, ReportedBackend, StorageConfig, attach_payload, config_matches, storage_fingerprint

__all__ = [
    "TARGET_BACKENDS",
    "Action",
    "ActionOutcome",
    "Attach",
    "DeletePod",
    "Detach",
    "Event",
    "Failure",
    "InvalidSwapState",
    "Phase",
    "PodObservation",
    "PodSwap",
    "ReportedBackend",
    "RolloutSettings",
    "SetRouted",
    "SetServingGate",
    "Stage",
    "StorageConfig",
    "SwapPlan",
    "SwapState",
    "apply_outcomes",
    "attach_payload",
    "config_matches",
    "plan_step",
    "storage_fingerprint",
]
