"""What ``--resume`` may change about a run, compared with the config its checkpoint was trained with.

Most settings may change: learning rates and weight decay (applied to the restored optimizers and schedules by
:meth:`stppo_agent.training.state.TrainingState.apply_learning_rates`), iterations, the update's geometry (mini-batch,
micro-batch, epochs), clipping and the other algorithm coefficients, sampling (not in a run that records its
rollouts: :data:`RECORDED_SAMPLING`), limits, the collapse monitor,
checkpointing, logging, the device and the strategy. Every change is printed when the run resumes.

Refused, each for its reason (:data:`FIXED`): what the checkpoint's weights, optimizer state, random streams or
prompt position are tied to. A run that needs one of those changed is a new run: start it from the checkpoint's
actor (``--model RUN/checkpoints/step-N/actor``) in another folder.
"""

from __future__ import annotations

from typing import Any, Mapping

# field -> why it cannot change on resume
FIXED = {
    "model": "the reference policy (KL) and the recorded initial weights are this model; the checkpoint's actor was "
             "trained from it (a moved copy of the same weights is accepted: checkpoints record their sha256, "
             "those written before that cannot tell)",
    "critic_model": "the checkpoint's critic was trained from it",
    "algo": "a run trains one algorithm; to apply another rule to the same start, replay recorded rollouts or start a "
            "new run from the checkpoint's actor",
    "algorithm.use_critic": "the checkpoint holds (or lacks) a critic and its optimizer state",
    "seed": "the random streams and the prompt order continue from the checkpoint; a new seed would make one run "
            "of two seeds",
    "env": "the checkpoint's prompt position indexes these envs' examples",
    "precision.dtype": "the weights and optimizer state are in this precision; a run, its resume and its replays "
                       "share it",
    "precision.autocast_dtype": "a run, its resume and its replays share the precision of their forward passes",
    "rollout.staleness": "the checkpoint holds the lagged weights of exactly this many iterations",
}
# env_kwargs that decide which examples an env holds: the prompt sampler's saved position indexes them
EXAMPLE_KWARGS = ("dataset", "split", "limit", "shuffle_seed", "benchmark", "family")
# how a recording run's rollouts were sampled: stppo replay reads them from the run's config.yaml for every recorded
# iteration (its behaviour log-probs, its rollout correction), so a resume may not change them under the recordings
RECORDED_SAMPLING = ("rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.backend",
                     "precision.generation_autocast_dtype")
# changes no one needs to be told about
QUIET = {"output_dir"}
# changes that leave every iteration's computation as it was: a replay of the recorded rollouts still reproduces the
# run (how long it runs, how often and how many checkpoints it keeps, what it shows while it runs)
REPLAY_NEUTRAL = {"iterations", "checkpoint.every", "checkpoint.keep", "logging.progress", "logging.tensorboard"}


def changes_a_replay(found: list[tuple[str, Any, Any]]) -> bool:
    """Whether any of ``found`` (:func:`check`'s changes) alters what an iteration computes, so that a replay, which
    applies the run's one config.yaml to every recorded iteration, no longer reproduces the iterations before it."""
    return any(key not in REPLAY_NEUTRAL | QUIET for key, _, _ in found)


def flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """``{"optimizer": {"actor_lr": 1e-6}, "monitor": {"thresholds": {"kl": 1}}}`` -> ``{"optimizer.actor_lr": 1e-6,
    "monitor.thresholds.kl": 1}`` (every mapping opened, as ``--set`` spells the keys)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}.{inner}": v for inner, v in flatten(value).items()})
        else:
            flat[key] = value
    return flat


def changes(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, before, now) for every setting that differs, in ``current``'s order (missing: None)."""
    before, now = flatten(previous), flatten(current)
    keys = list(now) + [k for k in before if k not in now]
    return [(k, before.get(k), now.get(k)) for k in keys if k not in QUIET and not _same(before.get(k), now.get(k))]


def check(previous: Mapping[str, Any], current: Mapping[str, Any], iteration: int) -> list[tuple[str, Any, Any]]:
    """The changes, after raising ValueError (one line) for the first one a resume cannot make."""
    found = changes(previous, current)
    for key, old, new in found:
        reason = FIXED.get(key)
        if reason is None and key.startswith("env_kwargs.") and key.split(".", 1)[1] in EXAMPLE_KWARGS:
            reason = "the checkpoint's prompt position indexes the examples this selects"
        if reason is None and key in RECORDED_SAMPLING and _recording(previous) and iteration > 0:
            reason = (f"iterations 1..{iteration} were recorded sampled with {key}={_show(old)}, and stppo replay "
                      "takes one setting for every recorded iteration")
        if reason is None and key == "logging.save_rollouts" and new and not old and iteration > 0:
            reason = (f"the recording would lack the initial weights and iterations 1..{iteration}, so stppo replay "
                      "could not use it")
        if reason is not None:
            raise ValueError(f"--resume cannot change {key} ({_show(old)} -> {_show(new)}): {reason}. Start a new "
                             "run in another --output-dir instead (--model RUN/checkpoints/step-N/actor starts it "
                             "from these weights)")
    return found


def describe(found: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} {_show(old)} -> {_show(new)}" for key, old, new in found)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def _recording(config: Mapping[str, Any]) -> bool:
    return bool((config.get("logging") or {}).get("save_rollouts"))
