"""Favoured control-plane components get a heavier CPU group; the others keep the default.

Real processes: components are spawned the way LocalCluster spawns them (a session each, so a
scheduling autogroup each) and the kernel's own view of their groups is read back.
"""
from __future__ import annotations

import os

import pytest

from localcluster.cluster import FAVOURED_NICE, LocalCluster, autogroup_nice


@pytest.mark.skipif(autogroup_nice(os.getpid()) is None,
                    reason="this process is not scheduled by an autogroup (no autogroups, or a CPU cgroup)")
def test_favoured_component_gets_its_own_heavier_group(tmp_path):
    c = LocalCluster(tmp_path / "cluster", favoured=("favoured",), bin_dir=tmp_path)
    c.logdir.mkdir(parents=True)
    own = autogroup_nice(os.getpid())
    try:
        c._spawn("favoured", ["sleep", "30"])
        c._spawn("plain", ["sleep", "30"])
        if c.favour_failures:
            assert os.geteuid() != 0, c.favour_failures  # only an unprivileged run may be refused
            pytest.skip(f"not permitted here: {c.favour_failures}")
        assert autogroup_nice(c.procs["favoured"].pid) == FAVOURED_NICE
        assert autogroup_nice(c.procs["plain"].pid) == 0
        assert autogroup_nice(os.getpid()) == own  # the caller's own group is untouched
    finally:
        c.stop()


def test_favour_without_autogroup_scheduling_is_reported_not_assumed(tmp_path, monkeypatch):
    """In a container with a CPU cgroup of its own the autogroup file reads empty and a written nice
    value changes nothing: the run must say it went unfavoured."""
    import localcluster.cluster as lc
    c = LocalCluster(tmp_path / "cluster", favoured=("favoured",), bin_dir=tmp_path)
    monkeypatch.setattr(lc, "autogroup_nice", lambda pid: None)
    monkeypatch.setattr(lc.Path, "write_text", lambda self, text: len(text))
    c._favour("favoured", os.getpid())
    assert "not scheduled by an autogroup" in c.favour_failures["favoured"]
