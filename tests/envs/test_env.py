"""``stppo_envs.env.SearchQAEnv``: settings and their refusals, spaces, reset and seeding,
what reaches the retriever and on which turn a search is served, failed searches, scoring and the format reward,
the info each step carries. In-memory retrievers only."""

from __future__ import annotations

import pytest

from stppo_envs import SearchQAEnv
from stppo_envs.retrieval import RetrievalError
from tests.support.envs import RecordingRetriever, _env, _RaisingRetriever
from tests.support.retrievers import KeywordRetriever


@pytest.mark.parametrize("kwargs", [dict(topk=2.0), dict(max_turns="3"), dict(topk=True), dict(max_turns=2.5)])
def test_non_integer_topk_or_max_turns_is_refused(kwargs):
    with pytest.raises(ValueError, match=r"^topk and max_turns must be integers, got topk="):
        _env(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(topk=0), dict(max_turns=0), dict(topk=-1)])
def test_topk_and_max_turns_below_one_are_refused(kwargs):
    with pytest.raises(ValueError, match=r"^topk and max_turns must be >= 1, got topk="):
        _env(**kwargs)


def test_the_smallest_and_edge_settings_are_accepted_and_kept():
    env = _env(topk=1, max_turns=1, format_reward=1.0, render_mode="ansi", reward="f1", split=None)
    assert (env.topk, env.max_turns, env.format_reward, env.render_mode, env.reward_name) == (1, 1, 1.0, "ansi", "f1")
    assert _env(format_reward=0.0).format_reward == 0.0
    assert (env.dataset, env.split) == (None, None) and env.benchmark == "nq"
    assert _env(benchmark="NQ").benchmark == "nq"


@pytest.mark.parametrize("kwargs, message", [
    (dict(reward="accuracy"), r"^reward must be auto, em, f1 or acc; got 'accuracy'$"),
    (dict(format_reward=1.01), r"^format_reward must be in \[0, 1\], got 1.01$"),
    (dict(format_reward=-0.01), r"^format_reward must be in \[0, 1\], got -0.01$"),
    (dict(render_mode="human"), r"^render_mode must be None or 'ansi', got 'human'$"),
])
def test_bad_settings_are_refused_with_their_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _env(**kwargs)


def test_an_empty_dataset_is_refused(tmp_path):
    data = tmp_path / "nq.jsonl"
    data.write_text('{"id": "1", "question": "q", "golden_answers": ["a"]}\n')
    with pytest.raises(ValueError, match=r"holds no examples$"):
        _env(dataset=str(data), limit=0)


def test_spaces_bound_observations_and_actions_at_64k_characters():
    env = _env()
    assert env.observation_space.max_length == 65536 and env.action_space.max_length == 65536
    assert env.observation_space.contains("x" * 65536) and not env.observation_space.contains("x" * 65537)


def test_step_before_reset_is_refused():
    env = _env()
    with pytest.raises(RuntimeError, match=r"^the episode is over \(or was never started\)"):
        env.step("<answer>x</answer>")


def test_render_is_the_transcript_in_ansi_mode_and_none_otherwise():
    env = _env(render_mode="ansi")
    prompt, _ = env.reset(options={"index": 0})
    assert env.render() == prompt
    observation, *_ = env.step("<search> paris </search>")
    assert env.render() == prompt + "<search> paris </search>" + observation
    plain = _env()
    plain.reset(options={"index": 0})
    assert plain.render() is None


def test_custom_templates_are_used_for_open_and_multiple_choice_questions():
    open_env = _env(template="Q={question}|")
    prompt, _ = open_env.reset(options={"index": 0})
    assert prompt == f"Q={open_env.examples[0].question.strip().rstrip('?')}?|"
    mcq = _env(benchmark="medqa", mcq_template="Q={question}|{options}")
    prompt, info = mcq.reset(options={"index": 0})
    example = mcq.examples[0]
    assert prompt == f"Q={example.question}|" + "\n".join(f"{k}. {v}" for k, v in example.choices.items())
    assert info["choices"] == dict(example.choices)
    assert _env().template.startswith("Answer the given question.")
    assert mcq.template.startswith("Answer the given question.")
    assert _env(benchmark="medqa").mcq_template.startswith("Answer the given multiple-choice question.")


# --- SearchQAEnv: reset --------------------------------------------------------------------------------------

def test_reset_index_bounds_and_info():
    env = _env()
    last = len(env.examples) - 1
    prompt, info = env.reset(options={"index": last})
    example = env.examples[last]
    assert info == {"messages": [{"role": "user", "content": prompt}], "example_id": example.id,
                    "benchmark": example.benchmark, "index": last, "turn": 0,
                    "segments": [("user", prompt, -1)], "question": example.question, "choices": None}
    assert env.reset(options={"index": "0"})[1]["index"] == 0
    for bad in (last + 1, -1):
        with pytest.raises(IndexError, match=rf"^options\['index'\]={bad} outside 0\.\.{last}$"):
            env.reset(options={"index": bad})


def test_a_seed_reshuffles_even_in_the_middle_of_a_pass():
    env = _env()
    first = [env.reset(seed=3)[1]["index"] for _ in range(1)] + [env.reset()[1]["index"] for _ in range(2)]
    again = [env.reset(seed=3)[1]["index"]] + [env.reset()[1]["index"] for _ in range(2)]
    assert again == first


def test_reset_starts_a_new_episode_with_fresh_counts():
    env = _env(max_turns=2)
    env.reset(options={"index": 0})
    env.step("junk")
    *_, info = env.step("<answer>x</answer>")
    assert info["invalid_actions"] == 1
    env.reset(options={"index": 1})
    assert env.turn == 0 and len(env.transcript) == 1
    observation, reward, terminated, truncated, info = env.step("<search> paris </search>")
    assert (info["turn"], info["invalid_actions"], info["search_calls"], info["search_errors"]) == (1, 0, 1, 0)
    assert observation.startswith("\n\n<information>") and not terminated and not truncated


# --- SearchQAEnv: step -----------------------------------------------------------------------------------------

def test_the_query_reaches_the_retriever_sanitised_with_the_envs_topk():
    retriever = RecordingRetriever()
    env = _env(retriever=retriever, topk=3)
    env.reset(options={"index": 0})
    _, _, _, _, info = env.step("<search> paris\x00 capital\ud800 </search>")
    assert retriever.asked == [(["paris  capital\ufffd"], 3)]
    assert info["query"] == "paris\x00 capital\ud800"  # info keeps what the policy wrote


@pytest.mark.parametrize("max_turns", [1, 2, 3])
def test_searches_are_served_on_every_turn_but_the_last(max_turns):
    retriever = RecordingRetriever()
    env = _env(retriever=retriever, max_turns=max_turns)
    env.reset(options={"index": 0})
    results = [env.step(f"<search> paris {t} </search>") for t in range(max_turns)]
    assert [queries for queries, _ in retriever.asked] == [[f"paris {t}"] for t in range(max_turns - 1)]
    assert [r[3] for r in results] == [False] * (max_turns - 1) + [True]  # truncated on the last turn only
    assert [r[4]["turn"] for r in results] == list(range(1, max_turns + 1))
    assert results[-1][0] == "" and results[-1][4]["search_calls"] == max_turns - 1


def test_an_answer_on_the_last_turn_terminates_and_is_not_truncated():
    env = _env(max_turns=2)
    env.reset(options={"index": 0})
    env.step("<search> paris </search>")
    observation, reward, terminated, truncated, info = env.step("<answer>x</answer>")
    assert (observation, terminated, truncated, info["prediction"]) == ("", True, False, "x")


def test_a_long_search_result_is_cut_at_the_observation_limit():
    retriever = RecordingRetriever([("Big", "word " * 40000)])
    env = _env(retriever=retriever, topk=1)
    env.reset(options={"index": 0})
    observation, *_ = env.step("<search> word </search>")
    assert len(observation) == 65536 and observation.startswith("\n\n<information>Doc 1(Title: \"Big\") word")


def test_a_failed_search_reports_type_and_message_and_counts_once():
    env = _env(retriever=_RaisingRetriever(RetrievalError("index   closed\nnow")))
    env.reset(options={"index": 0})
    observation, reward, terminated, truncated, info = env.step("<search> q </search>")
    assert info["error"] == {"type": "RetrievalError", "message": "index   closed\nnow"}
    assert (info["search_errors"], info["search_calls"], info["query"]) == (1, 0, "q")
    assert observation == "\n\n<information>Search failed: index closed now</information>\n\n"
    with pytest.raises(ValueError):  # only retrieval errors are the env's to report
        env2 = _env(retriever=_RaisingRetriever(ValueError("a bug")))
        env2.reset(options={"index": 0})
        env2.step("<search> q </search>")


def test_search_errors_add_up_over_an_episode():
    env = _env(retriever=_RaisingRetriever(RetrievalError("down")), max_turns=4)
    env.reset(options={"index": 0})
    env.step("<search> a </search>")
    *_, info = env.step("<search> b </search>")
    assert (info["search_errors"], info["search_calls"]) == (2, 0)


def test_no_step_after_the_episode_ended():
    env = _env()
    env.reset(options={"index": 0})
    env.step("<answer>x</answer>")
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("<answer>again</answer>")
    truncated_env = _env(max_turns=1)
    truncated_env.reset(options={"index": 0})
    assert truncated_env.step("junk")[3]
    with pytest.raises(RuntimeError, match="call reset"):
        truncated_env.step("junk")


def test_the_question_mark_setting_decides_the_prompt(tmp_path):
    data = tmp_path / "nq.jsonl"
    data.write_text('{"id": "1", "question": "who wrote the iliad", "golden_answers": ["Homer"]}\n')
    marked = _env(dataset=str(data), template="{question}")
    plain = _env(dataset=str(data), template="{question}", question_mark=False)
    assert marked.reset(options={"index": 0})[0] == "who wrote the iliad?"
    assert plain.reset(options={"index": 0})[0] == "who wrote the iliad"


def test_step_info_carries_the_turn_type_and_counts():
    env = _env(max_turns=4)
    env.reset(options={"index": 0})
    *_, info = env.step("<search> paris </search>")
    assert {k: info[k] for k in ("turn", "action_type", "search_calls", "invalid_actions", "search_errors")} == \
           {"turn": 1, "action_type": "search", "search_calls": 1, "invalid_actions": 0, "search_errors": 0}
    assert (info["example_id"], info["question"]) == (env.examples[0].id, env.examples[0].question)
    assert info["segments"][1] == ("environment", info["segments"][1].text, 0)
    assert "prediction" not in info and "em" not in info  # scores only when the episode ends


# --- SearchQAEnv: the final reward -----------------------------------------------------------------------------

def _answer(env, text, index=0, before=()):
    env.reset(options={"index": index})
    for action in before:
        env.step(action)
    return env.step(f"<answer>{text}</answer>")


def test_open_question_scores_em_f1_and_the_chosen_reward():
    def gold_and_partial(reward):
        env = _env(reward=reward)
        gold = env.examples[0].golden_answers[0]
        return _answer(env, gold)[1], _answer(env, gold + " and more words")

    (gold_em, (_, partial_em, _, _, info)) = gold_and_partial("em")
    assert gold_em == 1.0 and partial_em == 0.0 and info["em"] == 0.0 and 0.0 < info["f1"] < 1.0
    assert info["golden_answers"] == list(_env().examples[0].golden_answers)
    _, (_, partial_f1, *_) = gold_and_partial("f1")
    assert partial_f1 == pytest.approx(info["f1"])
    _, (_, partial_acc, *_) = gold_and_partial("acc")  # acc of an open question is its exact match
    assert partial_acc == 0.0
    _, (_, partial_auto, *_) = gold_and_partial("auto")  # auto: em for open questions
    assert partial_auto == 0.0


def test_multiple_choice_scores_the_letter_under_every_reward():
    for reward in ("auto", "em", "f1", "acc"):
        env = _env(benchmark="medqa", reward=reward)
        example = env.examples[0]
        wrong = next(letter for letter in example.choices if letter != example.answer_letter)
        _, right_reward, *_, info = _answer(env, example.answer_letter)
        assert right_reward == 1.0 and info["correct"] == 1.0 and info["predicted_letter"] == example.answer_letter
        _, wrong_reward, *_, info = _answer(env, wrong)
        assert wrong_reward == 0.0 and info["correct"] == 0.0 and info["predicted_letter"] == wrong


@pytest.mark.parametrize("lam", [0.25, 1.0])
def test_format_reward_mixes_score_and_format(lam):
    env = _env(format_reward=lam)
    gold = env.examples[0].golden_answers[0]
    assert _answer(env, gold)[1] == pytest.approx(1.0)
    assert _answer(env, "zzz wrong")[1] == pytest.approx(lam)
    assert _answer(env, gold, before=["junk"])[1] == pytest.approx(1.0 - lam)
    env.reset(options={"index": 0})
    results = [env.step("<search> paris </search>") for _ in range(4)]  # truncated: no answer, no format credit
    assert results[-1][1] == 0.0 and results[-1][3]


def test_constructor_defaults():
    env = SearchQAEnv()
    assert (env.benchmark, env.topk, env.max_turns, env.reward_name, env.format_reward, env.question_mark) == \
           ("searchqa", 3, 4, "auto", 0.0, True)
    assert "demo-bm25" in repr(env.retriever) and env.render_mode is None and env.dataset is None


def test_the_loader_settings_reach_the_dataset(tmp_path):
    from stppo_envs.data.loading import load_examples

    data = tmp_path / "mine.jsonl"
    data.write_text('{"id": "m1", "question": "q one", "choices": ["x", "y"], "answer": "B"}\n'
                    '{"id": "m2", "question": "q two", "choices": ["x", "y"], "answer": "A"}\n')
    mcq = _env(benchmark="searchqa", dataset=str(data), family="mcq")  # the generic benchmark as multiple choice
    assert [e.id for e in mcq.examples] == ["m1", "m2"] and mcq.examples[0].is_multiple_choice
    assert mcq.dataset == str(data)
    train = _env(split="train")
    assert train.examples == load_examples("nq", None, "train") != _env().examples and train.split == "train"
    shuffled = _env(shuffle_seed=1, limit=5)
    assert shuffled.examples == load_examples("nq", None, None, 5, 1) != load_examples("nq", None, None, 5)


def test_before_the_first_reset_nothing_has_happened():
    env = _env(render_mode="ansi")
    assert env.turn == 0 and env.render() == "" and env.example is None


# --- env: topk and the last turn -----------------------------------------------------------------------------

class CountingRetriever(KeywordRetriever):
    def __init__(self):
        super().__init__([(f"T{i}", f"text {i} paris") for i in range(10)])
        self.ks: list[int] = []

    def batch_search(self, queries, k=10):
        self.ks.append(k)
        return super().batch_search(queries, k)


@pytest.mark.parametrize("topk", [1, 2, 5])
def test_env_step_passes_topk_to_the_retriever(topk):
    from stppo_envs import SearchQAEnv

    retriever = CountingRetriever()
    env = SearchQAEnv("nq", retriever=retriever, topk=topk, max_turns=3)
    env.reset(options={"index": 0})
    observation, *_ = env.step("<search> paris </search>")
    assert retriever.ks == [topk] and observation.count("Doc ") == topk


def test_a_search_on_the_last_turn_is_not_served():
    from stppo_envs import SearchQAEnv

    retriever = CountingRetriever()
    env = SearchQAEnv("nq", retriever=retriever, max_turns=2)
    env.reset(options={"index": 0})
    env.step("<search> paris </search>")
    _, reward, terminated, truncated, info = env.step("<search> paris again </search>")
    assert len(retriever.ks) == 1 and truncated and not terminated and reward == 0.0
