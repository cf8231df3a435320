"""What ``stppo demo`` prints after its phases: the RL step's summary, the before/after table with the noise of its
few questions, and the ``check:`` line that holds the figures the demo exists to show against their ranges and, for
each one outside, says why it fell there.
"""

from __future__ import annotations

import collections
import math
from typing import NamedTuple, Sequence

RATE_ABOVE_ONE = "a rate above 1 is a miscount, not a result"


class Check(NamedTuple):
    low: float
    high: float
    below: str  # what a figure under ``low`` means
    above: str = RATE_ABOVE_ONE  # what a figure over ``high`` means


# What the demo is there to show, with the ranges its runs measured (docs/demo.md, "The check line"): a figure
# outside means the run did not show what it exists to show, not only that the CPU rounded differently. EM is not
# among them: on 8 questions per benchmark one answer moves it by 0.125.
CHECKS = {
    "answer rate before RL": Check(0.75, 1.0, "the warm start did not teach Search-R1's tags (more --sft-steps)"),
    "reward spread": Check(0.01, 1.0, "every RL trajectory earned the same reward, so no advantage told them apart: "
                                      "no learning signal, nothing for the update to push",
                           "the envs' rewards lie in [0, 1]: a wider spread is a reward from elsewhere"),
    "turn_clip_frac": Check(0.01, 0.5, "no turn's ratio left the clip range on the off-policy steps: the policy "
                                       "moved too little between them (a higher --lr moves it more)",
                            "most turns were clipped: the policy moved too far between steps (a lower --lr)"),
    "max clip_bias_scale": Check(1.01, 10.0, "the clipped turns' bias ||C|| stayed under 1.01 on every off-policy "
                                             "step, so the correction left their gradients as they were",
                                 "the clipped part dwarfed the gradient: the policy moved too far (a lower --lr)"),
    "answer rate after RL": Check(0.75, 1.0, "the RL step broke the format the warm start taught"),
}
EXPECTED_RANGES = {name: (check.low, check.high) for name, check in CHECKS.items()}
MECHANISM = ("turn_clip_frac", "max clip_bias_scale")  # what only a learning signal can move


def off_policy_means(run_dir) -> dict[str, float]:
    """Means over a run's off-policy steps (its metrics.jsonl, step diagnostics on), and the largest
    ``clip_bias_scale`` of any of them (its steps.jsonl); {} when there were none."""
    from stppo_agent.runs.metrics_log import read_metrics

    records = [r for r in read_metrics(run_dir) if r.get("offpolicy/steps")]
    if not records:
        return {}
    means = {"steps": sum(r["offpolicy/steps"] for r in records)}
    for key in ("clip_frac", "turn_clip_frac", "clip_bias_scale", "clip_bias_norm", "tail/token_outside_frac",
                "tail/ratio_max", "tail/turn_ratio_max"):
        values = [r[f"offpolicy/{key}"] for r in records if isinstance(r.get(f"offpolicy/{key}"), (int, float))]
        means[key] = sum(values) / len(values) if values else float("nan")
    scales = [r["clip_bias_scale"] for r in read_metrics(run_dir, "steps.jsonl")
              if not r.get("on_policy", True) and isinstance(r.get("clip_bias_scale"), (int, float))]
    means["clip_bias_scale_max"] = max(scales) if scales else float("nan")
    return means


def reward_counts(rewards: Sequence[float]) -> str:
    """``3 x 1.000, 5 x 0.200``: how many trajectories earned each reward, highest first."""
    counts = collections.Counter(round(float(r), 3) for r in rewards)
    return ", ".join(f"{n} x {value:.3f}" for value, n in sorted(counts.items(), reverse=True))


def off_policy_summary(means: dict[str, float], rewards: Sequence[float], resampled: float = 0.0) -> str:
    """What the RL step trained on (each trajectory's reward, and the rollout rounds dynamic sampling added) and what
    ST-PPO's mechanisms did on its off-policy steps."""
    sampled = "trained"
    if rewards:
        sampled += (f" on {len(rewards)} trajectories, reward {sum(rewards) / len(rewards):.3f} "
                    f"({reward_counts(rewards)})")
    if resampled:
        sampled += f" after {resampled:.0f} more rollout round(s) for groups whose samples all earned the same reward"
    if not means:
        return f"{sampled}; no off-policy step (one mini-batch per iteration)"
    return (f"{sampled}; on {means['steps']:.0f} off-policy steps: clip_frac {means['clip_frac']:.3f} (turn-level), "
            f"turn_clip_frac {means['turn_clip_frac']:.3f}, clip_bias_scale {means['clip_bias_scale']:.3f} (max "
            f"{means['clip_bias_scale_max']:.3f}; ||C|| {means['clip_bias_norm']:.3f}); token ratios outside the clip "
            f"range {means['tail/token_outside_frac']:.3f} (what token-level PPO would clip), max "
            f"{means['tail/ratio_max']:.2f} vs turn ratios max {means['tail/turn_ratio_max']:.2f}")


def _score(metrics: dict[str, float]) -> float:
    return metrics.get("em", metrics.get("acc", 0.0))


def before_after_table(before: Sequence[dict] | None, after: Sequence[dict]) -> str:
    """One row per benchmark, each cell ``before -> after`` (after alone without a warm start), plus the QA
    average of Search-R1's tables, and under it how much one answer moves EM at these question counts."""
    from stppo_agent.evaluation.tables import fixed_width_table

    columns = [("EM/acc", _score, "{:.3f}"), ("answer", lambda m: m["answer_rate"], "{:.3f}"),
               ("invalid", lambda m: m["invalid_action_rate"], "{:.3f}"),
               ("searches", lambda m: m["mean_search_calls"], "{:.2f}"),
               ("tokens", lambda m: m.get("mean_response_tokens", 0.0), "{:.1f}")]

    def cell(index: int, value, form: str) -> str:
        shown = form.format(value(after[index]["metrics"]))
        return shown if before is None else f"{form.format(value(before[index]['metrics']))} -> {shown}"

    header = ["benchmark", "n"] + [name for name, _, _ in columns]
    rows = [[r["benchmark"], str(r["metrics"]["n"])] + [cell(i, value, form) for _, value, form in columns]
            for i, r in enumerate(after)]
    qa = [i for i, r in enumerate(after) if "em" in r["metrics"]]
    if len(qa) > 1:
        def qa_avg(results):
            return f"{sum(results[i]['metrics']['em'] for i in qa) / len(qa):.3f}"
        average = qa_avg(after) if before is None else f"{qa_avg(before)} -> {qa_avg(after)}"
        rows.append(["QA avg (EM)", "", average] + [""] * (len(columns) - 1))
    title = "evaluation after RL" if before is None else "evaluation: before RL (after the warm start) -> after RL"
    return f"{title}\n{fixed_width_table(header, rows)}\n{answer_noise(after, len(qa))}"


def answer_noise(results: Sequence[dict], qa_benchmarks: int) -> str:
    """How far one question moves a score at these question counts: the size of a change that is noise."""
    sizes = sorted({int(r["metrics"]["n"]) for r in results if r["metrics"].get("n")})
    if not sizes:
        return "noise: no questions were scored"
    if len(sizes) == 1:
        n = sizes[0]
        step = f"one answer moves a benchmark's EM/acc by 1/{n} = {1 / n:.3f}"
        if qa_benchmarks > 1:
            step += f" and the QA average by {1 / (n * qa_benchmarks):.3f}"
    else:
        step = f"one answer moves a benchmark's EM/acc by 1/{sizes[-1]} to 1/{sizes[0]}"
    return f"noise: {step}; a change of a few answers either way is noise, not a result of RL"


def demo_figures(before: Sequence[dict] | None, after: Sequence[dict], means: dict[str, float],
                 rewards: Sequence[float] = ()) -> dict[str, float]:
    """The figures :data:`CHECKS` bounds (``reward spread`` only when the RL batch's rewards are known), and the
    RL batch's mean ``reward`` that the check line names when the spread is 0."""
    def answer_rate(results):
        return sum(r["metrics"]["answer_rate"] for r in results) / len(results)

    figures = {"answer rate after RL": answer_rate(after), "turn_clip_frac": means.get("turn_clip_frac", 0.0),
               "max clip_bias_scale": means.get("clip_bias_scale_max", 1.0)}
    if before is not None:
        figures["answer rate before RL"] = answer_rate(before)
    if rewards:
        figures["reward spread"] = max(rewards) - min(rewards)
        figures["reward"] = sum(rewards) / len(rewards)
    return figures


def range_check(figures: dict[str, float]) -> str:
    """One line: every figure the demo checks within its range, or each one outside with the reason."""
    shown, failed = [], []
    spread = CHECKS["reward spread"]
    no_signal = "reward spread" in figures and not spread.low <= figures["reward spread"] <= spread.high
    for name, check in CHECKS.items():
        if name not in figures:
            continue
        value = figures[name]
        text = f"{name} {value:.3f}"
        shown.append(text)
        if check.low <= value <= check.high:  # NaN is outside too
            continue
        if math.isnan(value):
            why = "no off-policy step measured it (one mini-batch per iteration)"
        elif no_signal and name in MECHANISM:
            why = "nothing to learn, so nothing to clip (the reward spread above)"
        elif name == "reward spread" and "reward" in figures:
            why = check.below.replace("the same reward", f"the same reward ({figures['reward']:.3f})", 1)
        else:
            why = check.below if value < check.low else check.above
        failed.append(f"{text} (expected {check.low:g}-{check.high:g}): {why}")
    if failed:
        return "check: FAILED: " + "; ".join(failed) + " -- docs/demo.md says what each figure shows"
    return "check: passed, each figure within its range (docs/demo.md): " + ", ".join(shown)
