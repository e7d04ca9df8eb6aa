"""The library's C ABI as ctypes sees it, read from the C++ sources instead of kept beside them.

``api.cpp``'s ``extern "C"`` block gives every exported function's parameter and return types
(``bind`` sets them on the loaded library), ``common.h`` the structures passed by pointer
(``struct_type``) and the dtype codes (``dtype_codes``). The sources ship with the package (their
digest already decides whether the built library is loaded), so a signature changed in C++ is the
signature ctypes uses; tests/unit/runtime/test_cpu_kernels_abi.py checks the Python call sites
against the same parse.
"""

from __future__ import annotations

import ctypes
import re
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent

# C scalar types of the ABI -> ctypes; any pointer is a c_void_p except ``const char*`` (strings)
_SCALARS = {"long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float, "void": None}


def _source(name: str) -> str:
    """A source file without its comments, which may hold anything, also parentheses."""
    return re.sub(r"//[^\n]*", "", (HERE / name).read_text())


def ctype(decl: str):
    """The ctypes type of one C type (``const void*``, ``long``, ``const hc::DecoderShape*``, ...)."""
    decl = " ".join(decl.replace("*", " * ").split())
    if decl.endswith("*"):
        return ctypes.c_char_p if decl.removeprefix("const ").startswith("char") and decl.count("*") == 1 \
            else ctypes.c_void_p
    base = decl.removeprefix("const ")
    if base not in _SCALARS:
        raise ValueError(f"C type {decl!r} has no ctypes mapping in cpu_kernels/abi.py")
    return _SCALARS[base]


def _split_param(param: str) -> tuple[str, str]:
    """``const int64_t* rows`` -> (``const int64_t*``, ``rows``)."""
    m = re.fullmatch(r"(.*?[\s*])(\w+)", param.strip())
    if m is None:
        raise ValueError(f"cannot read C parameter {param!r}")
    return m.group(1).strip(), m.group(2)


@cache
def functions() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Every function defined in api.cpp's extern "C" block: name -> (return type, [(type, name)])."""
    text = _source("api.cpp")
    block = text[text.index('extern "C" {'):]  # the block runs to the end of the file
    out = {}
    for m in re.finditer(r"^([A-Za-z_][\w:\s*]*?[\s*])(hc_\w+)\(([^)]*)\)\s*\{", block, re.M):
        ret, name, params = m.group(1).strip(), m.group(2), m.group(3).strip()
        out[name] = (ret, [_split_param(p) for p in params.split(",")] if params else [])
    return out


def bind(lib: ctypes.CDLL) -> None:
    """Sets every exported function's argtypes and restype on ``lib``."""
    for name, (ret, params) in functions().items():
        fn = getattr(lib, name)
        fn.argtypes = [ctype(t) for t, _ in params]
        fn.restype = ctype(ret)


@cache
def struct_fields(name: str) -> list[tuple[str, str]]:
    """The fields of ``struct name`` in common.h, in order: [(C type, field name)]."""
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", _source("common.h"), re.S)
    if m is None:
        raise ValueError(f"struct {name} not found in common.h")
    fields = []
    for stmt in m.group(1).split(";"):
        stmt = " ".join(stmt.split())
        if not stmt:
            continue
        first = re.fullmatch(r"((?:const\s+)?[\w:]+)\s*(.*)", stmt)
        base, declarators = first.group(1), first.group(2)
        for d in declarators.split(","):
            d = d.strip()
            stars = d.count("*")
            fields.append((base + "*" * stars, d.replace("*", "").strip()))
    return fields


def struct_type(name: str, doc: str) -> type[ctypes.Structure]:
    """A ctypes Structure laid out as ``struct name`` in common.h."""
    return type(name, (ctypes.Structure,), {"__doc__": doc,
                                            "_fields_": [(f, ctype(t)) for t, f in struct_fields(name)]})


@cache
def dtype_codes() -> dict[str, int]:
    """common.h's ``enum DType``: name -> code (F32, F16, BF16)."""
    m = re.search(r"enum\s+DType\s*:\s*int\s*\{([^}]*)\}", _source("common.h"))
    if m is None:
        raise ValueError("enum DType not found in common.h")
    return {k.strip(): int(v) for k, v in (item.split("=") for item in m.group(1).split(",") if item.strip())}
