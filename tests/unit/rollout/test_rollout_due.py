"""When a backend-swap step can be skipped (a settled fleet costs no runtime GETs)."""

from __future__ import annotations

from hicache_operator.plan import render
from hicache_operator.rollout import due
from hicache_operator.fleet import gate
from hicache_operator.fleet.storage_config import storage_fingerprint
from hicache_operator.api.spec import HiCacheDeploymentSpec


def spec(backend="none"):
    return HiCacheDeploymentSpec.model_validate({"image": "img", "hicache": {"storage": {"backend": backend}}})


def pod(serving, deleting=False):
    meta = {"name": "p", "deletionTimestamp": "2025-01-01T00:00:00Z"} if deleting else {"name": "p"}
    meta["labels"] = {} if serving is None else {gate.LABEL: serving.lower()}
    return {"metadata": meta, "status": {}}


def status(s, phase="Complete", pods=None):
    return {"backendSwap": {"phase": phase, "target": storage_fingerprint(render.storage_config(s)),
                            "pods": pods or {}}}


def needed(st, s, pods):
    return due.needed(st, storage_fingerprint(render.storage_config(s)), s.router_on, pods)


def test_settled_fleet_needs_no_step():
    s = spec()
    assert not needed(status(s), s, [pod("True"), pod("True")])
    assert not needed(status(s), s, [pod("True"), pod(None, deleting=True)])


def test_anything_unsettled_needs_a_step():
    s = spec()
    assert needed({}, s, [pod("True")])                                   # never stepped
    assert needed(status(s), s, [pod(None)])                              # a new pod to admit
    assert needed(status(s), s, [pod("False")])                           # out of serving
    assert needed(status(s, phase="InProgress"), s, [pod("True")])        # a swap running
    assert needed(status(s, pods={"p": {}}), s, [pod("True")])            # a record left
    assert needed(status(s), spec("file"), [pod("True")])                 # a new target
