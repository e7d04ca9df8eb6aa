"""The one condition setter: transition times move only on a flip, in place, foreign ones kept."""

from __future__ import annotations

from hicache_operator.api.conditions import condition, set_conditions


def test_transition_time_moves_only_on_flip_and_foreign_conditions_survive():
    prev = [{"type": "Ready", "status": "True", "lastTransitionTime": "t0"},
            {"type": "BackendSwapHalted", "status": "True", "lastTransitionTime": "t0"}]
    new = [condition("Ready", True, "a"), condition("Degraded", False, "b")]
    merged = set_conditions(prev, new, 3, "t1")
    assert [c["type"] for c in merged] == ["Ready", "BackendSwapHalted", "Degraded"]  # in place, new appended
    by_type = {c["type"]: c for c in merged}
    assert by_type["Ready"]["lastTransitionTime"] == "t0" and by_type["Degraded"]["lastTransitionTime"] == "t1"
    assert by_type["Ready"]["observedGeneration"] == 3 and "observedGeneration" not in by_type["BackendSwapHalted"]
    flipped = {c["type"]: c for c in set_conditions(merged, [condition("Ready", False, "c", "why")], 4, "t2")}
    assert flipped["Ready"] == {"type": "Ready", "status": "False", "reason": "c", "message": "why",
                                "observedGeneration": 4, "lastTransitionTime": "t2"}
    assert flipped["Degraded"]["observedGeneration"] == 3  # not set by this writer: as it was


def test_a_writer_drops_the_conditions_it_owns_and_no_longer_sets():
    prev = [{"type": "Ready", "status": "True"}, {"type": "BackendSwapFailed", "status": "True"},
            {"type": "Foreign", "status": "True"}]
    kept = set_conditions(prev, [condition("Ready", True, "a")], 1, "t", drop=("Ready", "BackendSwapFailed"))
    assert [c["type"] for c in kept] == ["Ready", "Foreign"]


def test_unknown_is_a_status_of_its_own():
    assert condition("X", "Unknown", "Waiting").status == "Unknown"
    assert condition("X", True, "r").brief() == {"type": "X", "status": "True", "reason": "r", "message": ""}
