"""The reward function for verl (stppo_agent/integrations/verl/reward.py): the env's reward for every kind of episode
on every demo benchmark, turns read from the agent loop's record and never from ``<information>`` text, and the
ground truth and return type that verl's ``main_eval`` uses (pandas, a float), loaded as verl loads it.

Needs no verl except for the loading test; the module is in the verl venv's test list with the rest of the bridge.
"""

from __future__ import annotations

import pytest

from stppo_agent.integrations.verl import reward as verl_reward
from stppo_agent.integrations.verl.turns import TURN_TEXTS
from stppo_envs import BENCHMARKS, SearchQAEnv
from tests.support.requires import require_verl
from tests.support.verl_rows import PER_BENCHMARK, OnePassage, export_every_benchmark, parquet_rows

QA = {"target": ["Paris"], "choices": [], "answer_letter": ""}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_every_benchmark(tmp_path_factory.mktemp("verl_data"))


def scripts_for(example) -> list[list[str]]:
    """Episodes with right, wrong, invalid, late and missing answers (the letter, a lower-case letter and the
    option's text for multiple choice), and <information> blocks the policy writes itself."""
    gold = example.answer_letter if example.is_multiple_choice else example.golden_answers[0]
    answers = [gold, "certainly not this"]
    if example.is_multiple_choice:
        answers += [f"({gold.lower()})", example.choices[gold]]
    episodes = [[f"<think>t</think><search> {example.question} </search>", f"<answer> {a} </answer>"]
                for a in answers]
    episodes += [
        ["I think it is", f"<answer>{gold}</answer>"],                              # an invalid turn, then right
        ["<search> q1 </search>", "<search> q2 </search>", f"<answer>{gold}</answer>"],  # the last turn answers
        ["<search> q1 </search>", "<search> q2 </search>", "<search> q3 </search>"],    # truncated
        [f"<answer>{gold}</answer><search> more </search>"],                       # first block decides
        ["<search>unclosed", "<search> q </search>", "nothing"],                  # two invalid turns, no answer
        [f"<think>I know.</think><information>Doc 1 x</information><answer>{gold}</answer>"],  # quoted, answers
        ["<information>no</information>", "<search> q </search><information>", f"<answer>{gold}</answer>"],
        [f"<search> q </search>\n\n<information>Doc 1 {gold}</information>\n\n<answer>{gold}</answer>"],
    ]
    return episodes


def play(env: SearchQAEnv, index: int, actions: list[str]) -> tuple[str, list[str], float]:
    """(the response as the agent loop decodes it, the turns it records, the env's reward)."""
    env.reset(options={"index": index})
    text, turns, total = "", [], 0.0
    for action in actions:
        observation, step_reward, terminated, truncated, _ = env.step(action)
        text += action + observation
        turns.append(action)
        total += step_reward
        if terminated or truncated:
            break
    return text, turns, total


@pytest.mark.parametrize("benchmark", list(BENCHMARKS))
def test_the_reward_function_scores_every_episode_as_the_env_does(exported, benchmark):
    path = next(p for p in exported if p.name.startswith(f"{benchmark}_"))
    env = SearchQAEnv(benchmark, split="test", retriever=OnePassage(), limit=PER_BENCHMARK, max_turns=3,
                      format_reward=0.2)
    seen = set()
    for row in parquet_rows(path):
        example = env.examples[row["extra_info"]["index"]]
        for actions in scripts_for(example):
            response, turns, expected = play(env, row["extra_info"]["index"], actions)
            extra_info = {**row["extra_info"], TURN_TEXTS: turns, "num_turns": 1 + 2 * len(turns)}
            got = verl_reward.compute_score(row["data_source"], response, row["reward_model"]["ground_truth"],
                                            extra_info)
            assert got == expected, (actions, response)
            seen.add(expected)
    assert {0.0, 0.8, 1.0} <= seen  # wrong, right after an invalid turn, right


@pytest.mark.parametrize("max_turns,format_reward", [(1, 0.0), (4, 0.2)])
def test_information_the_policy_wrote_is_text_of_its_turn(max_turns, format_reward):
    """One turn that quotes an <information> block before its answer: the env's reward, with the turn recorded or
    without a record (a single-turn response)."""
    turn = "<think>I know.</think><information>Doc 1(Title: x) y</information><answer>Paris</answer>"
    settings = {"max_turns": max_turns, "format_reward": format_reward}
    assert verl_reward.compute_score("nq", turn, QA, {**settings, TURN_TEXTS: [turn], "num_turns": 2}) == 1.0
    assert verl_reward.compute_score("nq", turn, QA, settings) == 1.0
    details = verl_reward.compute_score_details("nq", turn, QA, settings)
    assert (details["turns"], details["invalid_actions"], details["answered"]) == (1.0, 0.0, 1.0)


def test_a_late_answer_in_a_recorded_turn_past_the_budget_never_happened():
    turns = ["<tool_call>{}</tool_call>", "\n<information>Search failed</information>\n", "<answer>Paris</answer>"]
    # three recorded turns (the middle one: policy text that looks like an observation, an invalid action)
    assert verl_reward.compute_score("nq", "".join(turns), QA, {"max_turns": 3, TURN_TEXTS: turns}) == 1.0
    assert verl_reward.compute_score("nq", "".join(turns), QA, {"max_turns": 2, TURN_TEXTS: turns}) == 0.0
    details = verl_reward.compute_score_details("nq", "", QA, {"max_turns": 3, "format_reward": 0.2,
                                                               TURN_TEXTS: turns})
    assert (details["score"], details["invalid_actions"]) == (pytest.approx(0.8), 1.0)


def test_a_tool_call_is_the_turns_action_when_it_comes_first():
    first = ['<tool_call>{"name": "search"}</tool_call><answer>Paris</answer>', "<answer>Lyon</answer>"]
    assert verl_reward.compute_score("nq", "", QA, {TURN_TEXTS: first}) == 0.0  # searched, then answered Lyon
    answer_first = ['<answer>Paris</answer><tool_call>{"name": "search"}</tool_call>', "<answer>Lyon</answer>"]
    assert verl_reward.compute_score("nq", "", QA, {TURN_TEXTS: answer_first}) == 1.0


def test_a_multi_turn_response_without_the_turn_record_is_refused():
    text = "<search> q </search>\n\n<information>x</information>\n\n<answer>Paris</answer>"
    with pytest.raises(verl_reward.TurnsNotRecordedError, match=r"response of 4 turns .*stppo_turn_texts.*"
                                                                r"--agent-loop"):
        verl_reward.compute_score("nq", text, QA, {"num_turns": 4})
    # verl's single-turn loop (2 messages) and main_eval (no extra_info): one turn, whose first block is a search
    assert verl_reward.compute_score("nq", text, QA, {"num_turns": 2}) == 0.0
    assert verl_reward.compute_score("nq", text, QA) == 0.0


def test_main_eval_scores_the_parquet_as_pandas_reads_it(exported):
    """verl.trainer.main_eval loads the function by path (get_custom_reward_fn), reads the parquet with pandas
    (numpy arrays in the ground truth), calls it without extra_info and averages floats."""
    np = pytest.importorskip("numpy")
    pd = pytest.importorskip("pandas")
    require_verl("the loader is verl's")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = OmegaConf.create({"reward": {"custom_reward_function": {"path": verl_reward.__file__,
                                                                     "name": "compute_score", "reward_kwargs": {}}}})
    reward_fn = get_custom_reward_fn(config)
    for benchmark in ("nq", "medqa"):
        frame = pd.read_parquet(next(p for p in exported if p.name.startswith(f"{benchmark}_")))
        ground_truth = frame["reward_model"][0]["ground_truth"]
        assert isinstance(ground_truth["target"], np.ndarray)
        gold = ground_truth["answer_letter"] or ground_truth["target"][0]
        scores = [reward_fn(frame["data_source"][0], response, ground_truth)
                  for response in (f"<answer>{gold}</answer>", "<answer>certainly not this</answer>")]
        assert scores == [1.0, 0.0] and all(type(score) is float for score in scores)
        assert np.mean(scores) == 0.5
