"""Drain-aware rolling swaps of the L3 storage backend.

``plan_step`` is the pure planner (see ``planner`` and README.md for the state
machine); ``runtime_client`` talks to one pod's runtime. The handlers glue
them to Kubernetes: observe, plan, run the actions, ``apply_outcomes``,
persist ``state.to_status()`` in ``status.backendSwap``.
"""

from .actions import (
    SERVING_GATE,
    Action,
    ActionOutcome,
    Attach,
    Condition,
    Detach,
    Event,
    Plan,
    SetServingGate,
    apply_outcomes,
)
from .observation import PodObservation, RolloutSettings
from .planner import FAILED_CONDITION, IN_PROGRESS_CONDITION, plan_step
from .state import Failure, InvalidSwapState, Phase, PodSwap, Step, SwapState
from .storage_config import (
    TARGET_BACKENDS,
    ReportedBackend,
    StorageConfig,
    attach_payload,
    config_matches,
    storage_fingerprint,
)

__all__ = [
    "SERVING_GATE",
    "FAILED_CONDITION",
    "IN_PROGRESS_CONDITION",
    "TARGET_BACKENDS",
    "Action",
    "ActionOutcome",
    "Attach",
    "Condition",
    "Detach",
    "Event",
    "Failure",
    "InvalidSwapState",
    "Phase",
    "Plan",
    "PodObservation",
    "PodSwap",
    "ReportedBackend",
    "RolloutSettings",
    "SetServingGate",
    "Step",
    "StorageConfig",
    "SwapState",
    "apply_outcomes",
    "attach_payload",
    "config_matches",
    "plan_step",
    "storage_fingerprint",
]
