"""Run metrics: JSON lines always, TensorBoard when available, Weights & Biases when asked; and reading them back."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Appends one JSON object per iteration to ``metrics.jsonl`` (the source of truth for `stppo plot`)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # an optional extra: metrics.jsonl holds every metric; the README says how to add it
                self._tb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise ValueError("logging.wandb_project is set but wandb is not installed: pip install wandb") from exc
            self._wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=config, resume="allow")

    def truncate_after(self, step: int, report=print) -> None:
        """On resume: drop records of iterations after the checkpoint (they will be redone). A torn last line
        (what kill -9 during a write leaves) is dropped with a note; a corrupt line before it is an error."""
        if not self.path.exists():
            return
        records, torn = parse_records(self.path, "then --resume")
        if torn is not None:
            report(f"{self.path}: dropped a torn last record (line {torn}, an interrupted write)")
        kept = [line for line, record in records if record.get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: json_value(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for key, value in numbers.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def json_value(value: Any) -> Any:
    """A metric as JSON can hold it: tensors as numbers, NaN and infinities as strings."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


def parse_records(path: Path, then: str = "then retry") -> tuple[list[tuple[str, dict[str, Any]]], int | None]:
    """(line, record) for each JSON line of ``path``, and the number of a torn last line left out (None: none). A
    torn last line is what kill -9 during a write leaves, or a run still writing it: not an error. A line before
    it that is not JSON is (ValueError naming the file and line; ``then`` says what to do after fixing it)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((number for number, line in enumerate(lines, start=1) if line.strip()), default=0)
    records, torn = [], None
    for number, line in enumerate(lines, start=1):  # the file's own line numbers: the message names one to fix
        if not line.strip():
            continue
        try:
            records.append((line, json.loads(line)))
        except json.JSONDecodeError as exc:
            if number < last:
                raise ValueError(f"{path}, line {number} is not JSON ({exc}); fix or remove that line, {then}") \
                    from exc
            torn = number
    return records, torn


def read_metrics(run_dir: str | Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """A run's JSON-lines records: its metrics.jsonl, or another such file (``name="steps.jsonl"``); a torn last
    line is left out (:func:`parse_records`)."""
    path = Path(run_dir) / name
    return [record for _, record in parse_records(path)[0]] if path.exists() else []
