"""Label and annotation keys the operator writes, and the ones other parts read back."""

from __future__ import annotations

PREFIX = "hicache.dev"

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "hicache-operator"
NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
DEPLOYMENT = f"{PREFIX}/deployment"  # the owning HiCacheDeployment's name, on every child and fleet pod
ROUTER = f"{PREFIX}/router"  # the owning HiCacheDeployment's name, on its router's pods (not fleet pods)

# Pod template annotations.
RESTART_HASH = f"{PREFIX}/restart-hash"  # everything but the storage config; a change restarts pods
STORAGE_HASH = f"{PREFIX}/storage-hash"  # the storage config the pod runs; the rollout rewrites it after a live swap
STORAGE_BACKEND = f"{PREFIX}/storage-backend"  # its backend name, for the BACKEND column
PROCESS_BACKED = f"{PREFIX}/process-backed"  # local test cluster: run this pod's command as a process
RENDERED_HASH = f"{PREFIX}/rendered-hash"  # on every child: hash of the rendered object

# Client Service annotation: touched (a timestamp) to have the EndpointSlice controller sync the
# Service again when it sits on a readiness flip (see ``endpoint_lag``).
ENDPOINTS_RESYNC = f"{PREFIX}/endpoints-resync"


def selector_labels(name: str) -> dict[str, str]:
    return {NAME: "hicache", INSTANCE: name, MANAGED_BY: MANAGER}


def router_selector_labels(name: str) -> dict[str, str]:
    """The router's pods: apart from the fleet's (its StatefulSet, Services and affinity select those)."""
    return {NAME: "hicache-router", INSTANCE: f"{name}-router", MANAGED_BY: MANAGER}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
