"""Pins of stppo_agent/runs/recording.py's drop_recordings_after (a resume removes every rank's recordings of the
iterations after its checkpoint) and the iteration parser it shares with recorded_iterations."""

from __future__ import annotations

from stppo_agent.runs.recording import drop_recordings_after, recorded_iterations


def test_a_resume_drops_every_ranks_files_of_later_iterations_only(tmp_path):
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    kept = ["iter-000001.rank-0.safetensors", "iter-000002.rank-0.safetensors", "iter-000002.rank-1.json",
            "iter-latest.rank-0.safetensors", "format.json", "initial.safetensors"]
    dropped = ["iter-000003.rank-0.safetensors", "iter-000003.rank-1.json", "iter-000010.rank-2.transcripts.jsonl"]
    for name in kept + dropped:
        (rollouts / name).write_text("x")
    (tmp_path / "iter-000005.rank-0.safetensors").write_text("x")  # not in rollouts/: not a recording
    drop_recordings_after(tmp_path, 2)  # the boundary: iteration 2 is the checkpoint's, kept
    assert sorted(p.name for p in rollouts.iterdir()) == sorted(kept)
    assert (tmp_path / "iter-000005.rank-0.safetensors").exists()
    assert recorded_iterations(rollouts, 0) == [1, 2]


def test_dropping_from_a_run_that_never_recorded_is_a_no_op(tmp_path):
    drop_recordings_after(tmp_path, 0)
    assert list(tmp_path.iterdir()) == []


def test_a_file_gone_between_listing_and_removal_is_no_error(tmp_path, monkeypatch):
    from pathlib import Path

    (tmp_path / "rollouts").mkdir()
    vanished = tmp_path / "rollouts" / "iter-000004.rank-0.safetensors"  # listed, then removed by someone else
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter([vanished]))
    drop_recordings_after(tmp_path, 1)
    assert not vanished.exists()
