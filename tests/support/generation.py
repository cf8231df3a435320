"""Trajectories of the rollout-backend tests."""

from __future__ import annotations

from stppo_agent.rollouts.batch import Trajectory


def trajectories():
    a = Trajectory(env=None, group_id=1, prompt_ids=[11, 12, 13], info={"example_id": "a"})
    a.append([21, 22], policy=True, turn=0, logprobs=[-0.25, -0.75])
    a.append([31], policy=False, turn=0)
    a.append([23], policy=True, turn=1, logprobs=[-2.0])
    a.reward, a.turns, a.search_calls, a.search_errors, a.invalid_actions = 1.0, 2, 1, 0, 0
    a.answered, a.terminated, a.finish_reason = True, True, "answer"
    a.observations, a.observations_cut = 1, 1
    b = Trajectory(env=None, group_id=0, prompt_ids=[14], info={"example_id": "b"})
    b.append([24], policy=True, turn=0, logprobs=[-1.0])
    b.reward, b.turns, b.search_calls, b.search_errors, b.invalid_actions = -0.5, 3, 0, 2, 1
    b.truncated, b.finish_reason = True, "max_total_tokens"
    b.observations, b.observations_cut = 3, 0
    return [a, b]
