"""Scoring, env and evaluation edge cases: yes/no F1, option letters, the eval observation cut, openai: stop tags
(probes of session 14: each test failed on the code before its fix)."""

from __future__ import annotations

import dataclasses

import pytest

from stppo_envs.scoring import f1_score


@pytest.mark.parametrize("prediction, golden, f1", [
    ("yes no", ["yes"], 0.0),  # a hedge naming both got 2/3 on every yes/no question (reward=f1 pays for it)
    ("no yes", ["no"], 0.0),
    ("no, they are not", ["no"], 0.0),  # SQuAD F1: 0.4
    ("yes", ["yes there is"], 0.0),  # a bare yes/no is right or wrong, never partly right
    ("Yes.", ["yes"], 1.0),
    ("yes", ["no", "Yes"], 1.0),  # any gold that matches
    ("Eiffel Tower in Paris", ["the Eiffel Tower"], 2 / 3),  # other answers keep SQuAD's token F1
    ("yesterday and today", ["yesterday"], 0.5),  # "yes" as part of a word is no yes/no answer
])
def test_f1_scores_yes_no_answers_all_or_nothing_as_hotpotqa_and_flashrag_do(prediction, golden, f1):
    assert f1_score(prediction, golden) == pytest.approx(f1)


DRUGS = {"A": "aspirin", "B": "insulin", "C": "warfarin", "D": "heparin"}


@pytest.mark.parametrize("prediction, letter", [
    ("$\\boxed{\\text{B}}$", "B"),  # nested LaTeX (R1-style models): the inner wrapper alone was removed -> None
    ("\\boxed{\\textbf{c}}", "C"), ("The answer is $\\boxed{\\text{(D)}}$", "D"),
    ("B (insulin)", "B"), ("(B) (insulin)", "B"), ("B insulin", "B"), ("B – insulin", "B"), ("B—insulin", "B"),
    ("insulin (B)", "B"), ("Insulin [b].", "B"), ("insulin - (B)", "B"),  # a letter with its own option's text
    ("B – because it lowers glucose", "B"), ("Answer – C", "C"),  # an en/em dash delimits like " - "
])
def test_a_letter_with_its_own_text_nested_latex_and_dashes_name_the_option(prediction, letter):
    from stppo_envs.scoring import extract_choice

    assert extract_choice(prediction, DRUGS) == letter


@pytest.mark.parametrize("prediction", [
    "B (warfarin)", "warfarin (B)", "B cells",  # letter and text disagree, or a word that starts with a letter
    "B (insulin) or C (warfarin)", "insulin (B) or warfarin (C)",  # hedges
    "vitamin (A)",
])
def test_a_letter_beside_other_text_still_names_no_option(prediction):
    from stppo_envs.scoring import extract_choice

    assert extract_choice(prediction, DRUGS) is None


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


@pytest.mark.parametrize("content, closed, action", [
    # a server that does not say which stop string it hit stopped at the one closing the *last* open tag: the
    # first unclosed tag (one the model only mentioned while thinking) got the closing, and the search was lost
    ("<think>use <answer> or search?</think>\n<search> capital of France", "search", "search"),
    ("<think>no <search> yet</think> <answer> Paris", "answer", "answer"),
    ("<search> q </search> <answer> a", "answer", "search"),  # the turn's first complete block decides
])
def test_openai_agent_closes_the_tag_the_server_stopped_in(monkeypatch, content, closed, action):
    from stppo_agent.evaluation import openai_agent
    from stppo_agent.evaluation.agents import EpisodeView
    from stppo_envs import Segment
    from stppo_envs.actions import parse_action

    class Response:
        def raise_for_status(self):
            pass

        def json(self):
            return {"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}

    monkeypatch.setattr(openai_agent.requests, "post", lambda *args, **kwargs: Response())
    agent = openai_agent.OpenAIChatAgent("http://h/v1", "m")
    [text] = agent.act([EpisodeView("q1", "Capital of France?", None, (Segment("user", "prompt", -1),), 0)])
    assert parse_action(text).type.value == action
    assert text == f"{content}</{closed}>"


@pytest.mark.parametrize("extra", [-1, 1])
def test_an_agent_that_returns_another_number_of_actions_than_episodes_is_refused(extra):
    # zip() paired what it could: an extra action went nowhere, a missing one left its episode to be asked again
    # (forever, for an agent that always drops one)
    from stppo_agent.evaluation.agents import NoSearchAgent
    from stppo_agent.evaluation.evaluate import run_episodes
    from stppo_envs import SearchQAEnv

    class OffByOne(NoSearchAgent):
        name = "off-by-one"

        def act(self, episodes):
            return super().act(episodes) + ["<answer> x </answer>"] * extra if extra > 0 else \
                super().act(episodes)[:extra]

    envs = [SearchQAEnv("nq", limit=2) for _ in range(2)]
    with pytest.raises(ValueError, match=f"agent off-by-one returned {2 + extra} actions for 2 episodes"):
        run_episodes(envs, OffByOne(), [0, 1])


@pytest.mark.parametrize("benchmark", ["searchqa", "nq"])
@pytest.mark.parametrize("record", [
    {"id": "1", "question": "Which drug lowers glucose?", "choices": ["aspirin", "insulin"], "answer": "B"},
    {"id": "1", "question": "Which drug lowers glucose?", "options": {"A": "aspirin", "B": "insulin"},
     "answer_idx": "B", "answer": "insulin"},
    {"id": "1", "question": "Which drug lowers glucose?", "opa": "aspirin", "opb": "insulin", "cop": 2,
     "answer": "insulin"},
])
def test_a_multiple_choice_record_is_refused_by_an_open_qa_benchmark(tmp_path, benchmark, record):
    # It loaded as open QA: the prompt lost the options and the gold became the letter "B" (or the option's text),
    # so the model was scored against an answer key it was never shown -- silently.
    import json

    from stppo_envs import DatasetFormatError
    from stppo_envs.data.loading import load_examples

    path = tmp_path / f"{benchmark}_test.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=r"multiple-choice record .* family='mcq'"):
        load_examples(benchmark, path)
    assert load_examples(benchmark, path, family="mcq")[0].answer_letter == "B"


def test_an_open_qa_record_with_an_empty_choices_field_still_loads(tmp_path):
    import json

    from stppo_envs.data.loading import load_examples

    path = tmp_path / "nq_test.jsonl"
    rows = [{"id": "1", "question": "Capital of France?", "golden_answers": ["Paris"], "choices": []},
            {"id": "2", "question": "Capital of Peru?", "golden_answers": ["Lima"], "choices": None}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    assert [(e.golden_answers, e.choices) for e in load_examples("nq", path)] == [(("Paris",), None), (("Lima",), None)]
