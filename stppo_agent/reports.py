"""Comparing evaluation records (refusing apples to oranges) and plotting training curves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

# Provenance fields that may differ between records that are still comparable: they identify the contestant,
# or only say where the data and index lived (their content is compared through dataset_sha256 and retriever_id:
# the same index under two paths compares, a rebuilt index at the same path does not).
CONTESTANT_FIELDS = ("agent", "dataset", "retriever")


class ProvenanceMismatchError(ValueError):
    """Two results were produced under different conditions (data, retriever, prompt, limits, ...)."""


def load_results(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.exists():
        raise FileNotFoundError(f"no results.json at {path}; produce one with `stppo eval ... --output-dir DIR`")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a readable results.json ({exc})") from exc
    if not isinstance(results, list) or not all(isinstance(r, dict) and {"benchmark", "metrics"} <= set(r)
                                                for r in results):
        raise ValueError(f"{path} is not a results.json of `stppo eval` (a list of benchmark records)")
    return results


def provenance_differences(records: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Fields (other than the contestant's identity) whose values differ across records of one benchmark."""
    keys = sorted({k for r in records for k in r["provenance"]} - set(CONTESTANT_FIELDS))
    differences = {}
    for key in keys:
        values = [r["provenance"].get(key) for r in records]
        if any(v != values[0] for v in values):
            differences[key] = values
    return differences


SEARCH_ERROR_TOLERANCE = 0.005
"""Search-error rates further apart than this make results incomparable: the scores then differ by retriever
failures, not by agents."""


def search_error_differences(records: Sequence[dict[str, Any]]) -> list[float] | None:
    rates = [float(r["metrics"].get("search_error_rate", 0.0)) for r in records]
    return rates if rates and max(rates) - min(rates) > SEARCH_ERROR_TOLERANCE else None


COMPARED_METRICS = (("em", "EM"), ("acc", "acc"), ("f1", "F1"), ("answer_rate", "answer rate"),
                    ("invalid_action_rate", "invalid rate"), ("search_error_rate", "search errors"),
                    ("mean_turns", "turns"), ("mean_search_calls", "searches"), ("n", "n"))


def distinct_labels(paths: Sequence[str | Path]) -> list[str]:
    """Short, distinct column labels for result paths: the folder's name (not ``results.json``), with as many
    parent folders as it takes to tell them apart.

    >>> distinct_labels(["runs/a/eval/results.json", "runs/b/eval/results.json", "x/c"])
    ['a/eval', 'b/eval', 'c']
    """
    parts = [Path(p).parent.parts if Path(p).name == "results.json" else Path(p).parts for p in paths]

    def label(own: tuple[str, ...]) -> str:
        for depth in range(1, len(own) + 1):
            if sum(other[-depth:] == own[-depth:] for other in parts) == 1:
                return "/".join(own[-depth:])
        return "/".join(own)

    return [label(own) for own in parts]


def compare(result_sets: Sequence[Sequence[dict[str, Any]]], labels: Sequence[str], force: bool = False) -> str:
    """Every metric per benchmark, one column per result set; mismatched provenance raises unless ``force``."""
    benchmarks = sorted({r["benchmark"] for results in result_sets for r in results})
    warnings = []
    header = ["benchmark", "metric", *labels]
    rows = []
    for benchmark in benchmarks:
        records = [next((r for r in results if r["benchmark"] == benchmark), None) for results in result_sets]
        present = [r for r in records if r is not None]
        differences = provenance_differences(present)
        error_rates = search_error_differences(present)
        if error_rates:
            differences["search_error_rate"] = [round(rate, 4) for rate in error_rates]
        if differences:
            detail = "; ".join(f"{k}: {v}" for k, v in differences.items())
            if not force:
                raise ProvenanceMismatchError(
                    f"{benchmark}: results are not comparable ({detail}); rerun under the same settings or pass "
                    "--force to print them flagged")
            warnings.append(f"!! {benchmark} NOT COMPARABLE: {detail}")
        name = benchmark + (" (!)" if differences else "")
        for key, title in COMPARED_METRICS:
            if not any(r is not None and key in r["metrics"] for r in records):
                continue
            cells = ["-" if r is None or key not in r["metrics"] else
                     (str(r["metrics"][key]) if key == "n" else f"{r['metrics'][key]:.3f}") for r in records]
            rows.append([name, title, *cells])
            name = ""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in [header, ["-" * w for w in widths], *rows]]
    return "\n".join(lines + warnings)


PLOTS = {
    "reward": ["reward"],
    "clipping": ["clip_frac", "turn_clip_frac"],
    "clip_bias": ["clip_bias_norm", "pg_grad_norm", "clip_bias_scale"],
    "kl": ["approx_kl", "kl_to_reference", "kl_loss"],
    "entropy": ["entropy"],
    "response_length": ["response_tokens", "turns"],
}


# Per optimizer step, from steps.jsonl (step_diagnostics=true; on in replays): where off-policy drift shows first.
STEP_PLOT_KEYS = ["ratio_max", "ratio_p99", "token_outside_frac", "turn_outside_frac", "clip_bias_norm",
                  "grad_cos_to_first"]
STEP_PLOT_LOG_KEYS = {"ratio_max": 1.0, "clip_bias_norm": 0.1}  # key -> the linear range of its symlog axis


def collapse_events(records: Sequence[dict[str, Any]]) -> list[tuple[int, str]]:
    """The collapse monitor's events in a run's records: (iteration, "alarm" | "rollback")."""
    events = []
    for record in records:
        if "collapse/rollback_to" in record:
            events.append((int(record["step"]), "rollback"))
        elif record.get("collapse/alarm"):
            events.append((int(record["step"]), "alarm"))
    return events


EVENT_STYLES = {"alarm": dict(color="tab:red", linestyle=":", linewidth=1.2),
                "rollback": dict(color="tab:purple", linestyle="--", linewidth=1.5)}


def _mark_events(axis, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Vertical lines where a collapse alarm was raised or a rollback happened (labelled once per panel)."""
    labelled = set()
    for records in runs.values():
        for step, kind in collapse_events(records):
            axis.axvline(step, label=None if kind in labelled else f"collapse {kind}", **EVENT_STYLES[kind])
            labelled.add(kind)


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Distinct legend labels for run folders, as ``compare`` labels results: the folder's name with as many
    parents as it takes to tell the runs apart (runs/a/train and runs/b/train: a/train and b/train). Folders are
    resolved first, so that "." and "run/" are named; the same folder twice is an error, not two curves."""
    resolved = [Path(d).resolve() for d in run_dirs]
    seen: dict[Path, str] = {}
    for given, path in zip(run_dirs, resolved):
        if path in seen:
            raise ValueError(f"run {given} is given twice (as {seen[path]} too)")
        seen[path] = str(given)
    return distinct_labels(resolved)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path) -> list[Path]:
    """One PNG per metric group, every run a line; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .trainer import read_metrics

    labels = run_labels(run_dirs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {label: read_metrics(d) for label, d in zip(labels, run_dirs)}
    if not any(runs.values()):
        raise FileNotFoundError(f"no metrics.jsonl in {', '.join(map(str, run_dirs))}")
    from matplotlib.ticker import MaxNLocator

    # One style per run, the same in every panel; dashes and markers differ too, so identical curves stay visible.
    colours = plt.get_cmap("tab10").colors
    dashes = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "x"]
    styles = {run: dict(color=colours[i % len(colours)], linestyle=dashes[i % len(dashes)],
                        marker=markers[i % len(markers)], markersize=4, alpha=0.85) for i, run in enumerate(runs)}
    written = []
    for name, keys in PLOTS.items():
        figure, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
        for axis, key in zip(axes[0], keys):
            drawn = False
            for run, records in runs.items():
                points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
                if points:
                    axis.plot(*zip(*points), label=run, **styles[run])
                    drawn = True
            _mark_events(axis, runs)
            axis.set_title(key)
            axis.set_xlabel("iteration")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
            if drawn and (len(runs) > 1 or any(collapse_events(r) for r in runs.values())):
                axis.legend(fontsize="small")
        figure.tight_layout()
        path = out / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    steps = {label: read_metrics(d, "steps.jsonl") for label, d in zip(labels, run_dirs)}
    if any(steps.values()):
        written.append(_plot_steps(steps, styles, out / "steps.png", plt))
    return written


def _plot_steps(steps: dict[str, list[dict]], styles: dict[str, dict], path: Path, plt) -> Path:
    """One panel per step diagnostic, x = optimizer step; dotted verticals where an iteration's first (on-policy)
    step starts."""
    from matplotlib.ticker import MaxNLocator

    columns = 3
    rows = -(-len(STEP_PLOT_KEYS) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.3 * rows), squeeze=False)
    for axis, key in zip(axes.flat, STEP_PLOT_KEYS):
        drawn = False
        for run, records in steps.items():
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                axis.plot(*zip(*points), label=run, **dict(styles[run], markersize=3))
                drawn = True
        starts = sorted({r["step"] for records in steps.values() for r in records if r.get("on_policy")})
        for start in starts[1:]:
            axis.axvline(start - 0.5, color="grey", linestyle=":", linewidth=0.8)
        if key in STEP_PLOT_LOG_KEYS:  # one extreme token or step would flatten every other point
            axis.set_yscale("symlog", linthresh=STEP_PLOT_LOG_KEYS[key])
            axis.set_ylim(bottom=0)
        axis.set_title(key)
        axis.set_xlabel("optimizer step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        if drawn and len(steps) > 1:
            axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
