"""Pins every tensor, dtype and stat that ``rollouts.batch.to_batch`` builds from trajectories (exact values)."""

import torch

from stppo_agent.rollouts.batch import Trajectory, to_batch

PAD = 99


def _two():
    a = Trajectory(env=None, group_id=3, prompt_ids=[5, 6, 7], reward=1.0, terminated=True,
                   finish_reason="answer", turns=2, search_calls=1, answered=True, observations=1,
                   observations_cut=1, info={"example_id": "a"})
    a.append([10, 11], policy=True, turn=0, logprobs=[-0.5, -0.25])
    a.append([12], policy=False, turn=0)
    a.append([13], policy=True, turn=1, logprobs=[-1.0])
    b = Trajectory(env=None, group_id=4, prompt_ids=[8], reward=0.5, truncated=True,
                   finish_reason="max_total_tokens", turns=1, search_errors=1, invalid_actions=1,
                   observations=3, info={"example_id": "b"})
    b.append([20], policy=True, turn=0, logprobs=[-2.0])
    return [a, b]


def test_tensors_are_pinned_exactly():
    batch = to_batch(_two(), PAD)
    assert batch.prompt_width == 3
    assert batch.input_ids.tolist() == [[5, 6, 7, 10, 11, 12, 13], [PAD, PAD, 8, 20, PAD, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]]
    assert batch.response_ids.tolist() == [[10, 11, 12, 13], [20, PAD, PAD, PAD]]
    assert batch.loss_mask.tolist() == [[True, True, False, True], [True, False, False, False]]
    assert batch.turn_ids.tolist() == [[0, 0, -1, 1], [0, -1, -1, -1]]
    assert batch.sample_logprobs.tolist() == [[-0.5, -0.25, 0.0, -1.0], [-2.0, 0.0, 0.0, 0.0]]
    assert batch.rewards.tolist() == [1.0, 0.5]
    assert batch.group_ids.tolist() == [3, 4]
    assert batch.terminated.tolist() == [True, False]
    assert batch.truncated.tolist() == [False, True]
    assert batch.episode_info == [{"example_id": "a", "finish_reason": "answer"},
                                  {"example_id": "b", "finish_reason": "max_total_tokens"}]
    dtypes = {name: getattr(batch, name).dtype for name in ("input_ids", "attention_mask", "response_ids",
                                                           "loss_mask", "turn_ids", "sample_logprobs", "rewards",
                                                           "group_ids", "terminated", "truncated")}
    assert dtypes == {"input_ids": torch.long, "attention_mask": torch.long, "response_ids": torch.long,
                      "loss_mask": torch.bool, "turn_ids": torch.long, "sample_logprobs": torch.float32,
                      "rewards": torch.float32, "group_ids": torch.long, "terminated": torch.bool,
                      "truncated": torch.bool}


def test_stats_are_pinned_exactly():
    assert to_batch(_two(), PAD).stats == {
        "reward": 0.75, "response_tokens": 2.0, "turns": 1.5, "search_calls": 0.5, "search_errors": 0.5,
        "answer_rate": 0.5, "invalid_action_rate": 1 / 3, "search_error_rate": 0.5,
        "truncated_max_total_tokens": 0.5, "observations": 2.0, "observation_cut_rate": 0.25}


def test_one_observation_cut_of_one_is_rate_one():
    t = Trajectory(env=None, group_id=0, prompt_ids=[1], observations=1, observations_cut=1)
    t.append([2], policy=True, turn=0)
    assert to_batch([t], PAD).stats["observation_cut_rate"] == 1.0


def test_no_responses_give_one_pad_column_and_zero_rates():
    batch = to_batch([Trajectory(env=None, group_id=0, prompt_ids=[1, 2])], PAD)
    assert batch.response_ids.tolist() == [[PAD]]
    assert batch.turn_ids.tolist() == [[-1]]
    assert batch.input_ids.tolist() == [[1, 2, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 0]]
    assert batch.stats["observation_cut_rate"] == 0.0
    assert batch.stats["response_tokens"] == 0.0


def test_built_on_the_host_whatever_the_default_device():
    with torch.device("meta"):
        batch = to_batch(_two(), PAD)
    assert {getattr(batch, n).device.type for n in ("input_ids", "response_ids", "rewards", "loss_mask")} == {"cpu"}
    assert batch.input_ids[1].tolist() == [PAD, PAD, 8, 20, PAD, PAD, PAD]


def test_single_trajectory_counts_only_max_total_tokens_endings():
    t = Trajectory(env=None, group_id=0, prompt_ids=[1], finish_reason="answer")
    t.append([2], policy=True, turn=0)
    assert to_batch([t], PAD).stats["truncated_max_total_tokens"] == 0.0
    t.finish_reason = "max_total_tokens"
    assert to_batch([t], PAD).stats["truncated_max_total_tokens"] == 1.0


def test_float32_whatever_the_default_dtype_and_reward_type():
    t = Trajectory(env=None, group_id=0, prompt_ids=[1], reward=1)  # an int reward, as some envs return
    t.append([2], policy=True, turn=0, logprobs=[-0.5])
    assert to_batch([t], PAD).rewards.dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        batch = to_batch([t], PAD)
    finally:
        torch.set_default_dtype(previous)
    assert batch.sample_logprobs.dtype == torch.float32 and batch.rewards.dtype == torch.float32
