"""``stppo_agent.rollouts.global_batch``: the global batch merged and gathered
over ranks, and each rank's mini-batch rows."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.distributed import process_group
from stppo_agent.rollouts.batch import Trajectory, to_batch
from stppo_agent.rollouts.global_batch import gather_global_batch, merge_shares, mini_batch_rows

# -- global_batch --------------------------------------------------------------------------------------------------

def share_batch(groups, prompts, responses, pad=0, **extra):
    ts = []
    for g, p, r in zip(groups, prompts, responses):
        t = Trajectory(env=None, group_id=g, prompt_ids=p)
        t.append(r, policy=True, turn=0, logprobs=[-1.0] * len(r))
        ts.append(t)
    batch = to_batch(ts, pad)
    for key, value in extra.items():
        setattr(batch, key, value)
    return batch


def test_global_batch_merge_pads_prompts_left_responses_right_and_sorts_by_group():
    a = share_batch([0, 2], [[5, 6], [7]], [[8], [9, 9]], pad=1)
    b = share_batch([1], [[4, 4, 4]], [[3, 3, 3]], pad=1)
    stats = {"reward": 0.0}
    merged = merge_shares([a, b], 1, stats)
    assert merged.stats is stats and merged.prompt_width == 3
    assert merged.group_ids.tolist() == [0, 1, 2]
    assert merged.input_ids.tolist() == [[1, 5, 6, 8, 1, 1], [4, 4, 4, 3, 3, 3], [1, 1, 7, 9, 9, 1]]
    assert merged.attention_mask.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]]
    assert merged.response_ids.tolist() == [[8, 1, 1], [3, 3, 3], [9, 9, 1]]
    assert merged.turn_ids.tolist() == [[0, -1, -1], [0, 0, 0], [0, 0, -1]]
    assert merged.loss_mask.tolist() == [[True, False, False], [True, True, True], [True, True, False]]
    assert merged.sample_logprobs.tolist() == [[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]]
    assert merged.old_logprobs is None and merged.episode_info == [{"finish_reason": ""}] * 3
    assert merged.rewards.tolist() == [0.0, 0.0, 0.0]
    assert merged.loss_mask.dtype == torch.bool and merged.turn_ids.dtype == torch.long  # padding keeps dtypes
    assert merged.sample_logprobs.dtype == torch.float32 and merged.input_ids.dtype == torch.long
    # more rows than response columns; a single share (replay of a one-process recording)
    wide = merge_shares([share_batch([0, 1, 2], [[5]] * 3, [[7]] * 3), share_batch([3], [[5]], [[7, 7, 7]])], 0, {})
    assert wide.response_ids.tolist() == [[7, 0, 0]] * 3 + [[7, 7, 7]]
    alone = merge_shares([b], 1, {})
    assert torch.equal(alone.input_ids, b.input_ids) and torch.equal(alone.loss_mask, b.loss_mask)


def test_global_batch_merge_keeps_rank_order_within_a_group_and_refuses_half_set_fields():
    a = share_batch([0, 0], [[5], [6]], [[1], [2]])
    b = share_batch([0], [[7]], [[3]])
    merged = merge_shares([a, b], 0, {})
    assert merged.response_ids[:, 0].tolist() == [1, 2, 3]  # stable: the shares' order
    groups = [(3 * i) % 4 for i in range(24)]  # enough rows for an unstable sort to reorder equal keys
    first = share_batch(groups[:14], [[5]] * 14, [[i] for i in range(14)])
    second = share_batch(groups[14:], [[5]] * 10, [[i] for i in range(14, 24)])
    order = merge_shares([first, second], 0, {}).response_ids[:, 0].tolist()
    assert order == sorted(range(24), key=lambda i: groups[i])
    a.old_logprobs = torch.zeros(2, 1)
    with pytest.raises(ValueError, match="old_logprobs is set on some ranks' batches and not on others"):
        merge_shares([a, b], 0, {})
    b.old_logprobs = torch.ones(1, 1)
    assert merge_shares([a, b], 0, {}).old_logprobs.tolist() == [[0.0], [0.0], [1.0]]


def test_global_batch_gather_runs_one_collective_and_returns_this_ranks_stats(monkeypatch):
    a = share_batch([1], [[5]], [[6]])
    a.stats = {"reward": 1.0}
    b = share_batch([0], [[7, 7]], [[8, 8]])
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, b])
    merged = gather_global_batch(a, pad_id=0)
    assert merged.group_ids.tolist() == [0, 1] and merged.stats == {"reward": 1.0}
    assert merged.stats is not a.stats
    assert merged.input_ids.tolist() == [[7, 7, 8, 8], [0, 5, 6, 0]]


def test_global_batch_mini_batch_rows_are_every_world_th_row():
    order = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2])
    assert mini_batch_rows(order, 2, 4, 0, 2).tolist() == [7, 5]
    assert mini_batch_rows(order, 2, 4, 1, 2).tolist() == [6, 4]
    assert mini_batch_rows(order, 0, 8, 2, 4).tolist() == [7, 3]
    assert mini_batch_rows(order, 4, 4, 0, 1).tolist() == [5, 4, 3, 2]
