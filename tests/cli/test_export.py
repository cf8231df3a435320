"""`stppo export verl` as a user types it: one parquet per benchmark with verl's columns, the env's prompt and gold
answers, every env setting recorded per row, the prompt of the chosen agent loop, and a clear error for a benchmark
list that names nothing, an unknown benchmark or one named twice. (Loading through verl's RLHFDataset is in
tests/test_verl_bridge.py, which runs where verl is installed.)"""

from __future__ import annotations

import json

import datasets
import pytest

import stppo_envs
from stppo_agent.cli import main


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
