"""The operator tells kopf to keep no diff base (``handlers.NoDiffBase``): safe only while it
registers no change-detecting handlers, which read that diff base. This fails when one is added."""

from __future__ import annotations

import kopf

from hicache_operator import handlers


def test_no_change_detecting_handlers_so_no_diff_base_is_needed():
    registry = kopf.get_default_registry()
    assert handlers.on_deployment  # the module registered its handlers
    assert not registry._changing.get_all_handlers(), "a change handler needs kopf's diff base back"
    assert not registry._spawning.get_all_handlers(), "daemons and timers reset on diffs too"
    assert registry._watching.get_all_handlers()


def test_the_diff_base_is_empty():
    storage = handlers.NoDiffBase()
    body = kopf.Body({"metadata": {"name": "x"}, "spec": {"a": 1}})
    assert storage.build(body=body) is None and storage.fetch(body=body) is None
