"""``file`` L3 backend: one file per page in a directory (SGLang's ``HiCacheFile`` naming).

File name: ``<key>_<model with '/' -> '-'>[_<tp_rank>_<tp_size> unless MLA][_<pp_size>_<pp_rank> if pp>1].bin``
so several models and ranks can share one directory, and SGLang and this runtime find each
other's pages. Directory: extra_config ``storage_dir``, else ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``,
else ``/tmp/hicache``.

Writes go to a unique temp file that is renamed into place (``os.replace`` is atomic on POSIX),
so a reader sees either no page or a whole one, and a crashed writer leaves only a temp file.
Every page carries an integrity trailer (``page_trailer.py``); a page that fails it is deleted
and reported as a miss, so the next backup rewrites it.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import Counter

import torch

from cache_runtime.storage import page_trailer
from cache_runtime.storage.base import (
    HiCacheStorage,
    HiCacheStorageConfig,
    StorageUnavailable,
    as_byte_view,
    check_same_length,
    values_from,
)
from cache_runtime.storage.file_eviction import FileEvictor

log = logging.getLogger(__name__)

DEFAULT_DIR = "/tmp/hicache"
EXTRA_CONFIG_KEYS = {"storage_dir", "max_size", "min_free_space", "eviction_ratio"}


def config_suffix(config: HiCacheStorageConfig) -> str:
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    suffix = f"_{model}"
    if not config.is_mla_model:
        suffix += f"_{config.tp_rank}_{config.tp_size}"
    if config.pp_size > 1:
        suffix += f"_{config.pp_size}_{config.pp_rank}"
    return suffix


class HiCacheFile(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, file_path: str = DEFAULT_DIR) -> None:
        extra = storage_config.extra_config or {}
        self.file_path = (extra.get("storage_dir") or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
                          or file_path)
        self.suffix = config_suffix(storage_config)
        self._ensure_dir()
        self._evictor = FileEvictor(self.file_path, self.suffix, extra)
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()

    # -- helpers -----------------------------------------------------------------------------

    def _ensure_dir(self) -> None:
        try:
            os.makedirs(self.file_path, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(f"file backend: storage dir {self.file_path!r} is unusable: {exc}") from exc
        if not os.access(self.file_path, os.W_OK | os.X_OK):
            raise StorageUnavailable(f"file backend: storage dir {self.file_path!r} is not writable")

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[name] += n

    def _name(self, key: str) -> str:
        if not isinstance(key, str) or not key or "/" in key or "\0" in key:
            raise ValueError(f"invalid storage key {key!r}")
        return f"{key}{self.suffix}.bin"

    def _drop_corrupt(self, name: str, why: str) -> None:
        log.warning("file backend: page %s is damaged (%s); deleting it", name, why)
        self._count("corrupt")
        self._evictor.forget(name)
        try:
            os.remove(os.path.join(self.file_path, name))
        except OSError:
            pass

    # -- reads ---------------------------------------------------------------------------------

    def _read(self, key: str, target_location, target_sizes) -> torch.Tensor | None:
        name = self._name(key)
        target = None if target_location is None else as_byte_view(target_location, "target_location")
        try:
            fd = os.open(os.path.join(self.file_path, name), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("file backend: cannot open %s: %s", name, exc)
            return None
        try:
            size = os.fstat(fd).st_size
            trailer = os.pread(fd, page_trailer.TRAILER_SIZE, max(0, size - page_trailer.TRAILER_SIZE))
            length = page_trailer.payload_length(trailer, size)
            if not length:
                self._drop_corrupt(name, "bad trailer or length")
                return None
            expected = target.numel() if target is not None else target_sizes
            if expected is not None and int(expected) != length:
                log.warning("file backend: page %s holds %d bytes, caller expects %d", name, length, int(expected))
                return None
            out = target if target is not None else torch.empty(length, dtype=torch.uint8)
            buf = memoryview(out.numpy())
            got = 0
            while got < length:
                n = os.preadv(fd, [buf[got:]], got)
                if n <= 0:
                    break
                got += n
            if got != length:
                self._drop_corrupt(name, f"short read {got}/{length}")
                return None
            if not page_trailer.verify(trailer, name, buf):
                self._drop_corrupt(name, "checksum mismatch")
                return None
        except OSError as exc:
            log.warning("file backend: cannot read %s: %s", name, exc)
            return None
        finally:
            os.close(fd)
        self._evictor.touch(name, size)
        return out if target_location is None else target_location

    def get(self, key, target_location=None, target_sizes=None):
        self._ensure_dir()
        value = self._read(key, target_location, target_sizes)
        self._count("hits" if value is not None else "misses")
        return value

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        check_same_length(keys, target_locations, "target_locations")
        check_same_length(keys, target_sizes, "target_sizes")
        self._ensure_dir()
        out = []
        for i, key in enumerate(keys):
            value = self._read(key, None if target_locations is None else target_locations[i],
                               None if target_sizes is None else target_sizes[i])
            self._count("hits" if value is not None else "misses")
            out.append(value)
        return out

    def _valid(self, name: str) -> bool:
        try:
            fd = os.open(os.path.join(self.file_path, name), os.O_RDONLY)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            trailer = os.pread(fd, page_trailer.TRAILER_SIZE, max(0, size - page_trailer.TRAILER_SIZE))
            return bool(page_trailer.payload_length(trailer, size))
        except OSError:
            return False
        finally:
            os.close(fd)

    def exists(self, key) -> bool:
        self._ensure_dir()
        return self._valid(self._name(key))

    def batch_exists(self, keys, extra_info=None) -> int:
        self._ensure_dir()
        for i, key in enumerate(keys):
            if not self._valid(self._name(key)):
                return i
        return len(keys)

    # -- writes --------------------------------------------------------------------------------

    def _write(self, key: str, value) -> bool:
        name = self._name(key)
        data = as_byte_view(value, "value")
        if data.numel() == 0:
            raise ValueError(f"refusing to store an empty page under {key!r}")
        path = os.path.join(self.file_path, name)
        if self._valid(name):
            self._evictor.touch(name, data.numel() + page_trailer.TRAILER_SIZE)
            self._count("writes_skipped_existing")
            return True
        if not self._evictor.reserve(name, data.numel() + page_trailer.TRAILER_SIZE):
            self._count("writes_refused_by_cap")
            return False
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}"
        try:
            payload = memoryview(data.numpy())
            with open(tmp, "wb") as f:
                f.write(payload)
                f.write(page_trailer.make_trailer(name, payload))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("file backend: cannot write %s: %s", name, exc)
            self._evictor.abort(name)
            try:
                os.remove(tmp)
            except OSError:
                pass
            self._count("write_failures")
            return False
        self._evictor.commit(name)
        self._count("writes")
        return True

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        tensor = value if value is not None else target_location
        if tensor is None:
            raise ValueError("set needs value or target_location")
        self._ensure_dir()
        return self._write(key, tensor)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        tensors = values_from(keys, values, target_locations)
        self._ensure_dir()
        return all(self._write(key, tensor) for key, tensor in zip(keys, tensors))

    # -- admin ---------------------------------------------------------------------------------

    def clear(self) -> None:
        """Delete this model/rank's pages (and its writers' leftover temp files), nothing else in the dir."""
        mine = self.suffix + ".bin"
        removed = 0
        for entry in os.scandir(self.file_path):
            if entry.name.endswith(mine) or (mine + ".tmp.") in entry.name:
                try:
                    os.remove(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        self._evictor.reset()
        log.info("file backend: cleared %d files from %s", removed, self.file_path)

    def get_stats(self) -> dict:
        with self._stats_lock:
            stats = dict(self._stats)
        stats.update(backend="file", degraded=False, storage_dir=self.file_path, evictions=self._evictor.evictions)
        if self._evictor.enabled:
            stats.update(bytes_used=self._evictor.total_bytes, max_size=self._evictor.max_bytes)
        return stats
