"""The file backend: its directory, shared or not, and its size bounds as SGLang reads them."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.fleet.storage_config import FILE_DEFAULT_DIR
from hicache_operator.plan.sizing.memory import LOOSE_SIZE, UNIT_POWER
from hicache_operator.plan.validation.findings import Finding, finding


def check_file_storage(spec: HiCacheDeploymentSpec) -> list[Finding]:
    """The file backend's directory, read as both engines read it: extraConfig file_storage_path,
    else /tmp/hicache (the pod's own emptyDir); and its size bounds."""
    extra = spec.hicache.storage.extra_config
    if "storage_dir" in extra:
        return [finding("file-storage-dir-key")]
    out = check_file_sizes(spec)
    path = str(extra.get("file_storage_path") or FILE_DEFAULT_DIR).rstrip("/")
    mounts = [str(m.get("mountPath", "")).rstrip("/") for m in spec.extra_volume_mounts if isinstance(m, dict)]
    if not any(m and (path == m or path.startswith(m + "/")) for m in mounts):
        out.append(finding("file-storage-not-shared", path=path))
    return out


# The file backend's size bounds: extraConfig key, else env var (both engines read them alike).
FILE_SIZE_SETTINGS = {"max_size": "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE",
                      "min_free_space": "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"}
# SGLang's human_readable_int (utils/common.py), which its file backend reads them with.
SI_SIZE = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
IEC_SIZE = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
SGLANG_SIZE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")


def check_file_sizes(spec: HiCacheDeploymentSpec) -> list[Finding]:
    """Each size bound SGLang would read as something other than what was written: a string it cannot
    read (it logs a line and runs unbounded), a negative size (unbounded) or a boolean (1 byte)."""
    extra, env = spec.hicache.storage.extra_config, {e.name: e.value for e in spec.env if e.value is not None}
    out = []
    for key, var in FILE_SIZE_SETTINGS.items():
        where, value = ((f"hicache.storage.extraConfig.{key}", extra[key]) if extra.get(key) is not None else
                        (f"env {var}", env.get(var)))
        problem = file_size_problem(value)
        if problem is not None:
            out.append(finding("file-backend-size", where=where, value=value, problem=problem[0], fix=problem[1]))
    return out


NOT_READ = "is not a size SGLang reads, so it would run with no bound (logging one line)"


def file_size_problem(value: Any) -> tuple[str, str] | None:
    """(what SGLang makes of ``value``, what to write instead), or None when it reads what was written."""
    if isinstance(value, bool):
        return "is a boolean, which SGLang reads as 1 byte", "a size, e.g. '200G', or 0 for no bound"
    if value is None or isinstance(value, (int, float)):
        size = value or 0
    elif (text := str(value).strip()) in ("", "0"):
        size = 0
    elif m := SGLANG_SIZE.fullmatch(text):
        if "." in m.group(1) and m.group(2) in IEC_SIZE:
            return NOT_READ, _file_size_fix(text)
        size = (int(m.group(1)) * IEC_SIZE[m.group(2)] if m.group(2) in IEC_SIZE else
                int(Decimal(m.group(1)) * SI_SIZE[m.group(2)]))
    else:
        try:
            size = int(text)
        except ValueError:
            return NOT_READ, _file_size_fix(text)
    if size < 0:
        return "is negative, which SGLang reads as no bound", "a size, e.g. '200G', or 0 for no bound"
    return None


def _file_size_fix(text: str) -> str:
    m = LOOSE_SIZE.fullmatch(text)
    if not m:
        return "bytes, e.g. 200000000000, or '200G' (200 x 10^9 bytes) or '200Gi' (200 x 2^30 bytes)"
    number, unit = m.group(1), m.group(2).lower()
    power = UNIT_POWER[unit]
    si = f"{number}{'k' if unit == 'k' else unit.upper()}"
    iec_bytes = int(Decimal(number) * 1024**power)
    iec = (f"'{number}{unit.upper()}i' ({iec_bytes} bytes)" if "." not in number else
           f"{iec_bytes} ({number} x 2^{10 * power} bytes)")
    return f"'{si}' ({int(Decimal(number) * 1000**power)} bytes) or {iec}, whichever was meant"
