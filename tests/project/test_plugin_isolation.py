"""The autouse fixture in conftest.py must leave no trace of a plugin a test imported: neither its registration nor
its module. Two tests of one file share a worker and load the SAME plugin file, in file order."""

import sys

import pytest

from stppo_agent.algorithms import ALGORITHMS
from stppo_agent.plugins.loader import load_plugins

PLUGIN = """
import dataclasses
from stppo_agent.algorithms import ALGORITHMS, register_algorithm
register_algorithm(dataclasses.replace(ALGORITHMS["ppo"], name="isolation_probe_rule", clip_high=0.31))
"""


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "isolation_probe_plugin.py"
    path.write_text(PLUGIN)
    return path


@pytest.mark.parametrize("turn", ["first", "second"])
def test_a_plugin_loaded_by_an_earlier_test_loads_again_and_registers(plugin_file, turn):
    assert "isolation_probe_rule" not in ALGORITHMS  # the earlier test's registration is gone
    assert "isolation_probe_plugin" not in sys.modules  # ... and so is its module, or loading would be a no-op
    assert str(plugin_file.parent) not in sys.path
    load_plugins([str(plugin_file)])
    assert ALGORITHMS["isolation_probe_rule"].clip_high == 0.31
