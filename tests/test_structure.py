"""The house's shape, as the readable-house issue states it: no import loop between folders, no
function in src over 60 lines, a thin command line. These fail when a change breaks the shape."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvstreams"


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _folder(path: Path) -> str | None:
    """The package folder a file sits in (None for top-level modules)."""
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else None


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in ast.walk(node):
                if hasattr(child, "lineno"):
                    lines.add(child.lineno)
    return lines


def folder_imports() -> dict[str, set[str]]:
    """For each folder, the other folders its files import (lazy imports included; imports only for
    type checkers left out)."""
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    graph: dict[str, set[str]] = {f: set() for f in folders}
    for path, tree in _modules():
        here = _folder(path)
        if here is None:
            continue
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.lineno not in skip:
                names = [node.module]
            elif isinstance(node, ast.Import) and node.lineno not in skip:
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "kvstreams" and len(parts) > 1 and parts[1] in folders and parts[1] != here:
                    graph[here].add(parts[1])
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_loop_between_folders():
    assert _cycle(folder_imports()) is None, " -> ".join(_cycle(folder_imports()) or [])


def test_the_cycle_finder_finds_a_loop():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_function_in_src_is_over_60_lines():
    long = [
        f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, long


def test_the_command_line_is_thin():
    assert len((SRC / "cli.py").read_text().splitlines()) < 450


def test_scripts_and_examples_import_what_exists():
    """The scripts and examples are not imported by any test run: a moved module (kvstreams.train.loop
    became kvstreams.loop) broke `make gpu-check` silently once. Every name they import from kvstreams
    must exist."""
    import importlib

    missing = []
    for path in sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "examples").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvstreams"):
                try:
                    module = importlib.import_module(node.module)
                except ImportError:
                    missing.append(f"{path.name}: {node.module}")
                    continue
                missing += [
                    f"{path.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
                ]
    assert not missing, missing
