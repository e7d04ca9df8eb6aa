"""Tensors of a Hugging Face safetensors checkpoint, read one at a time into their own memory.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) layouts. Each
tensor is checked for presence, shape and a loadable dtype before it is read, so a bad checkpoint
fails at start with one message naming the file and the tensor. Tensors are read with ``pread``
straight into the buffer that keeps them (no memory mapping): the file's pages stay in the page
cache, which is not the process's memory, so loading peaks at the weights plus one tensor.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from cache_runtime.models.config import CheckpointError

# safetensors dtype names the runtime converts from
LOADABLE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class _File:
    """One safetensors file: its header, and reads of byte ranges of its data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
        try:
            size = os.fstat(self.fd).st_size
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(os.pread(self.fd, n, 8))
            header.pop("__metadata__", None)
            self.data_start = 8 + n
            self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
            for name, info in header.items():
                begin, end = info["data_offsets"]
                if not 0 <= begin <= end <= size - self.data_start:
                    raise ValueError(f"tensor {name}: data_offsets {[begin, end]} lie outside the file")
                self.tensors[name] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]), begin, end)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            os.close(self.fd)
            raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None

    def read(self, out: torch.Tensor, offset: int) -> None:
        """Fills the contiguous ``out`` with the bytes at ``offset`` of the tensor data."""
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], self.data_start + offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: file ends inside tensor data (offset {offset + done})")
            done += got

    def close(self) -> None:
        os.close(self.fd)


class CheckpointWeights:
    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self._where: dict[str, Path] = {}
        self._files: dict[Path, _File] = {}
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

    def _open(self, path: Path) -> _File:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = _File(path)
        return f

    def _add_file(self, path: Path) -> None:
        for name in self._open(path).tensors:
            self._where.setdefault(name, path)

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _info(self, name: str) -> tuple[_File, tuple[str, tuple[int, ...], int, int]]:
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        f = self._open(path)
        info = f.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{path}: tensor {name} is missing from the file")
        return f, info

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name)[1][1]

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """``name`` checked against ``shape`` (the full tensor's), converted to ``dtype`` on ``device``.

        ``rows``/``cols`` read only that range of dim 0 / dim 1 (tensor-parallel shards).
        """
        f, (src, got, begin, end) = self._info(name)
        path = f.path
        if got != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(got)}, expected {list(shape)} from config.json")
        if src not in LOADABLE:
            raise CheckpointError(f"{path}: tensor {name} has dtype {src}; the bundled runtime loads "
                                  f"{', '.join(LOADABLE)} only")
        stored = LOADABLE[src]
        item = torch.empty((), dtype=stored).element_size()
        numel = 1
        for d in got:
            numel *= d
        if end - begin != numel * item:
            raise CheckpointError(f"{path}: tensor {name} holds {end - begin} bytes, its shape and dtype need "
                                  f"{numel * item}")
        row_bytes = (numel // got[0]) * item if got else item
        r0, r1 = rows if rows is not None else (0, got[0] if got else 1)
        t = torch.empty((r1 - r0, *got[1:]), dtype=stored)
        f.read(t, begin + r0 * row_bytes)  # rows are contiguous in the file: one read
        if cols is not None:
            t = t[:, cols[0]:cols[1]]
        if not got:
            t = t.reshape(())
        if t.dtype == dtype and device.type == "cpu" and t.is_contiguous():
            return t
        return t.to(device=device, dtype=dtype).contiguous()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
