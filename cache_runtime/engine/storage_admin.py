"""L3 attach, detach, status and clear: the one place the storage backend's lifecycle lives.

The command line's backend is attached at boot (``attach_at_boot``, before the engine thread
starts) exactly as ``PUT /hicache/storage-backend`` attaches one (``attach``): parse the
configuration, open every rank's backend off the engine thread, then install it on the engine
thread. Whatever touches the cache (the idle check, installing, detaching, policy changes) runs
as a closure on the engine thread (``Engine.call``), which owns the cache; only opening, closing
and clearing a backend, which may block on the network, run elsewhere. Detach never deletes L3
data. The texts are SGLang's, so clients of either engine read the same answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from cache_runtime.args import ServerArgs, parse_extra_config
from cache_runtime.engine.runner import ModelRunner
from cache_runtime.hicache import HiCache
from cache_runtime.policies import PREFETCH_POLICIES, WRITE_POLICIES, PrefetchConfig, check_policy
from cache_runtime.storage.base import HiCacheStorageConfig
from cache_runtime.storage.factory import create_storage_backend
from cache_runtime.storage_io import RankedStorage

log = logging.getLogger(__name__)

ATTACH_FAILED = "Failed to attach HiCache storage backend."


@dataclass(frozen=True)
class StorageAttach:
    """One L3 configuration to attach, from the command line or ``PUT /hicache/storage-backend``."""

    name: str
    extra_json: str | None
    prefetch_policy: str
    write_policy: str
    extra: dict
    backend_extra: dict  # without the prefetch knobs, which the engine keeps
    prefetch: PrefetchConfig

    @classmethod
    def parse(cls, name: str, extra_json: str | None, prefetch_policy: str, write_policy: str) -> "StorageAttach":
        """Raises ValueError naming what is wrong."""
        check_policy("hicache_write_policy", write_policy, WRITE_POLICIES)
        check_policy("hicache_storage_prefetch_policy", prefetch_policy, PREFETCH_POLICIES)
        extra = parse_extra_config(extra_json)
        prefetch, backend_extra = PrefetchConfig.from_extra_config(prefetch_policy, extra)
        return cls(name, extra_json, prefetch_policy, write_policy, extra, backend_extra, prefetch)


class StorageAdmin:
    """The L3 backend of one engine. ``engine`` is the ``Engine`` that owns ``cache`` (its ``call``
    runs closures on the engine thread); ``args`` keeps the configuration in force, which
    ``GET /hicache/storage-backend`` and ``/server_info`` report."""

    def __init__(self, args: ServerArgs, runner: ModelRunner, cache: HiCache, engine) -> None:
        self.args, self.runner, self.cache, self.engine = args, runner, cache, engine
        self.unavailable: str | None = None  # why the boot's backend could not be reached

    # ------------------------------------------------------------------ state (any thread)
    def degraded(self) -> str | None:
        """Why L3 is not in use although configured (unreachable at boot, or degraded since), else None."""
        storage = self.cache.storage
        return (storage.degraded if storage else None) or self.unavailable

    def status(self) -> dict:
        """``GET /hicache/storage-backend``."""
        cache = self.cache
        out = {
            "hicache_storage_backend": cache.storage_backend_name,
            "hicache_storage_backend_extra_config": (json.dumps(cache.storage_extra_config)
                                                     if cache.storage is not None else None),
            "hicache_storage_prefetch_policy": self.args.hicache_storage_prefetch_policy,
            "hicache_write_policy": cache.write_policy,
        }
        if self.args.compat_mode == "bundled":
            out["hicache_storage_degraded"] = self.degraded()
        return out

    # ------------------------------------------------------------------ boot
    def attach_at_boot(self) -> None:
        """The command line's L3 backend. A bad configuration fails the boot with its message; an
        L3 that cannot be reached leaves the server on L1+L2, saying why (``unavailable``)."""
        a = self.args
        want = StorageAttach.parse(a.hicache_storage_backend, a.hicache_storage_backend_extra_config,
                                   a.hicache_storage_prefetch_policy, a.hicache_write_policy)
        try:
            backend = self.open(want)
        except ValueError:
            raise
        except Exception as exc:
            self.unavailable = f"{type(exc).__name__}: {exc}"
            log.error("L3 backend %s unavailable at boot, running with L1+L2 only: %s",
                      a.hicache_storage_backend, self.unavailable)
            return
        self.install(want, backend)

    # ------------------------------------------------------------------ backends (off the engine thread)
    def open(self, want: StorageAttach) -> RankedStorage:
        """Every TP rank's L3 backend (its own keys), or one for MLA, whose latent every rank shares."""
        ranks = 1 if self.runner.cfg.is_mla else self.args.tp_size
        backends = []
        try:
            for r in range(ranks):
                backends.append(create_storage_backend(want.name, self.storage_config(want.backend_extra, r)))
        except BaseException:
            for b in backends:
                b.close()
            raise
        return RankedStorage(backends, self.runner.host_pools)

    def storage_config(self, backend_extra: dict, tp_rank: int = 0) -> HiCacheStorageConfig:
        a = self.args
        return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=a.tp_size, pp_rank=0, pp_size=a.pp_size,
                                    is_mla_model=self.runner.cfg.is_mla,
                                    is_page_first_layout=a.hicache_mem_layout != "layer_first",
                                    model_name=a.served_name, extra_config=backend_extra)

    # ------------------------------------------------------------------ engine thread (or before it starts)
    def install(self, want: StorageAttach, backend: RankedStorage) -> None:
        """Attaches an opened backend and keeps the configuration it runs."""
        self.cache.attach_storage(want.name, backend, want.prefetch, want.extra)
        self.unavailable = None
        self.args.hicache_storage_backend, self.args.hicache_storage_backend_extra_config = want.name, want.extra_json
        self.set_policies(want)

    def set_policies(self, want: StorageAttach) -> None:
        """The write and prefetch policies of ``want`` (an attach of the backend already attached
        changes only these)."""
        self.cache.write_policy, self.cache.prefetch = want.write_policy, want.prefetch
        a = self.args
        a.hicache_storage_prefetch_policy, a.hicache_write_policy = want.prefetch_policy, want.write_policy

    def _not_idle(self, what: str) -> str:
        return (f"Reject {what}: scheduler is not idle. #queue-req={self.engine.num_queued} "
                f"#running-req={self.engine.num_running}")

    # ------------------------------------------------------------------ HTTP (the server's event loop)
    async def _on_engine(self, fn):
        return await asyncio.wrap_future(self.engine.call(fn))

    async def attach(self, name: str, extra_json: str | None, prefetch_policy: str | None,
                     write_policy: str | None) -> tuple[bool, str]:
        """``PUT /hicache/storage-backend``: (attached, SGLang's answer text)."""
        try:
            want = StorageAttach.parse(name, extra_json, prefetch_policy or self.args.hicache_storage_prefetch_policy,
                                       write_policy or self.cache.write_policy)
        except ValueError as exc:
            return False, f"{ATTACH_FAILED}\n{exc}\n"
        cache = self.cache

        def precheck():
            if cache.host is None:
                return "HiCache storage needs --enable-hierarchical-cache (no host pool on this server)."
            if not self.engine.is_idle():
                return self._not_idle("attach")
            current = cache.storage_backend_name
            if current is not None and current != name:
                return (f"HiCache storage backend '{current}' is attached. Cannot attach different backend "
                        f"'{name}'. Detach first.")
            if current == name:  # same backend: only the policies change
                self.set_policies(want)
                return "same"
            return None

        verdict = await self._on_engine(precheck)
        if verdict == "same":
            return True, "HiCache storage backend already enabled with same backend; policies updated.\n"
        if verdict:
            return False, f"{ATTACH_FAILED}\n{verdict}\n"
        try:
            backend = await asyncio.to_thread(self.open, want)
        except Exception as exc:
            return False, f"{ATTACH_FAILED}\n{type(exc).__name__}: {exc}\n"

        def install():
            if cache.storage is not None:  # another attach won the race
                return f"HiCache storage backend '{cache.storage_backend_name}' is attached. Detach first."
            self.install(want, backend)
            return None

        refused = await self._on_engine(install)
        if refused:
            await asyncio.to_thread(backend.close)
            return False, f"{ATTACH_FAILED}\n{refused}\n"
        return True, "HiCache storage backend attached.\n"

    async def detach(self) -> tuple[bool, str]:
        """``DELETE /hicache/storage-backend``: stops L3 traffic once idle; never deletes L3 data."""
        def run():
            if not self.engine.is_idle():
                return self._not_idle("detach")
            self.cache.detach_storage()
            self.args.hicache_storage_backend = None
            self.args.hicache_storage_backend_extra_config = None
            self.unavailable = None
            return None

        refused = await self._on_engine(run)
        if refused:
            return False, f"Failed to detach HiCache storage backend.\n{refused}\n"
        return True, "HiCache storage backend detached.\n"

    async def clear(self) -> tuple[bool, str]:
        """``POST /hicache/storage-backend/clear``: deletes the attached backend's L3 data."""
        storage = self.cache.storage
        if storage is None:
            return False, "Failed to clear HiCache storage backend.\nNo storage backend attached.\n"
        try:
            await asyncio.to_thread(storage.ranks.clear)
        except Exception as exc:
            return False, f"Failed to clear HiCache storage backend.\n{type(exc).__name__}: {exc}\n"
        return True, "HiCache storage backend cleared.\n"
