"""``stppo compare`` (stppo_agent/cli/compare.py): what it hands the comparison, and the
examples' content hash deciding whether two evaluations ran on the same examples."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_calls import Calls, run, usage_error
from tests.support.cli_in_process import stppo


@pytest.fixture
def evaluate(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def run(agent: str, out: str, *options: str) -> list[dict]:
        done = stppo("eval", "--agent", agent, "--benchmarks", "nq,hotpotqa", "--output-dir", out, *options,
                     capsys=capsys)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads((tmp_path / out / "results.json").read_text())
    return run


def test_the_same_examples_compare_whatever_limit_or_split_alias_chose_them(evaluate, capsys):
    plain = evaluate("oracle", "plain")
    size = max(r["metrics"]["n"] for r in plain)
    chosen = evaluate("search-copy", "chosen", "--limit", str(size), "--split", "dev")
    for a, b in zip(plain, chosen):  # what the two runs recorded differs; their examples do not
        assert a["provenance"]["dataset_sha256"] == b["provenance"]["dataset_sha256"]
        assert (a["provenance"]["limit"], b["provenance"]["limit"]) == (None, size)
    assert {r["provenance"]["split"] for r in plain if r["benchmark"] == "nq"} == {"test"}
    done = stppo("compare", "plain", "chosen", capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split()[-2:] == ["plain", "chosen"] and "NOT COMPARABLE" not in done.stdout
    em = {line.split()[0]: line.split()[-2:] for line in done.stdout.splitlines() if line.split()[1:2] == ["EM"]}
    assert em == {"hotpotqa": ["1.000", "0.000"], "nq": ["1.000", "0.000"]}


def test_a_limit_that_cuts_the_examples_is_still_refused(evaluate, capsys):
    evaluate("oracle", "plain")
    evaluate("search-copy", "cut", "--limit", "5")
    done = stppo("compare", "plain", "cut", capsys=capsys)
    assert done.returncode == 1 and "results are not comparable" in done.stderr
    assert "dataset_sha256" in done.stderr and "limit: [None, 5]" in done.stderr


# ---------------------------------------------------------------- compare, plot


def test_compare_hands_every_file_its_label_and_force(monkeypatch, capsys):
    from stppo_agent.evaluation import comparison
    from stppo_agent.runs import labels

    monkeypatch.setattr(comparison, "load_results", Calls(lambda path: [{"from": path}]))
    monkeypatch.setattr(labels, "distinct_labels", Calls(lambda paths: [p.upper() for p in paths]))
    monkeypatch.setattr(comparison, "compare", Calls("THE TABLE"))
    assert run(capsys, "compare", "a/results.json", "b") == (0, "THE TABLE\n", "")
    assert comparison.compare.only == (([[{"from": "a/results.json"}], [{"from": "b"}]], ["A/RESULTS.JSON", "B"],
                                        False), {})
    run(capsys, "compare", "a", "--force")
    assert comparison.compare.calls[-1][0][2] is True
    assert "required: results" in usage_error(capsys, "compare")
