"""``stppo export verl`` (stppo_agent/cli/export.py): one parquet per benchmark with verl's
columns, every option handed to ``export_verl``, and a clear error for a benchmark list that names nothing, an
unknown benchmark or one named twice."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

import stppo_agent.integrations.verl.data as verl_data
import stppo_envs
from stppo_agent.cli import main
from tests.support.cli_calls import Calls, run, usage_error


def test_export_writes_one_parquet_per_benchmark_with_the_envs_prompt_and_answers(tmp_path, capsys):
    assert main(["export", "verl", "--benchmarks", "nq,medqa", "--split", "test", "--out", str(tmp_path),
                 "--limit", "3", "--max-turns", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["medqa_test.parquet", "nq_test.parquet"]
    assert capsys.readouterr().out.split() == [str(tmp_path / "nq_test.parquet"), str(tmp_path / "medqa_test.parquet")]
    rows = datasets.load_dataset("parquet", data_files=str(tmp_path / "nq_test.parquet"))["train"]
    assert rows.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name"]
    assert (rows[0]["extra_info"]["reward"], rows[0]["extra_info"]["question_mark"]) == ("auto", True)
    assert len(rows) == 3 and set(rows["agent_name"]) == {"stppo_env"} and set(rows["data_source"]) == {"nq"}
    env = stppo_envs.SearchQAEnv("nq", split="test", limit=3, max_turns=3)
    prompt, info = env.reset(options={"index": 1})
    assert rows[1]["prompt"] == [{"role": "user", "content": prompt}]
    assert rows[1]["reward_model"]["ground_truth"]["target"] == list(env.examples[1].golden_answers)
    assert rows[1]["extra_info"]["example_id"] == info["example_id"] and rows[1]["extra_info"]["max_turns"] == 3
    medqa = datasets.load_dataset("parquet", data_files=str(tmp_path / "medqa_test.parquet"))["train"]
    assert medqa[0]["reward_model"]["ground_truth"]["answer_letter"] in "ABCDE"


def test_an_unknown_benchmark_is_one_line_with_a_suggestion(tmp_path, capsys):
    assert main(["export", "verl", "--benchmarks", "hotpotq", "--split", "test", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean hotpotqa?" in err


def test_a_benchmark_named_twice_is_refused_before_anything_is_written(tmp_path, capsys):
    # mmlu_med and mmlu-medical are one benchmark: exported twice, the second would overwrite the first's file and
    # print its path twice, so a verl config listing both paths trains on every row twice
    out = tmp_path / "out"
    assert main(["export", "verl", "--benchmarks", "nq,mmlu_med,mmlu-medical", "--split", "test",
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "names mmlu_med twice" in err
    assert not out.exists()


def test_every_env_setting_and_the_agent_loop_reach_the_rows(tmp_path, capsys):
    questions = tmp_path / "iliad.jsonl"
    questions.write_text(json.dumps({"id": "q0", "question": "who wrote the iliad", "golden_answers": ["Homer"]}))
    assert main(["export", "verl", "--benchmarks", "nq", "--split", "test", "--out", str(tmp_path / "out"),
                 "--dataset", str(questions), "--reward", "f1", "--format-reward", "0.1", "--no-question-mark",
                 "--agent-loop", "stppo_tool_agent", "--max-turns", "2"]) == 0
    (row,) = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "nq_test.parquet"))["train"]
    extra = row["extra_info"]
    settings = (extra["reward"], extra["format_reward"], extra["question_mark"], extra["max_turns"])
    assert settings == ("f1", 0.1, False, 2)
    prompt = row["prompt"][0]["content"]
    assert prompt.endswith("Question: who wrote the iliad\n") and row["agent_name"] == "stppo_tool_agent"
    # verl's tool agent runs tool calls, never <search>: the prompt asks for the call its hermes parser reads
    assert "<search>" not in prompt
    assert '<tool_call>{"name": "search", "arguments": {"query_list": ["query"]}}</tool_call>' in prompt


def test_a_benchmark_list_that_names_nothing_is_refused(tmp_path, capsys):
    for names in ("", " , "):
        assert main(["export", "verl", "--benchmarks", names, "--split", "test", "--out", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "names no benchmark" in err and "e.g. nq,hotpotqa" in err
    assert not (tmp_path / "o").exists()


def test_an_agent_loop_or_reward_that_does_not_exist_is_a_usage_error(tmp_path, capsys):
    base = ["export", "verl", "--benchmarks", "nq", "--split", "test", "--out", str(tmp_path)]
    for flag, value in (("--agent-loop", "tool_agent"), ("--reward", "bleu")):
        with pytest.raises(SystemExit) as exit_:
            main([*base, flag, value])
        assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


# ---------------------------------------------------------------- export


def test_export_verl_hands_every_option_to_export_verl(monkeypatch, capsys):
    from stppo_agent.integrations.verl import data

    monkeypatch.setattr(data, "export_verl", Calls([Path("o/nq_test.parquet")]))
    assert run(capsys, "export", "verl", "--benchmarks", "nq", "--split", "test", "--out", "o") == \
        (0, "o/nq_test.parquet\n", "")
    assert data.export_verl.only == ((["nq"], "test", "o"), {"dataset": None, "limit": None, "max_turns": 4,
                                                             "reward": "auto", "format_reward": 0.0,
                                                             "question_mark": True, "agent_name": "stppo_env"})
    run(capsys, "export", "verl", "--benchmarks", " nq, ,hotpotqa", "--split", "train", "--out", "p", "--dataset",
        "hub", "--limit", "3", "--max-turns", "2", "--format-reward", "0.1", "--reward", "em", "--no-question-mark",
        "--agent-loop", "stppo_tool_agent")
    assert data.export_verl.calls[-1] == ((["nq", "hotpotqa"], "train", "p"), {
        "dataset": "hub", "limit": 3, "max_turns": 2, "reward": "em", "format_reward": 0.1, "question_mark": False,
        "agent_name": "stppo_tool_agent"})


def test_export_refuses_a_missing_format_or_option(monkeypatch, capsys):
    assert "required: format" in usage_error(capsys, "export")
    assert "invalid choice" in usage_error(capsys, "export", "VERL")
    base = ["export", "verl", "--benchmarks", "nq", "--split", "test", "--out", "o"]
    for missing in ("--benchmarks", "--split", "--out"):
        argv = list(base)
        del argv[argv.index(missing):argv.index(missing) + 2]
        assert missing in usage_error(capsys, *argv)
    for flag in ("--limit", "--max-turns"):
        assert "must be >= 1" in usage_error(capsys, *base, flag, "0")
    assert "invalid float" in usage_error(capsys, *base, "--format-reward", "x")


def test_export_verl_passes_every_env_setting_and_the_agent_loop(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_export(benchmarks, split, out, **kwargs):
        calls.append((benchmarks, split, out, kwargs))
        return [f"{out}/nq_test.parquet"]

    monkeypatch.setattr(verl_data, "export_verl", fake_export)
    assert main(["export", "verl", "--benchmarks", "nq", "--split", "test", "--out", str(tmp_path),
                 "--dataset", "/data/nq", "--limit", "2", "--max-turns", "3", "--format-reward", "0.1",
                 "--reward", "f1", "--no-question-mark", "--agent-loop", "stppo_tool_agent"]) == 0
    [(benchmarks, split, out, kwargs)] = calls
    assert list(benchmarks) == ["nq"] and split == "test" and str(out) == str(tmp_path)
    assert kwargs == {"dataset": "/data/nq", "limit": 2, "max_turns": 3, "format_reward": 0.1, "reward": "f1",
                      "question_mark": False, "agent_name": "stppo_tool_agent"}
    assert capsys.readouterr().out.split() == [f"{tmp_path}/nq_test.parquet"]
