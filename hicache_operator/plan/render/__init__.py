"""Pure builders of a HiCacheDeployment's children, one module per kind.

Everything here is a function of the effective spec, the sizing record and the owner, so the
same inputs always give byte-identical objects (and hashes). ``render`` builds the operator's pod
template once and every applied child around it:

- StatefulSet ``<name>`` (``statefulset``) running the pod template, ``updateStrategy: OnDelete``.
- Service ``<name>`` (clients): the pods in serving, or with the router on the router's pods; then
  headless Service ``<name>-serving`` selects the pods in serving; headless Service ``<name>-pods``
  gives stable pod DNS (``services``).
- With the router on: Deployment ``<name>-router``, its ServiceAccount, Role and RoleBinding (``router``).
- ConfigMap ``<name>-storage`` and, with modelSource.huggingFace, ``<name>-model`` (``configmaps``);
  PodDisruptionBudget ``<name>`` (``pdb``).
- With ``hicache.storage.mooncake.managed``: Deployment and Service ``<name>-mooncake``
  (``mooncake_master``).

The key Secrets (``secrets.generated_secrets``) are created once, never applied, so an existing key
is never rotated by a re-render. The runtime container's args, env and resources, and the storage
config they carry, are ``runtime``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache_operator.api import labels
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.api.status import SizingRecord
from hicache_operator.plan import overlay
from hicache_operator.plan.render import statefulset
from hicache_operator.plan.render.common import Owner, digest
from hicache_operator.plan.render.configmaps import configmap, model_configmap
from hicache_operator.plan.render.mooncake_master import (MASTER_COMPONENT, managed_master, mooncake_cluster_id,
                                                          mooncake_master_address, mooncake_master_deployment,
                                                          mooncake_master_service, mooncake_metadata_url)
from hicache_operator.plan.render.pdb import pdb
from hicache_operator.plan.render.router import CLIENT_KEY_ENV, router_children, router_deployment, router_rbac
from hicache_operator.plan.render.runtime import (args, effective_extra_config, host_pool_text, mooncake_env,
                                                  operator_env, resources, storage_config, storage_hash)
from hicache_operator.plan.render.secrets import ADMIN_SECRET_KEY, generated_secrets, secret_ref, uses_api_key
from hicache_operator.plan.render.services import SERVING_SERVICE_COMPONENT, headless_service, serving_service, service
from hicache_operator.plan.render.statefulset import CONTAINER, operator_volumes

__all__ = ["ADMIN_SECRET_KEY", "CLIENT_KEY_ENV", "CONTAINER", "MASTER_COMPONENT", "SERVING_SERVICE_COMPONENT",
           "Owner", "Rendered", "args", "configmap", "effective_extra_config", "generated_secrets", "host_pool_text",
           "managed_master", "mooncake_cluster_id", "mooncake_env", "mooncake_master_address",
           "mooncake_metadata_url", "operator_env", "operator_volumes", "render", "resources",
           "router_children", "secret_ref", "service", "storage_config", "uses_api_key"]


@dataclass(frozen=True)
class Rendered:
    """One render of a fleet: the operator's pod template built once, and everything read from it.

    When spec.podTemplate cannot be merged (an item of a keyed list without its key), ``template``
    and ``restart_hash`` are None and ``children`` is empty: ``validation.check_rendered`` reports
    that overlay as a conflict, so such a render is never applied."""

    base_template: dict[str, Any]  # the operator's pod template, before spec.podTemplate
    template: dict[str, Any] | None  # after spec.podTemplate, with the restart and storage annotations
    restart_hash: str | None  # of the template without its storage-owned fields: a live swap restarts no pod
    storage_hash: str
    args: list[str]
    command: list[str]  # the runtime container's
    children: list[dict[str, Any]]  # the applied children, in apply order, the StatefulSet last


def render(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None, owner: Owner, *,
           process_backed: bool = False) -> Rendered:
    """Build the operator's pod template once, merge ``spec.podTemplate`` onto it, and render every
    applied child around it. Raises ValueError when the pod cannot be rendered (fromNodeMemory
    without a sizing record)."""
    base = statefulset.operator_template(spec, sizing, owner, process_backed=process_backed)
    patch = spec.pod_template.dump()
    storage = storage_hash(spec)
    runtime = base["spec"]["containers"][0]
    try:
        restart = digest(overlay.merge(statefulset.without_storage(base, spec, sizing, owner), patch))
        template = overlay.merge(base, patch)
    except overlay.OverlayError:
        return Rendered(base_template=base, template=None, restart_hash=None, storage_hash=storage,
                        args=list(runtime["args"]), command=list(runtime["command"]), children=[])
    template["metadata"]["annotations"].update({
        labels.RESTART_HASH: restart,
        labels.STORAGE_HASH: storage,
        labels.STORAGE_BACKEND: spec.hicache.storage.backend,
    })
    workload = statefulset.statefulset(spec, owner, template)
    return Rendered(base_template=base, template=template, restart_hash=restart, storage_hash=storage,
                    args=list(runtime["args"]), command=template["spec"]["containers"][0]["command"],
                    children=_applied(spec, owner, workload, process_backed=process_backed))


def _applied(spec: HiCacheDeploymentSpec, owner: Owner, workload: dict[str, Any], *,
             process_backed: bool) -> list[dict[str, Any]]:
    """The applied children around the StatefulSet ``workload``, in apply order (the StatefulSet
    last, after what its pods mount). With the router on, its ServiceAccount, Role and RoleBinding
    come right after the ConfigMaps (its pods need them at start)."""
    managed = managed_master(spec)
    master = [] if managed is None else [
        mooncake_master_service(managed, owner),
        mooncake_master_deployment(spec, managed, owner, process_backed=process_backed)]
    model = model_configmap(spec, owner)
    configmaps = [configmap(spec, owner), *([model] if model else [])]
    if not spec.router_on:
        return [*configmaps, headless_service(owner), service(owner), pdb(spec, owner), *master, workload]
    return [*configmaps, *router_rbac(owner), headless_service(owner), serving_service(owner),
            service(owner, router_on=True), pdb(spec, owner), *master,
            router_deployment(spec, owner, process_backed=process_backed), workload]
