"""``stppo_agent.evaluation.evaluate``: the settings a result records as its
provenance, every setting reaching the episodes it describes, episode records, metrics and the observation cut.
Scripted agents and an in-memory retriever."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import tqdm.auto

import stppo_envs
from stppo_agent.evaluation import evaluate as evaluate_module
from stppo_agent.evaluation.agents import OracleAgent
from stppo_agent.evaluation.evaluate import (
    EvalSettings,
    _episode_ids,
    evaluate_benchmark,
    examples_hash,
    portable_spec,
    run_episodes,
    summarize,
)
from stppo_agent.evaluation.results import evaluate_all
from stppo_envs import Example, SearchQAEnv
from stppo_envs.prompts import template_hash
from tests.support.evaluation import _no_search_factory
from tests.support.retrievers import FailingRetriever, KeywordRetriever


class IndexedRetriever(KeywordRetriever):
    """A keyword retriever reached through a server that names its index; records every batch's k."""

    index_id = "remote:remote:bm25:corpus-sha256:ab12"

    def __init__(self):
        super().__init__((("linguist", "Zaeththeiv Penda is a linguist."), ("chemist", "Kumsteth is a chemist.")))
        self.ks = []

    def batch_search(self, queries, k=10):
        self.ks.append(k)
        return super().batch_search(queries, k)


class ScriptAgent:
    """Even example numbers search once then answer their gold; odd ones answer "wrong" at once. Counts tokens."""

    name = "script"

    def __init__(self, examples):
        self.gold = {e.id: e.golden_answers[0] for e in examples}
        self.views, self.batches = [], []

    def act(self, episodes):
        self.batches.append([e.episode_id for e in episodes])
        self.views += episodes
        out = []
        for e in episodes:
            if int(e.example_id.rsplit("-", 1)[1]) % 2:
                out.append("<answer> wrong </answer>")
            elif e.turn == 0:
                out.append(f"<search> {e.question} </search>")
            else:
                out.append(f"<answer> {self.gold[e.example_id]} </answer>")
        return out

    def generated_tokens(self, episode_id):
        return len(episode_id)


class RecordingEnv(SearchQAEnv):
    resets: list = []

    def reset(self, *, seed=None, options=None):
        RecordingEnv.resets.append((seed, dict(options or {})))
        return super().reset(seed=seed, options=options)


@pytest.fixture
def recording_env(monkeypatch):
    RecordingEnv.resets = []
    monkeypatch.setattr(evaluate_module, "SearchQAEnv", RecordingEnv)
    return RecordingEnv


def _evaluate(settings, seen=None):
    def factory(spec, examples, max_new_tokens):
        agent = ScriptAgent(examples)
        if seen is not None:
            seen.update(spec=spec, examples=list(examples), max_new_tokens=max_new_tokens, agent=agent)
        return agent
    return evaluate_benchmark("script-agent", settings, agent_factory=factory)


# ---------------------------------------------------------------- evaluate_benchmark


def test_a_result_records_every_setting_it_ran_under(recording_env):
    retriever = IndexedRetriever()
    settings = EvalSettings("nq", limit=5, retriever=retriever, topk=2, max_turns=3, batch_size=2, seed=40,
                            max_new_tokens=17)
    seen = {}
    result = _evaluate(settings, seen)
    examples = SearchQAEnv("nq", limit=5).examples
    env = SearchQAEnv("nq", limit=5)
    assert result["provenance"] == {
        "agent": "script-agent", "benchmark": "nq", "dataset": "demo", "split": "test",
        "dataset_sha256": examples_hash(examples), "limit": 5, "retriever": "IndexedRetriever",
        "retriever_id": "bm25:corpus-sha256:ab12", "topk": 2, "max_turns": 3,
        "prompt_template": template_hash(env.template, env.mcq_template, "question_mark"),
        "seed": 40, "max_new_tokens": 17, "stppo_version": stppo_envs.__version__, "scoring_version": 2}
    assert set(result) == {"benchmark", "metrics", "provenance", "episodes", "timing"}
    assert result["benchmark"] == "nq"
    # the settings reached the episodes they describe
    assert seen["spec"] == "script-agent" and seen["max_new_tokens"] == 17
    assert [e.id for e in seen["examples"]] == [e.id for e in examples]
    assert retriever.ks and set(retriever.ks) == {2}
    assert {v.max_turns for v in seen["agent"].views} == {3}
    assert recording_env.resets == [(40 + i, {"index": i}) for i in range(5)]
    assert seen["agent"].batches[0] == ["demo-general-0", "demo-general-1"]  # batch_size episodes in flight
    assert max(len(b) for b in seen["agent"].batches) == 2
    assert retriever.batch_calls[0] == [examples[0].question]  # only the searching episode's query
    timing = result["timing"]
    assert set(timing) == {"started", "seconds"} and 0 <= timing["seconds"] < 60 and timing["started"] > 1.7e9


def test_metrics_and_episodes_of_an_evaluation():
    result = _evaluate(EvalSettings("nq", limit=5, retriever=IndexedRetriever(), batch_size=3))
    episodes = result["episodes"]
    assert [e["example_id"] for e in episodes] == [f"demo-general-{i}" for i in range(5)]
    assert [e["episode_id"] for e in episodes] == [f"demo-general-{i}" for i in range(5)]
    assert [e["em"] for e in episodes] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [e["turns"] for e in episodes] == [2, 1, 2, 1, 2]
    assert [e["response_tokens"] for e in episodes] == [14] * 5
    m = result["metrics"]
    assert m["n"] == 5 and m["em"] == pytest.approx(0.6) and "acc" not in m
    assert m["mean_turns"] == pytest.approx(1.6) and m["mean_search_calls"] == pytest.approx(0.6)
    assert m["answer_rate"] == 1.0 and m["invalid_action_rate"] == 0.0 and m["search_error_rate"] == 0.0
    assert m["mean_response_tokens"] == 14.0


def test_settings_change_the_provenance_and_defaults_are_recorded(tmp_path):
    base = _evaluate(EvalSettings("nq", limit=2, retriever=IndexedRetriever()))["provenance"]
    assert (base["topk"], base["max_turns"], base["seed"], base["max_new_tokens"], base["limit"]) == (3, 4, 0, 256, 2)
    data = tmp_path / "folder" / "mine.jsonl"
    data.parent.mkdir()
    data.write_text('{"id": "x-0", "question": "q?", "golden_answers": ["a"]}\n'
                    '{"id": "x-1", "question": "r?", "golden_answers": ["b"]}\n')
    other = _evaluate(EvalSettings("nq", dataset=str(data), split="dev", retriever=IndexedRetriever()))["provenance"]
    assert other["dataset"] == "mine.jsonl" and other["split"] == "dev" and other["limit"] is None
    assert other["dataset_sha256"] != base["dataset_sha256"]


def test_the_prompt_template_hash_follows_the_question_mark_setting(monkeypatch):
    class NoMark(SearchQAEnv):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, question_mark=False, **kwargs)

    marked = _evaluate(EvalSettings("nq", limit=1, retriever=IndexedRetriever()))["provenance"]["prompt_template"]
    monkeypatch.setattr(evaluate_module, "SearchQAEnv", NoMark)
    env = NoMark("nq", limit=1)
    plain = _evaluate(EvalSettings("nq", limit=1, retriever=IndexedRetriever()))["provenance"]["prompt_template"]
    assert plain == template_hash(env.template, env.mcq_template, "") != marked


def test_a_retriever_without_an_index_id_is_recorded_by_its_repr():
    class Plain(KeywordRetriever):
        def __repr__(self):
            return "remote:Plain()"

    provenance = _evaluate(EvalSettings("nq", limit=1, retriever=Plain()))["provenance"]
    assert provenance["retriever_id"] == "Plain()" and provenance["retriever"] == "Plain"


def test_batch_size_zero_still_runs_one_episode_at_a_time():
    seen = {}
    result = _evaluate(EvalSettings("nq", limit=3, retriever=IndexedRetriever(), batch_size=0), seen)
    assert result["metrics"]["n"] == 3 and all(len(b) == 1 for b in seen["agent"].batches)


def test_the_default_agent_builder_and_multiple_choice_metrics():
    result = evaluate_benchmark("oracle", EvalSettings("medqa", limit=3, retriever=IndexedRetriever()))
    m = result["metrics"]
    assert m["acc"] == 1.0 and "em" not in m and "f1" not in m and m["n"] == 3
    assert "mean_response_tokens" not in m and "response_tokens" not in result["episodes"][0]
    assert result["episodes"][0]["correct"] == 1.0 and "em" not in result["episodes"][0]


# ---------------------------------------------------------------- run_episodes and the records


def _envs(n, retriever, max_turns=3):
    return [SearchQAEnv("nq", retriever=retriever, max_turns=max_turns, limit=6) for _ in range(n)]


def test_run_episodes_record_of_one_searching_episode():
    retriever = IndexedRetriever()
    envs = _envs(1, retriever)
    agent = ScriptAgent(envs[0].examples)
    [record] = run_episodes(envs, agent, [0])
    env = envs[0]
    question = env.examples[0].question
    transcript = [{"role": s.role, "text": s.text, "turn": s.turn} for s in env.transcript]
    assert [t["role"] for t in transcript] == ["user", "assistant", "environment", "assistant", "environment"]
    assert transcript[1]["text"] == f"<search> {question} </search>" and "linguist" in transcript[2]["text"]
    assert record == {
        "example_id": "demo-general-0", "episode_id": "demo-general-0", "reward": 1.0, "terminated": True,
        "truncated": False, "question": question, "golden_answers": ["linguist"], "prediction": "linguist",
        "turns": 2, "search_calls": 1, "invalid_actions": 0, "search_errors": 0,
        "response_chars": len(f"<search> {question} </search>") + len("<answer> linguist </answer>"),
        "transcript": transcript, "em": 1.0, "f1": 1.0, "response_tokens": 14}
    assert type(record["terminated"]) is bool and type(record["truncated"]) is bool


def test_run_episodes_counts_failed_searches_and_truncation():
    envs = _envs(2, FailingRetriever(), max_turns=2)

    class Searcher:
        def act(self, episodes):
            return [f"<search> {e.question} </search>" for e in episodes]

    records = run_episodes(envs, Searcher(), [0, 1])
    assert [r["search_errors"] for r in records] == [1, 1] and [r["search_calls"] for r in records] == [0, 0]
    assert [r["truncated"] for r in records] == [True, True] and [r["terminated"] for r in records] == [False] * 2
    assert [r["prediction"] for r in records] == [None, None] and "response_tokens" not in records[0]
    invalid = run_episodes(_envs(1, FailingRetriever(), max_turns=1), type("A", (), {"act": lambda s, e: ["hm"]})(),
                           [2])
    assert invalid[0]["invalid_actions"] == 1 and invalid[0]["turns"] == 1


def test_run_episodes_in_chunks_keeps_file_order_and_seeds_each_example(recording_env):
    retriever = IndexedRetriever()
    envs = [RecordingEnv("nq", retriever=retriever, max_turns=3, limit=6) for _ in range(2)]
    agent = ScriptAgent(envs[0].examples)
    records = run_episodes(envs, agent, [4, 1, 0, 5, 2], seed=7)
    assert [r["example_id"] for r in records] == [f"demo-general-{i}" for i in (4, 1, 0, 5, 2)]
    assert recording_env.resets == [(7 + i, {"index": i}) for i in (4, 1, 0, 5, 2)]
    # chunk (4, 1): 4 searches while 1 answers; then 4 alone answers -> finished ones leave the batch
    assert agent.batches[:2] == [["demo-general-4", "demo-general-1"], ["demo-general-4"]]
    assert agent.batches[2] == ["demo-general-0", "demo-general-5"]
    assert retriever.batch_calls[:2] == [[envs[0].examples[4].question], [envs[0].examples[0].question]]
    views = [v for v in agent.views if v.episode_id == "demo-general-4"]
    assert [v.turn for v in views] == [0, 1] and [len(v.transcript) for v in views] == [1, 3]
    assert views[0].question == envs[0].examples[4].question and views[0].choices is None
    assert views[0].example_id == "demo-general-4"


def test_episode_ids_are_unique_within_a_run():
    assert _episode_ids(["a", "b", "a", "a#2", "a"]) == ["a", "b", "a#2", "a#2#2", "a#3"]
    assert _episode_ids([]) == []


def test_summarize_means_rates_and_tokens():
    def rec(em, f1, turns, searches, chars, terminated=True, **extra):
        return {"em": em, "f1": f1, "turns": turns, "search_calls": searches, "search_errors": 0,
                "invalid_actions": 0, "response_chars": chars, "terminated": terminated, **extra}

    records = [rec(1.0, 1.0, 2, 1, 10, response_tokens=4), rec(0.0, 0.5, 4, 3, 30, terminated=False,
                                                                response_tokens=8)]
    assert summarize(records, False) == {
        "n": 2, "em": 0.5, "f1": 0.75, "answer_rate": 0.5, "invalid_action_rate": 0.0, "search_error_rate": 0.0,
        "mean_turns": 3.0, "mean_search_calls": 2.0, "mean_response_chars": 20.0, "mean_response_tokens": 6.0}
    del records[1]["response_tokens"]  # tokens only when every episode counted them
    assert "mean_response_tokens" not in summarize(records, False)
    mcq = summarize([{**rec(0, 0, 1, 0, 5), "correct": 1.0}, {**rec(0, 0, 1, 0, 5), "correct": 0.0}], True)
    assert mcq["acc"] == 0.5 and "em" not in mcq and "f1" not in mcq
    empty = summarize([], False)
    assert empty["n"] == 0 and empty["em"] == 0.0 and empty["mean_turns"] == 0.0
    assert "mean_response_tokens" not in empty


# ---------------------------------------------------------------- provenance helpers


@pytest.mark.parametrize("spec, expected", [
    ("bm25:/data/idx/wiki", "bm25:wiki"), ("dense:/data/e5/index", "dense:e5/index"), ("demo", "demo"),
    ("bm25:", "bm25:"), ("http://host:8000/retrieve", "http://host:8000/retrieve"), ("other:/a/b", "other:/a/b"),
    ("bm25:relative-name", "bm25:relative-name"), ("bm25:/data/v1:2/wiki", "bm25:wiki")])
def test_portable_spec(spec, expected):
    assert portable_spec(spec) == expected


def test_portable_spec_of_a_retriever_object_is_its_class_name():
    assert portable_spec(IndexedRetriever()) == "IndexedRetriever"


def test_examples_hash_is_the_canonical_json_lines_digest():
    examples = [Example("q1", "Wo liegt München?", ("Bayern",), "nq"), Example("q2", "Capital?", ("Paris",), "nq")]
    lines = "".join(json.dumps(e.to_dict(), sort_keys=True, ensure_ascii=False) + "\n" for e in examples)
    assert examples_hash(examples) == hashlib.sha256(lines.encode("utf-8")).hexdigest()
    assert examples_hash(examples[::-1]) != examples_hash(examples)  # order is part of the data
    assert examples_hash([]) == hashlib.sha256(b"").hexdigest()


def test_evaluate_all_runs_each_named_benchmark_with_its_dataset_and_the_settings(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(evaluate_module, "evaluate_benchmark",
                        lambda agent, settings: calls.append((agent, settings)) or {"benchmark": settings.benchmark})
    out = evaluate_all("oracle", ["nq", "medqa"], {"medqa": "/data/medqa.jsonl"}, "dev", 7, "demo", 5, 2, 16, 3,
                       max_new_tokens=33)
    assert out == [{"benchmark": "nq"}, {"benchmark": "medqa"}]
    assert calls == [("oracle", EvalSettings("nq", None, "dev", 7, "demo", 5, 2, 16, 3, 33)),
                     ("oracle", EvalSettings("medqa", "/data/medqa.jsonl", "dev", 7, "demo", 5, 2, 16, 3, 33))]
    assert capsys.readouterr().out == ""  # nothing chosen for a scripted agent
    evaluate_all("oracle", ["nq"], {}, None, None, "demo", 3, 4, 32, 0)
    assert calls[-1][1].max_new_tokens == 256
    with pytest.raises(Exception):
        evaluate_all("oracle", ["nq", "no-such-benchmark"], {}, None, None, "demo", 3, 4, 32, 0)
    assert len(calls) == 3  # an unknown name fails before any benchmark runs


def test_evaluate_all_evaluates_the_checkpoint_the_spec_resolves_to_and_says_which(monkeypatch, capsys):
    from stppo_agent.evaluation import agent_specs

    calls = []
    monkeypatch.setattr(agent_specs, "resolve_agent_spec",
                        lambda spec: ("hf:run/checkpoints/step-2/actor", "run@best = step-2"))
    monkeypatch.setattr(evaluate_module, "evaluate_benchmark",
                        lambda agent, settings: calls.append(agent) or {"benchmark": settings.benchmark})
    evaluate_all("hf:run@best", ["nq"], {}, None, None, "demo", 3, 4, 32, 0)
    assert calls == ["hf:run/checkpoints/step-2/actor"]
    assert capsys.readouterr().out == "agent run@best = step-2\n"


def test_run_episodes_shows_each_episode_its_own_id_and_the_options_and_stays_silent_off_a_terminal(capsys):
    class Recorder:
        def __init__(self):
            self.views = []

        def act(self, episodes):
            self.views += episodes
            return ["<answer> A </answer>"] * len(episodes)

    envs = [RecordingEnv("medqa", retriever=IndexedRetriever(), limit=3) for _ in range(2)]
    RecordingEnv.resets = []
    agent = Recorder()
    records = run_episodes(envs, agent, [1, 1])
    assert [v.episode_id for v in agent.views] == ["demo-medical-1", "demo-medical-1#2"]
    assert agent.views[0].choices == envs[0].examples[1].choices and agent.views[0].choices
    assert RecordingEnv.resets == [(1, {"index": 1}), (1, {"index": 1})]  # seed 0 + the example's index
    assert [r["episode_id"] for r in records] == ["demo-medical-1", "demo-medical-1#2"]
    assert "correct" in records[0] and "em" not in records[0]
    out, err = capsys.readouterr()
    assert out == "" and err == ""  # no progress bar in logs and CI


def test_the_split_setting_chooses_the_file_of_a_dataset_folder(tmp_path):
    folder = tmp_path / "nq"
    folder.mkdir()
    (folder / "nq_train.jsonl").write_text('{"id": "train-1", "question": "q?", "golden_answers": ["a"]}\n')
    (folder / "nq_dev.jsonl").write_text('{"id": "dev-0", "question": "r?", "golden_answers": ["b"]}\n')
    result = _evaluate(EvalSettings("nq", dataset=str(folder), split="dev", retriever=IndexedRetriever()))
    assert [e["example_id"] for e in result["episodes"]] == ["dev-0"]
    assert result["provenance"]["split"] == "dev" and result["provenance"]["dataset"] == "nq"
    train = _evaluate(EvalSettings("nq", dataset=str(folder), split="train", retriever=IndexedRetriever()))
    assert [e["example_id"] for e in train["episodes"]] == ["train-1"]


# Evaluation cuts observations where training does, and counts how often.


def _tiny_smollm2_model(path):
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer
    from stppo_agent.models.tiny import build_tiny_llama

    return build_tiny_llama(path, load_tokenizer(str(smollm2_path())), hidden=16, layers=1, seed=5)


def test_eval_cuts_observations_where_told_and_says_how_often_it_cut(tmp_path):
    # A wiki-18 observation of 5 passages is ~800 SmolLM2 tokens (3 passages: 410-600): the hf: agent cut every one
    # to a fixed 512 tokens -- passages 4 and 5 and the closing tag gone -- and the results said topk=5, nothing else.
    from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
    from stppo_agent.evaluation.results import format_table

    model = _tiny_smollm2_model(tmp_path / "tiny")
    settings = EvalSettings("nq", limit=2, max_turns=3, max_new_tokens=4)
    default = evaluate_benchmark(f"hf:{model}", settings)
    cut = evaluate_benchmark(f"hf:{model}", dataclasses.replace(settings, max_observation_tokens=16))
    # the random model's turns are invalid: each is answered by Search-R1's ~60-token corrective message
    assert [e["turns"] for e in cut["episodes"]] == [3, 3]
    assert [e["observations_cut"] for e in cut["episodes"]] == [2, 2]  # both observations the agent read
    assert cut["metrics"]["observation_cut_rate"] == 1.0
    assert [e["observations_cut"] for e in default["episodes"]] == [0, 0]
    assert default["metrics"]["observation_cut_rate"] == 0.0
    # recorded where it is not the default, so compare refuses a 16-token cut beside a 512-token one; results made
    # before the setting existed (all at 512) stay comparable with the default
    assert cut["provenance"]["max_observation_tokens"] == 16 and "max_observation_tokens" not in default["provenance"]
    assert "obs cut" in format_table([default, cut]) and "obs cut" not in format_table([default])


def test_the_eval_observation_cut_defaults_to_trainings():
    from stppo_agent.evaluation.evaluate import EvalSettings, observation_cut
    from stppo_agent.rollouts.turn_loop import RolloutLimits

    # unset, an agent that does not say what it reads is taken to read what training did
    assert observation_cut(object(), EvalSettings("nq")) == RolloutLimits.max_observation_tokens == 512


def test_the_cut_rate_counts_the_observations_the_agent_read():
    from stppo_agent.evaluation.evaluate import summarize

    def rec(turns, cut):
        return {"em": 0.0, "f1": 0.0, "turns": turns, "search_calls": 0, "search_errors": 0, "invalid_actions": 0,
                "response_chars": 1, "terminated": True, "observations_cut": cut}

    # an episode of t turns read t - 1 observations (the last turn's is never read)
    assert summarize([rec(3, 1), rec(1, 0), rec(2, 1)], False)["observation_cut_rate"] == pytest.approx(2 / 3)
    uncounted = {k: v for k, v in rec(2, 0).items() if k != "observations_cut"}  # a scripted agent reads none
    assert "observation_cut_rate" not in summarize([rec(2, 0), uncounted], False)


def test_evaluate_all_hands_the_observation_budget_to_every_benchmark(monkeypatch):
    from stppo_agent.evaluation import evaluate as evaluate_module
    from stppo_agent.evaluation.results import evaluate_all

    seen = []
    monkeypatch.setattr(evaluate_module, "evaluate_benchmark", lambda agent, settings: seen.append(settings) or {})
    evaluate_all("oracle", ["nq", "hotpotqa"], {}, None, None, "demo", 3, 4, 32, 0, 256, 1024)
    evaluate_all("oracle", ["nq"], {}, None, None, "demo", 3, 4, 32, 0)
    assert [s.max_observation_tokens for s in seen] == [1024, 1024, None]  # None: the agent's own (hf: 512)


class _Bar:
    made: list[_Bar] = []

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.ticks, self.closed = args, kwargs, [], False
        _Bar.made.append(self)

    def update(self, n=1):
        self.ticks.append(n)

    def close(self):
        self.closed = True


def test_the_progress_bar_counts_every_episode_of_the_run(monkeypatch):
    _Bar.made = []
    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    envs = [SearchQAEnv("nq", max_turns=2, limit=4) for _ in range(2)]
    records = run_episodes(envs, OracleAgent(envs[0].examples), [0, 1, 2])
    assert len(records) == 3
    [bar] = _Bar.made
    assert bar.args == ()
    assert bar.kwargs == {"total": 3, "desc": "nq", "unit": "episode", "disable": None, "leave": False}
    assert bar.ticks == [1, 1, 1] and bar.closed


def test_an_agent_without_a_name_is_named_by_its_class_when_it_drops_an_action():
    class TerseAgent:
        def act(self, episodes):
            return ["<answer> x </answer>"] * (len(episodes) - 1)

    envs = [SearchQAEnv("nq", max_turns=2, limit=4) for _ in range(2)]
    with pytest.raises(ValueError, match="^agent TerseAgent returned 1 actions for 2 episodes$"):
        run_episodes(envs, TerseAgent(), [0, 1])


def test_the_default_observation_cut_is_not_recorded():
    settings = EvalSettings("nq", limit=1, retriever=KeywordRetriever())
    provenance = evaluate_benchmark("no-search", settings, agent_factory=_no_search_factory)["provenance"]
    assert "max_observation_tokens" not in provenance


def test_evaluate_all_hands_the_observation_cut_and_the_token_budget_to_every_benchmark(monkeypatch):
    calls = []
    monkeypatch.setattr(evaluate_module, "evaluate_benchmark",
                        lambda agent, settings: calls.append(settings) or {"benchmark": settings.benchmark})
    evaluate_all("oracle", ["nq", "hotpotqa"], {}, None, None, "demo", 5, 2, 16, 3, max_new_tokens=33,
                 max_observation_tokens=77)
    assert [(s.benchmark, s.topk, s.max_turns, s.batch_size, s.seed, s.max_new_tokens, s.max_observation_tokens)
            for s in calls] == [("nq", 5, 2, 16, 3, 33, 77), ("hotpotqa", 5, 2, 16, 3, 33, 77)]


def _record(turns: int, cut: int) -> dict:
    return {"em": 0.0, "f1": 0.0, "terminated": True, "truncated": False, "invalid_actions": 0, "search_calls": 0,
            "search_errors": 0, "turns": turns, "response_chars": 0, "observations_cut": cut}


def test_one_observation_read_and_cut_is_a_cut_rate_of_one():
    assert summarize([_record(2, 1)], multiple_choice=False)["observation_cut_rate"] == 1.0
    assert summarize([_record(1, 0)], multiple_choice=False)["observation_cut_rate"] == 0.0
