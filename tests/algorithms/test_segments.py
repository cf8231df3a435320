"""``stppo_agent.algorithms.segments``: masked sums and means, turn segment ids,
segment sums and broadcasts, whitening, the discounted reverse cumsum, quantiles and stable sorts, each on the
inputs' device."""

from __future__ import annotations

import math

import pytest
import torch

from stppo_agent.algorithms.advantages import compact_policy_positions
from stppo_agent.algorithms.second_moment import keep_items
from stppo_agent.algorithms.segments import (
    broadcast_segments,
    check_turn_ids,
    discounted_reverse_cumsum,
    masked_mean,
    masked_sum,
    quantile,
    segment_counts,
    segment_sum,
    turn_segment_ids,
    whiten,
)
from tests.support.batches import F64, t64
from tests.support.devices import _policy_batch

# --- segments -----------------------------------------------------------------------------------------------

def test_masked_sum_and_mean_ignore_masked_entries_even_nan():
    x = t64([[1.0, float("nan"), 3.0], [float("inf"), 5.0, 7.0]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    assert masked_sum(x, mask).item() == 9.0
    assert masked_sum(x, mask).dtype == F64
    assert masked_mean(x, mask).item() == 3.0
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0  # no entries: 0, not NaN
    counts = masked_sum(torch.tensor([[1, 2, 3]]), torch.tensor([[True, False, True]]))
    assert counts.dtype == torch.int64 and counts.item() == 4  # a sum of integers stays an integer
    one = torch.tensor([[False, False, False], [False, True, False]])
    assert masked_mean(x, one).item() == 5.0


def test_turn_segment_ids_flatten_row_and_turn_and_zero_off_the_mask():
    mask = torch.tensor([[True, True, False, True], [False, True, True, False]])
    turns = torch.tensor([[0, 0, -1, 2], [-1, 1, 3, -1]])
    ids, count = turn_segment_ids(turns, mask)
    assert count == 8
    assert ids.tolist() == [[0, 0, 0, 2], [0, 5, 7, 0]]
    # ids are clamped into the row's buckets, so a stray id cannot spill into the next row
    ids, _ = turn_segment_ids(torch.tensor([[9, -3]]), torch.tensor([[True, True]]))
    assert ids.tolist() == [[1, 0]]


def test_check_turn_ids_refuses_ids_outside_zero_to_t_on_policy_tokens_only():
    mask = torch.tensor([[True, True, False]])
    check_turn_ids(torch.tensor([[0, 2, -1]]), mask)  # T - 1 is fine; -1 off the mask is fine
    check_turn_ids(torch.tensor([[0, 1, 7]]), mask)
    with pytest.raises(ValueError, match=r"^turn_ids must be in \[0, T\) on every policy token \(loss_mask True\)$"):
        check_turn_ids(torch.tensor([[0, 3, 0]]), mask)
    with pytest.raises(ValueError, match="turn_ids"):
        check_turn_ids(torch.tensor([[-1, 0, 0]]), mask)


def test_segment_sum_counts_and_broadcast():
    x = t64([[1.0, 2.0, 0.0], [4.0, 0.0, 8.0]])
    ids = torch.tensor([[0, 0, 0], [3, 0, 5]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    torch.testing.assert_close(segment_sum(x, ids, 6), t64([3.0, 0.0, 0.0, 4.0, 0.0, 8.0]))
    counts = segment_counts(ids, 6, mask, F64)
    assert counts.dtype == F64 and counts.tolist() == [2.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    out = broadcast_segments(t64([10.0, 11.0, 12.0, 13.0, 14.0, 15.0]), ids)
    assert out.shape == (2, 3) and out.tolist() == [[10.0, 10.0, 10.0], [13.0, 10.0, 15.0]]
    x.requires_grad_(True)
    segment_sum(x, ids, 6)[3].backward()
    assert x.grad.tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_whiten_uses_the_unbiased_variance_and_eps():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    x = t64([[1.0, 2.0, 100.0], [6.0, -5.0, 7.0]])
    # mean 3, centered (-2, -1, 3), unbiased var 14 / 2 = 7
    torch.testing.assert_close(whiten(x, mask), t64([[-2.0, -1.0, 0.0], [3.0, 0.0, 0.0]]) / math.sqrt(7.0 + 1e-8))
    tiny = t64([[0.0, 2e-4]])
    both = torch.tensor([[True, True]])
    # var 2e-8: eps is not negligible
    torch.testing.assert_close(whiten(tiny, both), t64([[-1e-4, 1e-4]]) / math.sqrt(3e-8))
    torch.testing.assert_close(whiten(tiny, both, eps=0.0), t64([[-1e-4, 1e-4]]) / math.sqrt(2e-8))
    assert whiten(t64([[4.0, 9.0]]), torch.tensor([[True, False]])).tolist() == [[0.0, 0.0]]  # one entry: 0


@pytest.mark.parametrize("discount", [0.0, 0.5, 0.9, 1.0])
def test_discounted_reverse_cumsum_against_a_loop(discount):
    x = t64([[1.0, 2.0, -1.0, 4.0, 0.5, 3.0, 2.0]])
    expected = torch.zeros_like(x)
    running = 0.0
    for j in reversed(range(x.shape[1])):
        running = float(x[0, j]) + discount * running
        expected[0, j] = running
    torch.testing.assert_close(discounted_reverse_cumsum(x, discount), expected)
    assert discounted_reverse_cumsum(t64([[2.0]]), discount).tolist() == [[2.0]]
    # along the last dimension of any shape
    torch.testing.assert_close(discounted_reverse_cumsum(x[0], discount), expected[0])
    cube = torch.stack([x, 2 * x, -x])
    torch.testing.assert_close(discounted_reverse_cumsum(cube, discount), torch.stack([expected, 2 * expected,
                                                                                       -expected]))


def test_quantile_of_small_inputs():
    assert quantile(t64([1.0, 2.0, 3.0, 4.0, 5.0]), 0.5) == 3.0
    assert quantile(t64([0.0, 10.0]), 0.99) == pytest.approx(9.9)
    assert quantile(torch.tensor([3.0, 1.0, 2.0]), 0.0) == 1.0


def test_sorts_are_stable_on_long_rows():
    """Long enough rows that an unstable sort reorders: policy tokens keep their order (GAE runs over them) and
    M2PO drops tied segments first-come (every rank makes the same cut)."""
    generator = torch.Generator().manual_seed(5)
    mask = torch.rand(3, 60, generator=generator) < 0.5
    order = compact_policy_positions(mask)
    for row in range(3):
        policy = torch.nonzero(mask[row]).flatten().tolist()
        rest = torch.nonzero(~mask[row]).flatten().tolist()
        assert order[row].tolist() == policy + rest
    values = torch.ones(60, dtype=F64)
    values[::3] = 0.0  # 40 tied ones, 20 zeros: (40 - k) / (60 - k) < 0.5 once k = 21 ones are gone
    keep = keep_items(values, torch.ones(60, dtype=F64), 0.5)
    ones = torch.nonzero(values == 1.0).flatten()
    assert keep[ones[:21]].tolist() == [False] * 21 and keep[ones[21:]].all() and keep[values == 0.0].all()


# the one costly test (a 16M-value sort) last: under mutation testing -x stops before it for most mutants
def test_quantile_past_torchs_input_limit_subsamples_keeping_both_tails(monkeypatch):
    seen = []

    def limited_quantile(values, q):  # torch.quantile's own refusal, without its cost on 16M values
        seen.append(values)
        if values.numel() > 1 << 24:
            raise RuntimeError("quantile() input tensor is too large")
        return values.max() if q == 1.0 else values.min()

    monkeypatch.setattr(torch, "quantile", limited_quantile)
    big = torch.zeros((1 << 24) + 1, dtype=torch.float32)
    big[0], big[-1] = 7.0, -5.0
    assert quantile(big, 1.0) == 7.0
    assert seen[-1].numel() == 1 << 24 and seen[-1].dtype == F64
    assert seen[-1][0].item() == -5.0 and seen[-1][-1].item() == 7.0  # sorted, both ends kept


def test_segments_reductions_stay_on_the_inputs_device():
    from stppo_agent.algorithms.segments import (
        masked_mean,
        masked_sum,
        segment_counts,
        segment_sum,
        turn_segment_ids,
        whiten,
    )

    batch = _policy_batch()
    x, mask, turns = batch["advantages"], batch["loss_mask"], batch["turn_ids"]
    with torch.device("meta"):
        ids, num = turn_segment_ids(turns, mask)
        sums = segment_sum(x, ids, num)
        counts = segment_counts(ids, num, mask, F64)
        results = [masked_sum(x, mask), masked_mean(x, mask), whiten(x, mask)]
    want_ids, want_num = turn_segment_ids(turns, mask)
    assert ids.device.type == "cpu" and num == want_num and ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(sums, segment_sum(x, want_ids, want_num), rtol=0, atol=0)
    assert counts.dtype == F64 and counts.sum() == mask.sum() and counts.device.type == "cpu"
    torch.testing.assert_close(results[0], x[mask].sum(), rtol=0, atol=0)
    torch.testing.assert_close(results[1], x[mask].mean(), rtol=0, atol=0)
    for result in results:
        assert result.device.type == "cpu" and result.dtype == F64
    assert results[2][~mask].abs().sum() == 0 and abs(float(results[2][mask].mean())) < 1e-12
