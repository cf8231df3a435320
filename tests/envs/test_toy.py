"""``stppo_envs.toy``: ``stppo/Toy-v0``'s settings, prompts, targets and rewards."""

from __future__ import annotations

import pytest

from stppo_envs.env import Segment
from stppo_envs.toy import ToyTargetEnv

# ---------------------------------------------------------------- toy env, text space, name suggestions



@pytest.mark.parametrize("kwargs, message", [
    ({"turns": 0}, r"^need turns >= 1 and at least two choices$"),
    ({"choices": ("red",)}, r"^need turns >= 1 and at least two choices$"),
    ({"fixed_target": "pink"}, r"^fixed_target 'pink' is not one of \('red', 'green', 'blue', 'gold'\)$"),
    ({"reward_flip_episodes": (1, 2, 3)}, r"^reward_flip_episodes must be \[start, stop\) with 0 <= start <= stop, "
                                          r"got \(1, 2, 3\)$"),
    ({"reward_flip_episodes": (-1, 2)}, "reward_flip_episodes must be"),
    ({"reward_flip_episodes": (3, 2)}, "reward_flip_episodes must be"),
])
def test_toy_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ToyTargetEnv(**kwargs)


def test_toy_accepts_the_smallest_settings_and_keeps_them():
    env = ToyTargetEnv(turns=1, choices=["a", "b"], fixed_target=None, render_mode="ansi", reward_flip_episodes=[2, 2])
    assert (env.turns, env.choices, env.fixed_target, env.render_mode) == (1, ("a", "b"), None, "ansi")
    assert env.reward_flip_episodes == (2, 2) and env.episodes == 0 and env.target == "a"
    assert env.observation_space.max_length == 1024 and env.action_space.max_length == 1024
    assert ToyTargetEnv(reward_flip_episodes=[0, 0]).reward_flip_episodes == (0, 0)
    default = ToyTargetEnv()
    assert (default.turns, default.choices, default.fixed_target, default.render_mode) == \
        (2, ("red", "green", "blue", "gold"), "red", None)
    assert default.reward_flip_episodes is None and default.target == "red"
    with pytest.raises(RuntimeError,
                       match=r"^the episode is over \(or was never started\): call reset\(\) before step\(\)$"):
        ToyTargetEnv().step("red")


def test_toy_reset_prompt_info_and_targets():
    env = ToyTargetEnv(fixed_target=None)
    prompt, info = env.reset(options={"index": 6})
    assert prompt == "say blue" and env.target == "blue"
    assert info == {"messages": [{"role": "user", "content": "say blue"}], "example_id": "toy-blue",
                    "benchmark": "toy", "turn": 0, "segments": [Segment("user", "say blue", -1)],
                    "question": "say blue", "choices": None}
    assert env.transcript == [Segment("user", "say blue", -1)] and env.episodes == 1
    seen = {ToyTargetEnv(fixed_target=None).reset(seed=s)[0] for s in range(30)}
    assert seen == {f"say {c}" for c in ("red", "green", "blue", "gold")}
    def targets(seed):
        env = ToyTargetEnv(fixed_target=None)
        return [env.reset(seed=seed)[0]] + [env.reset()[0] for _ in range(9)]

    assert targets(4) == targets(4) and targets(4) != targets(5)  # the seed decides the targets
    assert ToyTargetEnv(render_mode="ansi").render() == ""  # nothing said before the first reset
    fixed = ToyTargetEnv(fixed_target="gold")
    assert fixed.reset(options={"index": 0})[0] == "say gold"


def test_toy_steps_reward_the_fraction_of_turns_on_target():
    env = ToyTargetEnv(turns=3, render_mode="ansi")
    env.reset()
    obs, reward, terminated, truncated, info = env.step("red and more")
    assert (obs, reward, terminated, truncated) == (" ok ", 0.0, False, False)
    assert info == {"turn": 1, "action_type": "move", "segments": [Segment("assistant", "red and more", 0),
                                                                    Segment("environment", " ok ", 0)],
                    "search_calls": 0, "invalid_actions": 0, "search_errors": 0}
    env.step(["not", "text"])
    obs, reward, terminated, truncated, info = env.step("  red")
    assert (obs, reward, terminated, truncated) == ("", pytest.approx(2 / 3), True, False)
    assert info["action_type"] == "answer" and info["turn"] == 3 and info["prediction"] == "red"
    assert info["golden_answers"] == ["red"] and info["em"] == 0.0 and info["f1"] == pytest.approx(2 / 3)
    assert env.transcript[3] == Segment("assistant", "['not', 'text']", 1)
    assert env.render() == "say red" + "red and more" + " ok " + "['not', 'text']" + " ok " + "  red" + ""
    assert ToyTargetEnv().render() is None
    with pytest.raises(RuntimeError):
        env.step("red")
    one = ToyTargetEnv(turns=1)
    one.reset()
    obs, reward, terminated, _, info = one.step("  ")
    assert (obs, reward, terminated, info["prediction"]) == ("", 0.0, True, "")  # nothing said
    one.reset()
    obs, reward, terminated, _, info = one.step("red")
    assert (reward, info["em"], info["prediction"]) == (1.0, 1.0, "red")


def test_toy_reward_flip_window_counts_episodes_from_zero():
    env = ToyTargetEnv(turns=1, reward_flip_episodes=(1, 3))
    rewards = []
    for _ in range(4):
        env.reset()
        rewards.append(env.step("red")[1])
    assert rewards == [1.0, 0.0, 0.0, 1.0] and env.episodes == 4
    env = ToyTargetEnv(turns=2, reward_flip_episodes=(0, 1))
    env.reset()
    env.step("blue")
    assert env.step("red")[1] == 0.5
