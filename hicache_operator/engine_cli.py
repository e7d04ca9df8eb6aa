"""The flags each engine's parser knows, and ``spec.extraArgs`` read against them and the flag table.

``engine_cli.json`` is generated from the parsers themselves (``python -m tests.support.engine_cli``:
the bundled runtime's, and SGLang's for every release in ``engine_versions.ORACLE_VERSIONS``; a unit
test keeps it current). A release between the checked ones is read against all of them; one newer
than the newest checked is not read for unknown flags. Both parsers are argparse with abbreviations
allowed, so a unique prefix names its flag.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from hicache_operator import engine_versions, flags

TABLE_PATH = Path(__file__).with_name("engine_cli.json")


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
