"""What a reconcile reports besides the pods: validation findings as Events, the managed
master's view, and the problems found outside the pods (a missing Secret or claim, a sizing
that no longer fits) that the status's Degraded condition names."""

from __future__ import annotations

import re
from typing import Any

from hicache_operator.api.rules import rule
from hicache_operator.api.status import MooncakeMasterStatus
from hicache_operator.fleet.names import names
from hicache_operator.io.kube import Kube
from hicache_operator.plan import render, sizing
from hicache_operator.plan.model import source as model_source
from hicache_operator.plan.validation import Outcome

Event = tuple[str, str, str]  # (type, reason, message)
Problem = tuple[str, str]  # (reason, message)


def event_reason(rule_name: str) -> str:
    """Kubernetes-style CamelCase reason for a rule name (mooncake-layer-first -> MooncakeLayerFirst)."""
    return "".join(part.capitalize() for part in re.split(r"[-_]", rule_name))


def finding_events(outcome: Outcome) -> list[Event]:
    return [("Warning", event_reason(f.rule), f"[{f.rule}] {f.message}")
            for f in outcome.findings if f.severity in ("error", "normalised", "warning")]


def master_view(spec: Any, name: str, observed: dict[str, Any] | None) -> MooncakeMasterStatus | None:
    """The managed master as status shows it: wanted by the spec, ready as its Deployment says
    (``informers.master_essence``; None: not created yet). None without a managed master."""
    managed = render.managed_master(spec)
    if managed is None:
        return None
    ready = int((observed or {}).get("readyReplicas") or 0)
    return MooncakeMasterStatus(deployment=names(name).mooncake_master,
                                address=spec.hicache.storage.mooncake.master_address,
                                replicas=managed.ha.replicas if managed.ha is not None else 1,
                                ready_replicas=ready, ready=ready > 0)


def secrets(kube: Kube, spec: Any, namespace: str, name: str, created: list[str],
            applied: bool) -> tuple[list[Event], list[Problem]]:
    """The key Secrets: an Event for each this reconcile created, a problem for each missing one
    the spec names (or, on the cheap path that applies nothing, any missing one)."""
    events: list[Event] = []
    problems: list[Problem] = []
    for which, reason, what in (("admin", "Admin", "the admin API key"), ("api", "Api", "the clients' API key")):
        if which == "api" and not render.uses_api_key(spec):
            continue
        secret_name = render.secret_ref(spec, name, which)[0]
        given = (spec.admin_key_secret_ref if which == "admin" else spec.api_key_secret_ref) is not None
        if secret_name in created:
            events.append(("Normal", f"{reason}KeyCreated", f"generated {what} in Secret {secret_name}"))
        elif (given or not applied) and not kube.secret_exists(namespace, secret_name):
            problems.append((f"{reason}SecretMissing", f"Secret {secret_name} with {what} does not exist"))
    return events, problems


def elsewhere(kube: Kube, spec: Any, namespace: str, outcome: Outcome, desired_sizing: Any,
              nodes: list[dict] | None) -> list[Problem]:
    """The model's claims and token Secret, and whether the sizing still fits the nodes."""
    problems = model_source.claim_problems(
        spec, {c.name: kube.claim_access_modes(namespace, c.name) for c in model_source.claims(spec)})
    token = model_source.token_secret(spec)
    if token is not None and not kube.secret_exists(namespace, token):
        problems.append(("ModelTokenSecretMissing", f"Secret {token} (modelSource.huggingFace.tokenSecretRef) "
                                                    "does not exist: the model download cannot start"))
    never_fitted = next((f for f in outcome.findings if f.rule == "no-eligible-nodes-yet"), None)
    if never_fitted is not None:
        problems.append(("NoEligibleNodes", never_fitted.message))
    elif nodes is not None and desired_sizing and desired_sizing.pod_memory_bytes:
        why = sizing.reevaluate(desired_sizing, spec, nodes)
        if why:
            problems.append(("SizingNoLongerFits", rule("sizing-no-longer-fits").message.format(why=why)))
    return problems
