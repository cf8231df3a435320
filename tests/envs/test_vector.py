"""``stppo_envs.vector``: the batched vector env -- one batch_search per step and
retriever, Gymnasium autoreset, batched spaces, seeds per env, the shared retriever, ``make_vec``."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.vector.utils import batch_space

from stppo_envs import SearchQAEnv, make_vec
from stppo_envs.retrieval import RetrievalError
from stppo_envs.vector import SearchQAVectorEnv, step_envs
from tests.support.envs import RecordingRetriever, _RaisingRetriever
from tests.support.retrievers import FailingRetriever, KeywordRetriever


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


# The batched vector env: one batch_search per step, Gymnasium autoreset, shared retriever.


def test_all_searches_of_a_step_go_in_one_batch_call():
    retriever = KeywordRetriever()
    envs = make_vec("stppo/NQ-v0", 4, retriever=retriever)
    observations, infos = envs.reset(seed=0)
    assert len(observations) == 4 and list(infos["turn"]) == [0, 0, 0, 0]
    actions = ["<search>a b</search>", "<answer>x</answer>", "<search>c</search>", "bad"]
    obs, rewards, terminated, truncated, infos = envs.step(actions)
    assert retriever.batch_calls == [["a b", "c"]]
    assert list(terminated) == [False, True, False, False] and not truncated.any()
    assert obs[0].startswith("\n\n<information>") and obs[1] == ""
    assert list(infos["action_type"]) == ["search", "answer", "search", "invalid"]
    # NEXT_STEP autoreset: env 1 resets on the next step and ignores its action
    obs, rewards, terminated, truncated, infos = envs.step(["<answer>y</answer>"] * 4)
    assert obs[1].startswith("Answer the given question") and rewards[1] == 0.0 and infos["turn"][1] == 0
    assert list(terminated) == [True, False, True, True]


def test_indices_and_per_env_seeds():
    envs = make_vec("stppo/MedQA-v0", 3, retriever=KeywordRetriever())
    _, infos = envs.reset(options={"indices": [0, 1, 2]})
    assert list(infos["index"]) == [0, 1, 2]
    first, _ = envs.reset(seed=5)
    second, _ = envs.reset(seed=5)
    assert first == second


def test_batch_failure_marks_only_searching_envs():
    envs = make_vec("stppo/NQ-v0", 2, retriever=FailingRetriever())
    envs.reset(seed=0)
    _, _, _, _, infos = envs.step(["<search>q</search>", "junk"])
    assert infos["_error"].tolist() == [True, False]
    assert infos["search_errors"].tolist() == [1, 0]
    assert np.all(infos["turn"] == 1)
