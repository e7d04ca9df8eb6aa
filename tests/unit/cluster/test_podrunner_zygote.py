"""The podrunner's zygote: a forked child must look to its module like `python -m` started it.

Real processes: a zygote (preloading a light module here, torch in clusters), children forked
from it running this very file as `__main__`, signals and exit codes through the zygote.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localcluster.podrunner import Runner
from localcluster.zygote import ZYGOTE_ENV, ZYGOTE_MODULES, Zygote

MODULE = "tests.unit.cluster.test_podrunner_zygote"


def child_main() -> None:
    """Run in the forked child: report what it sees, then behave as asked."""
    report = {"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_TEST"), "pid": os.getpid(),
              "sid": os.getsid(0), "pgid": os.getpgid(0), "path0": sys.path[0], "stdin": sys.stdin.read(),
              "comm": Path("/proc/self/comm").read_text().strip()}
    print(json.dumps(report), flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[2]))


@pytest.fixture
def zygote():
    z = Zygote(("json",), {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    yield z
    z.proc.stdin.close()
    z.proc.wait(timeout=10)


def spawn(zygote, tmp_path, *args):
    env = {**os.environ, "ZYGOTE_TEST": "from the pod"}
    return zygote.spawn([sys.executable, "-m", MODULE, *args], env, tmp_path, tmp_path / "container.log")


def test_child_runs_the_module_as_main_with_the_pods_argv_env_cwd_and_log(zygote, tmp_path):
    proc = spawn(zygote, tmp_path, "exit", "3")
    assert proc.wait(timeout=30) == 3
    report = json.loads((tmp_path / "container.log").read_text().splitlines()[-1])
    assert report["argv"][1:] == ["exit", "3"] and report["argv"][0].endswith("test_podrunner_zygote.py")
    assert report["cwd"] == str(tmp_path) and report["path0"] == str(tmp_path)
    assert report["env"] == "from the pod"
    # a process group of its own (stopped with its children), the zygote's session: one scheduling
    # group for all pods, as a kubelet's kubepods cgroup, not one each
    assert report["pid"] == proc.pid and report["pgid"] == proc.pid
    assert report["sid"] == zygote.proc.pid
    assert report["stdin"] == ""
    assert report["comm"] == MODULE[:15]


def test_a_signalled_child_is_reaped_and_its_exit_reported(zygote, tmp_path):
    proc = spawn(zygote, tmp_path, "sleep", "0")
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert proc.poll() == -signal.SIGTERM


def test_only_python_dash_m_of_a_listed_module_with_this_interpreter_uses_a_zygote(tmp_path, monkeypatch):
    monkeypatch.setenv(ZYGOTE_ENV, "1")
    runner = Runner.__new__(Runner)  # only the zygote table is needed
    runner.base_env = {"PATH": os.path.dirname(sys.executable), "PYTHONPATH": "/repo"}
    runner.zygotes, runner.zygote_lock = {}, __import__("threading").Lock()
    module = next(iter(ZYGOTE_MODULES))
    env = dict(runner.base_env)
    python = os.path.basename(sys.executable)
    assert runner.zygote_for([python, "-m", "some.other.module"], env) is None
    assert runner.zygote_for([python, "-u", "-m", module], env) is None
    assert runner.zygote_for(["/usr/bin/env", "-m", module], env) is None
    assert runner.zygote_for([python, "-m", module], {**env, "PYTHONPATH": "/elsewhere"}) is None
    monkeypatch.setenv(ZYGOTE_ENV, "0")
    assert runner.zygote_for([python, "-m", module], env) is None


if __name__ == "__main__":
    child_main()
