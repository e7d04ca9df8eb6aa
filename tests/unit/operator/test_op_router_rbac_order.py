"""A new fleet's first reconcile succeeds: the router's RoleBinding is applied only once its Role
exists. The API server checks a RoleBinding against the rules of the Role it references (the
operator may grant only what it holds, having no ``bind`` verb), so a binding whose Role does not
exist yet is refused with 404, failing the reconcile (ReconcileFailed, Degraded=True).

The Kube here refuses such a binding as the API server does, and creates a Role slowly (a busy
API server), so a binding applied beside its Role is applied before it exists. On a real API
server: tests/e2e/test_router.py creates a fleet with the router.
"""

from __future__ import annotations

import threading

from op_helpers import RecordingKube, body, context, gpu_node, seen
from kubernetes.client.exceptions import ApiException

from hicache_operator.control.pipeline import reconcile

SPEC = {"image": "hicache-runtime:0.1.0", "replicas": 2, "maxTotalTokens": 4096}


class RbacKube(RecordingKube):
    """Roles as the API server keeps them: a RoleBinding to a Role that does not exist is refused."""

    def __init__(self) -> None:
        super().__init__(None)
        self.release.set()
        self.roles: set[str] = set()

    def apply(self, obj: dict) -> dict:
        if obj["kind"] == "Role":
            threading.Event().wait(0.3)  # the write takes a while; nothing else waits on it
            self.roles.add(obj["metadata"]["name"])
        if obj["kind"] == "RoleBinding" and obj["roleRef"]["name"] not in self.roles:
            raise ApiException(status=404, reason=f'roles.rbac.authorization.k8s.io "{obj["roleRef"]["name"]}" '
                                                  "not found")
        return super().apply(obj)


def test_a_new_fleet_with_a_router_applies_its_role_before_the_rolebinding():
    kube = RbacKube()
    result = reconcile(context(kube), seen(body(SPEC), [gpu_node("gpu-0")], []))
    assert kube.calls.index("apply Role") < kube.calls.index("apply RoleBinding")
    assert {"apply ServiceAccount", "apply Deployment", "apply StatefulSet"} <= set(kube.calls)
    assert result.status["observedGeneration"] == 1


def test_the_routers_rbac_still_precedes_the_workloads_with_the_status_written_beside_them():
    kube = RbacKube()
    reconcile(context(kube), seen(body(SPEC), [gpu_node("gpu-0")], []))
    for workload in ("apply Deployment", "apply StatefulSet"):
        assert kube.calls.index("apply RoleBinding") < kube.calls.index(workload)
