"""``stppo replay``: apply an algorithm's updates to the batches a run recorded (``logging.save_rollouts=true``).

The replay starts from the recorded run's initial weights (``rollouts/initial/``) and, iteration by iteration,
scores and updates on the recorded batch instead of generating one: the same data under a different update
rule, a comparison no live run can give (a live run's data depends on its own earlier updates). It logs the
same ``metrics.jsonl`` as training and, by default, per-step diagnostics in ``steps.jsonl``
(:mod:`stppo_agent.monitoring.step_diagnostics`). Replaying with the recorded run's own algorithm and config reproduces
its logged update metrics exactly.

Replaying iteration k through algorithm B means: the batch that A's policy sampled at iteration k, scored and
updated by B's policy after B's own first k - 1 updates. From iteration 2 on, B's policy is therefore off the
recorded behaviour policy by however far B has drifted from A: the ratios are recomputed against B's weights
(old log-probs are re-scored), so each iteration's first mini-batch is still on-policy for B. (A replay through
another algorithm therefore uses ``rollout.old_logprobs=recompute``; ``--set rollout.old_logprobs=sampler`` takes the
recorded sampler's log-probs instead, A's, and no step is then on-policy for B.)

The rollout correction (``algorithm.rollout_correction``) belongs to the data, not to the rule: it corrects for
the engine that sampled the batches (vLLM), and the replay itself samples nothing. A replay (through the recorded
algorithm or another) keeps the recorded run's correction and cap as the run asked for them: a value it set, or
``auto`` resolved against the backend and sampler precision that sampled the recorded batches, under the replay's
own rule and objective (``--set rollout.stale_objective=decoupled`` then gets the decoupled objective's per-token mis).
Through another algorithm the level follows the replayed rule as ``auto`` would have chosen it (turn level for
turn-level rules) unless the recorded run set it explicitly. An explicit ``--set algorithm.rollout_correction...``
wins. The replay says which it used.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Sequence

import torch

from stppo_agent.algorithms import ALGORITHMS, AUTO_FIELDS, resolve_rollout_correction
from stppo_agent.distributed import process_group
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.runs.recording import (
    check_iteration_files,
    load_batch,
    load_iteration,
    read_format,
    recorded_iterations,
    tokenizer_fingerprint,
)
from stppo_agent.training.config import TrainConfig, load_config, set_value
from stppo_agent.training.config_checks import setting

# The distribution the recorded tokens were sampled from: a property of the data, never changed by a replay.
SAMPLING_FIELDS = ("rollout.temperature", "rollout.top_p", "rollout.top_k")
# and which weights sampled them: with rollout.staleness K the behaviour log-probs come from the weights K updates back
RECORDED_FIELDS = (*SAMPLING_FIELDS, "rollout.staleness")

# Settings of the recorded config that must not carry over into a replay: it generates nothing, writes its own folder.
_REPLAY_FIXED = {"logging.save_rollouts": False, "rollout.backend": "hf", "distributed.share_retriever": False}


class RecordedRollouts:
    """A rollout source that serves a run's recorded batches, iteration by iteration, to any number of processes.

    An iteration recorded by as many processes as replay it gives each rank the share that rank sampled. Otherwise
    the iteration's shares are merged into the whole batch (:func:`~stppo_agent.runs.recording.load_iteration`) and
    rank r takes prompts ``r::world``, as a live run with this many processes would have sampled them; every row
    of every iteration is used either way."""

    env_kwargs = None  # it plays no envs

    def __init__(self, run_dir: Path, tokenizer, rank: int = 0, world: int = 1, sampled_by_actor: bool = True):
        """``run_dir``: the recorded run; ``tokenizer``: the replay's own (it must be the recording's).
        ``sampled_by_actor``: the replay applies the recorded run's algorithm settings, so its actor is the one
        that sampled each batch (what the on-policy flag of ``rollout.old_logprobs=sampler`` needs to know)."""
        self.folder = Path(run_dir) / "rollouts"
        self.sampled_by_actor = sampled_by_actor
        meta = read_format(self.folder)
        mine = tokenizer_fingerprint(tokenizer)
        if mine != meta["tokenizer"]:
            differing = sorted(k for k in mine if mine[k] != meta["tokenizer"].get(k))
            raise ValueError(f"tokenizer mismatch: the model's tokenizer differs from the one that recorded {run_dir} "
                             f"({', '.join(differing)}); recorded token ids would mean other text")
        self.rank, self.world, self.pad_id = rank, world, tokenizer.pad_token_id
        self.iterations = recorded_iterations(self.folder, 0)

    def next_batch(self, iteration: int) -> RolloutBatch:
        number = iteration + 1
        if check_iteration_files(self.folder, number) == self.world:
            return load_batch(self.folder, number, self.rank)
        whole = load_iteration(self.folder, number, self.pad_id)
        groups = torch.unique(whole.group_ids)
        if self.world > 1 and len(groups) % self.world:
            raise ValueError(f"recorded iteration {number} holds {len(groups)} prompts, which {self.world} processes "
                             "cannot share evenly: replay it with a number of processes that divides that")
        if self.world == 1:
            return whole
        return whole.select(torch.isin(whole.group_ids, groups[self.rank::self.world]).nonzero().flatten())

    def state(self) -> dict:
        return {}

    def load(self, state: dict) -> None:
        pass


def recorded_config(run_dir: str | Path) -> TrainConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a run folder ({path} is missing)")
    return load_config(path)


def replay_config(run_dir: str | Path, algo: str | None, output_dir: str, overrides: Sequence[str] = (),
                  iterations: int | None = None) -> TrainConfig:
    """The recorded run's config with ``algo``, the replay's own folder, the initial weights and ``overrides``.

    Algorithm overrides recorded for the original algorithm are kept only when replaying that same algorithm.
    """
    run_dir = Path(run_dir)
    original = recorded_config(run_dir)
    folder = run_dir / "rollouts"
    read_format(folder)  # a clear error for a run without recordings, before anything is loaded
    available = recorded_iterations(folder, 0)
    if not available:
        raise FileNotFoundError(f"{folder} holds no recorded iteration")
    if available != list(range(1, len(available) + 1)):
        raise ValueError(f"{folder}: recorded iterations are not 1..N ({available[:5]}...); was the run resumed "
                         "from a checkpoint after deleting recordings?")
    for number in available:  # every rank's share of every iteration, or a clear refusal before any model loads
        check_iteration_files(folder, number)
    values = dataclasses.asdict(original)
    same_algo = algo is None or algo == original.algo
    values.update(algo=original.algo if same_algo else algo, output_dir=output_dir,
                  algorithm=values["algorithm"] if same_algo else recorded_correction(original),
                  iterations=len(available), model=str(folder / "initial" / "actor"))
    for key, value in {**_REPLAY_FIXED, "logging.step_diagnostics": True}.items():
        set_value(values, key, value)
    initial_critic = folder / "initial" / "critic"
    values["critic_model"] = str(initial_critic) if initial_critic.exists() else None
    if original.init_from:  # the run's weights and AdamW state came from there, and `model` was its reference
        if not Path(original.init_from).is_dir():
            raise ValueError(f"{run_dir} started from {original.init_from} (init_from), whose optimizer state a replay "
                             "needs: that checkpoint is gone")
        values.update(model=original.model, critic_model=None)
    if not same_algo:  # another rule scores with its own weights (old_logprobs=sampler, set here, takes the run's)
        values["rollout"]["old_logprobs"] = "recompute"
    config = load_config(None, list(overrides), **values)
    config.algorithm = {**config.algorithm, **correction_for_recording(config, original)}
    changed = [name for name in RECORDED_FIELDS if setting(config, name) != setting(original, name)]
    if changed:  # the recorded tokens were drawn from the recorded distribution; scoring must use that one
        raise ValueError(f"a replay scores the recorded tokens with the settings that sampled them; "
                         f"{', '.join(f'{n}={setting(original, n)}' for n in changed)} recorded, "
                         f"{', '.join(f'{n}={setting(config, n)}' for n in changed)} asked: drop that --set")
    if iterations is not None:
        config.iterations = iterations
    if config.iterations > len(available):
        raise ValueError(f"iterations={config.iterations}: {run_dir} recorded only {len(available)}")
    return config


def recorded_correction(original: TrainConfig) -> dict:
    """The rollout-correction fields the recorded run asked for, as algorithm overrides for another rule (``auto``
    where it left them to ``auto``; :func:`correction_for_recording` resolves those)."""
    recorded = original.algorithm_config()
    asked = {**dataclasses.asdict(ALGORITHMS[original.algo]), **original.algorithm}
    kept = {"rollout_correction": asked["rollout_correction"],
            "rollout_correction_cap": recorded.rollout_correction_cap}
    automatic = resolve_rollout_correction(dataclasses.replace(recorded, rollout_correction_level="auto"),
                                           original.rollout.backend,
                                           original.precision.generation_autocast_dtype).rollout_correction_level
    if asked["rollout_correction_level"] not in ("auto", automatic):  # set by hand for that run: keep it
        kept["rollout_correction_level"] = asked["rollout_correction_level"]
    return kept


def correction_for_recording(config: TrainConfig, original: TrainConfig) -> dict:
    """The replay's rollout-correction fields, resolved: ``auto`` against the backend and sampler precision that
    sampled the recorded batches (a replay generates nothing: its own backend is not theirs), for the replay's rule
    and objective."""
    sampled = dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, backend=original.rollout.backend),
        precision=dataclasses.replace(config.precision,
                                      generation_autocast_dtype=original.precision.generation_autocast_dtype))
    algo = sampled.algorithm_config()
    return {field: getattr(algo, field) for field in AUTO_FIELDS}


def describe_correction(config: TrainConfig, original: TrainConfig, overrides: Sequence[str]) -> str:
    algo, recorded = config.algorithm_config(), original.algorithm_config()
    used = (f"{algo.rollout_correction} at {algo.rollout_correction_level} level, cap {algo.rollout_correction_cap:g}"
            if algo.rollout_correction != "none" else "none")
    if any(item.startswith("algorithm.rollout_correction") for item in overrides):
        return f"rollout correction: {used} (set here; the recorded run used {recorded.rollout_correction})"
    return (f"rollout correction: {used}, kept from the recorded run (its batches were sampled by "
            f"{original.rollout.backend}); --set algorithm.rollout_correction=none|tis|mis to change it")


def replay(run_dir: str | Path, algo: str | None, output_dir: str, overrides: Sequence[str] = (),
           iterations: int | None = None, report: Callable[[str], None] = print, resume: bool = False,
           overwrite: bool = False) -> dict:
    """Replay ``run_dir``'s recorded batches through ``algo``; returns the last iteration's metrics. ``resume`` /
    ``overwrite``: continue or replace a replay already in ``output_dir``, as ``stppo train`` does."""
    from stppo_agent.training.trainer import Trainer

    config = replay_config(run_dir, algo, output_dir, overrides, iterations)
    if Path(output_dir).resolve() == Path(run_dir).resolve():
        raise ValueError("the replay's --output-dir must differ from the recorded run's folder")
    original = recorded_config(run_dir)
    same_rule = config.algorithm_config() == original.algorithm_config()
    trainer = Trainer(config, report=report,
                      rollout_source=lambda context: RecordedRollouts(Path(run_dir), context.tokenizer, context.rank,
                                                                      context.world, sampled_by_actor=same_rule),
                      resume=resume, overwrite=overwrite)
    if process_group.is_main():
        report(describe_correction(config, original, overrides))
        (Path(output_dir) / "replay.json").write_text(json.dumps(
            {"replay_of": str(Path(run_dir).resolve()), "recorded_algo": original.algo,
             "algo": config.algo, "iterations": config.iterations,
             "rollout_correction": trainer.algo.rollout_correction}, indent=1) + "\n")
    return trainer.train()
