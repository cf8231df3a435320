"""The code's shape, held against it: each package's parts in layers that import one way, no import circles, no
oversized modules or classes; ``stppo_envs`` standing alone; nothing but tests importing ``tests``.
docs/architecture.md explains the layers; this file is where they are enforced."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "stppo_agent"
ENVS = ROOT / "stppo_envs"
BENCHMARKS = ROOT / "benchmarks"

# Lowest first: a module may import its own subpackage and the ones listed before it, never one after it.
LAYERS = ("distributed", "algorithms", "models", "rollouts", "runs", "monitoring", "plugins", "evaluation",
          "training", "integrations", "cli")
# stppo_envs's parts (its subpackages and top-level modules), lowest first, the same way; the parts on one row are
# peers that import none of each other.
ENVS_LAYERS = (
    ("actions", "scoring", "spaces", "suggest"),  # the action protocol, answer scoring, the text space, did-you-mean
    ("data",),  # loaders and the FlashRAG schema
    ("retrieval",),  # retrievers, index builds, the /retrieve server (the demo corpus's place comes from data)
    ("prompts",),  # Search-R1's templates and observation text
    ("env",),  # SearchQAEnv
    ("copy_task", "toy", "vector"),  # the envs built on env's Segment, and the vector env
)
PACKAGES = {"stppo_agent": (PACKAGE, LAYERS), "stppo_envs": (ENVS, ENVS_LAYERS)}
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path) -> dict[str, Path]:
    return {_module_name(p, package.parent): p for p in package.rglob("*.py")}


def _targets(name: str, path: Path, modules: set[str] = frozenset()) -> set[str]:
    """Every dotted name this module imports, relative imports made absolute, at module level or inside a function.
    ``from a import b`` gives ``a.b``, and ``a`` too unless ``a.b`` is one of ``modules`` (``from . import scoring``
    imports the module ``scoring``, not a name of the package's ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            found.update(names + ([base] if not set(names) <= modules else []))
    return found


def _graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = _modules(package)
    known = set(modules)
    return {name: {t for t in _targets(name, path, known) if t in known and t != name}
            for name, path in modules.items()}


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _against_layers(graph: dict[str, set[str]], layers) -> list[str]:
    """``module -> target`` for each import of a later layer, of a peer on the same row, or of the package root."""
    rank = {part: i for i, row in enumerate(layers) for part in ((row,) if isinstance(row, str) else row)}
    wrong = []
    for module, imported in graph.items():
        own = _part(module)
        for target in imported:
            theirs = _part(target)
            if own is None or theirs is None:
                if theirs is None and own is not None:  # the package's front door imports its parts, not back
                    wrong.append(f"{module} -> {target}")
                continue
            if theirs != own and rank[theirs] >= rank[own]:
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def _foreign_imports(folder: Path, forbidden: set[str]) -> list[str]:
    """``module -> target`` for each import, anywhere under ``folder``, of a top-level name in ``forbidden``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        name = _module_name(path, folder.parent)
        found += [f"{name} -> {t}" for t in sorted(_targets(name, path)) if t.split(".")[0] in forbidden]
    return found


def test_every_subpackage_has_a_layer():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages <= set(LAYERS), f"add {sorted(subpackages - set(LAYERS))} to LAYERS (and docs/architecture.md)"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a subpackage: {loose}"


def test_every_part_of_stppo_envs_has_a_layer():
    parts = {p.parent.name for p in ENVS.glob("*/__init__.py")} | ({p.stem for p in ENVS.glob("*.py")} - {"__init__"})
    listed = {part for row in ENVS_LAYERS for part in row}
    assert parts == listed, (f"add {sorted(parts - listed)} to ENVS_LAYERS (and docs/architecture.md); "
                             f"gone: {sorted(listed - parts)}")


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_down_the_layers(package):
    folder, layers = PACKAGES[package]
    upward = _against_layers(_graph(folder), layers)
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


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


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package):
    assert _cycles(_graph(PACKAGES[package][0])) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _plant(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_upward_import_is_caught(tmp_path):
    _plant(tmp_path, {"stppo_agent/__init__.py": "", "stppo_agent/distributed/__init__.py": "",
                      "stppo_agent/training/__init__.py": "", "stppo_agent/training/trainer.py": "",
                      "stppo_agent/distributed/group.py": "def f():\n    from stppo_agent.training.trainer import x\n"})
    assert _against_layers(_graph(tmp_path / "stppo_agent"), LAYERS) == [
        "stppo_agent.distributed.group -> stppo_agent.training.trainer"]


def test_planted_imports_of_a_peer_and_of_a_later_layer_in_stppo_envs_are_caught(tmp_path):
    _plant(tmp_path, {"stppo_envs/__init__.py": "from .toy import X\n", "stppo_envs/vector.py": "",
                      "stppo_envs/toy.py": "from .vector import Y\n", "stppo_envs/retrieval/__init__.py": "",
                      "stppo_envs/retrieval/base.py": "from ..env import Segment\n", "stppo_envs/env.py": ""})
    assert _against_layers(_graph(tmp_path / "stppo_envs"), ENVS_LAYERS) == [
        "stppo_envs.retrieval.base -> stppo_envs.env", "stppo_envs.toy -> stppo_envs.vector"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_oversized_modules_or_classes(package):
    too_long = []
    for name, path in _modules(PACKAGES[package][0]).items():
        source = path.read_text(encoding="utf-8")
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"module {name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"class {name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, "\n".join(too_long)


def test_stppo_envs_stands_alone():
    """A benchmark user imports the envs without the trainer: stppo_envs imports nothing of stppo_agent."""
    assert _foreign_imports(ENVS, {"stppo_agent", "benchmarks", "tests"}) == []


def test_the_packages_and_benchmarks_never_import_tests():
    """Shared tiny models and fixtures live in the package (stppo_agent.models.tiny); benchmarks may import the
    packages and each other, the packages neither benchmarks nor tests."""
    assert _foreign_imports(PACKAGE, {"benchmarks", "tests"}) == []
    assert _foreign_imports(BENCHMARKS, {"tests"}) == []


def test_a_planted_benchmark_import_of_tests_is_caught(tmp_path):
    _plant(tmp_path, {"benchmarks/run.py": "import _common\nfrom stppo_agent.models.tiny import build_tiny_llama\n"
                                           "def f():\n    from tests.helpers import tiny\n"})
    assert _foreign_imports(tmp_path / "benchmarks", {"tests"}) == [
        "benchmarks.run -> tests.helpers", "benchmarks.run -> tests.helpers.tiny"]
