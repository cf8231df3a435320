"""benchmarks/stress_stats.py and benchmarks/collapse_criterion.py against values computed by hand: exact McNemar and
Fisher p-values, Fisher's exact power, the detectable difference, and the persistent collapse criterion."""

from __future__ import annotations

import sys
from math import comb
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import collapse_criterion as criterion  # noqa: E402
import stress_stats as stats  # noqa: E402
from stress_interaction import arm_comparison, interactions  # noqa: E402


@pytest.mark.parametrize("only_first,only_second,p", [(6, 0, 2 / 2**6), (0, 6, 2 / 2**6), (5, 1, 14 / 64),
                                                      (1, 1, 1.0), (0, 0, 1.0)])
def test_exact_mcnemar_on_discordant_pairs(only_first, only_second, p):
    assert stats.mcnemar_exact(only_first, only_second) == pytest.approx(p)


def test_fisher_exact_against_the_hypergeometric_by_hand():
    # 5 collapses of 20 all in the first arm: 2 * C(10,5) / C(20,5), the table and its mirror image
    assert stats.fisher(5, 10, 0, 10) == pytest.approx(2 * comb(10, 5) / comb(20, 5)) == pytest.approx(0.0325, abs=1e-4)
    assert stats.fisher(3, 3, 0, 3) == pytest.approx(0.1)
    assert stats.fisher(2, 5, 2, 5) == pytest.approx(1.0)


@pytest.mark.parametrize("n1,n0", [(10, 10), (7, 12), (3, 3)])
def test_the_rejection_region_is_scipys_fisher_test(n1, n0):
    region = stats._rejections(n1, n0, 0.05)
    by_scipy = np.array([[stats.fisher(a, n1, b, n0) <= 0.05 for b in range(n0 + 1)] for a in range(n1 + 1)])
    assert (region == by_scipy).all()


@pytest.mark.parametrize("p1,p0,n,power", [(0.8, 0.2, 5, 0.38), (0.8, 0.2, 10, 0.64), (0.5, 0.1, 10, 0.30),
                                           (0.8, 0.2, 20, 0.96), (0.5, 0.1, 20, 0.74), (1.0, 0.0, 3, 0.0)])
def test_fisher_power_matches_the_review_table(p1, p0, n, power):
    assert stats.fisher_power(p1, p0, n, n) == pytest.approx(power, abs=0.006)


def test_detectable_difference_against_a_control_that_never_collapses():
    # 10 vs 10 seeds, control 0/10: Fisher rejects exactly when the cell has >= 5 collapses (4/10 vs 0/10 gives
    # 2 * C(10,4) / C(20,4) = 0.087), so the detectable rate is the p with P(Bin(10, p) >= 5) = 0.8
    assert stats.fisher(4, 10, 0, 10) > 0.05 >= stats.fisher(5, 10, 0, 10)

    def at_least_five(p):
        return sum(comb(10, k) * p**k * (1 - p) ** (10 - k) for k in range(5, 11))

    d = stats.detectable_difference(10, 10, 0.0)
    assert at_least_five(d) >= 0.8 > at_least_five(d - 0.005)
    assert d == pytest.approx(0.585)
    assert stats.detectable_difference(20, 20, 0.0) < d < stats.detectable_difference(5, 5, 0.0)
    assert stats.detectable_difference(3, 3, 0.0) is None  # 3/3 vs 0/3 gives p = 0.1: nothing is detectable


def test_compare_pairs_seeds_for_mcnemar_and_counts_for_fisher():
    ppo = {0: True, 1: True, 2: True, 3: True, 4: True, 5: True, 6: False, 7: False}
    st_ppo = {s: False for s in ppo}
    paired = stats.compare(ppo, st_ppo, paired=True)
    assert (paired["test"], paired["only_first"], paired["only_second"]) == ("mcnemar", 6, 0)
    assert paired["p"] == pytest.approx(0.03125)
    unpaired = stats.compare(ppo, st_ppo, paired=False)
    assert unpaired["test"] == "fisher" and unpaired["first"] == [6, 8] and unpaired["second"] == [0, 8]
    assert unpaired["p"] == pytest.approx(stats.fisher(6, 8, 0, 8))


def test_final_rewards_compare_by_signed_rank_on_pairs_and_by_rank_sum_otherwise():
    st_ppo = {s: 0.7 + 0.01 * s for s in range(10)}
    ppo = {s: 0.5 + 0.005 * s for s in range(10)}  # st_ppo ends higher on every seed
    paired = stats.compare_values(st_ppo, ppo, paired=True)
    # every one of 10 signed ranks on one side: the exact two-sided p is 2 / 2^10
    assert (paired["test"], paired["wins"], paired["losses"]) == ("wilcoxon", 10, 0)
    assert paired["p"] == pytest.approx(2 / 2**10) and paired["mean_difference"] == pytest.approx(0.2225)
    # the t interval of the mean paired difference 0.2 + 0.005 s: sd 0.005 x 3.028, t(0.975, 9) = 2.262
    assert paired["ci95"] == pytest.approx([0.2225 - 0.01083, 0.2225 + 0.01083], abs=1e-4)
    assert stats.compare_values(ppo, st_ppo, paired=True)["mean_difference"] < 0  # first minus second
    ties = stats.compare_values(ppo, dict(ppo), paired=True)
    assert ties["p"] == 1.0 and ties["wins"] == ties["losses"] == 0
    apart = stats.compare_values({s: st_ppo[s] for s in range(5)}, {s: ppo[s] for s in range(5)}, paired=False)
    # 5 vs 5 with no overlap: the exact two-sided rank-sum p is 2 / C(10, 5)
    assert apart["test"] == "mann-whitney" and apart["p"] == pytest.approx(2 / comb(10, 5))
    low, high = apart["ci95"]  # Welch: the two samples' own spreads, unpaired
    assert low < apart["mean_difference"] < high and 0 < low and high < 0.3
    assert stats.compare_values({0: 1.0}, {0: 0.0}, paired=True)["ci95"] is None  # one pair: no interval


def test_the_interaction_compares_what_the_stress_cost_each_rule_not_where_they_ended():
    def runs(level_rewards):
        return {rule: {s: {"reward_curve": [0.0] * 3 + [reward + 0.01 * s] * 5} for s in range(8)}
                for rule, reward in level_rewards.items()}

    grid = {"lag0": runs({"turn_ppo": 0.9, "ppo": 0.5}), "lag64": runs({"turn_ppo": 0.8, "ppo": 0.2})}
    result = interactions(grid, "turn_ppo", "ppo", "lag0")["lag64"]
    # turn_ppo lost 0.1, ppo 0.3: a cost 0.2 smaller on each of 8 seeds (its higher level on lag0 does not count)
    assert result["mean_difference"] == pytest.approx(0.2) and (result["wins"], result["losses"]) == (8, 0)
    assert result["p"] == pytest.approx(2 / 2**8)
    assert interactions(grid, "ppo", "turn_ppo", "lag0")["lag64"]["mean_difference"] == pytest.approx(-0.2)
    assert "lag0" not in interactions(grid, "turn_ppo", "ppo", "lag0")


@pytest.mark.parametrize("k,n,low,high", [(0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634)])
def test_wilson_interval(k, n, low, high):
    assert stats.wilson(k, n) == pytest.approx((low, high), abs=5e-5)


def labels(values):
    return list(range(len(values)))


def test_a_dip_that_recovers_is_counted_apart_from_a_collapse():
    # moving averages 0.6 0.6 0.6 0.4 0.267 0.4 0.733: one read-out below half of the best 0.6, then back
    rewards = [0.6, 0.6, 0.6, 0.0, 0.2, 1.0, 1.0]
    verdict = criterion.judge(labels(rewards), rewards)
    assert not verdict.collapsed and verdict.dipped and verdict.dips == ((4, 4),)


def test_a_drop_that_stays_two_read_outs_collapses_at_its_first_read_out_even_if_it_recovers_later():
    rewards = [0.6, 0.6, 0.6, 0.0, 0.0, 0.0, 0.6, 0.6, 0.6]  # averages 0.4 (not below 0.3), 0.2, 0.0, 0.2, ...
    verdict = criterion.judge([10 * i for i in labels(rewards)], rewards)
    assert verdict.collapsed and verdict.collapsed_at == 40 and verdict.reason == "reward" and not verdict.dipped


def test_the_running_best_starts_at_the_first_full_window_so_one_lucky_first_probe_is_no_level_to_lose():
    # averages 0.47 0.37 0.337 0.27 0.2 0.2 0.233: the lone first read-out would make a best of 0.47 (line 0.235)
    # and the 0.2s a dip; from the first full window the best is 0.337 (line 0.168) and nothing is below it
    rewards = [0.47, 0.27, 0.27, 0.27, 0.06, 0.27, 0.37]
    verdict = criterion.judge(labels(rewards), rewards)
    assert not verdict.collapsed and not verdict.dipped
    assert criterion.below_the_line(rewards) == [None] * 7
    # a fall from a level held over a full window still counts from that window's average on
    held = [0.6, 0.6, 0.6, 0.0, 0.0]
    assert criterion.judge(labels(held), held).collapsed_at == 4


def test_the_line_at_the_end_is_half_the_best_full_window_average_what_a_zero_collapse_bound_covers():
    # best full-window average 0.337 (read-outs 0-2), not the lone first read-out's 0.47
    assert criterion.line_at_end([0.47, 0.27, 0.27, 0.27, 0.06, 0.27, 0.37]) == pytest.approx(0.1683, abs=1e-4)
    assert criterion.line_at_end([0.6, 0.6, 0.6, 0.0]) == pytest.approx(0.3)  # a later fall does not lower it
    assert criterion.line_at_end([]) is None


def test_below_the_line_at_the_final_read_out_is_a_collapse():
    rewards = [0.6, 0.6, 0.6, 0.6, 0.0, 0.0]  # the last average, 0.2, is the only one below 0.3
    assert criterion.judge(labels(rewards), rewards).collapsed_at == 5
    assert not criterion.judge(labels(rewards[:-1]), rewards[:-1]).collapsed


def test_the_line_is_strictly_below_half_of_a_best_of_at_least_a_tenth():
    exactly_half = [0.6, 0.6, 0.6, 0.3, 0.3, 0.3]  # averages end at 0.3 = half of 0.6: not below
    assert not criterion.judge(labels(exactly_half), exactly_half).collapsed
    small = [0.09, 0.0, 0.0, 0.0]
    assert not criterion.judge(labels(small), small).collapsed
    assert criterion.judge(labels(small), [10 * r for r in small]).collapsed


def test_invalid_actions_count_only_where_the_env_counts_them():
    rewards = [0.5] * 5
    invalid = [0.1, 0.1, 0.9, 0.9, 0.9]  # averages 0.1 0.1 0.37 0.63 0.9: above max(0.5, 0.2) from read-out 3
    verdict = criterion.judge(labels(rewards), rewards, invalid)
    assert verdict.collapsed and verdict.collapsed_at == 3 and verdict.reason == "invalid"
    assert not criterion.judge(labels(rewards), rewards, None).collapsed  # reward-only (stppo/Toy-v0)
    high_start = [0.6, 0.6, 0.9, 0.9, 0.9]  # twice the first is 1.2: never above it
    assert not criterion.judge(labels(rewards), rewards, high_start).collapsed


def test_a_nan_skipped_update_is_a_collapse_dated_at_its_version():
    rewards = [0.5] * 6
    verdict = criterion.judge(labels(rewards), rewards, skipped_at=[3, 5])
    assert verdict.collapsed and verdict.collapsed_at == 3 and verdict.reason == "nan_skip"


def test_the_criterion_text_states_the_constants_the_function_uses():
    for piece in ("3-point moving average", "0.5 x its running best", "at least 0.1", "2 or more consecutive",
                  "final read-out", "NaN/inf", "dipped", "stppo/Toy-v0"):
        assert piece in criterion.CRITERION


def test_docs_quote_the_criterion_as_the_code_states_it():
    text = (Path(__file__).resolve().parents[2] / "docs" / "stability.md").read_text()
    quoted = text.split("<!-- criterion -->\n", 1)[1].split("<!-- /criterion -->", 1)[0]
    assert quoted == criterion.CRITERION[0].upper() + criterion.CRITERION[1:]


def test_an_arm_comparison_pairs_cells_of_different_levels_and_measures_each_cost_from_its_own_rule():
    def cell(reward):
        return {s: {"reward_curve": [0.0] * 3 + [reward + 0.01 * s] * 5} for s in range(8)}

    grid = {"lag0": {"ppo": cell(0.9), "turn_ppo": cell(0.7)},
            "lag64": {"ppo": cell(0.2), "turn_ppo": cell(0.5)},
            "wide64": {"ppo": cell(0.6)}}
    result = arm_comparison(grid, ("wide64", "ppo"), ("lag64", "turn_ppo"), "lag0")
    # ended 0.6 vs 0.5; cost -0.3 (from ppo's 0.9) vs -0.2 (from turn_ppo's 0.7): ahead, yet lost more
    assert result["ended"]["mean_difference"] == pytest.approx(0.1) and result["ended"]["wins"] == 8
    assert result["cost"]["mean_difference"] == pytest.approx(-0.1) and result["cost"]["losses"] == 8
    with pytest.raises(SystemExit, match="nothing to pair"):
        arm_comparison(grid, ("wide64", "turn_ppo"), ("lag64", "ppo"), "lag0")
