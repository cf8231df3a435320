"""`hf:RUN@latest|@best|@healthy|@STEP` on a folder without such a checkpoint says so and lists what the folder
holds, never a Hugging Face hub error."""

from __future__ import annotations

import pytest

from stppo_agent.cli import main


def _eval(agent: str, tmp_path) -> list[str]:
    return ["eval", "--agent", agent, "--benchmarks", "nq", "--retriever", "http://127.0.0.1:9", "--limit", "1",
            "--output-dir", str(tmp_path / "out")]


@pytest.mark.parametrize("layout, which, expected", [
    ({}, "latest", "holds no checkpoint; it is empty"),
    ({"checkpoints/": None}, "best", "holds no checkpoint (checkpoints/ is empty)"),
    ({"config.yaml": "algo: ppo\n", "metrics.jsonl": '{"step": 1}\n'}, "healthy",
     "holds no checkpoint; it holds: config.yaml, metrics.jsonl"),
    ({"checkpoints/.corrupt-step-2/": None, "config.yaml": ""}, "3",
     "holds no checkpoint (checkpoints/ holds only .corrupt-step-2)"),
])
def test_a_run_folder_without_the_checkpoint(tmp_path, capsys, layout, which, expected):
    run = tmp_path / "runs" / "empty"
    run.mkdir(parents=True)
    for name, text in layout.items():
        if name.endswith("/"):
            (run / name).mkdir(parents=True)
        else:
            (run / name).write_text(text)
    assert main(_eval(f"hf:{run}@{which}", tmp_path)) == 1
    err = capsys.readouterr().err
    assert f"{run}" in err and expected in err and "Repo id" not in err and "tokenizer" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_run_folder_that_does_not_exist(tmp_path, capsys):
    (tmp_path / "runs" / "tour").mkdir(parents=True)
    missing = tmp_path / "runs" / "tuor" / "toy"
    assert main(_eval(f"hf:{missing}@latest", tmp_path)) == 1
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and "Repo id" not in err, err
    # the nearest folder that exists, what it holds, and the closest name
    assert f"{tmp_path / 'runs'} holds: tour" in err and "did you mean tour?" in err, err
    # without @: a path that cannot be a hub name (two slashes) is a missing folder, not a repo id
    assert main(_eval(f"hf:{missing}", tmp_path)) == 1
    assert "does not exist" in capsys.readouterr().err


def test_a_misspelt_checkpoint_choice(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert main(_eval(f"hf:{run}@lates", tmp_path)) == 1
    err = capsys.readouterr().err
    assert "choose @latest, @best, @healthy" in err and "did you mean @latest?" in err, err


@pytest.mark.parametrize("name", ["tiny@500", "tiny@latest", "my@model"])
def test_a_model_folder_named_with_an_at_sign_is_evaluated_as_typed(tmp_path, capsys, name):
    import json

    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    model = build_tiny_llama(tmp_path / name, word_tokenizer(), hidden=16, layers=1, seed=5)
    out = tmp_path / "out"
    assert main(["eval", "--agent", f"hf:{model}", "--benchmarks", "nq", "--retriever", "demo", "--limit", "1",
                 "--max-new-tokens", "2", "--output-dir", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())[0]["provenance"]["agent"] == f"hf:{model}"
