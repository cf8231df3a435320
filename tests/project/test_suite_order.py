"""The suite's own scheduling: the slowest files are collected first (see SLOWEST_FIRST in conftest.py)."""

from __future__ import annotations

from tests.conftest import REPO, SLOWEST_FIRST


def test_every_listed_slow_file_exists():
    names = {path.name for path in (REPO / "tests").glob("test_*.py")}
    assert [name for name in SLOWEST_FIRST if name not in names] == []


def test_the_slowest_files_are_collected_first_in_their_listed_order(request):
    files = list(dict.fromkeys(item.path.name for item in request.session.items))  # files in run order
    listed = [name for name in files if name in SLOWEST_FIRST]
    assert files[:len(listed)] == listed
    assert listed == [name for name in SLOWEST_FIRST if name in listed]
