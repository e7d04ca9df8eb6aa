"""The acting half of backend swaps: runtime reads, drains, gate patches, endpoint touches.

Everything here does I/O on behalf of the pure planner one level up; nothing here decides.
"""

from .endpoint_touch import EndpointTouches
from .executor import AFTER_ACTIONS_SECONDS, StepResult, Swapper, settle

__all__ = ["AFTER_ACTIONS_SECONDS", "EndpointTouches", "StepResult", "Swapper", "settle"]
