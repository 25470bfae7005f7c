"""Print attnsel's module import graph and exit 1 if it has a cycle (issue 13: "the import graph has no cycle").

Reads every module's `import` / `from ... import` statements with ast (function-level imports included: a lazy
import is still a dependency), resolves relative imports, and keeps edges between attnsel modules only.
Usage: python scripts/import_cycles.py [--graph]
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "attnsel"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def edges() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (ROOT / PKG).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in modules:  # `from pkg import name`: name may be a module or an attribute
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):  # a package's own __init__ is not a cycle
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def main() -> int:
    graph = edges()
    if "--graph" in sys.argv:
        for mod in sorted(graph):
            print(f"{mod} -> {', '.join(sorted(graph[mod])) or '-'}")
    cycle = find_cycle(graph)
    if cycle:
        print("import cycle: " + " -> ".join(cycle))
        return 1
    print(f"no import cycle among {len(graph)} attnsel modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
