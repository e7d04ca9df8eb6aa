"""kopf registration: what the operator watches, and where each event goes.

Every handler only hands its event to the one ``Controller`` (``controller.py``), which queues
work for its worker threads; nothing here reconciles. HiCacheDeployments get event handlers
only (no change handlers, timers or daemons), so kopf writes no finalizer and no annotations
on them and keeps no diff base (``NoDiffBase``); deletion is left to the garbage collector
through owner references. Fleet pods, router pods, the serving Services' EndpointSlices and the
managed Mooncake masters' Deployments are indexed (the controller's informers read kopf's
indexes) and their events forwarded.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from hicache_operator.api import labels
from hicache_operator.plan import render
from hicache_operator.control.controller import Controller
from hicache_operator.control.informers import NodeCache, master_essence, pod_essence, pod_identity, slice_readiness
from hicache_operator.api.spec import GROUP, PLURAL, VERSION

RESOURCE = {"group": GROUP, "version": VERSION, "plural": PLURAL}
OURS = {"labels": {labels.MANAGED_BY: labels.MANAGER}}

controller = Controller()


class NoDiffBase(kopf.DiffBaseStorage):
    """No essence kept or compared: kopf builds one (a deep copy of the body) on every watch
    event for change-detecting handlers, and this operator registers none, so it would be pure
    cost (with a thousand deployments' pods and EndpointSlices, the largest share of its CPU).
    A change handler, timer or daemon added here needs kopf's diff base back."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return None

    def fetch(self, *, body: Any) -> Any:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.diffbase_storage = NoDiffBase()
    # kopf applies the handlers' label filters after it has received and decoded each event;
    # these make the API server send only our pods and the serving Services' EndpointSlices
    # (which carry their Service's labels), not every pod of the cluster. The headless
    # Services' slices change with every pod and nothing reads them; the client Service's,
    # while it points at the router, hold router pods.
    ours = f"{labels.MANAGED_BY}={labels.MANAGER}"
    settings.watching.label_selectors["pods"] = ours
    settings.watching.label_selectors[("discovery.k8s.io", "endpointslices")] = \
        f"{ours},{labels.COMPONENT}={render.SERVING_SERVICE_COMPONENT}"
    # the managed Mooncake masters' Deployments (the router's is followed through its pods)
    settings.watching.label_selectors[("apps", "deployments")] = f"{ours},{labels.COMPONENT}={render.MASTER_COMPONENT}"
    settings.posting.level = logging.WARNING  # kopf's own chatter stays in the log; our Events are explicit
    settings.posting.reporting_component = labels.MANAGER
    settings.posting.event_name_prefix = "hicache-"
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.networking.request_timeout = 60
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # liveness probes, every few seconds
    logging.getLogger("httpx").setLevel(logging.WARNING)  # runtime GETs on every swap step
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # "Handler succeeded" for every pod event
    nodes = NodeCache(controller.kube.api, controller.nodes_changed, controller.stop)
    controller.informers.nodes = nodes
    nodes.start()


@kopf.on.cleanup()
def shutdown(**_: Any) -> None:
    controller.close()


@kopf.on.event(**RESOURCE)
async def on_deployment(event: dict, body: kopf.Body, namespace: str, name: str, pod_index: kopf.Index,
                        router_index: kopf.Index, slice_index: kopf.Index, master_index: kopf.Index,
                        **_: Any) -> None:
    controller.start(pod_index, router_index, slice_index, master_index)
    if event.get("type") == "DELETED":
        controller.deployment_deleted((namespace, name), body)
    elif not body.get("metadata", {}).get("deletionTimestamp"):
        controller.deployment_seen((namespace, name), body, initial=event.get("type") is None)


def _owner(body: kopf.Body, label: str = labels.DEPLOYMENT) -> str | None:
    return ((body.get("metadata") or {}).get("labels") or {}).get(label)


@kopf.index("", "v1", "pods", **OURS)
async def pod_index(body: kopf.Body, namespace: str, **_: Any) -> dict:
    owner = _owner(body)
    return {(namespace, owner): pod_essence(body)} if owner else {}


@kopf.index("", "v1", "pods", **OURS)
async def router_index(body: kopf.Body, namespace: str, **_: Any) -> dict:
    owner = _owner(body, labels.ROUTER)
    return {(namespace, owner): pod_essence(body)} if owner else {}


@kopf.index("discovery.k8s.io", "v1", "endpointslices", **OURS)
async def slice_index(body: kopf.Body, namespace: str, **_: Any) -> dict:
    service = ((body.get("metadata") or {}).get("labels") or {}).get("kubernetes.io/service-name")
    owner = _owner(body)
    return {(namespace, owner): (service, slice_readiness(body))} if service and owner else {}


@kopf.on.event("", "v1", "pods", **OURS)
async def on_pod(event: dict, body: kopf.Body, namespace: str, pod_index: kopf.Index, router_index: kopf.Index,
                 slice_index: kopf.Index, master_index: kopf.Index, **_: Any) -> None:
    controller.start(pod_index, router_index, slice_index, master_index)
    owner = _owner(body)
    if owner:
        controller.pod_event((namespace, owner), body["metadata"]["name"],
                             pod_identity(body, deleted=event.get("type") == "DELETED"))
    elif (router := _owner(body, labels.ROUTER)) is not None:
        controller.router_event((namespace, router))


@kopf.on.event("discovery.k8s.io", "v1", "endpointslices", **OURS)
async def on_endpointslice(event: dict, body: kopf.Body, namespace: str, pod_index: kopf.Index,
                           router_index: kopf.Index, slice_index: kopf.Index, master_index: kopf.Index,
                           **_: Any) -> None:
    controller.start(pod_index, router_index, slice_index, master_index)
    owner = _owner(body)
    if owner:
        controller.slice_event((namespace, owner), (body.get("metadata") or {}).get("name", ""),
                               None if event.get("type") == "DELETED" else slice_readiness(body))


@kopf.index("apps", "v1", "deployments", **OURS)
async def master_index(body: kopf.Body, namespace: str, **_: Any) -> dict:
    owner = _owner(body)
    return {(namespace, owner): master_essence(body)} if owner else {}


@kopf.on.event("apps", "v1", "deployments", **OURS)
async def on_master(event: dict, body: kopf.Body, namespace: str, pod_index: kopf.Index, router_index: kopf.Index,
                    slice_index: kopf.Index, master_index: kopf.Index, **_: Any) -> None:
    controller.start(pod_index, router_index, slice_index, master_index)
    owner = _owner(body)
    if owner:
        controller.master_event((namespace, owner))
