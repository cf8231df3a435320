"""``stppo_agent.evaluation.comparison``: provenance differences, the searched
index, search error rates, and comparisons refusing results produced under other settings."""

from __future__ import annotations

import json

import pytest

from stppo_agent.evaluation.comparison import (
    ProvenanceMismatchError,
    compare,
    load_results,
    provenance_differences,
    search_error_differences,
    searched_index_id,
)

# ---------------------------------------------------------------- comparison


def test_searched_index_id_strips_every_remote_layer_but_keeps_addresses():
    assert searched_index_id("remote:remote:bm25:x") == "bm25:x"
    assert searched_index_id("bm25:x") == "bm25:x"
    assert searched_index_id("remote:http://h:1/retrieve") == "remote:http://h:1/retrieve"
    assert searched_index_id("remote:https://h/retrieve") == "remote:https://h/retrieve"
    assert searched_index_id("remote:remote:https://h") == "remote:https://h"


def _record(benchmark="nq", metrics=None, **provenance):
    base = {"agent": "a", "dataset": "d", "retriever": "r", "topk": 3, "retriever_id": "bm25:x"}
    return {"benchmark": benchmark, "metrics": metrics or {"em": 0.5, "n": 2}, "provenance": {**base, **provenance}}


def test_provenance_differences_ignore_the_contestant_and_compare_the_searched_index():
    same = [_record(agent="x", dataset="p/one", retriever="bm25:a"),
            _record(agent="y", dataset="q/one", retriever="http://s", retriever_id="remote:bm25:x")]
    assert provenance_differences(same) == {}
    assert provenance_differences([_record(), _record(topk=5)]) == {"topk": [3, 5]}
    assert provenance_differences([_record(), _record(retriever_id="remote:http://h")]) == {
        "retriever_id": ["bm25:x", "remote:http://h"]}
    missing = _record()
    del missing["provenance"]["topk"]
    assert provenance_differences([_record(), missing]) == {"topk": [3, None]}
    assert provenance_differences([_record(max_new_tokens=256), _record(max_new_tokens=512),
                                   _record(max_new_tokens=256)]) == {"max_new_tokens": [256, 512, 256]}
    assert provenance_differences([_record(seed=1), _record(seed=1)]) == {}
    # only retriever_id names an index: another field's "remote:" prefix is part of its value
    assert provenance_differences([_record(prompt_template="remote:ab"), _record(prompt_template="ab")]) == {
        "prompt_template": ["remote:ab", "ab"]}
    assert provenance_differences([_record(retriever_id=None), _record(retriever_id="bm25:x")]) == {
        "retriever_id": [None, "bm25:x"]}


def test_search_error_rates_differ_only_beyond_the_tolerance():
    def rates(*values):
        return [{"metrics": {"search_error_rate": v}} for v in values]

    assert search_error_differences(rates(0.0, 0.005)) is None  # exactly the tolerance: comparable
    assert search_error_differences(rates(0.0, 0.0051)) == [0.0, 0.0051]
    assert search_error_differences(rates(0.0051, 0.0)) == [0.0051, 0.0]
    assert search_error_differences([{"metrics": {}}, {"metrics": {"search_error_rate": 0.5}}]) == [0.0, 0.5]
    assert search_error_differences([]) is None
    assert search_error_differences(rates(0.3, 0.3, 0.304)) is None  # equal failures on both sides: comparable


def test_compare_prints_every_metric_of_every_benchmark():
    a = [_record("nq", {"em": 0.5, "f1": 0.25, "n": 2, "mean_turns": 1.5}),
         _record("medqa", {"acc": 1.0, "n": 3})]
    b = [_record("nq", {"em": 0.125, "f1": 1.0, "n": 2, "mean_turns": 2.0})]
    assert compare([a, b], ["A", "B"]).splitlines() == [
        "benchmark  metric  A      B",
        "---------  ------  -----  -----",
        "medqa      acc     1.000  -",
        "           n       3      -",
        "nq         EM      0.500  0.125",
        "           F1      0.250  1.000",
        "           turns   1.500  2.000",
        "           n       2      2"]


@pytest.mark.parametrize("key, values", [("max_new_tokens", (256, 64)), ("max_turns", (4, 2)), ("topk", (3, 5)),
                                         ("seed", (0, 1)), ("prompt_template", ("ab", "cd")),
                                         ("dataset_sha256", ("x", "y")), ("split", ("dev", "test")),
                                         ("limit", (None, 10))])
def test_compare_refuses_results_produced_under_different_settings(key, values):
    a, b = [_record(**{key: values[0]})], [_record(**{key: values[1]})]
    with pytest.raises(ProvenanceMismatchError) as error:
        compare([a, b], ["A", "B"])
    assert str(error.value) == (f"nq: results are not comparable ({key}: {list(values)}); rerun under the same "
                                "settings or pass --force to print them flagged")
    flagged = compare([a, b], ["A", "B"], force=True).splitlines()
    assert flagged[2].split()[:3] == ["nq", "(!)", "EM"] and flagged[3].split()[0] == "n"
    assert flagged[3].startswith(" ")  # the flagged name on the benchmark's first row only
    assert flagged[-1] == f"!! nq NOT COMPARABLE: {key}: {list(values)}"


def test_compare_refuses_different_search_error_rates_with_both_reasons():
    a = [_record(metrics={"em": 0.5, "search_error_rate": 0.1}, topk=3)]
    b = [_record(metrics={"em": 0.5, "search_error_rate": 0.03456}, topk=5)]
    with pytest.raises(ProvenanceMismatchError, match=r"\(topk: \[3, 5\]; search_error_rate: \[0.1, 0.0346\]\)"):
        compare([a, b], ["A", "B"])
    lines = compare([a, b], ["A", "B"], force=True).splitlines()
    assert lines[-1] == "!! nq NOT COMPARABLE: topk: [3, 5]; search_error_rate: [0.1, 0.0346]"
    assert "search errors" in lines[3] and lines[3].split()[-2:] == ["0.100", "0.035"]


def test_a_benchmark_missing_from_one_side_is_compared_with_the_others_only():
    a = [_record("nq", topk=3), _record("hotpotqa", topk=3)]
    b = [_record("hotpotqa", topk=3)]
    c = [_record("nq", topk=3)]
    out = compare([a, b, c], ["A", "B", "C"]).splitlines()
    assert out[2].split() == ["hotpotqa", "EM", "0.500", "0.500", "-"]
    assert out[4].split() == ["nq", "EM", "0.500", "-", "0.500"]


def test_load_results_reads_a_folder_or_a_file_and_refuses_anything_else(tmp_path):
    records = [_record()]
    (tmp_path / "results.json").write_text(json.dumps(records))
    assert load_results(tmp_path) == records and load_results(str(tmp_path / "results.json")) == records
    with pytest.raises(FileNotFoundError) as error:
        load_results(tmp_path / "nowhere")
    assert str(error.value) == (f"no results.json at {tmp_path / 'nowhere'}; produce one with `stppo eval ... "
                                "--output-dir DIR`")
    bad = tmp_path / "bad.json"
    for content in (b"{not json", b"\xff\xfe\x00"):
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=f"^{bad} is not a readable results.json \\("):
            load_results(bad)
    for content in ({"benchmark": "nq", "metrics": {}}, [{"benchmark": "nq"}], [{"metrics": {}}], ["nq"],
                    [{"benchmark": "nq", "metrics": {}}, 3]):
        bad.write_text(json.dumps(content))
        with pytest.raises(ValueError) as error:
            load_results(bad)
        assert str(error.value) == f"{bad} is not a results.json of `stppo eval` (a list of benchmark records)"
    bad.write_text(json.dumps([{"benchmark": "nq", "metrics": {}, "extra": 1}]))
    assert load_results(bad) == [{"benchmark": "nq", "metrics": {}, "extra": 1}]
    bad.write_text(json.dumps([{"benchmark": "nq", "metrics": {}}]))  # the two required keys and nothing else
    assert load_results(bad) == [{"benchmark": "nq", "metrics": {}}]


def _recorded_with(**provenance):
    base = {"agent": "a", "dataset": "d", "retriever": "r", "topk": 3, "retriever_id": "bm25:x", "seed": 0,
            "max_new_tokens": 256}
    return {"benchmark": "nq", "metrics": {"em": 0.5, "n": 2}, "provenance": {**base, **provenance}}


@pytest.mark.parametrize("first_default", [True, False])
def test_compare_refuses_an_observation_cut_recorded_on_one_side_only(first_default):
    default, cut = _recorded_with(), _recorded_with(max_observation_tokens=256)
    records = [default, cut] if first_default else [cut, default]
    expected = [512, 256] if first_default else [256, 512]  # absent: the default, 512
    assert provenance_differences(records) == {"max_observation_tokens": expected}
    with pytest.raises(ProvenanceMismatchError, match="max_observation_tokens"):
        compare([[r] for r in records], ["A", "B"])


@pytest.mark.parametrize("key, odd", [("seed", 1), ("max_new_tokens", 64), ("topk", 5),
                                      ("retriever_id", "bm25:y"), ("max_observation_tokens", 128)])
def test_a_three_way_comparison_refuses_an_odd_one_out_in_the_middle(key, odd):
    a, b, c = _recorded_with(), _recorded_with(**{key: odd}), _recorded_with()
    assert key in provenance_differences([a, b, c])
    with pytest.raises(ProvenanceMismatchError, match=key):
        compare([[a], [b], [c]], ["A", "B", "C"])
    compare([[a], [_recorded_with()], [c]], ["A", "B", "C"])  # all alike: comparable
