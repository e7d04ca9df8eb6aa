"""``file`` L3 backend: one file per page in a directory, shared with SGLang's ``HiCacheFile``.

File name, SGLang's own:
``<key>_<model with '/' -> '-'>[_<tp_rank>_<tp_size> unless MLA][_<pp_size>_<pp_rank> if pp>1].bin``,
so several models and ranks share one directory and SGLang and this runtime find each other's
pages. Directory, in SGLang's order: env ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``,
else extra_config ``file_storage_path``, else ``/tmp/hicache``. Page bytes are in host-layout order and
the name does not say which layout, dtype or page size wrote them: the operator gives both engines a
``file_storage_path`` ending in the page-format namespace (``hicache_operator/fleet/storage_config.py``),
so pods of another format look in another directory.

What a page file may hold, and how a read decides (the caller states the page size it expects,
as a target tensor or ``target_sizes``):

- exactly the page bytes: how SGLang writes. Served when the file size equals the expected size,
  which only a whole page reaches: SGLang 0.5.21 and later publish a page by renaming a complete
  temp file, 0.5.9 writes it in place, front to back. Its content cannot be checked further
  (SGLang's format has no checksum): a flipped bit in such a page is served, the documented limit
  (counted as ``bare_page_hits``).
- the page bytes plus this runtime's 16-byte trailer (``page_trailer.py``: length + CRC-32):
  served when the trailer's length is the expected size and the CRC matches. SGLang reads these
  files too: it reads exactly the page size from offset 0 and never looks at the trailer.
- anything else (short, torn, another page size, a trailer whose CRC fails): a miss. Without a
  stated size, only a trailer-verified page is served, since a bare file's size is its only check.

A page that fails its check is reported and left alone: it may be SGLang's, or another engine's
page of another shape under the same name, and a damaged page of ours cannot be told from those,
so no read or write deletes or replaces an existing file. Writes skip a key whose file exists
(SGLang does the same) and publish a complete temp file with ``os.link``, which fails rather than
replacing a page another engine published meanwhile; only on a filesystem without hard links does
it fall back to SGLang's check-then-rename. A crashed writer leaves only a temp file. Files are
deleted only by the optional size cap (``file_eviction.py``) and by ``clear()``, which act on this
model/rank's file names whoever wrote them, as SGLang's evictor and clear do.
"""

from __future__ import annotations

import errno
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
DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
EXTRA_CONFIG_KEYS = {"file_storage_path", "max_size", "min_free_space", "eviction_ratio"}
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS}  # what link(2) says on filesystems without them


def config_suffix(config: HiCacheStorageConfig) -> str:
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    suffix = f"_{model}"
    if not config.is_mla_model:
        suffix += f"_{config.tp_rank}_{config.tp_size}"
    if config.pp_size > 1:
        suffix += f"_{config.pp_size}_{config.pp_rank}"
    return suffix


def _read_exact(fd: int, buf: memoryview) -> bool:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], got)
        if n <= 0:
            return False
        got += n
    return True


def _publish(tmp: str, path: str) -> bool:
    """Give the finished temp file the page's name unless a file already has it; False if one does."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
    if os.path.lexists(path):
        return False
    os.replace(tmp, path)
    return True


class HiCacheFile(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, file_path: str = DEFAULT_DIR) -> None:
        extra = storage_config.extra_config or {}
        self.file_path = os.environ.get(DIR_ENV) or extra.get("file_storage_path") or file_path
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

    def _reject(self, name: str, why: str) -> None:
        log.warning("file backend: page %s is not usable (%s); treating it as a miss", name, why)
        self._count("unusable_pages")

    # -- reads ---------------------------------------------------------------------------------

    def _read(self, key: str, target_location, target_sizes) -> torch.Tensor | None:
        name = self._name(key)
        target = None if target_location is None else as_byte_view(target_location, "target_location")
        expected = target.numel() if target is not None else None if target_sizes is None else int(target_sizes)
        try:
            fd = os.open(os.path.join(self.file_path, name), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("file backend: cannot open %s: %s", name, exc)
            return None
        try:
            size = os.fstat(fd).st_size
            if expected is not None and size == expected:  # a bare page, as SGLang writes them
                trailer = None
                length = size
            else:
                trailer = os.pread(fd, page_trailer.TRAILER_SIZE, max(0, size - page_trailer.TRAILER_SIZE))
                length = page_trailer.payload_length(trailer, size)
                if not length or (expected is not None and length != expected):
                    self._reject(name, f"{size} bytes, no valid trailer and no page size stated" if expected is None
                                 else f"{size} bytes, expected {expected} (or {expected + page_trailer.TRAILER_SIZE} "
                                 "with this runtime's trailer)")
                    return None
            out = target if target is not None else torch.empty(length, dtype=torch.uint8)
            buf = memoryview(out.numpy())
            if not _read_exact(fd, buf):
                self._reject(name, "short read")
                return None
            if trailer is not None and not page_trailer.verify(trailer, name, buf):
                self._reject(name, "checksum mismatch")
                return None
        except OSError as exc:
            log.warning("file backend: cannot read %s: %s", name, exc)
            return None
        finally:
            os.close(fd)
        self._count("hits" if trailer is not None else "bare_page_hits")
        self._evictor.touch(name, size)
        return out if target_location is None else target_location

    def get(self, key, target_location=None, target_sizes=None):
        self._ensure_dir()
        value = self._read(key, target_location, target_sizes)
        if value is None:
            self._count("misses")
        return value

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        check_same_length(keys, target_locations, "target_locations")
        check_same_length(keys, target_sizes, "target_sizes")
        self._ensure_dir()
        out = []
        for i, key in enumerate(keys):
            value = self._read(key, None if target_locations is None else target_locations[i],
                               None if target_sizes is None else target_sizes[i])
            if value is None:
                self._count("misses")
            out.append(value)
        return out

    def _plausible(self, name: str) -> bool:
        """A file is there that a read may serve: a bare page (only a read knows the size it needs), or
        one of ours whose trailer matches the file size."""
        try:
            fd = os.open(os.path.join(self.file_path, name), os.O_RDONLY)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            trailer = os.pread(fd, page_trailer.TRAILER_SIZE, max(0, size - page_trailer.TRAILER_SIZE))
        except OSError:
            return False
        finally:
            os.close(fd)
        return size > 0 and (not page_trailer.has_magic(trailer) or bool(page_trailer.payload_length(trailer, size)))

    def exists(self, key) -> bool:
        self._ensure_dir()
        return self._plausible(self._name(key))

    def batch_exists(self, keys, extra_info=None) -> int:
        self._ensure_dir()
        for i, key in enumerate(keys):
            if not self._plausible(self._name(key)):
                return i
        return len(keys)

    # -- writes --------------------------------------------------------------------------------

    def _skip_existing(self, name: str) -> bool:
        """True if a file already has the page's name: as SGLang, the key counts as stored and is not rewritten."""
        try:
            size = os.stat(os.path.join(self.file_path, name)).st_size
        except OSError:
            return False
        self._evictor.touch(name, size)
        self._count("writes_skipped_existing")
        return True

    def _write(self, key: str, value) -> bool:
        name = self._name(key)
        data = as_byte_view(value, "value")
        if data.numel() == 0:
            raise ValueError(f"refusing to store an empty page under {key!r}")
        if self._skip_existing(name):
            return True
        if not self._evictor.reserve(name, data.numel() + page_trailer.TRAILER_SIZE):
            self._count("writes_refused_by_cap")
            return False
        path = os.path.join(self.file_path, name)
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}"
        try:
            payload = memoryview(data.numpy())
            with open(tmp, "wb") as f:
                f.write(payload)
                f.write(page_trailer.make_trailer(name, payload))
            published = _publish(tmp, path)
        except OSError as exc:
            log.warning("file backend: cannot write %s: %s", name, exc)
            self._evictor.abort(name)
            self._count("write_failures")
            return False
        finally:
            try:
                os.remove(tmp)
            except OSError:
                pass
        if not published:  # another writer published this key first: its page stays
            self._evictor.abort(name)
            return self._skip_existing(name)
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
        stats.update(backend="file", degraded=False, file_storage_path=self.file_path,
                     evictions=self._evictor.evictions)
        if self._evictor.enabled:
            stats.update(bytes_used=self._evictor.total_bytes, max_size=self._evictor.max_bytes)
        return stats
