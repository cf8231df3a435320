"""``run_episodes``' progress bar: one tick per finished episode against a total of every episode, named by the
benchmark, counted in episodes, cleared when done (``leave=False``) and left to tqdm to silence off a terminal
(``disable=None``)."""

from __future__ import annotations

import pytest
import tqdm.auto

from stppo_agent.evaluation.agents import OracleAgent
from stppo_agent.evaluation.evaluate import run_episodes
from stppo_envs import SearchQAEnv


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
