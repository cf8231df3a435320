"""Algorithms, losses and estimators from outside the package, chosen by name on the command line.

A plugin is a Python module that registers things when imported (``register_algorithm``,
``register_policy_loss``, ``register_advantage_estimator``). Two routes, Python's usual ones:

- ``stppo train --import my_package.my_algos`` (or ``plugins: [my_package.my_algos]`` in the config): imported
  before the algorithm is resolved, and recorded in the run's ``config.yaml`` so ``--resume`` and ``stppo replay``
  import it again;
- an installed distribution that declares an entry point in the ``stppo.plugins`` group
  (``[project.entry-points."stppo.plugins"] my_algos = "my_package.my_algos"``): imported automatically.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Iterable

ENTRY_POINT_GROUP = "stppo.plugins"
_loaded_entry_points = False


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Import the installed entry-point plugins (once) and ``modules``; a module that fails names itself."""
    global _loaded_entry_points
    if not _loaded_entry_points:
        _loaded_entry_points = True
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                entry_point.load()
            except Exception as exc:  # a broken third-party plugin must not hide behind another error
                raise ImportError(f"stppo plugin {entry_point.name!r} ({entry_point.value}) failed to import: "
                                  f"{exc}") from exc
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"cannot import plugin module {module!r} ({exc}); is it on PYTHONPATH or "
                             "installed?") from exc
