"""Pins of the per-turn generation budget when trajectories of one turn have different room left (issue: one-line
bugs the suite let through): the backend is asked for the largest budget of the turn, each trajectory keeps only
its own, and none passes max_total_tokens. A character tokenizer, scripted envs and a backend that honours
``max_new_tokens`` keep every count exact."""

from __future__ import annotations

import pytest

from stppo_agent.rollouts.generation import Generation
from stppo_agent.rollouts.turn_loop import RolloutLimits, collect_rollouts

PAD, BOS = 0, 1


class CharTokenizer:
    pad_token_id = PAD
    chat_template = None

    def __call__(self, text, **kwargs):
        return {"input_ids": ([BOS] if kwargs.get("add_special_tokens", True) else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i >= 3)


class ScriptEnv:
    def __init__(self, prompt, observation="O" * 5):
        self.prompt, self.observation = prompt, observation

    def reset(self, seed=None, options=None):
        return self.prompt, {"example_id": self.prompt[:3], "benchmark": "b", "question": "q"}

    def step(self, action):
        return self.observation, 0.0, False, False, {}


class HonestBackend:
    """Generates exactly ``max_new_tokens`` tokens ("g") for every context; records what it is asked."""

    def __init__(self):
        self.asked = []

    def generate(self, contexts, max_new_tokens, keys=None):
        self.asked.append(max_new_tokens)
        return [Generation([ord("g")] * max_new_tokens, [-0.5] * max_new_tokens) for _ in contexts]


@pytest.mark.parametrize("long_first", [True, False])
def test_the_backend_is_asked_for_the_largest_budget_and_each_trajectory_keeps_its_own(long_first):
    limits = RolloutLimits(max_turns=2, max_new_tokens_per_turn=10, max_observation_tokens=50, max_prompt_tokens=20,
                           max_total_tokens=40)
    long_env, short_env = ScriptEnv("L" * 19), ScriptEnv("S")  # 20 and 2 prompt tokens with BOS
    envs = [long_env, short_env] if long_first else [short_env, long_env]
    backend = HonestBackend()
    batch = collect_rollouts(backend, CharTokenizer(), envs, [{}, {}], [0, 1], limits)
    # turn 0: both have room for 10; turn 1: the long one has 40 - (20 + 10 + 5) = 5 left, the short one 10
    assert backend.asked == [10, 10]
    lengths = batch.lengths().tolist()
    long_row, short_row = (0, 1) if long_first else (1, 0)
    assert lengths[long_row] == 40  # 20 + 10 + 5 + 5 generated: exactly max_total_tokens, never more
    assert lengths[short_row] == 2 + 10 + 5 + 10 + 5
    policy = batch.loss_mask.sum(1).tolist()
    assert policy[long_row] == 15 and policy[short_row] == 20
    assert batch.episode_info[long_row]["finish_reason"] == "max_total_tokens"
    assert batch.episode_info[short_row]["finish_reason"] == "max_turns"
    assert max(lengths) <= limits.max_total_tokens
