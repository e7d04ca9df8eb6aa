"""HiCacheDeployment.status: the one pure function that computes it (its shape: ``api.status``).

``derive`` builds the whole status from one ``Observed``: what the operator decided
(``Desired``, or the validation errors), what it observes (the pods), problems found elsewhere
(sizing, Secrets), the backend-swap view (``status.backendSwap`` and its two conditions, which
the rollout module computes and this module only reads) and, when a reconcile failed, the
failure. Every field a printer column shows and every condition come from the same counts, so
they cannot disagree; nothing is remembered from what the operator did, so a restarted
operator writes the same status. Condition types this module does not know are carried over.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from hicache_operator.api import labels
from hicache_operator.plan.model import source as model_source
from hicache_operator.api.conditions import SWAP_FAILED, SWAP_IN_PROGRESS, Condition, condition, set_conditions
from hicache_operator.api.status import OWN_CONDITIONS, REFUSED_REASON, ROUTER_READY, SWAP_CONDITIONS, EffectiveConfig, MooncakeMasterStatus, SizingRecord
from hicache_operator.fleet.pods import annotation, init_running, pod_is_ready, pod_serves, pod_is_terminating, pod_runs, unavailable_reason
from hicache_operator.plan.sizing import fmt_bytes



@dataclass(frozen=True)
class Desired:
    """What the operator rendered for the current spec."""

    replicas: int
    selector: str
    router_replicas: int | None  # spec.router.replicas with the router on, else None
    restart_hash: str
    storage_hash: str
    backend: str
    host_pool: str
    effective_config: EffectiveConfig
    sizing: SizingRecord | None


@dataclass(frozen=True)
class SwapView:
    """The backend-swap half of the status, as the rollout module left it: ``state`` is
    ``status.backendSwap`` (None before the first swap step), ``conditions`` its
    BackendSwapInProgress / BackendSwapFailed conditions ({type, status, reason, message})."""

    state: dict[str, Any] | None = None
    conditions: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, status: dict | None) -> "SwapView":
        """The view a status was written with (a reconcile that ran no swap step keeps it)."""
        status = status or {}
        return cls(status.get("backendSwap"),
                   tuple(c for c in status.get("conditions") or [] if c.get("type") in SWAP_CONDITIONS))

    def condition(self, ctype: str) -> dict[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == ctype), None)

    @property
    def failed(self) -> dict[str, Any] | None:
        """BackendSwapFailed when True: the rollout stopped until the target changes."""
        cond = self.condition(SWAP_FAILED)
        return cond if cond is not None and cond.get("status") == "True" else None

    @property
    def in_progress(self) -> dict[str, Any] | None:
        cond = self.condition(SWAP_IN_PROGRESS)
        return cond if cond is not None and cond.get("status") == "True" else None

    @property
    def records(self) -> set[str]:
        """Pods the swap holds (draining, swapping, rolling back, readmitting)."""
        pods = (self.state or {}).get("pods")
        return set(pods) if isinstance(pods, dict) else set()

    @property
    def unattached(self) -> dict[str, str]:
        """Pods started on the target that could not attach it (pod -> the runtime's reason)."""
        found = (self.state or {}).get("unattached")
        return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


@dataclass(frozen=True)
class Observed:
    """Everything one status is derived from.

    ``spec_replicas``: spec.replicas as written, READY's denominator even when the spec is
    invalid (None: ``desired``'s, or the live pods' count without either). ``desired`` is None
    when the spec is invalid (``errors`` says why); the status then describes the pods still
    running from the last valid spec, whose target ``previous`` keeps. ``problems``: (reason,
    message) found outside the pods (the sizing no longer fits, a Secret is missing).
    ``swap``: None means as ``previous`` has it. ``downloads``: pod -> the progress its model
    download reports (``model_download.Progress.report``). ``master``: the managed Mooncake
    master, None without one. ``router_pods``: the router's pods, as the watch shows them.
    ``l3_unavailable``: pod -> why its runtime last reported its L3 store unavailable (it serves
    from L1+L2 meanwhile); pods whose runtime reports nothing (SGLang) are never in it."""

    generation: int
    previous: dict[str, Any]
    now: str
    desired: Desired | None = None
    errors: tuple[tuple[str, str], ...] = ()
    pods: tuple[dict, ...] = ()
    problems: tuple[tuple[str, str], ...] = ()
    spec_replicas: int | None = None
    swap: SwapView | None = None
    downloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    master: MooncakeMasterStatus | None = None
    router_pods: tuple[dict, ...] = ()
    l3_unavailable: dict[str, str] = field(default_factory=dict)


class Status(dict):
    """A derived status (camelCase dict) that keeps the observation it was derived from, so a
    caller that learns more (spec.replicas of an invalid spec, its swap step's outcome) derives
    it again with ``rederive`` instead of patching fields."""

    def __init__(self, content: dict[str, Any], observed: Observed) -> None:
        super().__init__(content)
        self.observed = observed

    def rederive(self, **more: Any) -> "Status":
        return derive(replace(self.observed, **more))


def build_status(*, generation: int, previous: dict | None, desired: Desired | None,
                 errors: list[tuple[str, str]], pods: list[dict], degraded: list[tuple[str, str]],
                 now: str, spec_replicas: int | None = None, swap: SwapView | None = None,
                 downloads: dict[str, dict[str, Any]] | None = None,
                 master: MooncakeMasterStatus | None = None, router_pods: list[dict] | None = None) -> Status:
    """``derive`` of one reconcile's observation; ``degraded`` are its ``problems``."""
    return derive(Observed(generation=generation, previous=previous or {}, now=now, desired=desired,
                           errors=tuple(errors), pods=tuple(pods), problems=tuple(degraded),
                           spec_replicas=spec_replicas, swap=swap, downloads=downloads or {}, master=master,
                           router_pods=tuple(router_pods or ())))


@dataclass
class _Fleet:
    """The counts every field and condition is built from."""

    live: list[dict]
    terminating: int
    replicas: int
    ready: int
    unready: dict[str, str | None] = field(default_factory=dict)  # pod -> why it is unavailable, None: starting
    running: list[dict] = field(default_factory=list)
    downloading: list[str] = field(default_factory=list)  # pods whose model download runs
    target_hash: str | None = None
    target_backend: str | None = None
    on_target: list[dict] = field(default_factory=list)
    current_backend: str | None = None

    @property
    def starting(self) -> int:
        return sum(1 for why in self.unready.values() if why is None)


def derive(o: Observed) -> Status:
    """The whole status: fields, conditions, ``backendSwap`` (see the module docstring)."""
    swap = o.swap if o.swap is not None else SwapView.of(o.previous)
    fleet = _fleet(o, swap)
    out: dict[str, Any] = {"observedGeneration": o.generation, "replicas": len(fleet.live),
                           "readyReplicas": fleet.ready, "ready": f"{fleet.ready}/{fleet.replicas}"}
    carried = ("selector", "hostPool", "targetBackend", "effectiveConfig", "sizing")
    if o.desired is not None:
        out.update(selector=o.desired.selector, hostPool=o.desired.host_pool, targetBackend=o.desired.backend,
                   effectiveConfig=o.desired.effective_config.dump())
        if o.desired.sizing is not None:
            out["sizing"] = o.desired.sizing.dump()
    else:  # what the pods of the last valid spec run
        out.update({k: o.previous[k] for k in carried if o.previous.get(k) is not None})
    if o.desired is not None:
        out["updatedReplicas"] = sum(1 for p in fleet.live if annotation(p, labels.RESTART_HASH) == o.desired.restart_hash)
    if fleet.current_backend is not None:
        out["currentBackend"] = fleet.current_backend
    if fleet.target_hash is not None:
        out["swapProgress"] = f"{len(fleet.on_target)}/{fleet.replicas}"
    if swap.state is not None:
        out["backendSwap"] = swap.state
    router = _router(o)
    if router is not None:
        out["routerReady"] = router.message.split(" ", 1)[0]
    if o.master is not None:
        out["mooncakeMaster"] = o.master.model_dump(by_alias=True, exclude_none=True)
    progressing = _progressing(o, swap, fleet)
    ready = fleet.ready >= fleet.replicas
    conds = [_config_valid(o),
             condition("Progressing", progressing[0] is not None, *progressing[1:]),
             _degraded(o, swap, fleet, settled=progressing[0] in (None, "PodsStarting", "ModelDownloading")),
             condition("Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady",
                       f"{fleet.ready}/{fleet.replicas} pod(s) ready"),
             *(Condition.model_validate(c) for c in swap.conditions), *([router] if router else [])]
    out["conditions"] = set_conditions(o.previous.get("conditions") or [], conds, o.generation, o.now,
                                       drop=OWN_CONDITIONS)
    return Status(out, o)


def _router(o: Observed) -> Condition | None:
    """RouterReady (ready router pods >= spec.router.replicas) with the router on, else None. For an
    invalid spec: as the last valid one had it (its router keeps running)."""
    if o.desired is not None:
        want = o.desired.router_replicas
    else:
        shown = o.previous.get("routerReady")
        want = int(shown.split("/")[1]) if isinstance(shown, str) and shown.count("/") == 1 and \
            shown.split("/")[1].isdigit() else None
    if want is None:
        return None
    ready = sum(1 for p in o.router_pods if pod_is_ready(p) and not pod_is_terminating(p))
    return condition(ROUTER_READY, ready >= want, "RouterPodsReady" if ready >= want else "RouterPodsNotReady",
                     f"{ready}/{want} router pod(s) ready")


def _fleet(o: Observed, swap: SwapView) -> _Fleet:
    live = [p for p in o.pods if not pod_is_terminating(p)]
    replicas = o.spec_replicas if o.spec_replicas is not None else o.desired.replicas if o.desired else len(live)
    held = swap.records
    unready = {p["metadata"]["name"]: None if p["metadata"]["name"] in held else unavailable_reason(p)
               for p in live if not pod_serves(p)}
    fleet = _Fleet(live=live, terminating=len(o.pods) - len(live), replicas=replicas,
                   ready=len(live) - len(unready), unready=unready, running=[p for p in live if pod_runs(p)],
                   downloading=[p["metadata"]["name"] for p in live
                                if init_running(p, model_source.DOWNLOAD_CONTAINER)])
    if o.desired is not None:
        fleet.target_hash, fleet.target_backend = o.desired.storage_hash, o.desired.backend
    else:  # the last valid spec's target, if there was one
        fleet.target_hash = (o.previous.get("effectiveConfig") or {}).get("storageHash")
        fleet.target_backend = o.previous.get("targetBackend")
    # A pod runs the storage config its annotations name (its template's, rewritten by a live
    # swap), except one whose runtime could not attach it at start: that one runs none.
    unattached = swap.unattached
    fleet.on_target = [p for p in fleet.running if fleet.target_hash is not None and p["metadata"]["name"]
                       not in unattached and annotation(p, labels.STORAGE_HASH) == fleet.target_hash]
    behind = ["none" if p["metadata"]["name"] in unattached else annotation(p, labels.STORAGE_BACKEND) or "unknown"
              for p in fleet.running if p not in fleet.on_target]
    if fleet.running:
        fleet.current_backend = Counter(behind).most_common(1)[0][0] if behind else fleet.target_backend
    return fleet


def _config_valid(o: Observed) -> Condition:
    if o.errors:
        return condition("ConfigValid", False, o.errors[0][0], "; ".join(f"{r}: {m}" for r, m in o.errors))
    notes = o.desired.effective_config.normalisations if o.desired else []
    return condition("ConfigValid", True, "Valid",
                 f"{len(notes)} normalisation(s) applied, see status.effectiveConfig" if notes else "spec is valid")


def _progressing(o: Observed, swap: SwapView, fleet: _Fleet) -> tuple[str | None, str, str]:
    """(reason while True or None, reason, message): what the pods are converging to."""
    if o.desired is None:
        return None, "ConfigInvalid", "nothing is rolled out while the spec is invalid (see ConfigValid)"
    stale = [p for p in fleet.live if annotation(p, labels.RESTART_HASH) != o.desired.restart_hash]
    if stale:
        return "RollingRestart", "RollingRestart", (f"{len(stale)} of {len(fleet.live)} pod(s) run an older pod "
                                                    "template; each is drained, then restarted")
    if fleet.terminating:
        return "PodsTerminating", "PodsTerminating", f"{fleet.terminating} pod(s) terminating"
    if o.master is not None and not o.master.ready and not fleet.live and fleet.replicas:
        return "WaitingForMooncakeMaster", "WaitingForMooncakeMaster", (
            f"the pods start once the Mooncake master {o.master.deployment} is ready (0/{o.master.replicas})")
    if len(fleet.live) != fleet.replicas:
        return "Scaling", "Scaling", f"{len(fleet.live)} pod(s), want {fleet.replicas}"
    if swap.failed is not None:
        return None, SWAP_FAILED, ("the backend swap stopped (see BackendSwapFailed); it starts again when "
                                   "spec.hicache.storage changes")
    behind = [p for p in fleet.running if p not in fleet.on_target and p["metadata"]["name"] not in swap.unattached]
    if swap.in_progress is not None or behind:
        return "BackendSwap", "BackendSwap", (f"{len(fleet.on_target)}/{fleet.replicas} pod(s) on the target storage "
                                              f"config ({fleet.target_backend})")
    if fleet.downloading:
        return "ModelDownloading", "ModelDownloading", _download_message(fleet, o.downloads)
    if fleet.starting:
        return "PodsStarting", "PodsStarting", f"{fleet.starting} of {len(fleet.live)} pod(s) starting"
    return None, "Reconciled", "pods match the spec"


def _degraded(o: Observed, swap: SwapView, fleet: _Fleet, settled: bool) -> Condition:
    """Degraded: True with the first problem's reason and every problem's message."""
    problems: list[tuple[str, str]] = []
    if o.desired is None:
        problems.append(("ConfigInvalid", f"the spec is invalid (see ConfigValid); {len(fleet.live)} pod(s) of the "
                                          "last valid spec keep running"))
    problems += o.problems
    if o.master is not None and not o.master.ready and fleet.live:
        problems.append(("MooncakeMasterUnavailable", f"the Mooncake master {o.master.deployment} has no ready "
                         f"replica (0/{o.master.replicas}): the pods' L3 store is unreachable; see its pods"))
    if swap.failed is not None:
        problems.append((SWAP_FAILED, f"backend swap failed: {swap.failed.get('message', '')}"))
    if swap.unattached:
        names = sorted(swap.unattached)
        problems.append(("StorageUnavailable", f"{', '.join(names)} could not attach {fleet.target_backend} when "
                         f"started and serve from L1+L2 ({swap.unattached[names[0]]}); fix the store, then delete "
                         "those pods to restart them on it"))
    l3_down = _l3_unavailable_message(o, swap, fleet)
    if l3_down:
        problems.append(("StorageUnavailable", l3_down))
    if not problems and settled and fleet.ready + fleet.starting < fleet.replicas:
        problems.append(("ReplicasUnavailable", _unavailable_message(fleet.ready, fleet.replicas, fleet.starting,
                                                                     fleet.unready)))
    if not problems:
        return condition("Degraded", False, "AsExpected", "no problems found")
    return condition("Degraded", True, problems[0][0], "; ".join(m for _, m in problems))


def _l3_unavailable_message(o: Observed, swap: SwapView, fleet: _Fleet) -> str | None:
    """E.g. "the L3 store is unavailable on demo-0, demo-1 (StorageUnavailable: put failed with
    RPC_FAIL); they serve from L1+L2 until it recovers", for the live pods whose runtime reports
    it (those that could not attach at start have their own message), None when none does."""
    live = {p["metadata"]["name"] for p in fleet.live}
    by_reason: dict[str, list[str]] = {}
    for name, why in sorted(o.l3_unavailable.items()):
        if name in live and name not in swap.unattached:
            by_reason.setdefault(why, []).append(name)
    if not by_reason:
        return None
    groups = [f"{', '.join(names)} ({why})" for why, names in by_reason.items()]
    shown = "; ".join(groups[:3]) + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")
    return f"the L3 store is unavailable on {shown}; they serve from L1+L2 until it recovers"


def failed(previous: dict | None, generation: int, failure: tuple[str, str], now: str) -> dict[str, Any]:
    """The status after a reconcile that raised ``failure`` (reason, message): the fields and
    the other conditions as the last derive left them (nothing new was observed), Degraded with
    the failure, and Progressing False: nothing moves until a reconcile succeeds, and the next
    one that does derives the whole status again."""
    previous = previous or {}
    mine = [condition("Progressing", False, failure[0], "stopped: the last reconcile failed (see Degraded)"),
            condition("Degraded", True, *failure)]
    return {**previous, "conditions": set_conditions(previous.get("conditions") or [], mine, generation, now)}


def refused(previous: dict | None, generation: int, message: str, now: str) -> dict[str, Any]:
    """The status after the API server refused a rendered child: ConfigValid False with its
    message, the rest as the last derive left it (a spec edit or the next resync tries again)."""
    previous = previous or {}
    mine = [condition("ConfigValid", False, REFUSED_REASON, message)]
    return {**previous, "observedGeneration": generation,
            "conditions": set_conditions(previous.get("conditions") or [], mine, generation, now)}


def _download_message(fleet: _Fleet, downloads: dict[str, dict[str, Any]]) -> str:
    """E.g. "2 of 2 pod(s) downloading the model: Qwen/Qwen3-8B@main 3.1 GiB of 16.4 GiB (19%)"."""
    message = f"{len(fleet.downloading)} of {len(fleet.live)} pod(s) downloading the model"
    reports = [downloads[p] for p in fleet.downloading if isinstance(downloads.get(p), dict)]
    if not reports:
        return message + " (no progress reported yet)"
    best = max(reports, key=lambda r: r.get("bytesDone") or 0)  # every pod fills the same directory
    done, total = int(best.get("bytesDone") or 0), best.get("bytesTotal")
    where = f"{best.get('repo')}@{best.get('revision')}"
    if not total:
        return f"{message}: {where} {fmt_bytes(done)} so far ({best.get('phase')})"
    return f"{message}: {where} {fmt_bytes(done)} of {fmt_bytes(total)} ({100 * done // total}%)"


def _unavailable_message(ready: int, replicas: int, starting: int, unready: dict[str, str | None]) -> str:
    """E.g. "1 of 3 pod(s) ready, 1 starting; demo-2: CrashLoopBackOff": which pods to look at."""
    message = f"{ready} of {replicas} pod(s) ready" + (f", {starting} starting" if starting else "")
    why = [f"{name}: {reason}" for name, reason in sorted(unready.items()) if reason]
    if why:
        message += "; " + ", ".join(why[:3]) + (f" and {len(why) - 3} more" if len(why) > 3 else "")
    return message
