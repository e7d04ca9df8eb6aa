"""The local clusters' stand-in for `python -m sglang.launch_server` refuses what the real SGLang
release of the pod ($HICACHE_ENGINE_VERSION) refuses, with SGLang's own message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from localcluster.cluster import SGLANG_SHIM
from testbed import REPO


def launch(version: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SGLANG_SHIM}{os.pathsep}{REPO}", "HICACHE_ENGINE_VERSION": version}
    # --port 1: were the arguments accepted, the runtime would fail to bind rather than serve
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", "org/m", "--host",
                           "127.0.0.1", "--port", "1", *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("version,args,why", [
    ("0.5.23", ["--hicache-mem-layout", "sideways"], "invalid choice: 'sideways'"),
    ("0.5.9", ["--tp-size", "4", "--attn-dp-size", "2"], "unrecognized arguments: --attn-dp-size 2"),
    ("0.5.23", ["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
])
def test_a_flag_real_sglang_refuses_ends_the_pod_with_its_message(version, args, why):
    proc = launch(version, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"sglang shim: real SGLang {version} refuses these arguments" in proc.stderr
    assert why in proc.stderr


def test_an_unknown_release_is_refused_too():
    proc = launch("0.4.0")
    assert proc.returncode == 2 and "sglang 0.4.0 is not installed" in proc.stderr
