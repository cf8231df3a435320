"""``stppo_agent.runs.labels``: result labels take as many parent folders as it takes."""

from __future__ import annotations

from stppo_agent.runs.labels import distinct_labels


# -- labels --------------------------------------------------------------------------------------------------------
def test_labels_take_as_many_parents_as_it_takes_and_drop_results_json():
    assert distinct_labels(["runs/a/eval/results.json", "runs/b/eval/results.json", "x/c"]) == ["a/eval", "b/eval",
                                                                                              "c"]
    assert distinct_labels(["p/x/run/results.json", "q/x/run/results.json"]) == ["p/x/run", "q/x/run"]
    assert distinct_labels(["a/run", "b/other"]) == ["run", "other"]  # one part each is enough
    assert distinct_labels(["a/b/results.json"]) == ["b"]
    assert distinct_labels(["a/results.txt"]) == ["results.txt"]  # only results.json names its folder
    assert distinct_labels(["same/run", "same/run"]) == ["same/run", "same/run"]  # nothing tells them apart
    assert distinct_labels(["run", "x/run"]) == ["run", "x/run"]
    assert distinct_labels([]) == []
