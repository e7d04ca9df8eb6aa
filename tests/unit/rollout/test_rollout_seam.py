"""The rollout package's seam: the modules at its top level decide and import nothing that does
I/O (the Kubernetes client, HTTP, the acting half); ``act/`` does the I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import hicache_operator.rollout as rollout

IO = ("kubernetes", "httpx", "urllib3", "kopf", "hicache_operator.io.kube", "hicache_operator.rollout.act")
PACKAGE = Path(rollout.__file__).parent


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                base = ".".join(["hicache_operator", "rollout", *([base] if base else [])]) if node.level == 1 else base
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_the_deciding_modules_do_no_io():
    pure = [p for p in PACKAGE.glob("*.py")]
    assert {p.stem for p in pure} >= {"planner", "passes", "due", "state"}
    for path in pure:
        bad = sorted(m for m in imports(path) if any(m == io or m.startswith(io + ".") for io in IO))
        assert not bad, f"{path.name} imports {bad}: I/O belongs in rollout/act/"


def test_the_check_sees_an_io_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from .act.executor import Swapper\nimport httpx\n")
    assert {"hicache_operator.rollout.act.executor", "httpx"} <= imports(sample)
