"""The package's shape, held against its code: subpackages in layers that import one way, no import circles, no
oversized modules or classes. docs/architecture.md explains the layers; this file is where they are enforced."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stppo_agent"

# Lowest first: a module may import its own subpackage and the ones listed before it, never one after it.
LAYERS = ("distributed", "algorithms", "models", "rollouts", "runs", "monitoring", "plugins", "evaluation",
          "training", "integrations", "cli")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every stppo_agent module this one imports, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_subpackage_has_a_layer():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages <= set(LAYERS), f"add {sorted(subpackages - set(LAYERS))} to LAYERS (and docs/architecture.md)"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a subpackage: {loose}"


def test_imports_run_down_the_layers():
    upward = []
    for module, imported in _graph().items():
        own = _layer(module)
        for target in imported:
            theirs = _layer(target)
            if own is None or theirs is None:
                if target == "stppo_agent" and module != "stppo_agent":
                    upward.append(f"{module} -> {target}")
                continue
            if LAYERS.index(theirs) > LAYERS.index(own):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_planted_upward_import_is_caught(tmp_path, monkeypatch):
    (tmp_path / "stppo_agent" / "distributed").mkdir(parents=True)
    (tmp_path / "stppo_agent" / "training").mkdir()
    for folder in ("stppo_agent", "stppo_agent/distributed", "stppo_agent/training"):
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "stppo_agent" / "training" / "trainer.py").write_text("")
    (tmp_path / "stppo_agent" / "distributed" / "group.py").write_text(
        "def f():\n    from stppo_agent.training.trainer import x\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "stppo_agent")
    with pytest.raises(AssertionError, match="distributed.group -> stppo_agent.training.trainer"):
        test_imports_run_down_the_layers()


def test_no_oversized_modules_or_classes():
    too_long = []
    for name, path in _modules().items():
        source = path.read_text(encoding="utf-8")
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"module {name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"class {name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, "\n".join(too_long)
