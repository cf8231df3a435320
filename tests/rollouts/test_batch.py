"""``stppo_agent.rollouts.batch``: every tensor, dtype and statistic ``to_batch`` builds
from trajectories, padding, selection and trimming, on the host whatever the default device."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.rollouts.batch import Trajectory, left_pad, to_batch
from tests.support.devices import F64
from tests.support.generation import trajectories

# -- batch ---------------------------------------------------------------------------------------------------------

def test_batch_left_pad_puts_the_padding_on_the_left():
    ids, mask = left_pad([[5, 6, 7], [8], []], 0, "cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == torch.long and mask.dtype == torch.long
    ids, mask = left_pad([[4], [3, 2]], 9, "cpu")
    assert ids.tolist() == [[9, 4], [3, 2]] and mask.tolist() == [[0, 1], [1, 1]]


def test_batch_trajectory_append_records_roles_turns_and_logprobs():
    t = Trajectory(env=None, group_id=3, prompt_ids=[1, 2])
    assert (t.response_ids, t.policy_mask, t.turn_ids, t.sample_logprobs) == ([], [], [], [])
    assert (t.reward, t.done, t.terminated, t.truncated, t.finish_reason) == (0.0, False, False, False, "")
    assert (t.turns, t.search_calls, t.invalid_actions, t.search_errors, t.answered, t.info) == (0, 0, 0, 0, False, {})
    t.append([7, 8], policy=True, turn=0, logprobs=[-0.5, -1.5])
    t.append([9], policy=False, turn=0)
    t.append([4], policy=True, turn=1)
    assert t.response_ids == [7, 8, 9, 4]
    assert t.policy_mask == [True, True, False, True]
    assert t.turn_ids == [0, 0, -1, 1]
    assert t.sample_logprobs == [-0.5, -1.5, 0.0, 0.0]
    t.turns, t.invalid_actions, t.search_calls, t.search_errors, t.answered = 2, 1, 3, 4, True
    assert t.counters() == {"turns": 2, "invalid_actions": 1, "search_calls": 3, "search_errors": 4, "answered": True}
    other = Trajectory(env=None, group_id=0, prompt_ids=[])
    assert other.response_ids == [] and other.info == {}  # fresh lists, not shared with ``t``


def test_batch_to_batch_left_pads_prompts_right_pads_responses_and_averages_the_stats():
    batch = to_batch(trajectories(), pad_id=0)
    assert batch.prompt_width == 3 and batch.batch_size == 2
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 23], [0, 0, 14, 24, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]]
    assert batch.response_ids.tolist() == [[21, 22, 31, 23], [24, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[True, True, False, True], [True, False, False, False]]
    assert batch.turn_ids.tolist() == [[0, 0, -1, 1], [0, -1, -1, -1]]
    assert batch.sample_logprobs.tolist() == [[-0.25, -0.75, 0.0, -2.0], [-1.0, 0.0, 0.0, 0.0]]
    assert batch.sample_logprobs.dtype == torch.float32 and batch.loss_mask.dtype == torch.bool
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.turn_ids.dtype == torch.long
    assert batch.rewards.tolist() == [1.0, -0.5] and batch.rewards.dtype == torch.float32
    assert batch.group_ids.tolist() == [1, 0] and batch.group_ids.dtype == torch.long
    assert batch.terminated.tolist() == [True, False] and batch.truncated.tolist() == [False, True]
    assert batch.episode_info == [{"example_id": "a", "finish_reason": "answer"},
                                  {"example_id": "b", "finish_reason": "max_total_tokens"}]
    assert batch.stats == pytest.approx({
        "reward": 0.25, "response_tokens": 2.0, "turns": 2.5, "search_calls": 0.5, "search_errors": 1.0,
        "answer_rate": 0.5, "invalid_action_rate": 0.2, "search_error_rate": 2 / 3,
        "truncated_max_total_tokens": 0.5, "observations": 2.0,
        "observation_cut_rate": 0.25})  # cut observations over all observations, not a mean of per-row shares
    assert batch.old_logprobs is None and batch.ref_logprobs is None and batch.values is None
    assert batch.lengths().tolist() == [7, 2]


def test_batch_to_batch_of_empty_responses_keeps_one_column():
    t = Trajectory(env=None, group_id=0, prompt_ids=[5, 6])
    batch = to_batch([t], pad_id=3)
    assert batch.response_ids.tolist() == [[3]] and batch.loss_mask.tolist() == [[False]]
    assert batch.turn_ids.tolist() == [[-1]] and batch.input_ids.tolist() == [[5, 6, 3]]
    assert batch.attention_mask.tolist() == [[1, 1, 0]] and batch.attention_mask.dtype == torch.long
    assert batch.stats["truncated_max_total_tokens"] == 0.0 and batch.stats["response_tokens"] == 0.0
    t.reward = 1  # an env that pays whole numbers: the rewards are still float
    assert to_batch([t], pad_id=3).rewards.dtype == torch.float32


def test_batch_select_indexes_tensors_and_lists_and_keeps_the_stats():
    batch = to_batch(trajectories(), pad_id=0)
    batch.old_logprobs = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])
    one = batch.select([1])
    assert one.response_ids.tolist() == [[24, 0, 0, 0]] and one.rewards.tolist() == [-0.5]
    assert one.old_logprobs.tolist() == [[5, 6, 7, 8]] and one.episode_info == [batch.episode_info[1]]
    assert one.stats is batch.stats and one.prompt_width == 3 and one.ref_logprobs is None
    swapped = batch.select(torch.tensor([1, 0]))
    assert swapped.group_ids.tolist() == [0, 1] and swapped.episode_info[0]["example_id"] == "b"
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.stats == batch.stats


def test_batch_trimmed_drops_only_the_columns_no_row_uses():
    batch = to_batch(trajectories(), pad_id=0)
    assert batch.trimmed() is batch  # every column used
    short = batch.select([1]).trimmed()  # prompt [14], response [24]
    assert short.prompt_width == 1
    assert short.input_ids.tolist() == [[14, 24]] and short.attention_mask.tolist() == [[1, 1]]
    assert short.response_ids.tolist() == [[24]] and short.loss_mask.tolist() == [[True]]
    assert short.turn_ids.tolist() == [[0]] and short.sample_logprobs.tolist() == [[-1.0]]
    assert short.rewards.tolist() == [-0.5] and short.stats == batch.stats
    # a prompt-less row: the last prompt column stays (it predicts the first response token)
    empty = to_batch([Trajectory(env=None, group_id=0, prompt_ids=[5, 6])], 0)
    empty.attention_mask[:, :2] = 0
    cut = empty.trimmed()
    assert cut.prompt_width == 1 and cut.input_ids.shape == (1, 2)
    # wider prompt than response: left cut only
    b = Trajectory(env=None, group_id=0, prompt_ids=[7, 8])
    b.append([9, 10], policy=True, turn=0)
    c = Trajectory(env=None, group_id=0, prompt_ids=[7])
    c.append([9], policy=True, turn=0)
    both = to_batch([b, c], 0).select([1]).trimmed()
    assert both.prompt_width == 1 and both.input_ids.tolist() == [[7, 9]] and both.response_ids.tolist() == [[9]]
    right_only = to_batch([b, c], 0)
    right_only.attention_mask[:, 3] = 0
    right = right_only.trimmed()
    assert right.prompt_width == 2 and right.input_ids.tolist() == [[7, 8, 9], [0, 7, 9]]


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


def test_to_batch_lays_out_every_tensor_with_its_exact_values_and_dtype():
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


def test_to_batch_stats_are_the_exact_means_and_rates_of_the_trajectories():
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


# -- rollout batches, sampling and the stop criterion --------------------------------------------------------


def _trajectories():
    a = Trajectory(env=None, group_id=1, prompt_ids=[11, 12, 13])
    a.append([21, 22], policy=True, turn=0, logprobs=[-0.25, -0.75])
    b = Trajectory(env=None, group_id=0, prompt_ids=[14])
    b.append([24], policy=True, turn=0, logprobs=[-1.0])
    a.reward, b.reward = 1.0, 0.0
    return [a, b]


def test_batch_left_pad_and_to_move_every_tensor_to_the_device_asked_for():
    ids, mask = left_pad([[5, 6], [7]], 0, "meta")
    assert ids.device.type == mask.device.type == "meta" and ids.dtype == mask.dtype == torch.long
    moved = to_batch(_trajectories(), pad_id=0).to("meta")
    tensors = {name: value.device.type for name, value in vars(moved).items() if isinstance(value, torch.Tensor)}
    assert len(tensors) >= 9 and set(tensors.values()) == {"meta"}


def test_batch_is_built_on_the_host_whatever_the_default_device():
    # a GPU user may set torch's default device; the batch is assembled on the host (one copy to the device later,
    # by .to), so no part of it may follow the default while the prompt is built on "cpu"
    with torch.device("meta"):
        batch = to_batch(_trajectories(), pad_id=0)
    tensors = {name: value.device.type for name, value in vars(batch).items() if isinstance(value, torch.Tensor)}
    assert len(tensors) >= 9 and set(tensors.values()) == {"cpu"}
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22], [0, 0, 14, 24, 0]]


def test_batch_keeps_its_dtypes_whatever_the_default_dtype():
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        batch = to_batch(_trajectories(), pad_id=0)
    finally:
        torch.set_default_dtype(default)
    assert batch.sample_logprobs.dtype == torch.float32 and batch.rewards.dtype == torch.float32
    assert batch.sample_logprobs.tolist() == [[-0.25, -0.75], [-1.0, 0.0]]


def test_batch_select_of_no_rows_is_an_empty_batch():
    empty = to_batch(_trajectories(), pad_id=0).select([])
    assert empty.input_ids.shape == (0, 5) and empty.rewards.shape == (0,) and empty.episode_info == []
