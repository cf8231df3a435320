"""The batched vector env: one batch_search per step, Gymnasium autoreset, shared retriever."""

from __future__ import annotations

import numpy as np

from stppo_envs import make_vec

from .conftest import FailingRetriever, KeywordRetriever


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
