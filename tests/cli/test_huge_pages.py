"""The `stppo` command asks torch's CPU allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE), which torch
reads once at its first allocation: it must be set before torch is imported, and a user's own value wins."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = ("import sys, os; import stppo_agent.cli; "
         "print('torch' in sys.modules, os.environ.get('THP_MEM_ALLOC_ENABLE'))")


def run(env_value=None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_command_sets_huge_pages_before_torch_is_imported():
    assert run() == "False 1"  # set, and torch not imported yet: its first allocation will read it


def test_a_users_own_setting_wins():
    assert run("0") == "False 0"
