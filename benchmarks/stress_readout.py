"""What the stress grid reads of a finished run: its version-aligned read-outs, the collapse verdict on them
(benchmarks/collapse_criterion.py), its precursors, and whether two runs share their first batch (paired seeds).

Read-outs: the learner probe's records (``probe/reward`` of the current actor, labelled by ``probe/policy_version``
= optimizer steps) up to the last version the level's matched control reaches; without probes, the rollout rewards
of iterations K, K + s, ..., K + s(N-1) (the batch of iteration i is sampled by the weights after max(0, i - K)
iterations of updates; s > 1 for a step-matched control, whose read-outs then sit at the same optimizer steps as its
reuse level's). Precursors are read over the updates that made those versions (iterations 1 .. s*N).
"""

from __future__ import annotations

import math
import statistics

from collapse_criterion import judge, line_at_end

SPIKE = 10  # a grad-norm spike: an iteration's pre-clip norm above this many times the run's median


def finite(records: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def readouts(records: list[dict], staleness: int, scale: int, steps_per_iteration: int, versions: int,
             counts_invalid: bool) -> dict:
    """The run's read-out series: source (probe or rollouts), labels (policy versions in optimizer steps),
    rewards, invalid-action rates (None where the env does not count them)."""
    last_version = scale * versions * steps_per_iteration
    probes = [r for r in records if "probe/reward" in r and r["probe/policy_version"] <= last_version]
    if probes:
        source, chosen = "probe", probes
        labels = [float(r["probe/policy_version"]) for r in probes]
        rewards, invalid = [r["probe/reward"] for r in probes], [r["probe/invalid_action_rate"] for r in probes]
    else:
        by_step = {r["step"]: r for r in records}
        steps = [staleness + scale * t + 1 for t in range(versions)]
        chosen = [by_step[s] for s in steps if s in by_step]
        source = "rollouts"
        labels = [float(scale * t * steps_per_iteration) for t in range(len(chosen))]
        rewards = [r["reward"] for r in chosen]
        invalid = [r.get("invalid_action_rate", 0.0) for r in chosen]
    return {"source": source, "labels": labels, "rewards": rewards, "invalid": invalid if counts_invalid else None}


def precursors(updates: list[dict]) -> dict:
    """Entropy, pre-clip gradient norm (max, p99, spikes), ratio tails and effective sample size, KL to the warm
    start, clip fractions, the clip-bias correction's share of changed steps, ||C||: over ``updates`` (the
    iterations' metrics records). Keys a stppo does not log are None."""
    def mean(key):
        values = finite(updates, key)
        return statistics.fmean(values) if values else None

    def extreme(key, pick=max):
        values = finite(updates, key)
        return pick(values) if values else None

    def last(key):
        values = finite(updates, key)
        return values[-1] if values else None

    norms = finite(updates, "grad_norm")
    median = statistics.median(norms) if norms else None
    ordered = sorted(norms)
    return {
        "entropy_first": finite(updates, "entropy")[0] if finite(updates, "entropy") else None,
        "entropy_last": last("entropy"), "entropy_min": extreme("entropy", min),
        "probe_entropy_last": last("probe/entropy"),
        "grad_norm_max": max(norms, default=None), "grad_norm_median": median,
        "grad_norm_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None,
        "grad_norm_spikes": sum(n > SPIKE * median for n in norms) if median else 0,
        "ratio_max": extreme("tail/ratio_max"), "ratio_p99_max": extreme("tail/ratio_p99"),
        "ratio_p99_mean": mean("tail/ratio_p99"), "turn_ratio_max": extreme("tail/turn_ratio_max"),
        "ratio_min": extreme("tail/ratio_min", min),
        "ess_min": extreme("ratio/ess", min), "ess_mean": mean("ratio/ess"),
        "kl_to_reference_last": last("kl_to_reference"), "kl_to_reference_max": extreme("kl_to_reference"),
        "learner_kl_to_reference_last": last("learner_kl_to_reference"),
        "learner_kl_to_reference_max": extreme("learner_kl_to_reference"),
        "clip_frac_mean": mean("clip_frac"), "clip_frac_max": extreme("clip_frac"),
        "turn_clip_frac_mean": mean("turn_clip_frac"),
        "clip_bias_changed_share": mean("clip_bias_changed"), "clip_bias_scale_mean": mean("clip_bias_scale"),
        "clip_bias_norm_median": statistics.median(finite(updates, "clip_bias_norm"))
        if finite(updates, "clip_bias_norm") else None,
    }


def run_readout(records: list[dict], staleness: int, scale: int, steps_per_iteration: int, versions: int,
                counts_invalid: bool) -> dict:
    """Everything the grid keeps of one run: read-outs, verdict, precursors, its first batch's fingerprint."""
    series = readouts(records, staleness, scale, steps_per_iteration, versions, counts_invalid)
    updates = [r for r in records if r["step"] <= scale * versions]
    skipped_at = [float((r["step"]) * steps_per_iteration) for r in updates if r.get("skipped", 0) > 0]
    verdict = judge(series["labels"], series["rewards"], series["invalid"], skipped_at)
    first = records[0] if records else {}
    return {
        "readout_source": series["source"], "readouts": len(series["rewards"]), "labels": series["labels"],
        "reward_curve": series["rewards"], "invalid_curve": series["invalid"],
        "reward_first": series["rewards"][0] if series["rewards"] else None,
        "reward_last": series["rewards"][-1] if series["rewards"] else None,
        "collapsed": verdict.collapsed, "collapsed_at": verdict.collapsed_at, "collapse_reason": verdict.reason,
        "dipped": verdict.dipped, "dips": [list(d) for d in verdict.dips],
        "collapse_line_last": line_at_end(series["rewards"]),
        "first_batch": [first.get("reward"), first.get("response_tokens")],
        **precursors(updates),
    }
