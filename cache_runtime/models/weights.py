"""Tensors of a Hugging Face safetensors checkpoint, read one at a time from memory-mapped files.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) layouts. Each
tensor is checked for presence, shape and a loadable dtype before it is converted, so a bad
checkpoint fails at start with one message naming the file and the tensor. Every tensor is
copied out of the mapping, and the files are closed after loading: only the copies stay resident.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from cache_runtime.models.config import CheckpointError

# safetensors dtype names the runtime converts from
LOADABLE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointWeights:
    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.dir / INDEX
        if index.exists():
            self._read_index(index)
        elif (self.dir / SINGLE).exists():
            self._add_file(self.dir / SINGLE)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                other = [p.name for p in self.dir.glob("*.bin")] + [p.name for p in self.dir.glob("*.pt")]
                hint = f" (found {', '.join(other)}: convert the checkpoint to safetensors)" if other else ""
                raise CheckpointError(f"{self.dir}: no {SINGLE}, {INDEX} or *.safetensors file{hint}")
            for f in files:
                self._add_file(f)

    def _read_index(self, index: Path) -> None:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable: {exc}") from None
        for name, shard in weight_map.items():
            path = self.dir / str(shard)
            if not path.exists():
                raise CheckpointError(f"{path}: missing shard (listed in {index.name} for tensor {name})")
            self._where[name] = path
        for path in set(self._where.values()):
            self._open(path)

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
            self._handles[path] = handle
        return handle

    def _add_file(self, path: Path) -> None:
        for name in self._open(path).keys():
            self._where.setdefault(name, path)

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        return self._open(path).get_slice(name)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """``name`` checked against ``shape`` (the full tensor's), converted to ``dtype`` on ``device``.

        ``rows``/``cols`` read only that range of dim 0 / dim 1 (tensor-parallel shards).
        """
        sl = self._slice(name)
        path = self._where[name]
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(got)}, expected {list(shape)} from config.json")
        src = sl.get_dtype()
        if src not in LOADABLE:
            raise CheckpointError(f"{path}: tensor {name} has dtype {src}; the bundled runtime loads "
                                  f"{', '.join(LOADABLE)} only")
        if rows is not None and cols is not None:
            t = sl[rows[0]:rows[1], cols[0]:cols[1]]
        elif rows is not None:
            t = sl[rows[0]:rows[1]]
        elif cols is not None:
            t = sl[:, cols[0]:cols[1]]
        else:
            t = sl[:]
        # a copy even when the dtype already matches: a tensor read from the file is a view of its
        # mapping, which would keep the file resident next to the fused copies made from it
        return t.to(device=device, dtype=dtype, copy=True).contiguous()

    def close(self) -> None:
        self._handles.clear()
