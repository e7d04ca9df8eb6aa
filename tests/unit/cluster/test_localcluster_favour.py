"""Favoured control-plane components get a heavier CPU group; the others keep the default.

Real processes: components are spawned the way LocalCluster spawns them (a session each, so a
scheduling autogroup each) and the kernel's own view of their groups is read back.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cluster.localcluster import FAVOURED_NICE, LocalCluster


def autogroup_nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])  # "/autogroup-N nice K"


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="kernel without scheduler autogroups")
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
