"""Optional size cap for the file backend, with SGLang's knobs and LRU order.

SGLang (``LRUFileEvictor``): ``max_size`` (bytes cap), ``min_free_space`` (keep this much free
on the filesystem) and ``eviction_ratio`` (when over the cap, evict down to cap*ratio so the
next writes do not each trigger an eviction), from extra_config, else
``SGLANG_HICACHE_FILE_BACKEND_{MAX_SIZE,MIN_FREE_SPACE,EVICTION_RATIO}``. Unconfigured, it is
inert and storage is unbounded. Only this rank's files (its key suffix) are tracked or evicted.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from decimal import Decimal

log = logging.getLogger(__name__)

# SGLang's human_readable_int (utils/common.py): suffixes are case-sensitive; SI ones take decimals.
_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")


def _human_readable_int(text: str) -> int | None:
    m = _SIZE.fullmatch(text)
    if m:
        number, suffix = m.groups()
        if suffix in _IEC:
            return None if "." in number else int(number) * _IEC[suffix]
        return int(Decimal(number) * _SI[suffix])
    try:
        return int(text)
    except ValueError:
        return None


def parse_size(value, what: str) -> int:
    """Bytes as SGLang's file backend reads a size (``lru_file_evictor._parse_size_to_bytes``): a
    number as is; a string of bytes, or SI ('200G' = 200e9, '1.5G') or IEC ('200Gi' = 200 x 2**30)
    suffixed, case-sensitive. Negative, unset, '0' and unreadable (e.g. '200g', '10K', '1.5Gi') are
    0: no bound, as in SGLang (the operator refuses the unreadable ones at apply time)."""
    if value is None:
        return 0
    if isinstance(value, (int, float)):
        return max(0, int(value))
    text = str(value).strip()
    if not text or text == "0":
        return 0
    size = _human_readable_int(text)
    if size is None:
        log.warning("file backend: invalid size %r for %s; disabling it", value, what)
        return 0
    return max(0, size)


def _setting(extra: dict, key: str, env: str):
    value = extra.get(key)
    return os.environ.get(env) if value is None else value


class FileEvictor:
    def __init__(self, directory: str, suffix: str, extra_config: dict) -> None:
        self.directory = directory
        self.suffix = suffix  # "<suffix>.bin" marks this rank's files
        self.max_bytes = parse_size(_setting(extra_config, "max_size", "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"),
                                    "max_size")
        self.min_free_bytes = parse_size(
            _setting(extra_config, "min_free_space", "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"), "min_free_space")
        ratio = _setting(extra_config, "eviction_ratio", "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO")
        try:
            self.ratio = 0.9 if ratio is None else float(ratio)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"eviction_ratio must be a number in (0, 1], got {ratio!r}") from exc
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"eviction_ratio must be in (0, 1], got {ratio!r}")
        self.enabled = self.max_bytes > 0 or self.min_free_bytes > 0
        self._lru: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, oldest first
        self._pending: set[str] = set()  # reserved, not yet renamed into place
        self.total_bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()
        if self.enabled:
            self._scan()

    def _scan(self) -> None:
        entries = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(self.suffix + ".bin") and entry.is_file():
                st = entry.stat()
                entries.append((st.st_mtime, entry.name, st.st_size))
        for _, name, size in sorted(entries):
            self._lru[name] = size
            self.total_bytes += size
        with self._lock:
            self._evict_locked(0)

    def touch(self, name: str, size: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            if name in self._lru:
                self._lru.move_to_end(name)
            else:
                self._lru[name] = size
                self.total_bytes += size

    def reserve(self, name: str, size: int) -> bool:
        """Admit a new file of ``size`` bytes, evicting old ones; False if it cannot fit."""
        if not self.enabled:
            return True
        if self.max_bytes and size > self.max_bytes:
            return False
        with self._lock:
            if self.max_bytes and self.total_bytes + size > self.max_bytes:
                self._evict_locked(size)
                if self.total_bytes + size > self.max_bytes:
                    return False
            if self.min_free_bytes and not self._free_space_ok_locked(size):
                return False
            self.total_bytes -= self._lru.pop(name, 0)
            self._lru[name] = size
            self._pending.add(name)
            self.total_bytes += size
        return True

    def commit(self, name: str) -> None:
        with self._lock:
            self._pending.discard(name)

    def abort(self, name: str) -> None:
        with self._lock:
            self._pending.discard(name)
            self.total_bytes -= self._lru.pop(name, 0)

    def reset(self) -> None:
        with self._lock:
            self._lru.clear()
            self._pending.clear()
            self.total_bytes = 0

    def _free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _free_space_ok_locked(self, size: int) -> bool:
        free = self._free_bytes()
        if free is None:
            return True  # cannot tell: let the write itself fail if the disk is full
        while free - size < self.min_free_bytes and self._evict_one_locked():
            free = self._free_bytes() or 0
        return free - size >= self.min_free_bytes

    def _evict_locked(self, incoming: int) -> None:
        if not self.max_bytes:
            return
        target = max(0, int(self.max_bytes * self.ratio) - incoming)
        while self.total_bytes > target and self._evict_one_locked():
            pass

    def _evict_one_locked(self) -> bool:
        victim = next((n for n in self._lru if n not in self._pending), None)
        if victim is None:
            return False
        size = self._lru.pop(victim)
        try:
            os.remove(os.path.join(self.directory, victim))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("file backend: cannot evict %s: %s", victim, exc)
            self._lru[victim] = size
            self._lru.move_to_end(victim, last=False)
            return False
        self.total_bytes -= size
        self.evictions += 1
        return True
