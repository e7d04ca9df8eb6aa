"""The flags each engine's parser knows, and ``spec.extraArgs`` read against them and the flag table.

``cli.json`` is generated from the parsers themselves (``python -m testbed.engine_cli``:
the bundled runtime's, and SGLang's for every release in ``engine_versions.ORACLE_VERSIONS``; a unit
test keeps it current). A release between the checked ones is read against all of them; one newer
than the newest checked is not read for unknown flags. Both parsers are argparse with abbreviations
allowed, so a unique prefix names its flag.

Beside the flags' names, ``REFUSED_ARGS`` lists the extra flags (and values) SGLang accepts by name
but that break a pod the operator renders: SGLang's own resolution raises beside
``--enable-hierarchical-cache``, or the flag spreads the pod's ranks over other nodes or GPUs than
the pod has. ``ENGINE_ENV`` lists the env vars the engines read that override an operator-owned
setting. ``tests/unit/sglang/test_refused_args.py`` runs SGLang's resolution on a rendered command
with each of them (and with harmless ones) for every oracle release and checks both tables agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from hicache_operator.plan.engine import versions as engine_versions
from hicache_operator.api import flags

TABLE_PATH = Path(__file__).with_name("cli.json")


@lru_cache(maxsize=1)
def _table() -> dict:
    return json.loads(TABLE_PATH.read_text())


def known_flags(engine: str, version: str | None) -> list[tuple[str, ...]] | None:
    """Each flag the engine knows with its aliases; None when it cannot be told (an unchecked release)."""
    releases = _table()["sglang"]
    if engine == "bundled":
        return _lines(_table()["bundled"])
    if version in releases:
        return _lines(releases[version])
    if version is None or engine_versions.newer_than_checked(version):
        return None
    return _every_flag(engine)


def _every_flag(engine: str) -> list[tuple[str, ...]]:
    """Every flag any checked release of the engine knows, aliases of one flag across releases joined."""
    table = _table()
    lines = table["bundled"] if engine == "bundled" else [x for r in table["sglang"].values() for x in r]
    joined: list[set[str]] = []
    for line in lines:
        options = set(line.split())
        for other in [j for j in joined if j & options]:
            options |= other
            joined.remove(other)
        joined.append(options)
    return sorted(tuple(sorted(j)) for j in joined)


def _lines(lines: Iterable[str]) -> list[tuple[str, ...]]:
    return [tuple(line.split()) for line in sorted(lines)]


def _resolve(option: str, known: list[tuple[str, ...]]) -> tuple[str, ...] | list[str]:
    """The flag ``option`` names (its alias group), or the flags it abbreviates when that is not one."""
    exact = [g for g in known if option in g]
    if exact:
        return exact[0]
    prefixed = sorted({o for g in known for o in g if o.startswith(option)})
    groups = {g for g in known if any(o in prefixed for o in g)}
    return next(iter(groups)) if len(groups) == 1 else prefixed


@dataclass(frozen=True)
class Refusal:
    flag: str  # SGLang's option string
    why: str  # what happens with it, after "extraArgs <flag> <value>"
    keeps: tuple[str, ...] = ()  # values that change nothing; a flag taking no value is refused whenever given
    # Releases before this one accept the flag and ignore it (refused all the same: it does nothing).
    ignored_before: str | None = None


_HICACHE = "beside --enable-hierarchical-cache, which every pod runs, SGLang refuses it at start"
_ONE_NODE = "each pod is one node holding its tp x pp GPUs"
REFUSED_ARGS: tuple[Refusal, ...] = (
    # kv_cache_hook.py / hicache_hook.py (0.5.2x), server_args.py _handle_hicache (0.5.9)
    Refusal("--disable-radix-cache", _HICACHE + " (HiCache is a radix cache)"),
    # 0.5.9 managers/scheduler.py:699-714: HiCache is chosen before LMCache, which is then ignored.
    Refusal("--enable-lmcache", _HICACHE, ignored_before="0.5.21"),
    Refusal("--enable-unified-cache-external-linker", _HICACHE),
    Refusal("--dcp-size", "splits the KV cache across ranks, which SGLang's HiCache refuses at start for MHA "
            "models and with an L3 backend (which the operator may attach at any time)", ("1",)),
    Refusal("--nnodes", "spreads the pod's ranks over several nodes: the pod would wait forever for the "
            f"others ({_ONE_NODE}); raise parallelism.tp or replicas instead", ("1",)),
    Refusal("--node-rank", f"makes the pod a later node of a multi-node server ({_ONE_NODE})", ("0",)),
    Refusal("--dist-init-addr", f"points the ranks' rendezvous away from the pod ({_ONE_NODE})"),
    Refusal("--base-gpu-id", "moves the ranks onto GPUs the pod does not have (it sees exactly its tp x pp, "
            "from 0)", ("0",)),
    Refusal("--gpu-id-step", "spaces the ranks onto GPUs the pod does not have (it sees exactly its tp x pp, "
            "from 0)", ("1",)),
)

# Env vars an engine reads that override a setting the operator owns (status would name another).
ENGINE_ENV = {
    "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "moves the file backend's directory away from "
    "hicache.storage.extraConfig.file_storage_path (both engines read it first), so status would name a "
    "directory L3 is not in: set file_storage_path instead",
}


def values(extra_args: list[str], engine: str, version: str | None) -> list[tuple[str, tuple[str, ...], str | None]]:
    """Each option of ``extra_args``: (as written, the flag it names with its aliases, its value or None)."""
    known = known_flags(engine, version) or _every_flag(engine)
    out = []
    for i, arg in enumerate(extra_args):
        if not arg.startswith("-") or arg == "-" or _number(arg):
            continue
        option, eq, value = arg.partition("=")
        if not eq:
            nxt = extra_args[i + 1] if i + 1 < len(extra_args) else None
            value = nxt if nxt is not None and (not nxt.startswith("-") or _number(nxt)) else None
        found = _resolve(option, known)
        out.append((option, found if isinstance(found, tuple) else (option,), value))
    return out


def refused(extra_args: list[str], engine: str, version: str | None) -> list[tuple[str, str]]:
    """(the option as written with its value, why) for each ``REFUSED_ARGS`` use in ``extra_args``."""
    if engine != "sglang":
        return []
    by_flag = {r.flag: r for r in REFUSED_ARGS}
    out = []
    for option, names, value in values(extra_args, engine, version):
        r = next((by_flag[n] for n in names if n in by_flag), None)
        if r is not None and (not r.keeps or value not in r.keeps):
            out.append((option if value is None or not r.keeps else f"{option} {value}", r.why))
    return out


def check(extra_args: list[str], engine: str, version: str | None) -> list[tuple[str, str]]:
    """Problems of ``extra_args``: ("owned" or "unknown", the flag, why)."""
    strict = known_flags(engine, version)
    known = strict if strict is not None else _every_flag(engine)
    owned = flags.owned_flags(engine)
    release = ("the bundled runtime" if engine == "bundled" else f"SGLang {version}" if version in _table()["sglang"]
               else f"any SGLang release the operator was checked against ({', '.join(_table()['sglang'])})")
    out: list[tuple[str, str]] = []
    for arg in extra_args:
        if not arg.startswith("-") or arg == "-" or _number(arg):
            continue
        option = arg.split("=", 1)[0]
        found = _resolve(option, known)
        if isinstance(found, list) and strict is not None:
            why = (f"{release} does not know it" if not found else
                   f"it abbreviates several flags of {release} ({', '.join(found[:5])})")
            out.append(("unknown", option, why))
            continue
        names = (option,) if isinstance(found, list) else found
        field = next((owned[n] for n in names if n in owned), None)
        if field is not None:
            out.append(("owned", option, field))
    return out


def _number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True
