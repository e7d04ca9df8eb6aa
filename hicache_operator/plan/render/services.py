"""The fleet's Services: the clients' (the pods in serving, or the router's pods), the serving one
the router and swaps watch while the router is on, and the headless one for stable pod DNS."""

from __future__ import annotations

from typing import Any

from hicache_operator.api import flags, labels
from hicache_operator.fleet import gate
from hicache_operator.fleet.names import names
from hicache_operator.plan.render.common import Owner, meta, stamp

SERVING_SERVICE_COMPONENT = "service"  # the serving Service's component label (the operator watches its slices)
CLIENT_ROUTER_COMPONENT = "client"  # the client Service's while it points at the router


def http_port() -> list[dict[str, Any]]:
    return [{"name": "http", "port": flags.RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}]


def service(owner: Owner, router_on: bool = False) -> dict[str, Any]:
    """The client Service: the pods in serving, or the router's pods (same name, same port)."""
    if router_on:
        return stamp({
            "apiVersion": "v1", "kind": "Service",
            "metadata": meta(owner, names(owner.name).service, CLIENT_ROUTER_COMPONENT),
            "spec": {"type": "ClusterIP", "selector": labels.router_selector_labels(owner.name),
                     "ports": http_port()},
        })
    return stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta(owner, names(owner.name).service, SERVING_SERVICE_COMPONENT),
        "spec": {"type": "ClusterIP", "selector": {**labels.selector_labels(owner.name), **gate.selector()},
                 "ports": http_port()},
    })


def serving_service(owner: Owner) -> dict[str, Any]:
    """With the router on, the pods in serving (headless: the router reaches pods by their IPs; this
    Service's EndpointSlices are what swaps wait on, and its DNS name reaches the pods directly)."""
    return stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta(owner, names(owner.name).serving, SERVING_SERVICE_COMPONENT),
        "spec": {"clusterIP": "None", "selector": {**labels.selector_labels(owner.name), **gate.selector()},
                 "ports": http_port()},
    })


def headless_service(owner: Owner) -> dict[str, Any]:
    return stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta(owner, names(owner.name).headless, "pods"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": labels.selector_labels(owner.name),
                 "ports": [{"name": "http", "port": flags.RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}]},
    })
