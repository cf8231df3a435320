"""The config a checkpoint records, and the resume checks made against it before any model loads.

A checkpoint records the config it was trained with (every algorithm field resolved, as ``config.yaml`` holds it)
and the sha256 of its base model's weights (a moved copy of that model is accepted on resume:
:mod:`stppo_agent.runs.base_model`). Which settings may change on resume and which are refused:
:mod:`stppo_agent.runs.resume_settings`. What else a checkpoint holds and how it is put back:
:mod:`stppo_agent.training.state`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import yaml

from stppo_agent.algorithms import AlgorithmConfig
from stppo_agent.distributed import process_group
from stppo_agent.runs import base_model, resume_settings


def run_config(config, algo: AlgorithmConfig) -> dict[str, Any]:
    """``config`` (a TrainConfig) as ``config.yaml`` records it (every field of ``algo`` resolved), as plain
    values."""
    return yaml.safe_load(config.to_yaml(resolved=algo))


def checkpoint_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config ``checkpoint`` was trained with: its own record, or for checkpoints written before they held one,
    the run's ``config.yaml`` (read before the resumed run rewrites it)."""
    from stppo_agent.runs.config_yaml import NumberLoader, migrate_flat

    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if "config" in state:
        return migrate_flat(state["config"])[0]  # an earlier version's checkpoint records the flat layout
    path = checkpoint.parent.parent / "config.yaml"
    return migrate_flat(yaml.load(path.read_text(), Loader=NumberLoader))[0] if path.exists() else None


def check_resume_settings(config, algo: AlgorithmConfig, checkpoint: Path | None,
                          report: Callable[[str], None] = print) -> None:
    """Refuse (ValueError, one line) a resume that changes a setting the checkpoint is tied to; call it before the
    models load, so that a refusal costs seconds."""
    if checkpoint is not None:
        previous, iteration = previous_settings(config, algo, checkpoint, report if process_group.is_main() else None)
        if previous is not None:
            resume_settings.check(previous, run_config(config, algo), iteration)


def previous_settings(config, algo: AlgorithmConfig, checkpoint: Path,
                      report: Callable[[str], None] | None = None) -> tuple[dict[str, Any] | None, int]:
    """The checkpoint's config as the resume compares it (its base model's new place, when the resume names a
    copy of the same weights) and its iteration."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    previous = checkpoint_config(checkpoint)
    if previous is not None:
        needed = algo.kl_in_reward > 0 or algo.kl_loss_coef > 0  # the reference is the base model
        previous = dict(base_model.reconcile(previous, run_config(config, algo), state.get("model_sha256"), needed,
                                             report))
    return previous, int(state["iteration"])
