"""The key Secrets: which Secret holds each key, and the ones the operator generates."""

from __future__ import annotations

import base64
from typing import Any, Callable

from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.fleet.names import names
from hicache_operator.plan.render.common import Owner, meta, stamp

ADMIN_SECRET_KEY = "admin-api-key"
API_SECRET_KEY = "api-key"


def uses_api_key(spec: HiCacheDeploymentSpec) -> bool:
    """SGLang serves /server_info (resolved args, admin key included) to anyone unless --api-key is
    set, so its pods always get one; the bundled runtime redacts keys and takes one when given."""
    return spec.engine == "sglang" or spec.api_key_secret_ref is not None


def secret_ref(spec: HiCacheDeploymentSpec, owner_name: str, which: str) -> tuple[str, str]:
    """(Secret name, data key) of the admin key (``which`` "admin"), the clients' key ("api") or the
    fleet's internal key ("internal", always generated)."""
    if which == "internal":
        return names(owner_name).internal_secret, API_SECRET_KEY
    ref = spec.admin_key_secret_ref if which == "admin" else spec.api_key_secret_ref
    if ref is not None:
        return ref.name, ref.key
    return (names(owner_name).secret, ADMIN_SECRET_KEY) if which == "admin" else \
        (names(owner_name).api_secret, API_SECRET_KEY)


def pods_key(spec: HiCacheDeploymentSpec) -> str:
    """Which key the pods take as --api-key. Behind the router, the fleet's internal key, which only
    the router and the operator hold: SGLang gives its admin key (in /server_info) to any holder of
    its api key, so clients never get the pods' key. Without the router, clients reach the pods
    directly, with the pods' key: the clients' own (a warning says what that exposes)."""
    return "internal" if spec.router_on else "api"


def generated_secrets(spec: HiCacheDeploymentSpec, owner: Owner, new_key: Callable[[], str]) -> list[dict[str, Any]]:
    """The key Secrets the operator creates (once, never applied) because the spec names none."""
    out = []
    if spec.admin_key_secret_ref is None:
        out.append(_secret(owner, names(owner.name).secret, "admin-key", ADMIN_SECRET_KEY, new_key()))
    if uses_api_key(spec) and spec.api_key_secret_ref is None:
        out.append(_secret(owner, names(owner.name).api_secret, "api-key", API_SECRET_KEY, new_key()))
    if uses_api_key(spec) and spec.router_on:
        out.append(_secret(owner, names(owner.name).internal_secret, "internal-key", API_SECRET_KEY, new_key()))
    return out


def _secret(owner: Owner, name: str, component: str, field: str, key: str) -> dict[str, Any]:
    return stamp({
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": meta(owner, name, component),
        "data": {field: base64.b64encode(key.encode()).decode()},
    })
