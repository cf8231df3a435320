"""Bad input on the command line gets one clear line naming the fix, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from stppo_agent.cli import main
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


@pytest.mark.parametrize("extra, message", [
    (["--env", "stppo/Nope-v0"], "Registered stppo envs"),
    (["--env", "stppo/NQ-v0", "--set", "env_kwargs.topk=x"], "must be integers"),
    (["--env", "stppo/NQ-v0", "--set", "env_kwargs.nope=1"], "does not accept env_kwargs"),
    (["--env", "stppo/Toy-v0", "--set", "algorithm.clip_high=abc"], "algorithm.clip_high expects float"),
    (["--env", "stppo/Toy-v0", "--config", "/no/such.yaml"], "such.yaml"),
])
def test_train_errors_are_one_clear_line(model, tmp_path, capsys, extra, message):
    code = main(["train", "--algo", "ppo", "--model", str(model), "--output-dir", str(tmp_path / "run"),
                 "--iterations", "1", *extra])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "Traceback" not in err, err


def test_an_output_dir_under_a_file(model, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--model", str(model), "--output-dir",
                 str(tmp_path / "file" / "run"), "--iterations", "1"]) == 1
    assert "file" in capsys.readouterr().err


def test_dataset_errors_name_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "question": "q", "golden_answers": ["a"]}\n{broken\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    base = ["eval", "--agent", "oracle", "--benchmarks", "nq", "--retriever", "demo", "--output-dir",
            str(tmp_path / "out")]
    assert main(base + ["--dataset", f"nq={bad}"]) == 1
    assert f"{bad}, line 2 is not valid JSON" in capsys.readouterr().err
    assert main(base + ["--dataset", f"nq={empty}"]) == 1
    assert f"{empty} is empty" in capsys.readouterr().err


def test_compare_names_an_unreadable_file(tmp_path, capsys):
    broken = tmp_path / "results.json"
    broken.write_text("{")
    assert main(["compare", str(broken), str(broken)]) == 1
    assert f"{broken} is not a readable results.json" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--limit", "--topk", "--max-turns"])
def test_zero_is_refused_where_it_makes_no_sense(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--agent", "oracle", "--benchmarks", "nq", flag, "0", "--output-dir", "/tmp/x"])
    assert exit_info.value.code == 2 and "must be >= 1" in capsys.readouterr().err
