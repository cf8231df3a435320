"""`stppo eval --output-dir`: checked before any episode (a folder that cannot be written, another agent's results,
which --overwrite replaces; a training run's own checkpoints replace theirs), and written so that a failure part-way
leaves the previous results whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli_in_process import stppo
from .recording_agent import recording_agent, was_built


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def evaluate(capsys, agent: str, out: str, *options: str):
    return stppo("eval", "--agent", agent, "--benchmarks", "nq", "--limit", "2", "--output-dir", out, *options,
                 capsys=capsys)


def agents_in(out: Path) -> list[str]:
    return [r["provenance"]["agent"] for r in json.loads((out / "results.json").read_text())]


@pytest.mark.parametrize("out, problem", [("notes.txt/eval", "notes.txt is a file"),
                                          ("notes.txt", "notes.txt is a file")])
def test_an_output_folder_that_cannot_be_written_is_refused_before_any_episode(folder, capsys, out, problem):
    (folder / "notes.txt").write_text("a file\n")
    plugin = recording_agent(folder, "recorder", "OracleAgent")
    done = evaluate(capsys, "recorder", out, "--import", str(plugin))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"stppo eval: error: --output-dir {out} cannot be a folder: {problem}; choose another " \
                          "--output-dir\n"
    assert not was_built(plugin)  # no agent was built, no episode played
    assert (folder / "notes.txt").read_text() == "a file\n"


def test_another_agents_results_are_refused_unless_overwrite(folder, capsys):
    assert evaluate(capsys, "oracle", "out").returncode == 0
    before = (folder / "out" / "results.json").read_bytes()
    refused = evaluate(capsys, "no-search", "out")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == ("stppo eval: error: out holds the results of another agent (oracle on nq); this "
                              "evaluation is of no-search: choose another --output-dir, or pass --overwrite to "
                              "replace them\n")
    assert (folder / "out" / "results.json").read_bytes() == before
    assert evaluate(capsys, "oracle", "out", "--limit", "3").returncode == 0  # the same agent again: replaced
    assert evaluate(capsys, "no-search", "out", "--overwrite").returncode == 0
    assert agents_in(folder / "out") == ["no-search"]
    assert len((folder / "out" / "episodes.jsonl").read_text().splitlines()) == 2


def test_a_training_runs_checkpoints_replace_their_own_results(folder, capsys):
    trained = stppo("train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir", "run",
                    "--iterations", "2", "--set", "rollout.samples_per_prompt=2", "--set",
                    "rollout.prompts_per_iteration=2",
                    "--set", "rollout.max_new_tokens_per_turn=1", "--set", "checkpoint.every=1", "--set",
                    "logging.tensorboard=false",
                    "--set", "logging.progress=false", capsys=capsys)
    assert trained.returncode == 0, trained.stderr[-2000:]
    options = ("--retriever", "demo", "--max-new-tokens", "2", "--max-turns", "2")
    for agent, step in (("hf:run@1", 1), ("hf:run@latest", 2), ("hf:run", 2), ("hf:run/checkpoints/step-1/actor", 1)):
        done = evaluate(capsys, agent, "run/eval", *options)
        assert done.returncode == 0, (agent, done.stderr[-2000:])
        assert agents_in(folder / "run" / "eval") == [f"hf:run/checkpoints/step-{step}/actor"]
    refused = evaluate(capsys, "oracle", "run/eval", *options)
    assert refused.returncode == 1 and "holds the results of another agent (hf:run/checkpoints/step-1/actor on nq)" \
        in refused.stderr


def test_a_write_that_fails_part_way_leaves_the_previous_results_whole(folder, capsys, monkeypatch):
    import errno

    from stppo_agent.evaluation import results

    assert evaluate(capsys, "oracle", "out").returncode == 0
    before = {name: (folder / "out" / name).read_bytes() for name in ("results.json", "results.csv", "episodes.jsonl")}

    def disk_full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.csv, "writer", disk_full)  # the second of the three files fails
    failed = evaluate(capsys, "oracle", "out", "--limit", "3")
    assert failed.returncode == 1 and "No space left on device" in failed.stderr
    assert {name: (folder / "out" / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in (folder / "out").iterdir()) == sorted(before)  # nothing half-written left
