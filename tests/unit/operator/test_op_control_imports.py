"""The operator's modules import without a cycle, TYPE_CHECKING imports included: the controller,
its pipeline and what reports failures each get what they need passed in, and none reaches back
up to the module that drives it."""

from __future__ import annotations

import ast
from pathlib import Path

import hicache_operator

PACKAGE = Path(hicache_operator.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(n for n in names if n in modules and n != here)
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None
    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def graph_of(root: Path) -> dict[str, set[str]]:
    paths = {module_name(p): p for p in root.rglob("*.py")}
    modules = set(paths)
    # a package's __init__ importing its own modules is how a package is made, not a cycle
    return {name: {m for m in imports(path, modules) if not (path.name == "__init__.py" and m.startswith(name + "."))}
            for name, path in paths.items()}


def test_the_operator_imports_no_cycle():
    assert cycle(graph_of(PACKAGE)) is None


def test_the_check_finds_a_cycle(tmp_path):
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    failures = PACKAGE / "control" / "failures.py"
    assert "hicache_operator.control.informers" in imports(failures, set(graph_of(PACKAGE)))
