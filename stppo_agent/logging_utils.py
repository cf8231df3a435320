"""Run metrics: JSON lines always, TensorBoard when available, Weights & Biases when asked; and how much the
third-party libraries may print (:func:`set_third_party_output`)."""

from __future__ import annotations

import json
import math
import os
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
                raise ValueError("wandb_project is set but wandb is not installed: pip install wandb") from exc
            self._wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=config, resume="allow")

    def truncate_after(self, step: int, report=print) -> None:
        """On resume: drop records of iterations after the checkpoint (they will be redone). A torn last line
        (what kill -9 during a write leaves) is dropped with a note; a corrupt line before it is an error."""
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines()
                 if line.strip()]
        records = []
        for number, line in enumerate(lines, start=1):
            try:
                records.append((line, json.loads(line)))
            except json.JSONDecodeError as exc:
                if number < len(lines):
                    raise ValueError(f"{self.path}, line {number} is not JSON ({exc}); fix or remove that line, "
                                     "then --resume") from exc
                report(f"{self.path}: dropped a torn last record (line {number}, an interrupted write)")
        kept = [line for line, record in records if record.get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
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


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


VERBOSE_ENV = "STPPO_VERBOSE"  # read by stppo_envs.retrieval._pyserini (Lucene) and inherited by child processes


def verbose_requested(flag: bool) -> bool:
    """``--verbose``, or ``STPPO_VERBOSE=1`` in the environment (how a command's child processes inherit it)."""
    return flag or os.environ.get(VERBOSE_ENV) == "1"


def set_third_party_output(verbose: bool) -> None:
    """Without ``verbose``: transformers, datasets and huggingface_hub print errors only and no progress bars, and
    Lucene/Anserini keep their INFO lines to themselves (``STPPO_VERBOSE`` unset). With it: each library's own
    defaults. Set through the libraries' runtime switches, not only environment variables, because ``datasets``
    reads its variables once, when first imported -- which the command line has done before it parses ``--verbose``.
    """
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):  # for child processes
        if verbose:
            os.environ.pop(name, None)
        else:
            os.environ[name] = "1"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(hf_logging.WARNING if verbose else hf_logging.ERROR)
        hf_logging.enable_progress_bar() if verbose else hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from datasets.utils import logging as ds_logging

        ds_logging.set_verbosity(ds_logging.WARNING if verbose else ds_logging.ERROR)
        ds_logging.enable_progress_bar() if verbose else ds_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        import huggingface_hub.utils as hub_utils

        hub_utils.enable_progress_bars() if verbose else hub_utils.disable_progress_bars()
    except ImportError:
        pass
