"""The loader's in-process cache sees every edit of a dataset file, also inside a folder (issue 30.10)."""

from __future__ import annotations

import json
import os

from stppo_envs import load_examples


def _write(path, answer: str, mtime_ns: int) -> None:
    path.write_text(json.dumps({"id": "q1", "question": "Capital of France?", "golden_answers": [answer]}) + "\n")
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_editing_a_file_of_a_folder_dataset_in_place_is_seen(tmp_path):
    folder = tmp_path / "nq"
    folder.mkdir()
    path = folder / "nq_test.jsonl"
    _write(path, "Paris", 1_700_000_000_000_000_000)
    folder_mtime = folder.stat().st_mtime_ns
    assert load_examples("nq", str(folder))[0].golden_answers == ("Paris",)
    _write(path, "Lyon!", 1_700_000_000_000_000_000)  # same size, same mtime: only the content differs
    _write(path, "Lyon!", 1_700_000_000_000_000_001)  # ... one nanosecond later
    os.utime(folder, ns=(folder_mtime, folder_mtime))  # an in-place edit leaves the folder's mtime alone
    assert load_examples("nq", str(folder))[0].golden_answers == ("Lyon!",)
    _write(path, "Marseille", 1_700_000_000_000_000_001)  # another size, same mtime
    assert load_examples("nq", str(folder))[0].golden_answers == ("Marseille",)


def test_editing_a_single_file_within_the_same_second_is_seen(tmp_path):
    path = tmp_path / "nq_test.jsonl"
    _write(path, "Paris", 1_700_000_000_100_000_000)
    assert load_examples("nq", str(path))[0].golden_answers == ("Paris",)
    _write(path, "Lyon!", 1_700_000_000_200_000_000)
    assert load_examples("nq", str(path))[0].golden_answers == ("Lyon!",)


def test_a_file_added_to_a_folder_is_seen(tmp_path):
    folder = tmp_path / "nq"
    folder.mkdir()
    _write(folder / "a_test.jsonl", "Paris", 1_700_000_000_000_000_000)
    assert len(load_examples("nq", str(folder))) == 1
    folder_mtime = folder.stat().st_mtime_ns
    (folder / "b_test.jsonl").write_text(json.dumps({"id": "q2", "question": "Q?", "golden_answers": ["x"]}) + "\n")
    os.utime(folder, ns=(folder_mtime, folder_mtime))
    assert len(load_examples("nq", str(folder))) == 2
