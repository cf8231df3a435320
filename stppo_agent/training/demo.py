"""The embedded default: a short supervised warm start, ST-PPO on the demo set, then a per-benchmark evaluation of
the trained policy -- the recipe behind ``stppo demo``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

DEMO_BENCHMARKS = ("nq", "hotpotqa", "medqa")
DEMO_MAX_OBSERVATION_TOKENS = 160  # the demo's warm start and RL alike (the shared default is 512)


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    model: str = "smollm2"
    output_dir: str = "runs/demo"
    iterations: int = 3
    sft_steps: int = 20
    limit: int = 16
    lr: float = 1e-5
    on_collapse: str = "warn"


def demo_config(settings: DemoSettings, model: str, out: Path):
    from stppo_agent.training.config import TrainConfig

    return TrainConfig(
        algo="st_ppo", env="stppo/NQ-v0,stppo/HotpotQA-v0", model=model, output_dir=str(out / "train"),
        # Search-R1's format reward gives an untuned 135M model some signal: a well-formed answer earns 0.2.
        env_kwargs={"split": "train", "format_reward": 0.2}, iterations=settings.iterations, prompts_per_iteration=2,
        # Two mini-batches x two epochs: 3 of every 4 optimizer steps are off-policy, and the second epoch revisits
        # data the first already pushed -- where ST-PPO's turn-level clipping and clip-bias correction act (measured:
        # with one mini-batch per iteration, or at lr <= 3e-6, no turn ever left the clip range).
        samples_per_prompt=2, mini_batch_size=2, micro_batch_size=2, ppo_epochs=2, actor_lr=settings.lr,
        critic_lr=1e-5, max_turns=3,
        max_new_tokens_per_turn=48, max_observation_tokens=DEMO_MAX_OBSERVATION_TOKENS, max_prompt_tokens=400,
        max_total_tokens=768,
        # A rollback needs a recent healthy checkpoint to return to: then one is written every iteration.
        save_every=1 if settings.on_collapse == "rollback" else settings.iterations, keep_checkpoints=1,
        device="auto",
        autocast_dtype="auto",  # bfloat16 forwards on a GPU or an AMX CPU, where they are faster
        step_diagnostics=True, on_collapse=settings.on_collapse)


def run_demo(settings: DemoSettings, say: Callable[[str], None] = print) -> None:
    from stppo_agent.evaluation.results import evaluate_all, format_table, write_results
    from stppo_agent.models.default_model import resolve_model
    from stppo_agent.plugins.name_checks import check_model
    from stppo_agent.training.trainer import Trainer

    out = Path(settings.output_dir)
    check_model(settings.model)
    model = resolve_model(settings.model)
    say(f"stppo demo: {settings.sft_steps} warm-start steps, then {settings.iterations} iterations of ST-PPO on "
        f"{settings.model} with the bundled demo set (BM25, on a GPU when there is one, else the CPU)")
    if settings.sft_steps > 0:
        # A 135M model never writes Search-R1's tags on its own, so RL would see no reward at all: a short
        # supervised warm start on scripted search-then-answer episodes of the *train* split teaches the format.
        from stppo_agent.training.sft import SFTConfig, train_sft

        summary = train_sft(SFTConfig(model=model, output_dir=str(out / "sft"), benchmarks=DEMO_BENCHMARKS,
                                      steps=settings.sft_steps, lr=5e-5,
                                      max_observation_tokens=DEMO_MAX_OBSERVATION_TOKENS, max_total_tokens=1024),
                            report=lambda _: None)
        say(f"warm start: {summary['demonstrations']} demonstrations, loss {summary['first_loss']:.2f} -> "
            f"{summary['last_loss']:.2f} in {settings.sft_steps} steps")
        model = str(out / "sft")
    metrics = Trainer(demo_config(settings, model, out)).train()
    say(off_policy_summary(out / "train", metrics["reward"]))
    results = evaluate_all(f"hf:{out / 'train'}@latest", DEMO_BENCHMARKS, {}, None, settings.limit, "demo", 3, 3,
                           16, 0, 48)
    write_results(results, out / "eval")
    say(format_table(results))
    say(f"run folder: {out / 'train'}; evaluation: {out / 'eval'}")


def off_policy_summary(run_dir: Path, reward: float) -> str:
    """What ST-PPO's mechanisms did on the off-policy steps of a run (its metrics.jsonl, step diagnostics on)."""
    from stppo_agent.runs.metrics_log import read_metrics

    records = [r for r in read_metrics(run_dir) if r.get("offpolicy/steps")]
    if not records:
        return f"trained: reward {reward:.3f}; no off-policy step (one mini-batch per iteration)"
    steps = sum(r["offpolicy/steps"] for r in records)

    def mean(key: str) -> float:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else float("nan")

    return (f"trained: reward {reward:.3f}; on {steps:.0f} off-policy steps: clip_frac "
            f"{mean('offpolicy/clip_frac'):.3f} (turn-level), turn_clip_frac "
            f"{mean('offpolicy/turn_clip_frac'):.3f}, clip_bias_scale "
            f"{mean('offpolicy/clip_bias_scale'):.3f} (||C|| {mean('offpolicy/clip_bias_norm'):.3f}); token ratios "
            f"outside the clip range {mean('offpolicy/tail/token_outside_frac'):.3f} (what token-level PPO would "
            f"clip), max {mean('offpolicy/tail/ratio_max'):.2f} vs turn ratios max "
            f"{mean('offpolicy/tail/turn_ratio_max'):.2f}")
