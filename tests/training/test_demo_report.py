"""``stppo_agent.training.demo_report``: the RL step's summary, the before/after
table with the noise of its few questions, and the check line."""

from __future__ import annotations

import json
import math

import pytest

from stppo_agent.training import demo
from stppo_agent.training.demo import EXPECTED_RANGES, before_after_table, demo_figures, off_policy_summary, range_check


def test_demo_off_policy_means_average_the_off_policy_records(tmp_path):
    assert demo.off_policy_means(tmp_path) == {}
    records = [{"iteration": 1, "offpolicy/steps": 0},
               {"iteration": 2, "offpolicy/steps": 3, "offpolicy/clip_frac": 0.1, "offpolicy/turn_clip_frac": 0.2,
                "offpolicy/clip_bias_scale": 2.0, "offpolicy/clip_bias_norm": 1.0,
                "offpolicy/tail/token_outside_frac": 0.3, "offpolicy/tail/ratio_max": 3.0,
                "offpolicy/tail/turn_ratio_max": 1.5},
               {"iteration": 3, "offpolicy/steps": 1, "offpolicy/clip_frac": 0.3, "offpolicy/turn_clip_frac": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = [{"step": 1, "on_policy": True, "clip_bias_scale": 9.0}, {"step": 2, "on_policy": False,
                                                                       "clip_bias_scale": 1.5},
             {"step": 3, "on_policy": False, "clip_bias_scale": 2.5}, {"step": 4, "on_policy": False,
                                                                        "clip_bias_scale": None}]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    means = demo.off_policy_means(tmp_path)
    assert means == pytest.approx({"steps": 4, "clip_frac": 0.2, "turn_clip_frac": 0.2, "clip_bias_scale": 2.0,
                                   "clip_bias_norm": 1.0, "tail/token_outside_frac": 0.3, "tail/ratio_max": 3.0,
                                   "tail/turn_ratio_max": 1.5, "clip_bias_scale_max": 2.5})  # not the on-policy 9
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"offpolicy/steps": 2}) + "\n")
    (tmp_path / "steps.jsonl").unlink()
    assert math.isnan(demo.off_policy_means(tmp_path)["clip_frac"])
    assert math.isnan(demo.off_policy_means(tmp_path)["clip_bias_scale_max"])


def test_demo_off_policy_summary_names_every_figure():
    means = {"steps": 3.0, "clip_frac": 0.1234, "turn_clip_frac": 0.25, "clip_bias_scale": 1.8, "clip_bias_norm": 0.5,
             "tail/token_outside_frac": 0.4, "tail/ratio_max": 2.345, "tail/turn_ratio_max": 1.5,
             "clip_bias_scale_max": 2.25}
    assert demo.off_policy_summary(means, [0.2, 0.0]) == (
        "trained on 2 trajectories, reward 0.100 (1 x 0.200, 1 x 0.000); on 3 off-policy steps: clip_frac 0.123 "
        "(turn-level), turn_clip_frac 0.250, clip_bias_scale 1.800 (max 2.250; ||C|| 0.500); token ratios outside the "
        "clip range 0.400 (what token-level PPO would clip), max 2.35 vs turn ratios max 1.50")
    assert demo.off_policy_summary({}, []) == "trained; no off-policy step (one mini-batch per iteration)"
    assert demo.off_policy_summary({}, [1.0, 1.0], 1.0).startswith(
        "trained on 2 trajectories, reward 1.000 (2 x 1.000) after 1 more rollout round(s) for groups whose")


def metrics_rows(em, answer, tokens=True):
    rows = []
    for benchmark, score in (("nq", {"em": em}), ("hotpotqa", {"em": em / 2}), ("medqa", {"acc": 0.25})):
        metrics = {"n": 8, **score, "answer_rate": answer, "invalid_action_rate": 0.125, "mean_search_calls": 1.25}
        if tokens:
            metrics["mean_response_tokens"] = 40.0
        rows.append({"benchmark": benchmark, "metrics": metrics})
    return rows


def test_demo_before_after_table_cells_and_qa_average():
    table = demo.before_after_table(metrics_rows(0.5, 0.75), metrics_rows(1.0, 1.0, tokens=False)).splitlines()
    assert table[1].split() == ["benchmark", "n", "EM/acc", "answer", "invalid", "searches", "tokens"]
    assert table[3].split() == ["nq", "8", "0.500", "->", "1.000", "0.750", "->", "1.000", "0.125", "->", "0.125",
                                "1.25", "->", "1.25", "40.0", "->", "0.0"]
    assert table[4].split()[2:5] == ["0.250", "->", "0.500"] and table[5].split()[2:5] == ["0.250", "->", "0.250"]
    assert table[6].split() == ["QA", "avg", "(EM)", "0.375", "->", "0.750"] and len(table) == 8
    assert table[7] == ("noise: one answer moves a benchmark's EM/acc by 1/8 = 0.125 and the QA average by 0.062; a "
                        "change of a few answers either way is noise, not a result of RL")
    after = demo.before_after_table(None, metrics_rows(1.0, 1.0)).splitlines()
    assert after[0] == "evaluation after RL" and after[-2].split() == ["QA", "avg", "(EM)", "0.750"]
    assert after[3].split() == ["nq", "8", "1.000", "1.000", "0.125", "1.25", "40.0"]
    one_qa = demo.before_after_table(None, metrics_rows(1.0, 1.0)[:1] + metrics_rows(1.0, 1.0)[2:]).splitlines()
    assert len(one_qa) == 6 and "QA avg" not in one_qa[-2]  # one QA benchmark: no average, nor its noise
    assert one_qa[-1].startswith("noise: one answer moves a benchmark's EM/acc by 1/8 = 0.125;")
    unscored = [{"benchmark": "x", "metrics": {"n": 1, "answer_rate": 0.5, "invalid_action_rate": 0.0,
                                               "mean_search_calls": 0.0}}]
    assert demo.before_after_table(None, unscored).splitlines()[3].split()[:3] == ["x", "1", "0.000"]
    from stppo_agent.training.demo_report import answer_noise

    assert answer_noise([{"benchmark": "x", "metrics": {"n": 0}}], 0) == "noise: no questions were scored"


def test_demo_figures_and_the_range_check_bounds():
    after, before = metrics_rows(1.0, 0.9), metrics_rows(1.0, 0.6)
    figures = demo.demo_figures(before, after, {"turn_clip_frac": 0.5, "clip_bias_scale": 1.02,
                                                "clip_bias_scale_max": 1.05})
    assert figures == pytest.approx({"answer rate after RL": 0.9, "answer rate before RL": 0.6,
                                     "turn_clip_frac": 0.5, "max clip_bias_scale": 1.05})
    assert demo.demo_figures(None, after, {}) == pytest.approx({"answer rate after RL": 0.9, "turn_clip_frac": 0.0,
                                                                "max clip_bias_scale": 1.0})
    assert demo.demo_figures(None, after, {}, [0.2, 0.2, 1.0])["reward spread"] == pytest.approx(0.8)
    edges = {"answer rate before RL": 0.75, "reward spread": 0.01, "turn_clip_frac": 0.5,
             "max clip_bias_scale": 10.0, "answer rate after RL": 1.0}
    assert demo.range_check(edges) == ("check: passed, each figure within its range (docs/demo.md): answer rate "
                                       "before RL 0.750, reward spread 0.010, turn_clip_frac 0.500, max "
                                       "clip_bias_scale 10.000, answer rate after RL 1.000")
    low = dict(edges, **{"answer rate before RL": 0.7499, "turn_clip_frac": 0.0099})
    assert demo.range_check(low) == (
        "check: FAILED: answer rate before RL 0.750 (expected 0.75-1): the warm start did not teach Search-R1's tags "
        "(more --sft-steps); turn_clip_frac 0.010 (expected 0.01-0.5): no turn's ratio left the clip range on the "
        "off-policy steps: the policy moved too little between them (a higher --lr moves it more) -- docs/demo.md "
        "says what each figure shows")
    high = {"max clip_bias_scale": 10.01, "answer rate after RL": 1.001}
    assert demo.range_check(high).count("(expected") == 2 and "clip_bias_scale 10.010 (expected 1.01-10): the " \
        "clipped part dwarfed the gradient" in demo.range_check(high)
    assert demo.range_check({"turn_clip_frac": 0.3}) == ("check: passed, each figure within its range "
                                                         "(docs/demo.md): turn_clip_frac 0.300")


# `stppo demo`'s own parts: the progress display, the before/after table with its noise line and the check line (the
# command end to end, on a tiny model: tests/training/test_sft.py).


def results(em: float, answer: float, n: int = 8) -> list[dict]:
    rows = []
    for benchmark in ("nq", "hotpotqa"):
        rows.append({"benchmark": benchmark, "metrics": {
            "n": n, "em": em, "f1": em, "answer_rate": answer, "invalid_action_rate": 0.0, "mean_search_calls": 1.5,
            "mean_response_tokens": 60.0}})
    rows.append({"benchmark": "medqa", "metrics": {
        "n": n, "acc": 0.25, "answer_rate": answer, "invalid_action_rate": 0.125, "mean_search_calls": 1.0,
        "mean_response_tokens": 50.0}})
    return rows


def test_before_after_table_puts_both_runs_in_each_cell():
    table = before_after_table(results(0.5, 0.875), results(0.75, 1.0)).splitlines()
    assert table[0] == "evaluation: before RL (after the warm start) -> after RL"
    assert table[1].split() == ["benchmark", "n", "EM/acc", "answer", "invalid", "searches", "tokens"]
    assert table[3].split() == ["nq", "8", "0.500", "->", "0.750", "0.875", "->", "1.000", "0.000", "->", "0.000",
                                "1.50", "->", "1.50", "60.0", "->", "60.0"]
    assert table[5].split()[:5] == ["medqa", "8", "0.250", "->", "0.250"]
    assert table[6].split() == ["QA", "avg", "(EM)", "0.500", "->", "0.750"]  # nq and hotpotqa, not medqa's acc
    without_warm_start = before_after_table(None, results(0.0, 0.0)).splitlines()
    assert without_warm_start[0] == "evaluation after RL" and "->" not in "".join(without_warm_start)


def test_range_check_names_each_figure_outside_its_range():
    means = {"turn_clip_frac": 0.1, "clip_bias_scale": 1.3, "clip_bias_scale_max": 2.0}
    good = demo_figures(results(0.5, 0.9), results(0.75, 1.0), means, [1.0, 0.2, 0.2, 0.0])
    assert good == {"answer rate before RL": 0.9, "answer rate after RL": 1.0, "turn_clip_frac": 0.1,
                    "max clip_bias_scale": 2.0, "reward spread": 1.0, "reward": 0.35}
    assert range_check(good).startswith("check: passed")
    assert all(name in range_check(good) for name in EXPECTED_RANGES)
    # no clipping acted (an on-policy-only run: no off-policy means), and the warm start taught no tags
    bad = demo_figures(results(0.0, 0.1), results(0.75, 1.0), {})
    line = range_check(bad)
    assert line.startswith("check: FAILED")
    assert "turn_clip_frac 0.000 (expected 0.01-0.5): no turn's ratio left the clip range" in line
    assert "answer rate before RL 0.100 (expected 0.75-1): the warm start did not teach" in line
    assert "max clip_bias_scale 1.000 (expected 1.01-10)" in line and "answer rate after RL" not in line
    nan = dict(good, **{"max clip_bias_scale": math.nan})  # a figure no step measured is never "within"
    assert "max clip_bias_scale nan (expected 1.01-10): no off-policy step measured it" in range_check(nan)
    # without a warm start there is no "before" figure to check, without the batch's rewards no spread
    assert "before RL" not in range_check(demo_figures(None, results(0.75, 1.0), means))
    assert "reward spread" not in range_check(demo_figures(None, results(0.75, 1.0), means))


# Figures real runs printed: a run of the earlier recipe with a mix of rewards, where clipping acted (its largest
# clip_bias_scale is above its mean of 1.831), and a run of the same recipe on another CPU, in bfloat16, whose 4
# trajectories all earned 0.200 (with nothing clipped by the correction, every step's scale was 1).
PASSED_RUN = {"answer rate before RL": 1.0, "reward spread": 0.2, "reward": 0.15, "turn_clip_frac": 0.133,
              "max clip_bias_scale": 1.831, "answer rate after RL": 1.0}
NO_SIGNAL_RUN = {"answer rate before RL": 1.0, "reward spread": 0.0, "reward": 0.2, "turn_clip_frac": 0.067,
                 "max clip_bias_scale": 1.0, "answer rate after RL": 1.0}


def test_the_check_passes_a_run_that_showed_the_mechanism():
    assert range_check(PASSED_RUN) == (
        "check: passed, each figure within its range (docs/demo.md): answer rate before RL 1.000, reward spread "
        "0.200, turn_clip_frac 0.133, max clip_bias_scale 1.831, answer rate after RL 1.000")


def test_the_check_names_no_learning_signal_as_the_reason_the_correction_did_not_act():
    line = range_check(NO_SIGNAL_RUN)
    assert line == (
        "check: FAILED: reward spread 0.000 (expected 0.01-1): every RL trajectory earned the same reward (0.200), "
        "so no advantage told them apart: no learning signal, nothing for the update to push; max clip_bias_scale "
        "1.000 (expected 1.01-10): nothing to learn, so nothing to clip (the reward spread above) -- docs/demo.md "
        "says what each figure shows")
    # a spread but no clipping: the reason is the policy's movement, not the signal
    moved_little = dict(PASSED_RUN, **{"max clip_bias_scale": 1.0})
    assert "max clip_bias_scale 1.000 (expected 1.01-10): the clipped turns' bias ||C|| stayed under 1.01" in \
        range_check(moved_little)


@pytest.mark.parametrize("name", list(EXPECTED_RANGES))
def test_each_check_boundary_holds_on_its_side(name):
    low, high = EXPECTED_RANGES[name]
    for value, passes in ((low, True), (high, True), (low - 1e-4, False), (high + 1e-4, False)):
        line = range_check(dict(PASSED_RUN, **{name: value}))
        assert line.startswith("check: passed") is passes, (name, value, line)
        if not passes:
            outside = line.split("check: FAILED: ", 1)[1]
            assert outside.startswith(f"{name} {value:.3f} (expected {low:g}-{high:g}): ")
            reason = outside.split("): ", 1)[1].split(" -- docs/demo.md", 1)[0]
            assert len(reason) > 20  # a reason, not only the range


def test_answer_noise_says_how_much_one_answer_moves_a_score():
    from stppo_agent.training.demo_report import answer_noise

    table = before_after_table(results(0.75, 1.0), results(0.25, 1.0)).splitlines()
    assert table[-1] == ("noise: one answer moves a benchmark's EM/acc by 1/8 = 0.125 and the QA average by 0.062; "
                         "a change of a few answers either way is noise, not a result of RL")
    assert answer_noise(results(0.5, 1.0, n=4), 1).startswith("noise: one answer moves a benchmark's EM/acc by "
                                                              "1/4 = 0.250;")
    mixed = results(0.5, 1.0, n=8)
    mixed[2]["metrics"]["n"] = 5
    assert answer_noise(mixed, 2).startswith("noise: one answer moves a benchmark's EM/acc by 1/8 to 1/5;")


def test_off_policy_summary_without_off_policy_steps():
    assert off_policy_summary({}, [1.0, 0.2, 0.2, 0.6]) == (
        "trained on 4 trajectories, reward 0.500 (1 x 1.000, 1 x 0.600, 2 x 0.200); no off-policy step (one "
        "mini-batch per iteration)")
    assert off_policy_summary({}, [0.0, 1.0], resampled=2.0) == (
        "trained on 2 trajectories, reward 0.500 (1 x 1.000, 1 x 0.000) after 2 more rollout round(s) for groups "
        "whose samples all earned the same reward; no off-policy step (one mini-batch per iteration)")
