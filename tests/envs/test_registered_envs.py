"""Every registered env: Gymnasium's checker, seeded determinism, pickling, and scripted episodes."""

from __future__ import annotations

import pickle

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import stppo_envs
from stppo_envs.actions import INVALID_ACTION_MESSAGE
from tests.support.retrievers import FailingRetriever, KeywordRetriever

ENV_IDS = stppo_envs.registered_ids()


def gold_action(env) -> str:
    example = env.unwrapped.example
    answer = example.answer_letter if example.is_multiple_choice else example.golden_answers[0]
    return f"<think>I know it now.</think><answer> {answer} </answer>"


def wrong_action(env) -> str:
    example = env.unwrapped.example
    if example.is_multiple_choice:
        return "<answer>" + next(c for c in example.choices if c != example.answer_letter) + "</answer>"
    return "<answer>certainly not the answer 123</answer>"


def rollout(env, seed: int, actions) -> list:
    trace = [env.reset(seed=seed)[0]]
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        trace.append((obs, reward, terminated, truncated, info.get("action_type")))
        if terminated or truncated:
            break
    return trace


def test_every_benchmark_is_registered():
    expected = {"NQ", "TriviaQA", "PopQA", "HotpotQA", "2Wiki", "MuSiQue", "Bamboogle", "MedQA", "MedMCQA",
                "PubMedQA", "MMLU-Med", "SearchQA"}
    assert {f"stppo/{name}-v0" for name in expected} == set(ENV_IDS)
    assert all(env_id in gym.registry for env_id in ENV_IDS)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_gymnasium_env_checker(env_id):
    env = gym.make(env_id)
    check_env(env.unwrapped, skip_render_check=True)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_seeded_double_rollout_is_identical(env_id):
    actions = ["<search>first question words</search>", "junk", "<answer>x</answer>"]
    first = rollout(gym.make(env_id), 123, actions)
    second = rollout(gym.make(env_id), 123, actions)
    assert first == second
    assert rollout(gym.make(env_id), 124, actions)[0] != first[0] or len(gym.make(env_id).unwrapped.examples) == 1


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_pickled_env_continues_identically(env_id):
    env = gym.make(env_id).unwrapped
    env.reset(seed=7)
    env.step("<search>capital</search>")
    clone = pickle.loads(pickle.dumps(env))
    action = "<search>the founder</search>"
    assert clone.step(action)[:4] == env.step(action)[:4]
    assert clone.transcript == env.transcript


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_search_then_gold_answer_scores_one(env_id):
    env = gym.make(env_id, max_turns=4)
    prompt, info = env.reset(seed=3)
    assert info["turn"] == 0 and info["example_id"] and info["benchmark"]
    assert info["messages"] == [{"role": "user", "content": prompt}]
    question = env.unwrapped.example.question
    obs, reward, terminated, truncated, info = env.step(f"<think>search</think><search>{question}</search>")
    assert obs.startswith("\n\n<information>Doc 1(Title: ") and obs.endswith("</information>\n\n")
    assert (reward, terminated, truncated, info["action_type"], info["turn"]) == (0.0, False, False, "search", 1)
    obs, reward, terminated, truncated, info = env.step(gold_action(env))
    assert (reward, terminated, truncated, info["action_type"]) == (1.0, True, False, "answer")
    assert info["golden_answers"] == list(env.unwrapped.example.golden_answers)
    score_keys = ("correct",) if env.unwrapped.example.is_multiple_choice else ("em", "f1")
    assert all(info[key] == 1.0 for key in score_keys)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_wrong_answer_scores_zero(env_id):
    env = gym.make(env_id)
    env.reset(seed=5)
    _, reward, terminated, truncated, info = env.step(wrong_action(env))
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info["prediction"] is not None


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_running_out_of_turns_truncates_with_zero_reward(env_id):
    env = gym.make(env_id, max_turns=3)
    env.reset(seed=11)
    results = [env.step("<search>anything at all</search>") for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True]
    assert [r[2] for r in results] == [False, False, False]
    assert results[-1][1] == 0.0 and results[-1][4]["prediction"] is None
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<answer>late</answer>")


def test_invalid_action_gets_search_r1_message_and_counts():
    env = gym.make("stppo/NQ-v0", retriever=KeywordRetriever())
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("I think the answer is Paris")
    assert obs == INVALID_ACTION_MESSAGE
    assert info["action_type"] == "invalid" and info["invalid_actions"] == 1 and "invalid_reason" in info


def test_segments_map_every_character_to_its_turn():
    env = gym.make("stppo/NQ-v0", retriever=KeywordRetriever(), render_mode="ansi")
    prompt, info = env.reset(seed=0)
    segments = list(info["segments"])
    actions = ["<search>capital of France</search>", "oops", "<answer>Paris</answer>"]
    for action in actions:
        *_, info = env.step(action)
        segments += info["segments"]
    assert [s.turn for s in segments] == [-1, 0, 0, 1, 1, 2, 2]
    assert [s.role for s in segments] == ["user"] + ["assistant", "environment"] * 3
    assert [s.text for s in segments if s.role == "assistant"] == actions
    assert "".join(s.text for s in segments) == env.render()


def test_retrieval_failure_is_reported_not_raised():
    env = gym.make("stppo/NQ-v0", retriever=FailingRetriever())
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("<search>anything</search>")
    assert info["error"]["type"] == "RetrievalError" and "down" in info["error"]["message"]
    assert info["search_errors"] == 1 and info["search_calls"] == 0
    # The agent sees that the search failed, and why, not an empty result it could take for "nothing found".
    assert obs == "\n\n<information>Search failed: retrieval server at http://127.0.0.1:9 is down</information>\n\n"
    assert not terminated


def test_format_reward_follows_search_r1():
    def final_reward(actions, format_reward=0.2):
        env = gym.make("stppo/SearchQA-v0", retriever=KeywordRetriever(), format_reward=format_reward)
        env.reset(seed=0)
        for action in actions:
            _, reward, terminated, truncated, _ = env.step(action)
        return reward

    gold = gym.make("stppo/SearchQA-v0", retriever=KeywordRetriever())
    gold.reset(seed=0)
    answer = gold.unwrapped.example.golden_answers[0]
    assert final_reward([f"<answer>{answer}</answer>"]) == pytest.approx(1.0)
    assert final_reward(["bad", f"<answer>{answer}</answer>"]) == pytest.approx(0.8)
    assert final_reward(["<answer>wrong wrong</answer>"]) == pytest.approx(0.2)
    assert final_reward(["bad", "<answer>wrong wrong</answer>"]) == pytest.approx(0.0)


def test_reset_index_option_and_bad_index():
    env = gym.make("stppo/MedQA-v0", retriever=KeywordRetriever()).unwrapped
    _, info = env.reset(options={"index": 2})
    assert info["example_id"] == env.examples[2].id
    assert "Options:\nA. " in env.transcript[0].text
    with pytest.raises(IndexError, match="outside"):
        env.reset(options={"index": len(env.examples)})


def test_bad_constructor_arguments_have_clear_errors():
    with pytest.raises(KeyError, match="known: 2wiki, bamboogle"):
        stppo_envs.SearchQAEnv(benchmark="nope")
    with pytest.raises(ValueError, match="topk"):
        gym.make("stppo/NQ-v0", topk=0, retriever=KeywordRetriever())
    with pytest.raises(ValueError, match="bad retriever spec"):
        gym.make("stppo/NQ-v0", retriever="nonsense")
    with pytest.raises(FileNotFoundError, match="stppo index bm25"):
        gym.make("stppo/NQ-v0", retriever="bm25:/does/not/exist")


def test_prompt_questions_end_with_a_question_mark_as_in_search_r1(tmp_path, keyword_retriever):
    """Search-R1's data scripts strip the question and append '?' when it has none (NQ-open questions do not)."""
    from stppo_envs import SearchQAEnv

    data = tmp_path / "nq.jsonl"
    data.write_text('{"id": "1", "question": " who wrote the iliad ", "golden_answers": ["Homer"]}\n'
                    '{"id": "2", "question": "Is Paris in France?", "golden_answers": ["yes"]}\n')
    env = SearchQAEnv("nq", dataset=str(data), retriever=keyword_retriever)
    prompts = [env.reset(options={"index": i})[0] for i in range(2)]
    assert "Question: who wrote the iliad?\n" in prompts[0]
    assert "Question: Is Paris in France?\n" in prompts[1] and "??" not in prompts[1]
    plain = SearchQAEnv("nq", dataset=str(data), retriever=keyword_retriever, question_mark=False)
    assert "Question: who wrote the iliad\n" in plain.reset(options={"index": 0})[0]
    _, info = env.reset(options={"index": 0})
    assert info["question"] == "who wrote the iliad"  # the dataset's question is kept as given in info


def test_resets_without_an_index_walk_the_dataset_without_repeats(keyword_retriever):
    from stppo_envs import SearchQAEnv

    env = SearchQAEnv("nq", retriever=keyword_retriever)
    n = len(env.examples)
    seen = [env.reset(seed=7)[1]["example_id"]] + [env.reset()[1]["example_id"] for _ in range(n - 1)]
    assert len(set(seen)) == n  # one pass visits every example once
    again = [env.reset(seed=7)[1]["example_id"]] + [env.reset()[1]["example_id"] for _ in range(n - 1)]
    assert again == seen  # the same seed, the same sequence
    other = [env.reset(seed=8)[1]["example_id"]] + [env.reset()[1]["example_id"] for _ in range(n - 1)]
    assert other != seen and sorted(other) == sorted(seen)
    _, info = env.reset(options={"index": 3})
    assert info["example_id"] == env.examples[3].id and info["index"] == 3


def test_step_info_names_the_episode(keyword_retriever):
    from stppo_envs import SearchQAEnv

    env = SearchQAEnv("nq", retriever=keyword_retriever)
    _, reset_info = env.reset(options={"index": 0})
    _, _, _, _, info = env.step("<search> paris </search>")
    assert info["example_id"] == reset_info["example_id"] and info["question"] == reset_info["question"]
