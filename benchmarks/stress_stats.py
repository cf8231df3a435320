"""The stress grid's statistics: collapse rates with Wilson intervals, exact tests between cells, and the smallest
difference a cell's seed count can detect.

- Paired cells (the same seeds from the same warm start, whose first batches are checked to be the same) are
  compared by the exact McNemar test on the discordant seeds: collapsed in one cell and not in the other
  (``scipy.stats.binomtest`` of one side's count among the discordant ones, p = 1/2, two-sided).
- Unpaired cells by Fisher's exact test on the 2 x 2 table of collapsed / not (``scipy.stats.fisher_exact``).
- The detectable difference of a cell against its control: the smallest rise of the collapse rate above the
  control's observed rate that Fisher's test at alpha 0.05 (two-sided) finds with 80% power at the two cells' seed
  counts, computed exactly by enumerating every outcome of both binomials (no normal approximation).
"""

from __future__ import annotations

import functools
import math

import numpy as np

Z95 = 1.959963984540054
ALPHA, POWER = 0.05, 0.8


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion k/n (95% by default): unlike p +- z*se it stays inside
    [0, 1] and is not empty at 0/n or n/n, which small seed counts hit all the time."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs: seeds that collapsed under the first cell only,
    and under the second only (6 and 0 give 2 / 2**6 = 0.03125)."""
    from scipy.stats import binomtest

    discordant = only_first + only_second
    return 1.0 if discordant == 0 else float(binomtest(only_first, discordant, 0.5).pvalue)


def fisher(k1: int, n1: int, k0: int, n0: int) -> float:
    """Two-sided Fisher exact p-value of k1/n1 against k0/n0 (5/10 against 0/10 gives 0.0325)."""
    from scipy.stats import fisher_exact

    return float(fisher_exact([[k1, n1 - k1], [k0, n0 - k0]]).pvalue)


@functools.lru_cache(maxsize=None)
def _rejections(n1: int, n0: int, alpha: float) -> np.ndarray:
    """1 where Fisher's test rejects at ``alpha`` for k1 (rows, of n1) and k0 (columns, of n0) collapses. Per total
    of collapses the two-sided p-value of each table is the hypergeometric mass of the tables no likelier than it
    (scipy.stats.fisher_exact's definition, with its 1e-7 relative tolerance), all of a total's tables at once."""
    from scipy.stats import hypergeom

    out = np.zeros((n1 + 1, n0 + 1))
    for total in range(n1 + n0 + 1):
        k1 = np.arange(max(0, total - n0), min(n1, total) + 1)
        mass = hypergeom.pmf(k1, n1 + n0, n1, total)
        p = np.array([mass[mass <= m * (1 + 1e-7)].sum() for m in mass])
        out[k1, total - k1] = np.minimum(p, 1.0) <= alpha
    return out


def binomial_pmf(n: int, p: float) -> np.ndarray:
    k = np.arange(n + 1)
    return np.array([math.comb(n, i) for i in k], dtype=float) * p ** k * (1 - p) ** (n - k)


def fisher_power(p1: float, p0: float, n1: int, n0: int, alpha: float = ALPHA) -> float:
    """Exact power of two-sided Fisher's test at ``alpha`` for true collapse rates p1 (n1 seeds) and p0 (n0)."""
    return float(binomial_pmf(n1, p1) @ _rejections(n1, n0, alpha) @ binomial_pmf(n0, p0))


def detectable_difference(n1: int, n0: int, control_rate: float, alpha: float = ALPHA, power: float = POWER,
                          step: float = 0.005) -> float | None:
    """The smallest d (on a grid of ``step``) such that a cell of n1 seeds with collapse rate control_rate + d is
    told from a control of n0 seeds at ``control_rate`` with ``power``; None when no rate up to 1 is."""
    if n1 == 0 or n0 == 0:
        return None
    for d in np.arange(step, 1 - control_rate + step / 2, step):
        if fisher_power(min(1.0, control_rate + d), control_rate, n1, n0, alpha) >= power:
            return round(float(d), 6)
    return None


def compare(first: dict[int, bool], second: dict[int, bool], paired: bool) -> dict:
    """Collapsed-or-not per seed in two cells -> the test that fits: exact McNemar on the seeds both ran when
    ``paired``, else Fisher on the counts."""
    if paired:
        common = sorted(set(first) & set(second))
        a = sum(first[s] and not second[s] for s in common)
        b = sum(second[s] and not first[s] for s in common)
        return {"test": "mcnemar", "pairs": len(common), "only_first": a, "only_second": b,
                "p": mcnemar_exact(a, b)}
    k1, n1, k0, n0 = sum(first.values()), len(first), sum(second.values()), len(second)
    return {"test": "fisher", "first": [k1, n1], "second": [k0, n0], "p": fisher(k1, n1, k0, n0)}


def compare_values(first: dict[int, float], second: dict[int, float], paired: bool) -> dict:
    """A per-seed figure (a run's final reward) in two cells -> the test that fits, two-sided, with the difference
    ``first - second``: the Wilcoxon signed-rank test on the seeds both ran when ``paired`` (exact for small n;
    zero differences dropped; p = 1 when every pair ties), else the Mann-Whitney U test on the two samples."""
    from scipy.stats import mannwhitneyu, wilcoxon

    if paired:
        common = sorted(set(first) & set(second))
        differences = [first[s] - second[s] for s in common]
        nonzero = [d for d in differences if d != 0]
        p = float(wilcoxon(nonzero).pvalue) if nonzero else 1.0
        return {"test": "wilcoxon", "pairs": len(common), "mean_difference": float(np.mean(differences)),
                "ci95": mean_interval(differences), "wins": sum(d > 0 for d in differences),
                "losses": sum(d < 0 for d in differences), "p": p}
    a, b = list(first.values()), list(second.values())
    p = float(mannwhitneyu(a, b, alternative="two-sided").pvalue) if a and b else 1.0
    return {"test": "mann-whitney", "n": [len(a), len(b)],
            "mean_difference": float(np.mean(a) - np.mean(b)) if a and b else 0.0,
            "ci95": welch_interval(a, b), "p": p}


def mean_interval(values: list[float], level: float = 0.95) -> list[float] | None:
    """The t interval of the mean of ``values`` (paired differences): the size of an effect, which a rank test's p
    does not give (at 10 pairs its smallest two-sided p is 0.002 however large the effect). None below 2 values."""
    from scipy import stats

    if len(values) < 2:
        return None
    mean, sem = float(np.mean(values)), float(stats.sem(values))
    if sem == 0:
        return [mean, mean]
    low, high = stats.t.interval(level, len(values) - 1, loc=mean, scale=sem)
    return [float(low), float(high)]


def welch_interval(a: list[float], b: list[float], level: float = 0.95) -> list[float] | None:
    """The Welch t interval of mean(a) - mean(b) (unpaired cells); None below 2 values a side."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return None
    result = stats.ttest_ind(a, b, equal_var=False)
    low, high = result.confidence_interval(level)
    return [float(low), float(high)]
