"""The suite's own scheduling: the slowest files are collected first (see SLOWEST_FIRST in conftest.py)."""

from __future__ import annotations

from tests.conftest import REPO, SLOWEST_FIRST, suite_path


def test_every_listed_slow_file_exists():
    names = {suite_path(path) for path in (REPO / "tests").rglob("test_*.py")}
    assert [name for name in SLOWEST_FIRST if name not in names] == []


def test_the_slowest_files_are_collected_first_in_their_listed_order(request):
    files = list(dict.fromkeys(suite_path(item.path) for item in request.session.items))  # files in run order
    listed = [name for name in files if name in SLOWEST_FIRST]
    assert files[:len(listed)] == listed
    assert listed == [name for name in SLOWEST_FIRST if name in listed]
