"""Training curves of one or more runs (metrics.jsonl, and steps.jsonl for per-step diagnostics) as PNG files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from stppo_agent.runs.labels import distinct_labels

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

    from stppo_agent.runs.metrics_log import read_metrics

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
        starts = sorted({r["step"] for records in steps.values() for r in records if r.get("minibatch") == 0})
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
