"""`stppo export verl` as a user types it (issue 32.5): one parquet per benchmark with verl's columns, the env's
prompt and gold answers, and a clear error for an unknown benchmark. (Loading through verl's RLHFDataset is in
tests/test_verl_bridge.py, which runs where verl is installed.)"""

from __future__ import annotations

import datasets

import stppo_envs
from stppo_agent.cli import main


def test_export_writes_one_parquet_per_benchmark_with_the_envs_prompt_and_answers(tmp_path, capsys):
    assert main(["export", "verl", "--benchmarks", "nq,medqa", "--split", "test", "--out", str(tmp_path),
                 "--limit", "3", "--max-turns", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["medqa_test.parquet", "nq_test.parquet"]
    assert capsys.readouterr().out.split() == [str(tmp_path / "nq_test.parquet"), str(tmp_path / "medqa_test.parquet")]
    rows = datasets.load_dataset("parquet", data_files=str(tmp_path / "nq_test.parquet"))["train"]
    assert rows.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name"]
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
