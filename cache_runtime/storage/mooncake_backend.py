"""``mooncake`` L3 backend on the real ``mooncake.store.MooncakeDistributedStore``.

Object keys are SGLang's ``MooncakeStore`` keys, so both engines share one store: every key starts
with ``[<extra_backend_tag>_]<model with '/' -> '-'>_`` (parts that are unset are left out), then
the page hash, then the rank part. MHA pages are two objects, ``..._{tp_rank}_k`` and
``..._{tp_rank}_v`` (with PP ``..._{tp_rank}_{pp_rank}_k|v``), the first and second half of the
page bytes (SGLang's zero-copy K and V regions of a host page); MLA pages are one object
``{hash}__k`` (an empty rank part; with PP ``{hash}_{pp_rank}_k``).

Checksums: with every page it stores, this runtime puts one more object, ``..._{rank part}_crc``:
``page_trailer``'s 16 bytes (length + CRC-32 of the whole page, K then V, seeded with the page's
``_k`` key). A read fetches it with the page in the same batch call; a page whose check object is
there but does not match (a flipped bit, a truncated or foreign object, halves from two writers)
is a miss. SGLang never reads or writes these objects (it reads only ``_k`` / ``_v`` and wipes
them with the rest), so it still reads this runtime's pages. Its own pages have no check object,
nor has a page whose check object the store evicted: those are served unverified (counted as
``unverified_hits``), since a missing check object cannot be told from an SGLang page. Only a page
this runtime wrote whole is given one, never a page whose halves another writer stored.

Data moves with Mooncake's zero-copy batch calls (``batch_put_from`` / ``batch_get_into``).
Memory must be registered with the store for that: the engine registers its L2 pool once with
:meth:`register_buffer` (as SGLang does); any other tensor is registered for the duration of
the call (a few microseconds on TCP).

Availability (measured on mooncake 0.3.13 by tests/integration/reliability/test_rel_mooncake_faults.py): with the master gone,
every store call blocks ~4.3 s, ``close()`` blocks ~13 s with the GIL held, and ``setup()``
blocks ~4.5 s per retry. So we (a) poll the master's RPC port before ``setup``, (b) ask the
client's own ``health_check()`` (local, instant; it turns "unreachable" within ~1-2 s of the
master dying) before each call, and treat an RPC_FAIL result the same way: both raise
:class:`StorageUnavailable` and mark the backend degraded. While degraded every call raises at
once, except that at most every ``retry_interval_s`` one call probes again (master port open and
``health_check() == 0``). Reconnection itself is Mooncake's: its client keeps pinging the master
and re-mounts its segment when a master comes back (about 1 s after it listens), so the same
client object is reused; pages stored before the restart are gone with the old master's
metadata and read as misses.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import threading
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager

import torch

from cache_runtime.storage import page_trailer
from cache_runtime.storage.base import (HiCacheStorage, HiCacheStorageConfig, StorageUnavailable, as_byte_view,
                                        check_same_length, values_from)
from cache_runtime.storage.endpoints import any_open, wait_for_port
from cache_runtime.storage.mooncake_config import load_mooncake_config

log = logging.getLogger(__name__)

RPC_FAIL = -900  # mooncake ErrorCode::RPC_FAIL: the master did not answer
OBJECT_NOT_FOUND = -704  # mooncake ErrorCode::OBJECT_NOT_FOUND
_WARMUP_BYTES = 4096
_PROBE_KEY = "hicache_probe"


def key_prefix(extra_backend_tag, model_name: str | None) -> str | None:
    """SGLang's ``config_prefix``: the tag and the model name ('/' -> '-'), joined by '_'; None if neither is set."""
    parts = [] if extra_backend_tag is None else [str(extra_backend_tag)]
    if model_name:
        parts.append("-".join(model_name.split("/")))
    return "_".join(parts) or None


def _merged_ranges(parts: list[torch.Tensor]) -> list[tuple[int, int]]:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in parts if t.numel())
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


class MooncakeStore(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = load_mooncake_config(extra)
        try:
            master_wait_s = float(extra.get("master_wait_s", 5.0))
            self.retry_interval_s = float(extra.get("retry_interval_s", 1.0))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"mooncake backend: master_wait_s / retry_interval_s must be numbers: {exc}") from exc
        self._prefix = key_prefix(extra.get("extra_backend_tag"), storage_config.model_name)
        self._mla = storage_config.is_mla_model
        if storage_config.pp_size > 1:
            self._rank_part = (f"{storage_config.pp_rank}" if self._mla
                               else f"{storage_config.tp_rank}_{storage_config.pp_rank}")
        else:
            self._rank_part = "" if self._mla else f"{storage_config.tp_rank}"

        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ValueError("mooncake backend needs the mooncake package "
                             "(scripts/install-mooncake.sh installs mooncake-transfer-engine-non-cuda)") from exc

        if not wait_for_port(self.config.endpoints, master_wait_s):
            raise StorageUnavailable(f"mooncake master {self.config.master_server_address} "
                                     f"not reachable within {master_wait_s:.1f}s (config from {self.config.source})")
        if self.config.check_server:
            self._wait_for_segments(self.config.endpoints[0][0], master_wait_s)

        # One setup attempt (~4.5 s) instead of Mooncake's default 20 (~90 s) when the master vanishes
        # between our port check and setup; an operator can still raise it in the pod env.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        store = MooncakeDistributedStore()
        segment = self.config.global_segment_size // max(1, storage_config.tp_size * storage_config.pp_size)
        rc = store.setup(self.config.local_hostname, self.config.metadata_server, segment,
                         self.config.local_buffer_size, self.config.protocol,
                         self._device_for(storage_config.tp_rank), self.config.master_server_address)
        if rc != 0:
            raise StorageUnavailable(f"mooncake setup against {self.config.master_server_address} failed (rc={rc})")
        self._store = store
        self._registered: list[tuple[int, int]] = []
        self._temp_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._degraded_reason: str | None = None
        self._last_probe = 0.0
        self._closed = False
        self._stats: Counter[str] = Counter()
        self._warmup()
        self._segment_name = store.get_hostname()  # "<local_hostname>:<port>", as the master lists it
        log.info("mooncake backend ready: master=%s segment=%s (config from %s)",
                 self.config.master_server_address, self._segment_name, self.config.source)

    # -- setup helpers -------------------------------------------------------------------------

    def _device_for(self, tp_rank: int) -> str:
        """``device_name`` may be a JSON map of tp_rank -> RDMA device (SGLang)."""
        name = self.config.device_name
        if not name.strip().startswith("{"):
            return name
        try:
            mapping = json.loads(name)
        except json.JSONDecodeError as exc:
            raise ValueError(f"mooncake device_name looks like JSON but does not parse: {exc}") from exc
        return str(mapping.get(str(tp_rank), ""))

    def _wait_for_segments(self, host: str, deadline_s: float) -> None:
        """``check_server``: wait (bounded) until the master lists at least one memory segment."""
        url = f"http://{host}:{self.config.master_metrics_port}/get_all_segments"
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.read().strip():
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise StorageUnavailable(f"mooncake master at {url} lists no segments after {deadline_s:.1f}s")

    def _warmup(self) -> None:
        """One real put/get/remove, so a backend that constructs is one that works."""
        key = f"hicache_warmup_{os.getpid()}_{id(self)}"
        value = bytes(range(256)) * (_WARMUP_BYTES // 256)
        ok = self._store.put(key, value) == 0 and self._store.get(key) == value
        self._store.remove(key, True)
        if not ok:
            self._abandon()
            raise StorageUnavailable(f"mooncake warmup put/get failed against {self.config.master_server_address}")

    # -- availability ------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._degraded_reason is not None

    def _mark_degraded(self, reason: str) -> StorageUnavailable:
        with self._state_lock:
            if self._degraded_reason is None:
                log.warning("mooncake backend unavailable: %s", reason)
                self._stats["degraded_events"] += 1
            self._degraded_reason = reason
            self._last_probe = time.monotonic()
        return StorageUnavailable(f"mooncake master {self.config.master_server_address}: {reason}")

    def _guard(self) -> None:
        """Raise StorageUnavailable at once unless the master is believed reachable."""
        if self._closed:
            raise StorageUnavailable("mooncake backend is closed")
        if self._degraded_reason is None:
            if self._store.health_check() != 0:
                raise self._mark_degraded("client health check reports the master unreachable")
            return
        with self._state_lock:
            if time.monotonic() - self._last_probe < self.retry_interval_s:
                raise StorageUnavailable(f"mooncake master {self.config.master_server_address}: "
                                         f"{self._degraded_reason}")
            self._last_probe = time.monotonic()
        # The RPC also flushes pooled connections to a dead master, which each fail once with RPC_FAIL.
        if (not any_open(self.config.endpoints) or self._store.health_check() != 0
                or self._store.batch_is_exist([_PROBE_KEY])[0] == RPC_FAIL):
            raise StorageUnavailable(f"mooncake master {self.config.master_server_address}: still unreachable")
        with self._state_lock:
            self._degraded_reason = None
        log.warning("mooncake backend: master %s reachable again", self.config.master_server_address)

    def _check_rpc(self, results: list[int]) -> None:
        if any(r == RPC_FAIL for r in results):
            raise self._mark_degraded("store call failed with RPC_FAIL")

    # -- keys and memory --------------------------------------------------------------------------

    def _object_keys(self, key: str) -> list[str]:
        if not isinstance(key, str) or not key:
            raise ValueError(f"invalid storage key {key!r}")
        base = key if self._prefix is None else f"{self._prefix}_{key}"
        if self._mla:
            return [f"{base}_{self._rank_part}_k"]
        return [f"{base}_{self._rank_part}_k", f"{base}_{self._rank_part}_v"]

    @staticmethod
    def _check_key(object_keys: list[str]) -> str:
        """The check object of the page whose data objects are ``object_keys`` (``..._k`` first)."""
        return object_keys[0][: -len("_k")] + "_crc"

    def _split(self, page: torch.Tensor, key: str) -> list[torch.Tensor]:
        if self._mla:
            return [page]
        n = page.numel()
        if n == 0 or n % 2:
            raise ValueError(f"MHA page for {key!r} must have an even, non-zero byte count (K then V), got {n}")
        return [page[: n // 2], page[n // 2 :]]

    def register_buffer(self, tensor: torch.Tensor) -> None:
        view = as_byte_view(tensor, "buffer")
        start = view.data_ptr()
        rc = self._store.register_buffer(start, view.numel())
        if rc != 0:
            raise ValueError(f"mooncake register_buffer failed (rc={rc}); overlapping an already registered buffer?")
        self._registered.append((start, start + view.numel()))

    def _is_registered(self, part: torch.Tensor) -> bool:
        start, end = part.data_ptr(), part.data_ptr() + part.numel()
        return any(s <= start and end <= e for s, e in self._registered)

    @contextmanager
    def _memory_for(self, parts: list[torch.Tensor]):
        """Register for this call whatever the engine did not register up front. Yields False if that fails."""
        ranges = _merged_ranges([p for p in parts if not self._is_registered(p)])
        if not ranges:
            yield True
            return
        with self._temp_lock:
            done = []
            try:
                for start, end in ranges:
                    if self._store.register_buffer(start, end - start) != 0:
                        log.warning("mooncake: cannot register a %d-byte buffer for this call", end - start)
                        yield False
                        return
                    done.append(start)
                yield True
            finally:
                for start in done:
                    self._store.unregister_buffer(start)

    # -- reads ---------------------------------------------------------------------------------------

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        check_same_length(keys, target_locations, "target_locations")
        check_same_length(keys, target_sizes, "target_sizes")
        self._guard()
        obj_keys = [self._object_keys(k) for k in keys]
        if target_locations is not None:
            pages = [as_byte_view(t, "target_location") for t in target_locations]
        else:
            pages = []
            for i, ks in enumerate(obj_keys):
                if target_sizes is not None:
                    size = int(target_sizes[i])
                else:
                    sizes = [self._store.get_size(k) for k in ks]
                    self._check_rpc(sizes)
                    size = sum(sizes) if all(s > 0 for s in sizes) and len(set(sizes)) == 1 else 0
                pages.append(torch.empty(size, dtype=torch.uint8))
        ok = [p.numel() > 0 and (self._mla or p.numel() % 2 == 0) for p in pages]
        wanted = [i for i in range(len(keys)) if ok[i]]
        checks = torch.empty((len(wanted), page_trailer.TRAILER_SIZE), dtype=torch.uint8)
        flat_keys, parts, owner = [], [], []
        for i in wanted:
            for k, part in zip(obj_keys[i], self._split(pages[i], keys[i])):
                flat_keys.append(k)
                parts.append(part)
                owner.append(i)
        for row, i in enumerate(wanted):
            flat_keys.append(self._check_key(obj_keys[i]))
            parts.append(checks[row])
        check_size = [OBJECT_NOT_FOUND] * len(keys)
        if flat_keys:
            with self._memory_for(parts) as usable:
                results = (self._store.batch_get_into(flat_keys, [p.data_ptr() for p in parts],
                                                      [p.numel() for p in parts])
                           if usable else [-1] * len(parts))
            self._check_rpc(results)
            for i, r, part in zip(owner, results, parts):
                if r != part.numel():  # missing (<0) or a stored object of another size
                    ok[i] = False
            for i, r in zip(wanted, results[len(owner):]):
                check_size[i] = r
        for row, i in enumerate(wanted):
            if ok[i] and not self._verified(keys[i], obj_keys[i], pages[i], checks[row], check_size[i]):
                ok[i] = False
        out = []
        for i, page in enumerate(pages):
            self._stats["hits" if ok[i] else "misses"] += 1
            out.append((page if target_locations is None else target_locations[i]) if ok[i] else None)
        return out

    def _verified(self, key: str, object_keys: list[str], page: torch.Tensor, check: torch.Tensor,
                  check_size: int) -> bool:
        """Whether a page read whole may be served: its check object matches, or it has none."""
        if check_size == OBJECT_NOT_FOUND:  # none stored: SGLang's page, or the check object was evicted
            self._stats["unverified_hits"] += 1
            return True
        trailer = check.numpy().tobytes()
        if check_size == page_trailer.TRAILER_SIZE and page_trailer.verify(trailer, object_keys[0],
                                                                             memoryview(page.numpy())):
            return True
        log.warning("mooncake backend: page %s fails its checksum; treating it as a miss", key)
        self._stats["unusable_pages"] += 1
        return False

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], None if target_location is None else [target_location],
                              None if target_sizes is None else [target_sizes])[0]

    def _exist_flags(self, keys: list[str]) -> list[list[int]]:
        obj_keys = [self._object_keys(k) for k in keys]
        flat = [k for ks in obj_keys for k in ks]
        results = list(self._store.batch_is_exist(flat)) if flat else []
        self._check_rpc(results)
        per = 1 if self._mla else 2
        return [results[i * per : (i + 1) * per] for i in range(len(keys))]

    def batch_exists(self, keys, extra_info=None) -> int:
        self._guard()
        for i, flags in enumerate(self._exist_flags(list(keys))):
            if not all(f == 1 for f in flags):
                return i
        return len(keys)

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    # -- writes --------------------------------------------------------------------------------------

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Puts only the objects not in the store yet, as SGLang does: an existing object (a whole page, or
        the surviving half of one, whoever wrote it) is never replaced, and ``batch_put_from`` itself
        leaves an object that another writer put meanwhile as it is. A page none of whose data objects
        (nor a check object) is there yet also gets its check object."""
        tensors = values_from(keys, values, target_locations)
        pages = [as_byte_view(t, "value") for t in tensors]
        split = [self._split(p, k) for p, k in zip(pages, keys)]
        self._guard()
        obj_keys = [self._object_keys(k) for k in keys]
        check_keys = [self._check_key(ks) for ks in obj_keys]
        flat = [k for ks in obj_keys for k in ks]
        found = list(self._store.batch_is_exist(flat + check_keys)) if flat else []
        self._check_rpc(found)
        per = len(obj_keys[0]) if obj_keys else 1
        flags = [found[i * per : (i + 1) * per] for i in range(len(keys))]
        put_keys, parts, check_keys_put, check_rows = [], [], [], []
        for i, (ks, page_parts, page_flags) in enumerate(zip(obj_keys, split, flags)):
            for k, part, flag in zip(ks, page_parts, page_flags):
                if flag != 1:
                    put_keys.append(k)
                    parts.append(part)
            if all(f != 1 for f in page_flags) and found[len(flat) + i] != 1:
                check_keys_put.append(check_keys[i])
                check_rows.append(page_trailer.make_trailer(ks[0], memoryview(pages[i].numpy())))
        if check_rows:
            checks = torch.frombuffer(bytearray(b"".join(check_rows)), dtype=torch.uint8)
            put_keys += check_keys_put
            parts += list(checks.view(len(check_rows), page_trailer.TRAILER_SIZE))
        self._stats["writes_skipped_existing"] += sum(all(f == 1 for f in fl) for fl in flags)
        if not put_keys:
            return True
        with self._memory_for(parts) as usable:
            results = (self._store.batch_put_from(put_keys, [p.data_ptr() for p in parts],
                                                  [p.numel() for p in parts])
                       if usable else [-1] * len(parts))
        self._check_rpc(results)
        data = len(put_keys) - len(check_rows)
        failed = sum(1 for r in results[:data] if r != 0)
        self._stats["write_failures"] += failed
        self._stats["writes"] += data - failed
        # a check object that did not land leaves its page unverified, not wrong: the page still counts
        self._stats["check_write_failures"] += sum(1 for r in results[data:] if r != 0)
        return failed == 0

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        tensor = value if value is not None else target_location
        if tensor is None:
            raise ValueError("set needs value or target_location")
        return self.batch_set([key], [tensor])

    # -- admin -----------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this model's and rank's page objects (this prefix and rank part); SGLang wipes the whole store."""
        self._guard()
        prefix = "" if self._prefix is None else re.escape(self._prefix) + "_"
        halves = "(k|crc)" if self._mla else "(k|v|crc)"
        removed = self._store.remove_by_regex(f"^{prefix}[0-9a-f]{{64}}_{re.escape(self._rank_part)}_{halves}$", True)
        self._check_rpc([removed])
        log.info("mooncake backend: cleared %s objects", removed)

    def get_stats(self) -> dict:
        stats = dict(self._stats)
        stats.update(backend="mooncake", degraded=self.degraded, degraded_reason=self._degraded_reason,
                     master=self.config.master_server_address, local_hostname=self.config.local_hostname,
                     segment_name=self._segment_name)
        return stats

    def _abandon(self) -> None:
        """Keep the client alive forever: destroying it while the master is gone blocks ~13 s with the GIL held."""
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._store))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.degraded or self._store.health_check() != 0 or not any_open(self.config.endpoints):
            log.warning("mooncake backend: master unreachable at close; leaving the client to process exit")
            self._abandon()
            return
        for start, _ in self._registered:
            self._store.unregister_buffer(start)
        self._registered.clear()
        self._store.close()
