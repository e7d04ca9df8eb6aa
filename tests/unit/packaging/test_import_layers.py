"""The project's import structure: the operator in layers, and no import cycle anywhere.

The operator's packages form a stack; a module imports only from its own layer and those below:

    api -> fleet -> plan -> io -> rollout -> control -> tools      (then ``__main__`` on top)

``router_gate`` runs alone in the router pod and imports nothing of the operator. Every import
counts, also one inside a function: a deferred import that closes a cycle is still a cycle. And no
module of the shipped or shared packages is over ``MAX_LINES`` unless the first paragraph of its
docstring says why it must be one unit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
OPERATOR = "hicache_operator"
LAYERS = ("api", "fleet", "plan", "io", "rollout", "control", "tools")
TOP = {f"{OPERATOR}.__main__"}
ALONE = {f"{OPERATOR}.router_gate"}
MAX_LINES = 450
SIZED = (OPERATOR, "cache_runtime", "kernels", "localcluster", "testbed")
SKIP_DIRS = {".venv", ".venv-sglang", ".git", "build", "node_modules", "__pycache__", ".hypothesis"}


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the project's packages (a top-level folder with ``__init__.py``), by dotted name."""
    found: dict[str, Path] = {}
    for top in sorted(root.iterdir()):
        if top.name in SKIP_DIRS or not (top / "__init__.py").is_file():
            continue
        for path in top.rglob("*.py"):
            rel = path.relative_to(root)
            if SKIP_DIRS & set(rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` (module ``name``) imports: ``from a import b`` names module
    ``a.b`` when that is a module, else ``a``."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imported(path, name, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int | None:
    """The operator layer ``module`` belongs to; None outside the layers."""
    parts = module.split(".")
    if parts[0] != OPERATOR or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(edges.items()):
        if not module.startswith(OPERATOR + ".") and module != OPERATOR:
            continue
        own = [t for t in targets if t.split(".")[0] == OPERATOR and t != OPERATOR]
        if module in ALONE:
            bad += [f"{module} -> {t}: it runs alone in the router pod" for t in own]
            continue
        if module in TOP or module == OPERATOR:
            continue
        mine = layer_of(module)
        if mine is None:
            bad.append(f"{module}: not in a layer ({', '.join(LAYERS)})")
            continue
        for target in own:
            theirs = layer_of(target)
            if theirs is None and target not in ALONE:
                bad.append(f"{module} -> {target}: not in a layer")
            elif theirs is not None and theirs > mine:
                bad.append(f"{module} ({LAYERS[mine]}) -> {target} ({LAYERS[theirs]}): imports a layer above it")
    return bad


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return graph(project_modules())


def test_every_operator_module_sits_in_a_layer_and_imports_only_below(edges):
    assert sum(1 for m in edges if m.startswith(OPERATOR + ".")) > 40, "the operator's modules were not found"
    assert layer_violations(edges) == []


def test_no_import_cycle_in_the_project(edges):
    assert {m.split(".")[0] for m in edges} >= {OPERATOR, "cache_runtime", "kernels", "localcluster", "testbed", "tests"}
    assert cycles(edges) == []


def test_no_module_over_the_line_limit_without_saying_why():
    over = []
    for name, path in project_modules().items():
        if name.split(".")[0] not in SIZED:
            continue
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > MAX_LINES and "one unit" not in doc.split("\n\n")[0]:
            over.append(f"{name}: {text.count(chr(10))} lines")
    assert over == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    _write(tmp_path, {
        f"{OPERATOR}/__init__.py": "",
        f"{OPERATOR}/api/__init__.py": "",
        f"{OPERATOR}/api/spec.py": "def f():\n    from hicache_operator.plan import render\n",
        f"{OPERATOR}/plan/__init__.py": "",
        f"{OPERATOR}/plan/render.py": "from ..api.spec import f\n",
        f"{OPERATOR}/router_gate.py": "from hicache_operator.api import spec\n",
    })
    found = graph(project_modules(tmp_path))
    assert found[f"{OPERATOR}.plan.render"] == {f"{OPERATOR}.api.spec"}
    assert cycles(found) == [[f"{OPERATOR}.api.spec", f"{OPERATOR}.plan.render"]]
    assert layer_violations(found) == [
        f"{OPERATOR}.api.spec (api) -> {OPERATOR}.plan.render (plan): imports a layer above it",
        f"{OPERATOR}.router_gate -> {OPERATOR}.api.spec: it runs alone in the router pod"]
