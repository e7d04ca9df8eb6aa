"""The acting half of drain-aware backend swaps: observe, run the planner's step, act.

``rollout.plan_step`` decides; this module only gathers what it needs (pods, their
EndpointSlice entries, each runtime's ``GET /hicache/storage-backend`` and request counts)
and carries out the actions it returns (serving-gate patches guarded by the pod's uid,
detach/attach through the admin API with the key from the Secret). One call is one step:
nothing here waits for anything, so a handler returns quickly and the next trigger (a pod
event or the swap timer) takes the next step from what is then observed.

The serving gate: every pod carries the readiness gate ``hicache.dev/serving``, and the
planner is its only writer. A new pod is admitted by setting it True; a pod to be swapped
is taken out by setting it False, which makes the pod not Ready, so the EndpointSlice
controller marks its endpoint not ready and clients stop routing to it. This works for
both engines (SGLang has no drain switch) and is exactly what a real kubelet honours.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hicache_operator import labels, metrics, render
from hicache_operator.flags import RUNTIME_PORT
from hicache_operator.rollout import (
    ActionOutcome,
    Attach,
    Condition,
    Detach,
    Event,
    PodObservation,
    RolloutSettings,
    SetServingGate,
    apply_outcomes,
    plan_step,
    storage_fingerprint,
)
from hicache_operator.rollout.runtime_client import RuntimeClient
from hicache_operator.spec import HiCacheDeploymentSpec

ADMIN_KEY_FIELD = "admin-api-key"


@dataclass
class SwapStep:
    backend_swap: dict[str, Any]
    conditions: list[Condition] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


def admin_key(core: client.CoreV1Api, namespace: str, secret_name: str) -> str | None:
    try:
        data = core.read_namespaced_secret(secret_name, namespace).data or {}
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    raw = data.get(ADMIN_KEY_FIELD)
    return base64.b64decode(raw).decode() if raw else None


def endpoint_readiness(discovery: client.DiscoveryV1Api, namespace: str, service: str) -> dict[str, bool]:
    """Pod IP -> the `ready` condition of its endpoint in the Service's EndpointSlices."""
    out: dict[str, bool] = {}
    slices = discovery.list_namespaced_endpoint_slice(namespace, label_selector=f"kubernetes.io/service-name={service}")
    for s in slices.items:
        for ep in s.endpoints or []:
            ready = bool(ep.conditions and ep.conditions.ready)
            for addr in ep.addresses or []:
                out[addr] = out.get(addr, False) or ready
    return out


def _gate(pod: dict) -> bool | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == labels.SERVING_CONDITION:
            return c.get("status") == "True"
    return None


def _parse_time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


async def _observe(pods: list[dict], endpoints: dict[str, bool], key: str | None,
                   observed_at: dt.datetime) -> list[PodObservation]:
    async def one(pod: dict) -> PodObservation:
        meta, status = pod["metadata"], pod.get("status") or {}
        ip = status.get("podIP")
        fields: dict[str, Any] = {"runtime_error": "pod has no IP yet"}
        if ip:
            async with RuntimeClient(f"http://{ip}:{RUNTIME_PORT}", key, timeout=3.0) as rc:
                fields = (await rc.observe()).observation_fields()
        return PodObservation(name=meta["name"], uid=meta["uid"], phase=status.get("phase") or "Pending",
                              deletion_timestamp=_parse_time(meta.get("deletionTimestamp")),
                              serving_gate=_gate(pod), endpoint_ready=endpoints.get(ip) if ip else None,
                              observed_at=observed_at, **fields)
    return list(await asyncio.gather(*(one(p) for p in pods)))


def _set_gate(core: client.CoreV1Api, namespace: str, action: SetServingGate, target_hash: str,
              target_backend: str, target_fp: str, now: str) -> None:
    if action.serving and action.runs is not None:
        on_target = storage_fingerprint(action.runs) == target_fp
        core.patch_namespaced_pod(action.pod, namespace, {"metadata": {"uid": action.uid, "annotations": {
            labels.STORAGE_HASH: target_hash if on_target else storage_fingerprint(action.runs),
            labels.STORAGE_BACKEND: target_backend if on_target else (action.runs.get("backend") or "none")}}})
    reason, message = ("Serving", "admitted by the operator") if action.serving else \
        ("BackendSwap", "taken out of serving to swap the L3 storage backend")
    core.patch_namespaced_pod_status(action.pod, namespace, {
        "metadata": {"uid": action.uid},  # precondition: never touch a replacement pod of the same name
        "status": {"conditions": [{"type": labels.SERVING_CONDITION, "status": "True" if action.serving else "False",
                                   "reason": reason, "message": message, "lastTransitionTime": now}]}})


async def _execute(core: client.CoreV1Api, namespace: str, actions: list, ips: dict[str, str], key: str | None,
                   target_hash: str, target_backend: str, target_fp: str, now: str) -> list[ActionOutcome]:
    async def one(action) -> ActionOutcome:
        kind = type(action).__name__
        try:
            if isinstance(action, SetServingGate):
                await asyncio.to_thread(_set_gate, core, namespace, action, target_hash, target_backend, target_fp, now)
            else:
                ip = ips.get(action.pod)
                if not ip:
                    raise RuntimeError(f"pod {action.pod} has no IP")
                async with RuntimeClient(f"http://{ip}:{RUNTIME_PORT}", key, timeout=30.0) as rc:
                    if isinstance(action, Detach):
                        await rc.detach()
                    elif isinstance(action, Attach):
                        await rc.attach(action.payload)
            metrics.SWAP_ACTIONS.labels(kind, "ok").inc()
            return ActionOutcome(action)
        except Exception as exc:  # every failure is reported to the planner, never raised
            metrics.SWAP_ACTIONS.labels(kind, "error").inc()
            return ActionOutcome.failed(action, exc)
    return list(await asyncio.gather(*(one(a) for a in actions)))


def step(api: client.ApiClient, body: dict, spec: HiCacheDeploymentSpec, pods: list[dict], now: str) -> SwapStep:
    """One observe -> plan -> act pass for one HiCacheDeployment; returns what to persist."""
    t0 = time.monotonic()
    meta = body["metadata"]
    ns, name = meta.get("namespace", "default"), meta["name"]
    core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    secret = spec.admin_key_secret_ref.name if spec.admin_key_secret_ref else render.names(name)["secret"]
    key = admin_key(core, ns, secret)
    endpoints = endpoint_readiness(discovery, ns, render.names(name)["service"])
    observed_at = dt.datetime.now(dt.timezone.utc)
    observations = asyncio.run(_observe(pods, endpoints, key, observed_at))
    target = render.storage_config(spec)
    settings = RolloutSettings(max_unavailable=spec.rollout.max_unavailable,
                               drain_timeout_seconds=spec.rollout.drain_timeout_seconds,
                               desired_replicas=spec.replicas, poll_seconds=2.0)
    plan = plan_step(target, observations, settings, (body.get("status") or {}).get("backendSwap"),
                     dt.datetime.now(dt.timezone.utc))
    ips = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in pods}
    outcomes = asyncio.run(_execute(core, ns, plan.actions, ips, key, render.storage_hash(spec),
                                    spec.hicache.storage.backend, storage_fingerprint(target), now))
    state = apply_outcomes(plan.state, outcomes)
    metrics.SWAP_STEP_SECONDS.observe(time.monotonic() - t0)
    return SwapStep(state.to_status(), plan.conditions, plan.events, plan.requeue_after)


def needed(status: dict | None, spec: HiCacheDeploymentSpec, pods: list[dict]) -> bool:
    """Whether a step could do anything: a swap pending, a target the last step did not plan
    for, or a live pod not (or no longer) admitted. Otherwise the fleet is settled and the
    observation (a GET per pod) is skipped; the periodic reconcile still steps regardless, so
    drift nobody reported is found within one interval."""
    swap_state = (status or {}).get("backendSwap")
    if not swap_state or pending(status):
        return True
    if swap_state.get("target") != storage_fingerprint(render.storage_config(spec)):
        return True
    return any(_gate(p) is not True for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp"))


def pending(status: dict | None) -> bool:
    """Whether a swap step is due without any other trigger (drain waits, verification)."""
    swap = (status or {}).get("backendSwap") or {}
    return swap.get("phase") == "InProgress" or bool(swap.get("pods"))
