"""A step's writes to its pods: serving gate patches and uid-guarded deletions.

Blocking Kubernetes client calls; the step runs them on the swapper's gate pool.
``PodWrites`` holds what every write of one step shares.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hicache_operator.fleet import gate
from hicache_operator.io import metrics
from hicache_operator.io.kube import plain_json

from ..actions import DeletePod, SetServingGate


@dataclass(frozen=True)
class PodWrites:
    """The namespace's pods, and the storage target a readmitted pod's annotations name."""

    core: client.CoreV1Api
    namespace: str
    target_fp: str
    target_backend: str

    def gate(self, action: SetServingGate) -> None:
        with metrics.API_SECONDS.labels("patch", "Pod").time():
            plain_json(self.core.patch_namespaced_pod, action.pod, self.namespace,
                       gate.patch(action.uid, action.serving, action.runs, self.target_fp, self.target_backend))

    def gate_counted(self, action: SetServingGate) -> None:
        """``gate``, counted in the actions metric (a last pass's patches, which no pass awaits)."""
        try:
            self.gate(action)
        except Exception:
            metrics.SWAP_ACTIONS.labels(SetServingGate.__name__, "error").inc()
            raise
        metrics.SWAP_ACTIONS.labels(SetServingGate.__name__, "ok").inc()

    def delete(self, action: DeletePod) -> None:
        """Delete the pod if it is still the one the action names; gone or replaced already is
        done (404, or 409 from the uid precondition)."""
        try:
            with metrics.API_SECONDS.labels("delete", "Pod").time():
                self.core.delete_namespaced_pod(action.pod, self.namespace,
                                                body={"preconditions": {"uid": action.uid}}, _preload_content=False)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            return
        metrics.POD_RESTARTS.inc()
