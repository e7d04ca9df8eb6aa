"""The ctypes side of the CPU kernels against the C++ declarations it is read from: every function
api.cpp exports is bound with the types it declares, every Python call passes each of its
parameters, each export forwards the signature of the op table in common.h, and the structures
passed by pointer have common.h's fields. A signature changed on one side only fails here."""

from __future__ import annotations

import ast
import ctypes
import re

import pytest

from cache_runtime import cpu_kernels
from cache_runtime.cpu_kernels import abi

_INIT = abi.HERE / "__init__.py"


def _norm(t: str) -> str:
    return " ".join(t.replace("hc::", "").replace("*", " * ").split())


def test_every_export_of_api_cpp_is_read():
    raw = (abi.HERE / "api.cpp").read_text()
    block = raw[raw.index('extern "C" {'):]
    named = set(re.findall(r"\b(hc_\w+)\(", block))
    assert len(named) >= 10 and set(abi.functions()) == named


def test_each_export_forwards_the_op_tables_signature():
    table = re.search(r"struct Ops \{(.*?)\};", abi._source("common.h"), re.S).group(1)
    ops = {m.group(1): [_norm(abi._split_param(p)[0]) for p in m.group(2).split(",")]
           for m in re.finditer(r"\(\*(\w+)\)\(([^)]*)\)", table)}
    assert {"linear", "decode_attention", "add_rms_norm", "silu_mul", "rope_store", "decode_stack"} <= set(ops)
    for op, params in ops.items():
        _, exported = abi.functions()["hc_" + op]
        assert [_norm(t) for t, _ in exported] == params, op


def test_python_calls_pass_every_declared_parameter():
    calls = {}
    for node in ast.walk(ast.parse(_INIT.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("hc_"):
            calls.setdefault(node.func.attr, []).append(len(node.args))
    declared = abi.functions()
    assert {"hc_linear", "hc_decode_attention", "hc_rope_store", "hc_decode_stack"} <= set(calls)
    for name, counts in calls.items():
        assert name in declared, f"{name} is called but api.cpp does not export it"
        assert set(counts) == {len(declared[name][1])}, f"{name}: called with {counts} arguments"


def test_structures_have_the_headers_fields():
    for struct in (cpu_kernels.DecoderLayer, cpu_kernels.DecoderShape):
        assert [(f, t) for f, t in struct._fields_] == [(f, abi.ctype(t)) for t, f in abi.struct_fields(struct.__name__)]
    assert [f for f, _ in cpu_kernels.DecoderShape._fields_][-4:] == ["eps", "scale", "dt", "kv_dt"]
    assert ctypes.sizeof(cpu_kernels.DecoderLayer) == 14 * ctypes.sizeof(ctypes.c_void_p)


def test_dtype_codes_are_the_headers():
    assert abi.dtype_codes() == {"F32": 0, "F16": 1, "BF16": 2}


def test_an_unknown_c_type_is_refused_not_guessed():
    with pytest.raises(ValueError, match="double"):
        abi.ctype("double")
    assert abi.ctype("const char*") is ctypes.c_char_p and abi.ctype("const int64_t*") is ctypes.c_void_p


@pytest.mark.skipif(cpu_kernels._loaded is None, reason="the CPU kernel library is not built or does not run here")
def test_the_loaded_library_is_bound_as_declared():
    for name, (ret, params) in abi.functions().items():
        fn = getattr(cpu_kernels._loaded, name)
        assert fn.argtypes == [abi.ctype(t) for t, _ in params], name
        assert fn.restype == abi.ctype(ret), name
