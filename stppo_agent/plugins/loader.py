"""Algorithms, losses, estimators and agents from outside the package, chosen by name on the command line.

A plugin is a Python file or module that registers things when imported (``register_algorithm``,
``register_policy_loss``, ``register_advantage_estimator``, ``stppo_agent.evaluation.agent_specs.register_agent``).
Routes:

- ``--import myrule.py`` (a file; a relative path is recorded as an absolute one) or ``--import myrule`` (a
  module: importable from the current directory, as ``python -m`` would find it, or installed) on ``stppo train``,
  ``replay``, ``eval`` and ``sft``; or ``plugins: [...]`` in the config. Training records them in the run's
  ``config.yaml``, so ``--resume`` and ``stppo replay`` import them again;
- an installed distribution that declares an entry point in the ``stppo.plugins`` group
  (``[project.entry-points."stppo.plugins"] my_algos = "my_package.my_algos"``): imported automatically.

A plugin that cannot be imported (no such file or module, a syntax error, an exception while importing) is a
``ValueError`` of one line naming the file and the reason.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Iterable

ENTRY_POINT_GROUP = "stppo.plugins"
IMPORT_HELP = ("import a plugin first: a .py file (./myrule.py) or a module importable from the current directory "
               "or installed (my_package.my_algos); it registers algorithms, losses, estimators or agents of your "
               "own. Repeatable")
_loaded_entry_points = False


def add_import_argument(parser: argparse.ArgumentParser, recorded: bool = False) -> None:
    """The same ``--import`` on every command (and benchmark script) that builds algorithms or agents."""
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE_OR_MODULE",
                        help=IMPORT_HELP + (" (recorded in the run's config.yaml for --resume and replay)"
                                            if recorded else ""))


def is_file_spec(spec: str) -> bool:
    """``./myrule.py``, ``plugins/myrule.py``, ``/abs/myrule.py``: a file; ``my_package.my_algos``: a module."""
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def portable_specs(specs: Iterable[str]) -> list[str]:
    """Files as absolute paths (a run resumed or replayed from another directory finds them), modules as typed;
    duplicates dropped, order kept."""
    out = [str(Path(s).expanduser().resolve()) if is_file_spec(s) else s for s in specs]
    return list(dict.fromkeys(out))


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Import the installed entry-point plugins (once) and ``modules`` (files or module names; each once)."""
    global _loaded_entry_points
    if not _loaded_entry_points:
        _loaded_entry_points = True
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                entry_point.load()
            except Exception as exc:  # a broken third-party plugin must not hide behind another error
                raise ValueError(f"stppo plugin {entry_point.name!r} ({entry_point.value}) failed to import: "
                                 f"{_reason(exc)}") from exc
    for spec in modules:
        if is_file_spec(spec):
            _import_file(Path(spec).expanduser())
        else:
            _import_module(spec)


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # one line, whatever the plugin put in its message
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_file(path: Path) -> None:
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"plugin file {path} does not exist")
    if path.suffix != ".py":
        raise ValueError(f"plugin file {path} is not a .py file")
    name = path.stem
    if not name.isidentifier():
        raise ValueError(f"plugin file {path}: {name!r} is not a valid module name; rename the file "
                         "(letters, digits and underscores)")
    loaded = sys.modules.get(name)
    if loaded is not None:
        origin = getattr(loaded, "__file__", None)
        if origin and Path(origin).resolve() == path:
            return  # imported already: registering twice would be refused
        raise ValueError(f"plugin file {path}: a module named {name!r} is already imported "
                         f"(from {origin or 'a built-in'}); rename the file")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered under its name (pickling, and the plugin's own `import myrule` elsewhere, find it); its folder
    # joins the path so that it can import modules next to it, as it could when run as a script.
    sys.modules[name] = module
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a half-run module must not stay importable
        del sys.modules[name]
        raise ValueError(f"plugin {path} failed to import: {_reason(exc)}") from exc


def _import_module(name: str) -> None:
    if name in sys.modules:
        return
    if name.startswith(".") or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"plugin {name!r} is neither a module name (my_package.my_algos) nor a .py file")
    # The console script `stppo` does not put the current directory on the path (`python -m` does): a user's
    # myrule.py next to them must be found either way. Appended, so it never shadows an installed module.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:  # a parent package is missing or broken
        raise ValueError(f"cannot import plugin module {name!r}: {_reason(exc)}") from exc
    if spec is None:
        raise ValueError(f"cannot import plugin module {name!r}: no {name.replace('.', '/')}.py in the current "
                         f"directory ({cwd}) and no installed module of that name; pass a file path "
                         f"(--import path/to/{name.rsplit('.', 1)[-1]}.py) or install it")
    try:
        importlib.import_module(name)
    except (Exception, SystemExit) as exc:
        raise ValueError(f"plugin module {name!r} ({spec.origin}) failed to import: {_reason(exc)}") from exc
