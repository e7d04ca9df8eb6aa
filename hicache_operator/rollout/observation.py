"""What the operator saw of each pod in one pass, and the rollout knobs.

The planner trusts these observations over its own records: an action it
asked for may or may not have happened (the operator can die in between), so
every decision is re-derived from what the pod, its EndpointSlice and its
runtime say *now*.
"""

from __future__ import annotations


from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, NonNegativeInt, field_validator

from hicache_operator.api.spec import resolve_max_unavailable

from hicache_operator.fleet.storage_config import ReportedBackend


class PodObservation(BaseModel):
    """One pod as seen at ``observed_at``.

    ``serving_gate``: the pod's ``hicache.dev/serving`` label (None when absent:
    a pod from an older template, which no Service selects). ``endpoint_ready``: the ``ready`` condition of the
    pod's address in the Service's EndpointSlices (None when the address is
    in no slice, which also means "not routed"). ``backend``: the runtime's
    ``GET /hicache/storage-backend``, None when that failed (then
    ``runtime_error`` says why). ``in_flight``/``queued``: the runtime's
    ``sglang:num_running_reqs``/``sglang:num_queue_reqs``, None when unknown.
    ``started_on_target``: the pod was created with the target storage config
    on its command line (its template carried it). ``stale_template``: the pod
    runs an older pod template than the one its StatefulSet now carries (a
    restart brings it the new one). ``router_replicas``: the fleet's router pods that may route
    (0: no router); ``routed_by``: how many of them list the pod as a worker (None: one of them
    could not be read), see ``routing``. ``ready``: the pod's Ready condition (None: unknown), which
    a router's workers follow without the EndpointSlice's lag.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    uid: str = Field(min_length=1)
    phase: str = "Running"
    deletion_timestamp: AwareDatetime | None = None
    serving_gate: bool | None = None
    endpoint_ready: bool | None = None
    backend: ReportedBackend | None = None
    in_flight: NonNegativeInt | None = None
    queued: NonNegativeInt | None = None
    runtime_error: str | None = None
    started_on_target: bool = False
    stale_template: bool = False
    ready: bool | None = None
    router_replicas: NonNegativeInt = 0
    routed_by: NonNegativeInt | None = 0
    observed_at: AwareDatetime

    @property
    def live(self) -> bool:
        """Still a member of the fleet (not going away, not finished)."""
        return self.deletion_timestamp is None and self.phase not in ("Succeeded", "Failed")

    @property
    def reachable(self) -> bool:
        return self.backend is not None

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.queued == 0

    @property
    def start_failure(self) -> str | None:
        """Why the target it was started with is not attached (it serves from L1+L2), or None.
        Such a pod is not swapped: the attach failed once already, and a fix of the store
        reaches it by a restart (or the next storage change), not by taking it out of serving."""
        if self.started_on_target and self.backend is not None and self.backend.backend is None:
            return self.backend.start_failure
        return None

    @property
    def unrouted(self) -> bool:
        """No router sends it requests (none lists it, or there is no router)."""
        return self.routed_by == 0

    @property
    def fully_routed(self) -> bool:
        """Every router pod lists it (so with no router, trivially)."""
        return self.routed_by is not None and self.routed_by >= self.router_replicas

    @property
    def available(self) -> bool:
        """Counts as serving for the maxUnavailable budget."""
        return self.live and self.phase == "Running" and self.serving_gate is True and self.endpoint_ready is True \
            and self.fully_routed


class RolloutSettings(BaseModel):
    """``spec.rollout`` plus the fleet size.

    ``max_unavailable``: pods allowed out of serving at once, counting pods
    that are out for any other reason; an int >= 1 or a percentage of the
    fleet (rounded down, at least 1), as in a Deployment.
    ``drain_timeout_seconds``: how long one pod may take to drain; also bounds
    each later wait on that pod (runtime unreachable mid-swap, endpoint not
    coming back). ``desired_replicas``: when given, absent pods count as
    unavailable. ``max_runtime_calls``: detach/attach calls one pod gets to
    reach a config before it counts as failed (a swap needs two).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_unavailable: int | str = 1
    drain_timeout_seconds: float = Field(default=300.0, gt=0)
    desired_replicas: NonNegativeInt | None = None
    poll_seconds: float = Field(default=2.0, gt=0)
    max_runtime_calls: int = Field(default=4, ge=2)

    @field_validator("max_unavailable", mode="before")
    @classmethod
    def _int_or_percent(cls, value: object) -> int | str:
        resolve_max_unavailable(value, 1)  # raises for anything the spec refuses
        return value.strip() if isinstance(value, str) else value

    def budget(self, fleet_size: int) -> int:
        return resolve_max_unavailable(self.max_unavailable, fleet_size)
