"""The names of a fleet's children, from the HiCacheDeployment's name: one place that spells them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Names:
    statefulset: str
    service: str  # the clients': the pods in serving, or with the router on the router's pods
    serving: str  # with the router on, the pods in serving (headless)
    headless: str  # stable pod DNS
    configmap: str  # the storage extra config
    secret: str  # the generated admin key
    api_secret: str  # the generated clients' key
    internal_secret: str  # the fleet's internal key (router and operator)
    pdb: str
    router: str  # its Deployment, ServiceAccount, Role and RoleBinding
    mooncake_master: str  # a managed master's Deployment and Service


def names(name: str) -> Names:
    return Names(statefulset=name, service=name, serving=f"{name}-serving", headless=f"{name}-pods",
                 configmap=f"{name}-storage", secret=f"{name}-admin", api_secret=f"{name}-api",
                 internal_secret=f"{name}-internal", pdb=name, router=f"{name}-router",
                 mooncake_master=f"{name}-mooncake")
