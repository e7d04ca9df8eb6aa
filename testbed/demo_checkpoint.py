"""The demo checkpoint the benchmarks serve by default, and the weight bytes a decode step reads."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from testbed import REPO

# The demo checkpoint (python -m cache_runtime.synth --preset demo): random weights, Llama-3 KV geometry,
# ~247 M parameters in bf16. Written on first use; the synth CLI leaves an up-to-date one alone.
# the embedded default checkpoint scripts/setup.sh writes (written here too when absent)
MODELS_DIR = Path(os.environ.get("HICACHE_MODELS_DIR") or Path.home() / ".cache" / "hicache-operator" / "models")
DEMO_CHECKPOINT = MODELS_DIR / "demo"
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


def ensure_demo_checkpoint(path: Path = DEMO_CHECKPOINT) -> Path:
    """The demo checkpoint at ``path``, written by the synth CLI if missing or stale (a no-op otherwise)."""
    subprocess.run([sys.executable, "-m", "cache_runtime.synth", "--preset", "demo", "--out", str(path)],
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, stdout=subprocess.DEVNULL)
    return path


def resolve_model_path(value: str | None) -> str:
    """``None`` or ``demo``: the demo checkpoint (written if absent); ``builtin:*`` or a directory as given."""
    if value in (None, "demo"):
        return str(ensure_demo_checkpoint())
    return value


def _safetensors_headers(model_dir: Path) -> dict[str, dict]:
    tensors: dict[str, dict] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        tensors.update(header)
    return tensors


def matmul_weight_bytes(model_dir: str | Path, dtype_bytes: int | None = None) -> dict:
    """Bytes of every matmul weight a decode step reads (2-D ``*.weight`` tensors, the LM head included;
    the input embedding is a row lookup, not read whole), at the checkpoint's dtype or ``dtype_bytes``."""
    tensors = _safetensors_headers(Path(model_dir))
    params = embed = 0
    stored = 0
    for name, t in tensors.items():
        if not name.endswith(".weight") or len(t["shape"]) != 2:
            continue
        numel = 1
        for d in t["shape"]:
            numel *= d
        if "embed_tokens" in name:
            embed += numel
            continue
        params += numel
        stored += numel * _DTYPE_BYTES[t["dtype"]]
    total = sum(_numel(t["shape"]) for t in tensors.values())
    return {"matmul_params": params, "embedding_params": embed, "total_params": total,
            "matmul_weight_bytes": params * dtype_bytes if dtype_bytes else stored}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
