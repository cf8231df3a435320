"""``stppo eval`` (stppo_agent/cli/evaluate.py): every option's default and what reaches
``evaluate_all``, the refusals naming the fix, the verdict on failing searches, the warning where observations
were cut, and ``--output-dir`` checked before any episode and written whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stppo_agent.cli.evaluate import warn_of_cut_observations
from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS
from tests.support.cli_calls import Calls, plugin_file, run, usage_error
from tests.support.cli_in_process import stppo
from tests.support.recording_agent import recording_agent, was_built

# ---------------------------------------------------------------- eval


def _eval(monkeypatch, metrics=None):
    from stppo_agent.evaluation import results

    metrics = metrics or {}
    found = Calls(lambda agent, benchmarks, *_: [{"benchmark": b, "metrics": metrics.get(b, {})} for b in benchmarks])
    monkeypatch.setattr(results, "evaluate_all", found)
    monkeypatch.setattr(results, "write_results", Calls())
    monkeypatch.setattr(results, "format_table", Calls("TABLE"))
    return results


EVAL = ("eval", "--agent", "oracle", "--benchmarks", "nq", "--output-dir", "out")


def test_evaluate_defaults_reach_evaluate_all(monkeypatch, capsys):
    results = _eval(monkeypatch)
    assert run(capsys, *EVAL) == (0, "TABLE\n", "")
    args, kwargs = results.evaluate_all.only
    assert (args, kwargs) == (("oracle", ["nq"], {}, None, None, "demo", 3, 4, 32, 0, 256, None), {})
    written, _ = results.write_results.only
    assert written == ([{"benchmark": "nq", "metrics": {}}], Path("out"))
    assert results.format_table.only == (([{"benchmark": "nq", "metrics": {}}],), {})


def test_evaluate_every_option_reaches_evaluate_all(monkeypatch, capsys, tmp_path):
    results = _eval(monkeypatch)
    plugin = plugin_file(tmp_path)
    code, _, _ = run(capsys, "eval", "--agent", "search-copy", "--benchmarks", " NQ, ,HotpotQA ", "--dataset",
                     "nq=demo", "--dataset", "HotpotQA=data/hp", "--split", "dev", "--limit", "5", "--retriever",
                     "bm25:idx", "--topk", "7", "--max-turns", "2", "--batch-size", "9", "--seed", "11",
                     "--max-new-tokens", "64", "--max-observation-tokens", "700", "--output-dir", str(tmp_path / "o"),
                     "--import", str(plugin))
    assert code == 0
    assert results.evaluate_all.only == (("search-copy", ["nq", "hotpotqa"], {"nq": "demo", "hotpotqa": "data/hp"},
                                          "dev", 5, "bm25:idx", 7, 2, 9, 11, 64, 700), {})
    assert results.write_results.only[0][1] == tmp_path / "o"
    import sys

    assert getattr(sys.modules.get(plugin.stem), "LOADED", False)


def test_evaluate_refusals_name_the_fix(monkeypatch, capsys):
    results = _eval(monkeypatch)
    code, _, err = run(capsys, *EVAL, "--dataset", "hotpotqa=x")
    assert code == 1 and err == ("stppo eval: error: --dataset given for hotpotqa, which --benchmarks (nq) does not "
                                 "include; add it to --benchmarks or drop the --dataset\n")
    code, _, err = run(capsys, "eval", "--agent", "oracle", "--benchmarks", "musique,nq", "--output-dir", "o",
                       "--dataset", "popqa=x", "--dataset", "hotpotqa=y")
    assert code == 1 and err.startswith("stppo eval: error: --dataset given for hotpotqa, popqa, which --benchmarks "
                                        "(musique, nq) does not include")
    code, _, err = run(capsys, *EVAL, "--dataset", "nq=data/nq.jsonl")
    assert code == 1 and err == (
        "stppo eval: error: --dataset nq=... is real data, but no --retriever was given: the default demo corpus "
        "(a fictional encyclopedia) cannot answer it. Pass --retriever bm25:DIR, dense:DIR or http://HOST:PORT "
        "(stppo index bm25 --corpus ... builds one), or --retriever demo to search the demo corpus anyway\n")
    code, _, err = run(capsys, *EVAL, "--retriever", "bm52:idx")
    assert code == 1 and "did you mean bm25?" in err
    assert results.evaluate_all.calls == []  # nothing ran for any of them
    # the demo set named explicitly, or an empty source, is not real data; an explicit retriever serves real data
    for dataset in ("nq=demo", "nq="):
        assert run(capsys, *EVAL, "--dataset", dataset)[0] == 0
    assert run(capsys, *EVAL, "--dataset", "nq=data/nq.jsonl", "--retriever", "demo")[0] == 0
    assert results.evaluate_all.calls[-1][0][5] == "demo"


def test_evaluate_options_refuse_bad_values(monkeypatch, capsys):
    _eval(monkeypatch)
    for flag in ("--topk", "--max-turns", "--batch-size", "--limit", "--max-new-tokens"):
        assert "must be >= 1" in usage_error(capsys, *EVAL, flag, "0"), flag
    assert "invalid int" in usage_error(capsys, *EVAL, "--seed", "x")
    assert "invalid float" in usage_error(capsys, *EVAL, "--max-search-error-rate", "x")
    for missing in ("--agent", "--benchmarks", "--output-dir"):
        argv = list(EVAL)
        del argv[argv.index(missing):argv.index(missing) + 2]
        assert missing in usage_error(capsys, *argv)


def test_evaluate_search_errors_above_the_limit_exit_1(monkeypatch, capsys):
    _eval(monkeypatch, {"nq": {"search_error_rate": 0.02}, "hotpotqa": {"search_error_rate": 0.01}})
    code, out, err = run(capsys, "eval", "--agent", "oracle", "--benchmarks", "nq,hotpotqa", "--output-dir", "o")
    assert code == 1 and out == "TABLE\n"  # results written and shown, the status says they are broken
    assert err == ("stppo eval: error: searches failed (nq 2.0%; limit 1.0%): these scores measure a failing "
                   "retriever, not the agent. Check the retriever (a server that is down?) and rerun; "
                   "--max-search-error-rate raises the limit.\n")
    assert run(capsys, "eval", "--agent", "oracle", "--benchmarks", "nq,hotpotqa", "--output-dir", "o",
               "--max-search-error-rate", "0.5")[0] == 0


def test_evaluate_search_error_verdict_boundary_and_missing_rates(capsys):
    from stppo_agent.cli.evaluate import search_error_verdict

    def result(name, **metrics):
        return {"benchmark": name, "metrics": metrics}

    assert search_error_verdict([result("nq", search_error_rate=0.01)], 0.01) == 0  # at the limit: fine
    assert search_error_verdict([result("nq")], 0.0) == 0  # no searches reported: none failed
    assert capsys.readouterr().err == ""
    rates = [result("nq", search_error_rate=0.5), result("popqa", search_error_rate=0.0),
             result("hotpotqa", search_error_rate=0.125)]
    assert search_error_verdict(rates, 0.1) == 1
    assert "(nq 50.0%, hotpotqa 12.5%; limit 10.0%)" in capsys.readouterr().err


# `stppo eval --output-dir`: checked before any episode (a folder that cannot be written, another agent's results,
# which --overwrite replaces; a training run's own checkpoints replace theirs), and written so that a failure part-way
# leaves the previous results whole.


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


# Input given by mistake is refused with the fix named.


@pytest.mark.parametrize("names, twice", [("nq,hotpotqa,nq", "nq"), ("mmlu_med,mmlu-medical", "mmlu_med")])
def test_eval_refuses_a_benchmark_named_twice(tmp_path, capsys, names, twice):
    # evaluated twice it wrote two records of one benchmark: the QA average counted it twice, compare read one
    done = stppo("eval", "--agent", "oracle", "--benchmarks", names, "--limit", "1",
                 "--output-dir", str(tmp_path / "out"), capsys=capsys)
    assert done.returncode == 1 and f"--benchmarks names {twice} twice" in done.stderr
    assert not (tmp_path / "out").exists()


def test_eval_refuses_a_search_error_limit_outside_zero_to_one(tmp_path, capsys):
    # -1 reported "searches failed (nq 0.0%; limit -100.0%)" for searches that never failed
    with pytest.raises(SystemExit):
        stppo("eval", "--agent", "oracle", "--benchmarks", "nq", "--limit", "1", "--max-search-error-rate", "-0.1",
              "--output-dir", str(tmp_path / "out"), capsys=capsys)
    assert "--max-search-error-rate: must be a share in [0, 1], got -0.1" in capsys.readouterr().err
    done = stppo("eval", "--agent", "oracle", "--benchmarks", "nq", "--limit", "1", "--max-search-error-rate", "0",
                 "--output-dir", str(tmp_path / "ok"), capsys=capsys)
    assert done.returncode == 0
    assert [r["benchmark"] for r in json.loads((tmp_path / "ok" / "results.json").read_text())] == ["nq"]


def test_eval_refuses_two_datasets_for_one_benchmark(tmp_path, capsys):
    # the second silently replaced the first (a dict); which file was evaluated depended on the flags' order
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, answer in ((first, "x"), (second, "y")):
        path.write_text(json.dumps({"id": "q1", "question": "Who?", "golden_answers": [answer]}) + "\n")
    done = stppo("eval", "--agent", "oracle", "--benchmarks", "nq", "--retriever", "demo", "--dataset", f"nq={first}",
                 "--dataset", f"NQ={second}", "--output-dir", str(tmp_path / "out"), capsys=capsys)
    assert done.returncode == 1 and "--dataset names nq twice" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_warning_word_for_word(capsys):
    warn_of_cut_observations([
        {"benchmark": "nq", "metrics": {"observation_cut_rate": 0.125}, "provenance": {}},
        {"benchmark": "popqa", "metrics": {"observation_cut_rate": 1.0}, "provenance": {"max_observation_tokens": 9}},
    ])
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        f"stppo eval: warning: observations were cut (nq 12.5% at {DEFAULT_MAX_OBSERVATION_TOKENS} tokens, popqa "
        "100.0% at 9 tokens; share of those the agent read), as in training (max_observation_tokens): the agent did "
        "not see every passage --topk asked for; --max-observation-tokens raises the limit.\n")


def test_a_zero_or_missing_cut_rate_says_nothing(capsys):
    warn_of_cut_observations([{"benchmark": "nq", "metrics": {"observation_cut_rate": 0.0}, "provenance": {}},
                              {"benchmark": "toy", "metrics": {}, "provenance": {}}])
    assert capsys.readouterr().err == ""


def test_the_smallest_cut_is_reported(capsys):
    warn_of_cut_observations([{"benchmark": "nq", "metrics": {"observation_cut_rate": 1e-4},
                               "provenance": {"max_observation_tokens": 512}}])
    assert "(nq 0.0% at 512 tokens;" in capsys.readouterr().err


# The warning where observations were cut.


def test_eval_warns_where_observations_were_cut(capsys):
    from stppo_agent.cli.evaluate import warn_of_cut_observations

    results = [{"benchmark": "nq", "metrics": {"observation_cut_rate": 0.25}, "provenance": {}},
               {"benchmark": "hotpotqa", "metrics": {"observation_cut_rate": 0.0}, "provenance": {}},
               {"benchmark": "popqa", "metrics": {"observation_cut_rate": 0.5},
                "provenance": {"max_observation_tokens": 9}},
               {"benchmark": "medqa", "metrics": {}, "provenance": {}}]  # a scripted agent cuts nothing
    warn_of_cut_observations(results)
    err = capsys.readouterr().err
    assert "observations were cut (nq 25.0% at 512 tokens, popqa 50.0% at 9 tokens;" in err
    assert "hotpotqa" not in err
    warn_of_cut_observations(results[1:2] + results[3:])
    assert capsys.readouterr().err == ""
