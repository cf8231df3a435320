"""Pins for the environment slice (env.py, vector.py, prompts.py): values, boundaries and directions that the
broader tests leave open (issue 27: one-line bugs in what reaches the retriever, at which turn a search is
served, autoreset, spaces, dtypes). In-memory retrievers only; every test runs in well under a second."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.vector.utils import batch_space

from stppo_envs import SearchQAEnv, make_vec
from stppo_envs.retrieval import Hit, RetrievalError
from stppo_envs.vector import SearchQAVectorEnv, step_envs

from .conftest import KeywordRetriever

PASSAGES = [(f"T{i}", f"passage {i} about paris") for i in range(6)]


class RecordingRetriever(KeywordRetriever):
    """Records every (queries, k) it is asked."""

    def __init__(self, passages=PASSAGES):
        super().__init__(passages)
        self.asked: list[tuple[list[str], int]] = []

    def batch_search(self, queries, k=10):
        self.asked.append((list(queries), k))
        return super().batch_search(queries, k)


class OptionsRecordingEnv(SearchQAEnv):
    """Records the options each reset receives (a subclass may read its own reset options)."""

    def reset(self, *, seed=None, options=None):
        self.seen_options = dict(options or {})
        return super().reset(seed=seed, options=options)


def _envs(n, retriever=None, topk=2, max_turns=4, benchmark="nq", cls=SearchQAEnv):
    retriever = retriever if retriever is not None else RecordingRetriever()
    return [cls(benchmark, retriever=retriever, topk=topk, max_turns=max_turns) for _ in range(n)]


# --- vector env: construction ------------------------------------------------------------------------------

def test_vector_env_refuses_no_envs_and_mixed_topk_with_their_reason():
    with pytest.raises(ValueError, match=r"^a vector env needs at least one env$"):
        SearchQAVectorEnv([])
    retriever = RecordingRetriever()
    envs = [SearchQAEnv("nq", retriever=retriever, topk=2), SearchQAEnv("nq", retriever=retriever, topk=3)]
    with pytest.raises(ValueError, match=r"^all sub-envs of a vector env must use the same topk$"):
        SearchQAVectorEnv(envs)


def test_vector_env_shares_the_first_envs_retriever_with_every_env():
    first, second = RecordingRetriever(), RecordingRetriever()
    envs = [SearchQAEnv("nq", retriever=first, topk=2), SearchQAEnv("nq", retriever=second, topk=2),
            SearchQAEnv("nq", retriever=second, topk=2)]
    vec = SearchQAVectorEnv(envs)
    assert vec.retriever is first and all(env.retriever is first for env in envs)
    vec.reset(options={"indices": [0, 1, 2]})
    vec.step(["<search> paris 0 </search>"] * 3)
    assert first.asked == [(["paris 0"] * 3, 2)] and second.asked == []


def test_a_vector_env_of_one_env_works_and_batches_its_spaces():
    retriever = RecordingRetriever()
    vec = SearchQAVectorEnv(_envs(1, retriever))
    observations, _ = vec.reset(options={"indices": [0]})
    observations, *_ = vec.step(["<search> paris </search>"])
    assert observations[0].startswith("\n\n<information>") and retriever.asked == [(["paris"], 2)]
    assert vec.single_observation_space is vec.envs[0].observation_space
    assert vec.single_action_space is vec.envs[0].action_space


@pytest.mark.parametrize("n", [1, 3])
def test_batched_spaces_hold_one_entry_per_env(n):
    vec = SearchQAVectorEnv(_envs(n))
    assert vec.observation_space == batch_space(vec.single_observation_space, n)
    assert vec.action_space == batch_space(vec.single_action_space, n)
    observations, _ = vec.reset(seed=0)
    assert vec.observation_space.contains(observations)
    assert len(vec.action_space.sample()) == n
    assert not vec.observation_space.contains(observations + ("one too many",))


# --- vector env: reset -------------------------------------------------------------------------------------

def test_reset_returns_each_envs_prompt_and_checks_the_indices():
    vec = SearchQAVectorEnv(_envs(3))
    observations, infos = vec.reset(options={"indices": [2, 0, 5]})
    assert observations == tuple(env.prompt_for(env.examples[i]) for env, i in zip(vec.envs, [2, 0, 5]))
    assert list(infos["index"]) == [2, 0, 5]
    with pytest.raises(ValueError, match=r"^options\['indices'\] needs 3 entries, got 2$"):
        vec.reset(options={"indices": [0, 1]})


def test_reset_passes_the_other_options_to_every_env():
    vec = SearchQAVectorEnv(_envs(2, cls=OptionsRecordingEnv))
    vec.reset(options={"indices": [3, 4], "note": "kept"})
    assert [env.seen_options for env in vec.envs] == [{"note": "kept", "index": 3}, {"note": "kept", "index": 4}]
    vec.reset(seed=1, options={"note": "plain"})
    assert [env.seen_options for env in vec.envs] == [{"note": "plain"}, {"note": "plain"}]


# --- vector env: step --------------------------------------------------------------------------------------

def test_step_checks_the_number_of_actions():
    vec = SearchQAVectorEnv(_envs(2))
    vec.reset(seed=0)
    with pytest.raises(ValueError, match=r"^expected 2 actions, got 3$"):
        vec.step(["x"] * 3)


def test_step_asks_the_retriever_for_topk_and_returns_gymnasium_dtypes():
    retriever = RecordingRetriever()
    vec = SearchQAVectorEnv(_envs(2, retriever, topk=2))
    vec.reset(options={"indices": [0, 1]})
    observations, rewards, terminated, truncated, infos = vec.step(["<search> paris </search>", "<answer>x</answer>"])
    assert retriever.asked == [(["paris"], 2)] and observations[0].count("Doc ") == 2
    assert rewards.dtype == np.float64 and terminated.dtype == np.bool_ and truncated.dtype == np.bool_
    assert terminated.tolist() == [False, True] and truncated.tolist() == [False, False]


def test_step_records_each_envs_own_action_text_in_its_segments():
    vec = SearchQAVectorEnv(_envs(2))
    vec.reset(options={"indices": [0, 1]})
    actions = ["<search> paris </search>", "<think>hm</think><answer> x </answer>"]
    *_, infos = vec.step(actions)
    for i, action in enumerate(actions):
        assert infos["segments"][i][0] == ("assistant", action, 0)
        assert vec.envs[i].transcript[1].text == action


def test_after_an_autoreset_the_env_plays_the_next_step_again():
    retriever = RecordingRetriever()
    vec = SearchQAVectorEnv(_envs(2, retriever))
    vec.reset(options={"indices": [0, 1]})
    vec.step(["<answer>x</answer>", "<search> a </search>"])  # env 0 ends
    observations, *_ = vec.step(["<search> ignored </search>", "<search> b </search>"])  # env 0 resets
    assert observations[0].startswith("Answer the given question") and retriever.asked[-1] == (["b"], 2)
    observations, rewards, terminated, _, infos = vec.step(["<search> c </search>", "<answer>y</answer>"])
    assert retriever.asked[-1] == (["c"], 2)  # env 0 played this step: its search went out
    assert observations[0].startswith("\n\n<information>") and infos["turn"].tolist() == [1, 3]
    assert terminated.tolist() == [False, True]


def test_an_int_seed_gives_env_i_seed_plus_i_and_a_list_gives_each_its_own():
    def index_for(seed):
        return SearchQAEnv("nq", retriever=RecordingRetriever()).reset(seed=seed)[1]["index"]

    expected = [index_for(5), index_for(6), index_for(7)]
    assert len(set(expected)) == 3  # the seeds lead to different examples, so a shifted seed shows
    vec = SearchQAVectorEnv(_envs(3))
    assert vec.reset(seed=5)[1]["index"].tolist() == expected
    assert vec.reset(seed=[7, 5, 6])[1]["index"].tolist() == [expected[2], expected[0], expected[1]]
    with pytest.raises(ValueError, match=r"^expected 3 seeds, got 2$"):
        vec.reset(seed=[1, 2])


# --- make_vec and step_envs --------------------------------------------------------------------------------

def test_make_vec_builds_n_envs_with_the_given_settings_and_refuses_zero():
    retriever = RecordingRetriever()
    vec = make_vec("stppo/NQ-v0", 1, retriever=retriever, topk=1, max_turns=2)
    assert vec.num_envs == 1 and vec.retriever is retriever
    assert (vec.envs[0].topk, vec.envs[0].max_turns, vec.envs[0].benchmark) == (1, 2, "nq")
    with pytest.raises(ValueError, match=r"^num_envs must be >= 1, got 0$"):
        make_vec("stppo/NQ-v0", 0, retriever=retriever)


def test_make_vec_takes_the_retriever_from_the_spec_then_the_demo_index():
    import gymnasium as gym

    retriever = RecordingRetriever()
    gym.register(id="stppo-test/PinsNQ-v0", entry_point="stppo_envs.env:SearchQAEnv",
                 kwargs={"benchmark": "nq", "retriever": retriever})
    try:
        vec = make_vec("stppo-test/PinsNQ-v0", 2)
        assert vec.retriever is retriever and all(env.retriever is retriever for env in vec.envs)
    finally:
        del gym.registry["stppo-test/PinsNQ-v0"]
    default = make_vec("stppo/NQ-v0", 2)  # nothing given: the bundled demo index, built (lazily) once
    assert "demo-bm25" in repr(default.retriever) and default.envs[1].retriever is default.retriever


class _PlainEnv:
    """Not a SearchQAEnv: step_envs steps it on its own."""

    def __init__(self):
        self.actions = []

    def step(self, action):
        self.actions.append(action)
        return "plain", 0.5, False, False, {}


def test_step_envs_batches_per_retriever_with_its_topk_and_keeps_each_action():
    retriever = RecordingRetriever()
    envs = [SearchQAEnv("nq", retriever=retriever, topk=2), _PlainEnv(), SearchQAEnv("nq", retriever=retriever, topk=2)]
    envs[0].reset(options={"index": 0})
    envs[2].reset(options={"index": 1})
    actions = ["<search> paris 1 </search>", "<search> plain </search>", "<think>t</think><search> paris 2 </search>"]
    results = step_envs(envs, actions)
    assert retriever.asked == [(["paris 1", "paris 2"], 2)] and envs[1].actions == [actions[1]]
    assert results[1] == ("plain", 0.5, False, False, {})
    for i in (0, 2):
        observation, _, _, _, info = results[i]
        assert observation.count("Doc ") == 2 and info["segments"][0] == ("assistant", actions[i], 0)


# --- SearchQAEnv: constructor ------------------------------------------------------------------------------

def _env(**kwargs):
    kwargs.setdefault("retriever", RecordingRetriever())
    return SearchQAEnv(kwargs.pop("benchmark", "nq"), **kwargs)


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


class _RaisingRetriever(RecordingRetriever):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def batch_search(self, queries, k=10):
        raise self.error


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


def test_an_invalid_action_reports_its_reason_and_a_non_string_action_is_recorded_by_repr():
    from stppo_envs.actions import INVALID_ACTION_MESSAGE

    env = _env()
    env.reset(options={"index": 0})
    observation, reward, terminated, truncated, info = env.step(42)
    assert info["action_type"] == "invalid" and info["invalid_reason"] and info["invalid_actions"] == 1
    assert observation == INVALID_ACTION_MESSAGE
    assert info["segments"] == [("assistant", "42", 0), ("environment", INVALID_ACTION_MESSAGE, 0)]
    assert "error" not in info and "query" not in info
    assert (reward, terminated, truncated) == (0.0, False, False)
    *_, info = env.step("no tags at all")
    assert info["invalid_actions"] == 2 and info["segments"][1] == ("environment", INVALID_ACTION_MESSAGE, 1)


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


# --- prompts ---------------------------------------------------------------------------------------------------

def test_search_r1_question_strips_and_adds_one_question_mark():
    from stppo_envs.prompts import search_r1_question

    assert search_r1_question(" who wrote the iliad ") == "who wrote the iliad?"
    assert search_r1_question("Is it? ") == "Is it?" and search_r1_question("   ") == ""


def test_render_prompt_fills_options_only_for_choices():
    from stppo_envs.prompts import render_prompt

    assert render_prompt("{question}|{options}|", "q") == "q||"
    assert render_prompt("{question}|{options}|", "q", {"A": "x", "B": "y"}) == "q|A. x\nB. y|"


def test_format_information_numbers_docs_one_per_line():
    from stppo_envs.prompts import format_information

    hits = [Hit("1", 2.0, "Paris", "Capital. "), Hit("2", 1.0, "Rome", "Eternal.", title_line="Rome")]
    assert format_information(hits) == \
        '\n\n<information>Doc 1(Title: "Paris") Capital. \nDoc 2(Title: Rome) Eternal.</information>\n\n'
    assert format_information([]) == "\n\n<information></information>\n\n"


def test_search_failure_observation_collapses_whitespace_and_keeps_200_characters():
    from stppo_envs.prompts import search_failure_observation

    assert search_failure_observation(RetrievalError("a\n\tb  c")) == \
        "\n\n<information>Search failed: a b c</information>\n\n"
    assert search_failure_observation(RetrievalError("x" * 300)) == \
        "\n\n<information>Search failed: " + "x" * 200 + "</information>\n\n"
    assert search_failure_observation(TimeoutError()) == \
        "\n\n<information>Search failed: TimeoutError</information>\n\n"


def test_template_hash_is_the_first_12_hex_of_the_sha256_of_the_unit_separated_templates():
    import hashlib

    from stppo_envs.prompts import SEARCH_R1_MCQ_TEMPLATE, SEARCH_R1_TEMPLATE, template_hash

    expected = hashlib.sha256((SEARCH_R1_TEMPLATE + "\x1f" + SEARCH_R1_MCQ_TEMPLATE).encode()).hexdigest()[:12]
    assert template_hash(SEARCH_R1_TEMPLATE, SEARCH_R1_MCQ_TEMPLATE) == expected
    assert template_hash("a", "b") != template_hash("ab") and len(template_hash("a")) == 12


def test_the_templates_are_search_r1s_text():
    from stppo_envs.prompts import SEARCH_R1_MCQ_TEMPLATE, SEARCH_R1_TEMPLATE

    assert SEARCH_R1_TEMPLATE.endswith("For example, <answer> Beijing </answer>. Question: {question}\n")
    assert "call a search engine by <search> query </search> and it will return the top searched results " \
           "between <information> and </information>." in SEARCH_R1_TEMPLATE
    assert SEARCH_R1_MCQ_TEMPLATE.endswith(
        "for example <answer> B </answer>. Question: {question}\nOptions:\n{options}\n")


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


def test_step_envs_groups_by_retriever_and_topk():
    one, two = RecordingRetriever(), RecordingRetriever()
    envs = [SearchQAEnv("nq", retriever=one, topk=1), SearchQAEnv("nq", retriever=two, topk=1),
            SearchQAEnv("nq", retriever=one, topk=3)]
    for i, env in enumerate(envs):
        env.reset(options={"index": i})
    results = step_envs(envs, [f"<search> paris {i} </search>" for i in range(3)])
    assert one.asked == [(["paris 0"], 1), (["paris 2"], 3)] and two.asked == [(["paris 1"], 1)]
    assert [r[0].count("Doc ") for r in results] == [1, 1, 3]


def test_failed_searches_reach_the_env_through_step_envs_and_the_vector_env():
    failing = _RaisingRetriever(RetrievalError("backend down"))
    envs = [SearchQAEnv("nq", retriever=failing), SearchQAEnv("nq", retriever=failing)]
    for env in envs:
        env.reset(options={"index": 0})
    results = step_envs(envs, ["<search> a </search>", "<answer>x</answer>"])
    assert results[0][4]["error"] == {"type": "RetrievalError", "message": "backend down"}
    assert "Search failed: backend down" in results[0][0] and "error" not in results[1][4]
    vec = SearchQAVectorEnv([SearchQAEnv("nq", retriever=failing) for _ in range(2)])
    vec.reset(options={"indices": [0, 1]})
    observations, *_, infos = vec.step(["<answer>x</answer>", "<search> a </search>"])
    assert infos["_error"].tolist() == [False, True] and infos["error"]["message"][1] == "backend down"
    assert infos["search_errors"].tolist() == [0, 1] and "Search failed: backend down" in observations[1]
