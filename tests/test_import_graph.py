"""The package's import graph: no circles among corl_jax modules, and the core never imports the demo world at
module level (it names demo data sources and checkpoints by string, through corl_jax.registry)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "corl_jax"
DEMO = "corl_jax.demo"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, name: str, *, module_level: bool) -> set[str]:
    """corl_jax modules imported by the module at `path` (only top-level statements when `module_level`)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level else list(ast.walk(tree))
    if module_level:  # statements under a top-level `if`/`try` still run at import time
        nodes = [n for top in tree.body for n in ast.walk(top)
                 if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "corl_jax" or m.startswith("corl_jax.")}


def _graph(*, module_level: bool) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imported(path, name, module_level=module_level) if m in modules and m != name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (a package's import of its own submodules excepted), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if node.startswith(target + "."):  # a submodule naming its package: the package is already loading
                continue
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_at_module_level():
    assert _cycle(_graph(module_level=True)) is None, " -> ".join(_cycle(_graph(module_level=True)))


def test_no_import_cycle_counting_function_level_imports():
    assert _cycle(_graph(module_level=False)) is None, " -> ".join(_cycle(_graph(module_level=False)))


def test_core_does_not_import_the_demo_world_at_module_level():
    offenders = {name: sorted(m for m in imports if m == DEMO or m.startswith(DEMO + "."))
                 for name, imports in _graph(module_level=True).items()
                 if not (name == DEMO or name.startswith(DEMO + "."))}
    assert not {k: v for k, v in offenders.items() if v}, offenders
