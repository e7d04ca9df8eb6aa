"""The swap step phase: whether one is due, and what it is given.

A step reads every runtime, so it runs only when it could do anything (``rollout.due``) or when
a trigger asks for fresh reads (``READ_TRIGGERS``, a restarted operator's first look at a
degraded deployment). The storage target is derived from the spec once per step, here.
"""

from __future__ import annotations

from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.control.context import Context, Observation
from hicache_operator.plan import render
from hicache_operator.rollout import act, due
from hicache_operator.rollout.act.step import StepInput
from hicache_operator.rollout.observation import RolloutSettings

READ_TRIGGERS = ("resync", "master", "storage")  # triggers that step (read every runtime) regardless


def degraded(status: dict) -> bool:
    """The status says Degraded=True: a restarted operator reads the runtimes at once, since
    what they last reported (L3 unavailable) is known only from them."""
    return any(c.get("type") == "Degraded" and c.get("status") == "True" for c in status.get("conditions") or [])


def swap_step(ctx: Context, seen: Observation, spec: HiCacheDeploymentSpec, storage_hash: str, pods: list[dict],
              restart_hash: str | None) -> act.StepResult | None:
    """One swap step on the pods as this reconcile sees them, when one is due; None otherwise.
    ``storage_hash``: the target's fingerprint as the plan rendered it; ``restart_hash``: the
    template's once the StatefulSet carries it (see ``StepInput``)."""
    previous = seen.body.get("status") or {}
    swapper = ctx.swapper
    if swapper is None or not (pods or due.pending(previous)):
        return None
    if not (seen.trigger in READ_TRIGGERS or seen.trigger == "resume" and degraded(previous) or
            due.needed(previous, storage_hash, spec.router_on, pods, restart_hash, swapper.routes.get(seen.key))):
        return None
    namespace, name = seen.key
    secret, field = render.secret_ref(spec, name, "admin")
    api_key = None
    if spec.router_on and render.uses_api_key(spec):  # the router's own and its workers' key
        api_secret, api_field = render.secret_ref(spec, name, "internal")
        api_key = ctx.kube.secret_key(namespace, api_secret, api_field)
    given = StepInput(
        fleet=seen.key, swap_state=previous.get("backendSwap"), target=render.storage_config(spec),
        target_fp=storage_hash, pods=pods,
        endpoints=lambda: ctx.informers.serving_endpoints(seen.key), restart_hash=restart_hash, why=seen.why,
        key=ctx.kube.secret_key(namespace, secret, field),
        settings=RolloutSettings(max_unavailable=spec.rollout.max_unavailable,
                                 drain_timeout_seconds=spec.rollout.drain_timeout_seconds,
                                 desired_replicas=spec.replicas, poll_seconds=2.0),
        routers=seen.router_pods if spec.router_on else [], api_key=api_key)
    return swapper.step(ctx.kube.api, given)

