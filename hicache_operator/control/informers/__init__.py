"""What the operator's watches have shown, kept for its workers (the client-go informer pattern).

- ``bodies``: the newest HiCacheDeployment bodies (a reconcile never GETs its object);
- ``nodes``: what sizing reads from every node (a list+watch of its own);
- ``pods``: the fleets' pods (kopf's index, filled from the pod watch), what a swap step must
  hear about at once (``pod_identity``), and the serving gates the operator's own patches set
  that the watch has not delivered yet;
- ``routers``: the fleets' router pods (kopf's index);
- ``slices``: the serving Services' EndpointSlices (kopf's index): the Service, pod IP -> ready;
- ``masters``: the managed Mooncake masters' Deployments (kopf's index).

The kopf handlers (``handlers``) fill these; the controller's workers read them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Mapping

from hicache_operator.fleet.names import names
from hicache_operator.fleet.gate import serving_gate, with_gate

from .bodies import BodyCache
from .nodes import NodeCache

Key = tuple[str, str]  # (namespace, HiCacheDeployment name)


def pod_essence(body: Any) -> dict:
    """What status, restarts and swaps read from a pod (no spec, no managedFields: memory)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels", "annotations",
                                               "deletionTimestamp", "creationTimestamp") if k in meta},
            "status": {**{k: status[k] for k in ("phase", "podIP", "conditions") if k in status},
                       "containerStatuses": [_container_essence(cs) for cs in status.get("containerStatuses") or []],
                       "initContainerStatuses": [_container_essence(cs)
                                                 for cs in status.get("initContainerStatuses") or []]}}


def _container_essence(cs: dict) -> dict:
    out = {k: cs[k] for k in ("name", "started", "ready", "restartCount") if k in cs}
    state = cs.get("state") or {}
    if state.get("running") is not None:
        out["state"] = {"running": {"startedAt": state["running"].get("startedAt")}}
    elif state.get("waiting") is not None:
        out["state"] = {"waiting": {"reason": state["waiting"].get("reason")}}
    # the last line the container wrote before it failed: why it cannot start (pods.unavailable_reason)
    message = (((cs.get("lastState") or {}).get("terminated") or {}).get("message") or "").strip()
    if message:
        out["lastState"] = {"terminated": {"message": message.splitlines()[-1][:300]}}
    return out


def master_essence(body: Any) -> dict:
    """What status reads from a managed master's Deployment: desired and ready replicas."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    return {"name": (body.get("metadata") or {}).get("name"), "replicas": spec.get("replicas", 1),
            "readyReplicas": status.get("readyReplicas") or 0}


def pod_identity(body: Any, deleted: bool = False) -> tuple:
    """What a swap step needs to hear about at once: which pod (uid), whether it is going away,
    where its runtime is (IP) and its phase. Its conditions (the serving gate, Ready) are not
    in it: a swap step waits for what they cause, the EndpointSlice change, which has its own
    event."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    return (meta.get("uid"), deleted or bool(meta.get("deletionTimestamp")), status.get("podIP"), status.get("phase"))


def slice_readiness(endpoint_slice: Mapping[str, Any]) -> dict[str, bool]:
    """Pod IP -> the ``ready`` condition of its endpoint in one EndpointSlice (a Service's view
    is the union of its slices', ready if any says so)."""
    out: dict[str, bool] = {}
    for ep in endpoint_slice.get("endpoints") or []:
        ready = bool((ep.get("conditions") or {}).get("ready"))
        for addr in ep.get("addresses") or []:
            out[addr] = out.get(addr, False) or ready
    return out


class Informers:
    """The caches (see the module docstring). ``pods``/``routers``/``slices``/``masters``: kopf's indexes,
    mappings of (namespace, deployment) -> fleet pod essences, router pod essences, and (the
    serving Service's name, slice readiness) per slice."""

    def __init__(self) -> None:
        self.bodies = BodyCache()
        self.nodes: NodeCache | None = None
        self.pods: Mapping[Key, Any] = {}
        self.routers: Mapping[Key, Any] = {}
        self.slices: Mapping[Key, Any] = {}
        self.masters: Mapping[Key, Any] = {}
        self._guard = threading.Lock()
        self._identities: dict[tuple[Key, str], tuple] = {}  # (deployment, pod) -> pod_identity
        self._slice_readiness: dict[tuple[str, str], dict[str, bool]] = {}  # (namespace, slice) -> IP -> ready
        self.acked_gates: dict[Key, dict[str, tuple[str, bool]]] = {}  # see note_gates

    def pod_changed(self, key: Key, pod: str, identity: tuple) -> bool:
        """Record the pod's identity; whether it changed (a pod going away is forgotten)."""
        with self._guard:
            changed = self._identities.get((key, pod)) != identity
            if identity[1]:
                self._identities.pop((key, pod), None)
            else:
                self._identities[(key, pod)] = identity
        return changed

    def slice_changed(self, namespace: str, slice_name: str, readiness: dict[str, bool] | None) -> set[str] | None:
        """Record one slice's readiness (None: deleted). None when nothing changed, else the
        IPs it no longer shows ready (not ready, or gone)."""
        slot = (namespace, slice_name)
        with self._guard:
            before = self._slice_readiness.get(slot)
            if before == readiness:
                return None
            if readiness is None:
                self._slice_readiness.pop(slot, None)
            else:
                self._slice_readiness[slot] = readiness
        # an endpoint leaves the client Service's slices when its pod leaves serving
        return {ip for ip, ready in (before or {}).items() if ready and not (readiness or {}).get(ip)}

    def note_gates(self, key: Key, gates: list[tuple[str, str, bool]]) -> None:
        """The serving gates a step patched, acknowledged by the API server: (pod, uid, serving).
        ``cached_pods`` shows them until the pod watch does: the next step plans on the pods as
        the watch shows them, 50-150 ms behind a patch, and one that still saw a pod's old gate
        would take it out (or readmit it) again. The operator is the gate's only writer, so what
        the API server acknowledged is the gate until the next patch."""
        with self._guard:
            noted = self.acked_gates.setdefault(key, {})
            for pod, uid, serving in gates:
                noted[pod] = (uid, serving)

    def live_pods(self, key: Key) -> list[dict]:
        """The deployment's pods as the watch last saw them (kopf's own objects: read only)."""
        return list(self.pods.get(key, []))

    def master(self, key: Key) -> dict | None:
        """The deployment's managed master Deployment (``master_essence``) as the watch last saw
        it; None when there is none."""
        found = list(self.masters.get(key, []))
        return dict(found[0]) if found else None

    def cached_pods(self, key: Key) -> list[dict]:
        """The deployment's pods as the watch last saw them (copies: a reconcile edits its own),
        with the serving gates the operator's own patches set where the watch is still behind.
        An acknowledged gate the watch now shows, or of a pod gone or replaced, is forgotten."""
        pods = copy.deepcopy(self.live_pods(key))
        with self._guard:
            noted = self.acked_gates.get(key)
            if not noted:
                return pods
            at = {p["metadata"].get("name"): i for i, p in enumerate(pods)}
            for name, (uid, serving) in list(noted.items()):
                i = at.get(name)
                if i is None or pods[i]["metadata"].get("uid") != uid or serving_gate(pods[i]) is serving:
                    del noted[name]
                else:
                    pods[i] = with_gate(pods[i], serving)
            if not noted:
                del self.acked_gates[key]
        return pods

    def router_pods(self, key: Key) -> list[dict]:
        """The deployment's router pods as the watch last saw them (read only)."""
        return list(self.routers.get(key, []))

    def serving_endpoints(self, key: Key) -> dict[str, bool]:
        """Pod IP -> ready, over the deployment's serving Service's EndpointSlices as the watch
        last saw them (a Service's view is the union of its slices', ready if any says so)."""
        out: dict[str, bool] = {}
        for _service, readiness in list(self.slices.get(key, [])):
            for ip, ready in readiness.items():
                out[ip] = out.get(ip, False) or ready
        return out

    def serving_service(self, key: Key) -> str:
        """The name of the deployment's serving Service, as its slices show it (the client
        Service's name until one is seen)."""
        for service, _readiness in list(self.slices.get(key, [])):
            return service
        return names(key[1]).service

    def still_out(self, key: Key, pod: dict) -> bool:
        """Whether the watches show the pod (same uid and IP, not being deleted) out of serving,
        its gate False (the operator's acknowledged patch counting where the watch is behind),
        and its endpoint not ready."""
        uid, ip, name = pod["metadata"]["uid"], pod["status"]["podIP"], pod["metadata"]["name"]
        live = next((p for p in self.live_pods(key) if p["metadata"].get("uid") == uid), None)
        if live is None or live["metadata"].get("deletionTimestamp") or (live.get("status") or {}).get("podIP") != ip:
            return False
        with self._guard:
            noted = (self.acked_gates.get(key) or {}).get(name)
        gate = noted[1] if noted is not None and noted[0] == uid else serving_gate(live)
        return gate is False and self.serving_endpoints(key).get(ip) is not True

    def forget(self, key: Key) -> None:
        """The deployment is gone."""
        with self._guard:
            self.acked_gates.pop(key, None)
            for gone in [k for k in self._identities if k[0] == key]:
                del self._identities[gone]
