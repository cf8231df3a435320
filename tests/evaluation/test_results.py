"""``stppo_agent.evaluation.results``: the results table and files."""

from __future__ import annotations

import csv
import json

from stppo_agent.evaluation.results import format_table, write_results

# ---------------------------------------------------------------- results.py


def _metrics(**kw):
    base = {"n": 4, "em": 0.5, "f1": 0.625, "answer_rate": 0.75, "invalid_action_rate": 0.125, "mean_turns": 1.5,
            "mean_search_calls": 0.25}
    return {**base, **kw}


def test_format_table_of_qa_and_mcq_benchmarks_with_the_qa_average():
    results = [{"benchmark": "nq", "metrics": _metrics()},
               {"benchmark": "hotpotqa", "metrics": _metrics(em=0.25, f1=0.5)},
               {"benchmark": "medqa", "metrics": {k: v for k, v in _metrics(acc=1.0).items() if k not in ("em", "f1")}}]
    assert format_table(results).splitlines() == [
        "benchmark    n  EM/acc  F1     answer  invalid  turns  searches",
        "-----------  -  ------  -----  ------  -------  -----  --------",
        "nq           4  0.500   0.625  0.750   0.125    1.50   0.25",
        "hotpotqa     4  0.250   0.500  0.750   0.125    1.50   0.25",
        "medqa        4  1.000   -      0.750   0.125    1.50   0.25",
        "QA avg (EM)     0.375"]


def test_format_table_adds_tokens_and_search_errors_only_when_there_are_any():
    one = [{"benchmark": "nq", "metrics": _metrics(search_error_rate=0.0)}]
    assert format_table(one).splitlines()[0].split()[-1] == "searches"  # one QA benchmark: no average either
    assert len(format_table(one).splitlines()) == 3
    both = [{"benchmark": "nq", "metrics": _metrics(mean_response_tokens=12.25, search_error_rate=0.5)},
            {"benchmark": "bamboogle", "metrics": _metrics(search_error_rate=0.0)}]
    lines = format_table(both).splitlines()
    assert lines[0].endswith("searches  tokens  search errors")
    assert lines[2].split()[-2:] == ["12.2", "0.500"] and lines[3].split()[-2:] == ["0.0", "0.000"]
    assert lines[4].split() == ["QA", "avg", "(EM)", "0.500"] and lines[4].endswith("0.500")
    unrecorded = [both[0], {"benchmark": "old", "metrics": _metrics()}]  # a record from before the rate existed
    assert format_table(unrecorded).splitlines()[3].split()[-1] == "0.000"
    no_em = [{"benchmark": "x", "metrics": {k: v for k, v in _metrics().items() if k != "em"}}]
    assert format_table(no_em).splitlines()[2].split()[2] == "0.000"


def test_write_results_writes_the_three_files(tmp_path):
    results = [{"benchmark": "nq", "metrics": {"n": 2, "em": 0.5}, "provenance": {"topk": 3},
                "episodes": [{"example_id": "a", "em": 1.0, "question": "Wo liegt München?"},
                             {"example_id": "b", "em": 0.0}]},
               {"benchmark": "medqa", "metrics": {"n": 1, "acc": 1.0}, "provenance": {"topk": 3},
                "episodes": [{"example_id": "c", "correct": 1.0}]}]
    out = tmp_path / "new" / "deeper"
    write_results(results, out)
    summary = json.loads((out / "results.json").read_text())
    assert summary == [{k: v for k, v in r.items() if k != "episodes"} for r in results]
    assert (out / "results.json").read_text() == json.dumps(summary, indent=2, sort_keys=True) + "\n"
    episodes = (out / "episodes.jsonl").read_text(encoding="utf-8").splitlines()
    assert episodes == [json.dumps({"benchmark": "nq", **results[0]["episodes"][0]}, sort_keys=True),
                        json.dumps({"benchmark": "nq", **results[0]["episodes"][1]}, sort_keys=True),
                        json.dumps({"benchmark": "medqa", **results[1]["episodes"][0]}, sort_keys=True)]
    assert "München" not in (out / "episodes.jsonl").read_text(encoding="utf-8")  # ASCII-escaped JSON
    assert (out / "results.csv").read_bytes() == (b"benchmark,acc,em,n\r\n" b"nq,,0.5,2\r\n" b"medqa,1.0,,1\r\n")
    with open(out / "results.csv", newline="") as handle:
        assert list(csv.reader(handle))[0] == ["benchmark", "acc", "em", "n"]
    write_results(results[:1], out)  # an existing folder is reused, files replaced
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 2


def test_the_obs_cut_column_shows_each_rate_and_zero_for_an_unrecorded_one():
    results = [{"benchmark": "nq", "metrics": _metrics(observation_cut_rate=0.125)},
               {"benchmark": "old", "metrics": _metrics()}]
    assert format_table(results).splitlines() == [
        "benchmark    n  EM/acc  F1     answer  invalid  turns  searches  obs cut",
        "-----------  -  ------  -----  ------  -------  -----  --------  -------",
        "nq           4  0.500   0.625  0.750   0.125    1.50   0.25      0.125",
        "old          4  0.500   0.625  0.750   0.125    1.50   0.25      0.000",
        "QA avg (EM)     0.500"]
    uncut = [{"benchmark": "nq", "metrics": _metrics(observation_cut_rate=0.0)}]
    assert "obs cut" not in format_table(uncut)
