"""The runtime's shape: the engine package's import directions (HTTP over the engine, the loop over the scheduler and
the runner, the TP transport over the runner alone), so no cycle can form between them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3] / "cache_runtime"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("cache_runtime")}


@pytest.mark.parametrize("module,forbidden", [
    ("cache_runtime.engine.runner", ("cache_runtime.engine.", "cache_runtime.server")),
    ("cache_runtime.engine.tp", ("cache_runtime.engine.loop", "cache_runtime.engine.scheduler",
                                 "cache_runtime.engine.storage_admin", "cache_runtime.hicache", "cache_runtime.server")),
    ("cache_runtime.engine.scheduler", ("cache_runtime.engine.loop", "cache_runtime.engine.runner",
                                        "cache_runtime.engine.tp", "cache_runtime.server")),
    ("cache_runtime.engine.requests", ("cache_runtime.engine.", "cache_runtime.server")),
    ("cache_runtime.engine.storage_admin", ("cache_runtime.engine.loop", "cache_runtime.engine.tp",
                                            "cache_runtime.server")),
    ("cache_runtime.engine.loop", ("cache_runtime.server",)),
    ("cache_runtime.hicache", ("cache_runtime.engine", "cache_runtime.server")),
])
def test_engine_import_directions(module, forbidden):
    imported = _imports(_modules()[module])
    allowed = {"cache_runtime.engine.runner"} if module == "cache_runtime.engine.tp" else set()
    bad = sorted(m for m in imported - allowed if m.startswith(forbidden))
    assert not bad, f"{module} imports {bad}"


def test_the_tp_transport_runs_the_runner():
    assert "cache_runtime.engine.runner" in _imports(_modules()["cache_runtime.engine.tp"])
