"""A checkpoint the runtime cannot serve stops the process at start: non-zero exit, and the last
line it writes names the file and the field or tensor (what a pod's termination message shows)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testbed.checkpoints import DEFECTS, write_bad_checkpoint

# what the one line must name, per defect (besides the file)
EXPECT = {
    "unsupported-architecture": ("config.json", "Gemma2ForCausalLM"),
    "missing-shard": ("missing shard", "model.safetensors.index.json", "for tensor model."),
    "missing-tensor": ("model.layers.1.self_attn.k_proj.weight", "missing"),
    "misshaped-tensor": ("model.layers.1.self_attn.k_proj.weight", "shape"),
    "unknown-dtype": ("config.json", "float8_e4m3fn"),
    "unusable-tensor-dtype": ("model.layers.1.self_attn.k_proj.weight", "F8_E4M3"),
    "missing-tokenizer": ("tokenizer.json", "missing"),
    "bad-config-json": ("config.json", "unreadable"),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_bad_checkpoint_exits_with_one_line_naming_the_problem(tmp_path, defect):
    path = write_bad_checkpoint(tmp_path, defect)
    proc = subprocess.run([sys.executable, "-m", "cache_runtime", "serve", "--model-path", str(path),
                           "--port", "0", "--max-total-tokens", "256"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    last = lines[-1]
    assert last.startswith("error: "), proc.stderr[-2000:]
    assert str(path) in last
    for word in EXPECT[defect]:
        assert word in last, last
    assert "Traceback" not in proc.stderr
