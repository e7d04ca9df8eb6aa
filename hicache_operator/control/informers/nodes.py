"""What sizing needs from every node, kept current by a list+watch of its own.

Why not a kopf handler on nodes: kopf keeps per-object machinery for every watched object and
turns every heartbeat into a handler call; on a 2000-node cluster that alone cost the operator
~60 MB and a steady trickle of CPU. Sizing only reads each node's labels, taints,
schedulability and allocatable resources ("essence"), so this keeps exactly that, lists in pages,
reads raw JSON (no typed models), and calls ``on_change`` only when an essence changes after the
first full listing. Reconciles wait for that listing (``wait_synced``): sizing from a partial
node list would pin a wrong host pool.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable

import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from hicache_operator.plan.sizing import Nodes

PAGE = 500
WATCH_SECONDS = 240
log = logging.getLogger("hicache_operator.nodes")


def node_essence(body: dict[str, Any]) -> dict[str, Any]:
    """What sizing reads from a node; heartbeats do not change it."""
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    return {"metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
            "spec": {"taints": list(spec.get("taints") or []), "unschedulable": bool(spec.get("unschedulable"))},
            "status": {"allocatable": dict(status.get("allocatable") or {})}}


class NodeCache:
    def __init__(self, api: client.ApiClient, on_change: Callable[[], None], stop: threading.Event) -> None:
        self._core = client.CoreV1Api(api)
        self._on_change = on_change
        self._stop = stop
        self._nodes: dict[str, dict[str, Any]] = {}
        self._version = 0  # bumped on every change (sizing remembers eligibility per version)
        self._synced = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="hicache-nodes").start()

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    def nodes(self) -> Nodes:
        version = self._version  # read first: a change racing this call gets a newer version
        return Nodes(list(self._nodes.values()), version=(id(self), version))

    def _run(self) -> None:
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    resource_version = self._relist()
                resource_version = self._watch(resource_version)
            except ApiException as exc:
                if exc.status == 410:  # our resourceVersion is too old: list afresh
                    resource_version = None
                    continue
                log.warning("node watch: Kubernetes API error %s %s; relisting", exc.status, exc.reason)
                resource_version = None
                self._stop.wait(2)
            except (urllib3.exceptions.HTTPError, OSError) as exc:  # the API server went away: one line
                log.warning("node watch: connection lost (%s); relisting", type(exc).__name__)
                resource_version = None
                self._stop.wait(2)
            except Exception:  # a bug: say where, list afresh, never die
                log.exception("node watch failed; relisting")
                resource_version = None
                self._stop.wait(2)

    def _relist(self) -> str:
        fresh: dict[str, dict[str, Any]] = {}
        token, resource_version = None, ""
        while True:
            page = self._core.list_node(limit=PAGE, _continue=token, _preload_content=False)
            body = json.loads(page.data)
            for item in body.get("items") or []:
                fresh[item["metadata"]["name"]] = node_essence(item)
            resource_version = body["metadata"].get("resourceVersion", resource_version)
            token = body["metadata"].get("continue")
            if not token:
                break
        changed = fresh != self._nodes
        self._nodes = fresh
        self._version += 1
        if self._synced.is_set() and changed:
            self._on_change()
        if not self._synced.is_set():
            log.info("listed %d nodes", len(fresh))
        self._synced.set()
        return resource_version

    def _watch(self, resource_version: str) -> str:
        stream = watch.Watch().stream(lambda **kw: self._core.list_node(**kw),  # untyped: raw dicts
                                      resource_version=resource_version, allow_watch_bookmarks=True,
                                      timeout_seconds=WATCH_SECONDS)
        for event in stream:
            kind, obj = event["type"], event["raw_object"]
            if kind == "ERROR":
                raise ApiException(status=obj.get("code", 500), reason=obj.get("reason"))
            resource_version = obj["metadata"]["resourceVersion"]
            if kind == "BOOKMARK":
                continue
            name = obj["metadata"]["name"]
            essence = None if kind == "DELETED" else node_essence(obj)
            if self._nodes.get(name) == essence:
                continue  # a heartbeat
            if essence is None:
                self._nodes.pop(name, None)
            else:
                self._nodes[name] = essence
            self._version += 1
            self._on_change()
            if self._stop.is_set():
                break
        return resource_version
