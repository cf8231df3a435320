"""The embedded default: a short supervised warm start, an evaluation of the warm-started model, ST-PPO on the demo
set, then the same evaluation of the trained policy -- the recipe behind ``stppo demo``.

It is sized to finish in about five minutes on two CPU cores (README, "Set up a fresh machine") while still
showing what ST-PPO does: its off-policy steps, where turn-level clipping and the clip-bias correction act.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from stppo_agent.training.config_sections import (
    CheckpointConfig,
    LoggingConfig,
    MonitorConfig,
    OptimizerConfig,
    PrecisionConfig,
    RolloutConfig,
)
from stppo_agent.training.demo_progress import DemoProgress
from stppo_agent.training.demo_report import (  # noqa: F401 (EXPECTED_RANGES: the demo's public figures)
    EXPECTED_RANGES,
    before_after_table,
    demo_figures,
    off_policy_means,
    off_policy_summary,
    range_check,
)
from stppo_agent.training.trainer import Trainer

DEMO_BENCHMARKS = ("nq", "hotpotqa", "medqa")
DEMO_MAX_OBSERVATION_TOKENS = 160  # the demo's warm start and RL alike (the shared default is 512)
DEMO_MAX_TURNS = 3
DEMO_MAX_NEW_TOKENS = 48  # per turn, in rollouts and evaluation: a search or an answer takes 15-30 tokens
DEMO_SFT_BATCH_SIZE = 4
DEMO_SFT_LR = 1e-4
DEMO_SFT_MAX_TOTAL_TOKENS = 1024
DEMO_RL_ENV = "stppo/NQ-v0"  # the demo set's general questions, single-hop: what the warm start teaches best
DEMO_MAX_RESAMPLE_ROUNDS = 4
DEMO_SAMPLES = 8  # answers sampled per RL question
DEMO_CLIP_BIAS_KAPPA = 0.5
AUTOCAST_CHOICES = ("auto", "bfloat16", "none")

@dataclasses.dataclass(frozen=True)
class DemoSettings:
    model: str = "smollm2"
    output_dir: str = "runs/demo"
    iterations: int = 1  # its 3 off-policy steps are where clipping acts
    sft_steps: int = 8
    limit: int = 8  # evaluation questions per benchmark, before RL and after
    lr: float = 1.5e-5
    on_collapse: str = "warn"
    seed: int = 0  # the warm start's batch order and the RL step's prompts and samples
    autocast_dtype: str = "auto"  # the RL step's forwards: auto (bfloat16 on a GPU or an AMX CPU), bfloat16, none

    def __post_init__(self):
        if self.autocast_dtype not in AUTOCAST_CHOICES:
            raise ValueError(f"autocast_dtype must be one of {', '.join(AUTOCAST_CHOICES)}, got "
                             f"{self.autocast_dtype!r}")


def demo_config(settings: DemoSettings, model: str, out: Path):
    from stppo_agent.training.config import TrainConfig

    return TrainConfig(
        algo="st_ppo", env=DEMO_RL_ENV, model=model, output_dir=str(out / "train"),
        # Search-R1's format reward tells a well-formed wrong answer (0.2) from an invalid turn or none (0).
        env_kwargs={"split": "train", "format_reward": 0.2}, iterations=settings.iterations,
        # Eight samples of one general question, which the warm-started model answers about half the time (sampled
        # at temperature 1, a question's 4 rewards differed in 6 of 8 questions); DAPO's dynamic sampling draws
        # another question while all 8 earned the same reward, so the update always has something to learn. Eight,
        # not four: with four, one batch in twenty (bfloat16 seed 7: a right answer after two searches, a misspelt
        # and a malformed one after one) taught "do not answer after the first search" so strongly that the greedy
        # policy stopped answering at all; eight samples of the question put both kinds of answer in most batches,
        # so the shared format tokens' gradients cancel. A smaller step was not the fix: lowering the lr from 2e-5
        # moved the failure to another seed, and an lr warm-up over the 4 steps left the clip-bias correction idle.
        rollout=RolloutConfig(prompts_per_iteration=1, samples_per_prompt=DEMO_SAMPLES, max_turns=DEMO_MAX_TURNS,
                              max_new_tokens_per_turn=DEMO_MAX_NEW_TOKENS,
                              max_observation_tokens=DEMO_MAX_OBSERVATION_TOKENS, max_prompt_tokens=400,
                              max_total_tokens=768),
        # The clip-bias correction divides a step's gradient by ||C|| / kappa once the clipped turns' part C of it
        # exceeds kappa. ||C|| is a gradient norm, so its size depends on the model and the loss's normalisation,
        # and kappa is set relative to it (as docs/stability.md recommends): over the demo's 8-sample batches the
        # off-policy steps' ||C|| measured 0.3-1.4, so at the spec's default of 1 the correction never acted on
        # one seed's batch in either precision while turn-level clipping did; at 0.5 it acted there too
        # (docs/demo.md, "Why this recipe").
        algorithm={"dynamic_sampling": True, "max_resample_rounds": DEMO_MAX_RESAMPLE_ROUNDS,
                   "clip_bias_kappa": DEMO_CLIP_BIAS_KAPPA},
        # Two mini-batches x two epochs: 3 of every 4 optimizer steps are off-policy, and the second epoch revisits
        # data the first already pushed -- where ST-PPO's turn-level clipping and clip-bias correction act (measured:
        # with one mini-batch per iteration, or at lr <= 3e-6, no turn ever left the clip range).
        optimizer=OptimizerConfig(mini_batch_size=DEMO_SAMPLES // 2, micro_batch_size=2, epochs=2,
                                  actor_lr=settings.lr, critic_lr=1e-5),
        # A rollback needs a recent healthy checkpoint to return to: then one is written every iteration.
        # The demo evaluates its checkpoint and never resumes it: without AdamW's moments it is 1.1 GB, not 3.2.
        checkpoint=CheckpointConfig(every=1 if settings.on_collapse == "rollback" else settings.iterations, keep=1,
                                    optimizer="all" if settings.on_collapse == "rollback" else "none"),
        device="auto", seed=settings.seed,
        # auto: bfloat16 forwards on a GPU or an AMX CPU, where they are faster
        precision=PrecisionConfig(autocast_dtype=None if settings.autocast_dtype == "none"
                                  else settings.autocast_dtype),
        # progress off: the demo's own display reports each rollout turn and update step
        logging=LoggingConfig(progress=False, step_diagnostics=True),
        monitor=MonitorConfig(on_collapse=settings.on_collapse))


class DemoTrainer(Trainer):
    """The trainer with its phases (rollout turns, scoring, update steps) on the demo's display."""

    def __init__(self, config, progress: DemoProgress):
        self.progress = progress
        self.rewards: list[float] = []  # every sampled trajectory's reward: whether the update had anything to learn
        # The demo owns its output folder: a second `make demo` replaces the first one's run, as it replaces its
        # warm start and evaluations, instead of refusing after minutes of warm start and evaluation.
        super().__init__(config, report=progress.say, overwrite=True)

    def phase(self, text: str) -> None:
        super().phase(text)
        if self.state.iteration != self.progress.done:  # the first phase of the next iteration: one more is done
            self.progress.step(self.state.iteration, text)
        else:
            self.progress.note(text)

    def score(self, batch, old_from_update: bool = False) -> None:
        super().score(batch, old_from_update)
        self.rewards += [float(reward) for reward in batch.rewards.tolist()]


class ProgressAgent:
    """An evaluation agent that tells the display which turn it is generating, and how fast."""

    def __init__(self, agent, progress: DemoProgress, max_turns: int):
        self.agent, self.progress, self.max_turns = agent, progress, max_turns
        self.benchmark, self.tokens, self.seconds = "", 0, 0.0

    def act(self, episodes) -> list[str]:
        import time

        turn = max(episode.turn for episode in episodes) + 1
        speed = f", {self.tokens / self.seconds:.0f} tokens/s" if self.seconds else ""
        self.progress.note(f"{self.benchmark}: turn {turn}/{self.max_turns} of {len(episodes)} episodes{speed}")
        before = sum(self.agent.generated_tokens(e.episode_id) for e in episodes if e.turn > 0)
        started = time.perf_counter()
        actions = self.agent.act(episodes)
        self.seconds += time.perf_counter() - started
        self.tokens += sum(self.agent.generated_tokens(e.episode_id) for e in episodes) - before
        return actions

    def generated_tokens(self, episode_id: str) -> int:
        return self.agent.generated_tokens(episode_id)

    @property
    def max_observation_tokens(self) -> int | None:
        """The cut the wrapped agent applies: what the evaluation records it read."""
        return self.agent.max_observation_tokens


def evaluate_demo(spec: str, settings: DemoSettings, progress: DemoProgress, out: Path, name: str) -> list[dict]:
    """The demo's evaluation of one model (``spec``) on the test questions; results written to ``out``."""
    from stppo_agent.evaluation.agent_specs import resolve_agent_spec
    from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
    from stppo_agent.evaluation.hf_agent import HFAgent
    from stppo_agent.evaluation.results import write_results

    progress.phase(name, total=len(DEMO_BENCHMARKS))
    spec, chosen = resolve_agent_spec(spec)
    if chosen:
        progress.say(f"agent {chosen}")
    # observations cut as in the warm start and RL: a held-out score of the policy as it was trained to read
    agent = ProgressAgent(HFAgent(spec[3:], max_new_tokens=DEMO_MAX_NEW_TOKENS,
                                  max_observation_tokens=DEMO_MAX_OBSERVATION_TOKENS), progress, DEMO_MAX_TURNS)
    results = []
    for number, benchmark in enumerate(DEMO_BENCHMARKS):
        agent.benchmark = benchmark
        progress.step(number, f"{benchmark}: loading")
        results.append(evaluate_benchmark(spec, EvalSettings(
            benchmark, None, None, settings.limit, "demo", 3, DEMO_MAX_TURNS, 16, 0, DEMO_MAX_NEW_TOKENS,
            DEMO_MAX_OBSERVATION_TOKENS),
            agent_factory=lambda *_: agent))
    write_results(results, out)
    return results


def cpu_threads(cores: int, others: float, requested: str | None) -> int:
    """torch's CPU threads for the demo: one per core (torch's default), less one per other process running.

    torch's threads meet at a barrier after every parallel operation, so a thread that waits for a core stalls
    the rest: with other work on a 2-core machine, 2 threads measured 1.2x slower than 1 on the warm start's
    matrix products and 16x slower on generation's small ones. ``OMP_NUM_THREADS``, when set, decides."""
    if requested:
        return max(1, int(requested))
    return max(1, cores - math.ceil(others - 0.5))


def other_running_processes(samples: int = 5, interval_s: float = 0.1) -> float:
    """Mean number of runnable tasks on the machine besides this one (``procs_running`` of /proc/stat); 0 where
    the file does not exist."""
    import time

    counts = []
    for sample in range(samples):
        try:
            with open("/proc/stat", encoding="ascii") as handle:
                line = next(line for line in handle if line.startswith("procs_running"))
        except (OSError, StopIteration):
            return 0.0
        counts.append(int(line.split()[1]) - 1)  # this process, reading the file, is one of them
        if sample < samples - 1:
            time.sleep(interval_s)
    return sum(counts) / len(counts)


def run_demo(settings: DemoSettings, progress: DemoProgress | None = None) -> dict[str, Any]:
    """Warm start, evaluation, ST-PPO, evaluation; prints what each did and returns the figures it checked."""
    import os

    import torch

    from stppo_agent.plugins.name_checks import check_model

    progress = progress or DemoProgress()
    out = Path(settings.output_dir)
    check_model(settings.model)
    cores, others = torch.get_num_threads(), other_running_processes()
    threads = cpu_threads(cores, others, os.environ.get("OMP_NUM_THREADS"))
    busy = f"; {threads} of {cores} CPU threads: {others:.1f} other processes running" if threads < cores else ""
    torch.set_num_threads(threads)
    try:
        return _run_demo(settings, progress, out, busy)
    finally:
        torch.set_num_threads(cores)  # the process's setting again (the tests call the command in-process)


def _run_demo(settings: DemoSettings, progress: DemoProgress, out: Path, busy: str) -> dict[str, Any]:
    from stppo_agent.models.default_model import resolve_model

    with progress:
        progress.say(f"stppo demo: {settings.sft_steps} warm-start steps, then {settings.iterations} iteration(s) "
                     f"of ST-PPO (seed {settings.seed}, {rl_precision(settings.autocast_dtype)} forwards) on "
                     f"{settings.model} with the bundled demo set (BM25, on a GPU when there is one, "
                     f"else the CPU{busy}), evaluated on {settings.limit} test questions per benchmark before and "
                     "after RL")
        model = resolve_model(settings.model)
        if settings.sft_steps > 0:
            model = warm_start(settings, model, out, progress)
        before = evaluate_demo(f"hf:{model}", settings, progress, out / "eval_before",
                               "evaluation before RL") if settings.sft_steps > 0 else None
        progress.phase("ST-PPO iteration", total=settings.iterations)
        figures = train_and_check(settings, demo_config(settings, model, out), progress, out, before)
        evaluations = f"{out / 'eval_before'} (before RL), {out / 'eval'} (after)" if before else out / "eval"
        progress.say(f"run folder: {out / 'train'}; evaluation: {evaluations}")
    return figures


def train_and_check(settings: DemoSettings, config, progress: DemoProgress, out: Path,
                    before: list[dict] | None) -> dict[str, float]:
    """The RL step on ``config``, its summary, the evaluation after it beside ``before``, and the check line;
    returns the checked figures."""
    trainer = DemoTrainer(config, progress)
    metrics = trainer.train()
    means = off_policy_means(out / "train")
    progress.say(off_policy_summary(means, trainer.rewards, metrics.get("dynamic_sampling/rounds", 0.0)))
    after = evaluate_demo(f"hf:{out / 'train'}@latest", settings, progress, out / "eval", "evaluation after RL")
    progress.say(before_after_table(before, after))
    figures = demo_figures(before, after, means, trainer.rewards)
    progress.say(range_check(figures))
    return figures


def rl_precision(autocast_dtype: str) -> str:
    """The precision of the RL step's forwards on this machine, ``auto`` resolved as the trainer will."""
    from stppo_agent.models.loading import resolve_device
    from stppo_agent.models.precision import resolve_autocast_dtype

    return resolve_autocast_dtype(None if autocast_dtype == "none" else autocast_dtype, resolve_device("auto")) \
        or "float32"


def warm_start(settings: DemoSettings, model: str, out: Path, progress: DemoProgress) -> str:
    """A 135M model never writes Search-R1's tags on its own, so RL would see no reward at all: a short
    supervised warm start on scripted search-then-answer episodes of the *train* split teaches the format."""
    from stppo_agent.training.sft import SFTConfig, train_sft

    progress.phase("warm start: the gold-search teacher's demonstrations")

    def on_step(done: int, steps: int, loss: float) -> None:
        if done == 0:  # the demonstrations are ready and the model loaded: the steps' clock starts
            progress.phase("warm start", total=steps)
        else:
            progress.step(done, f"loss {loss:.3f}")

    # each demonstration is seen once: the teacher plays only as many episodes as the steps use
    per_benchmark = math.ceil(settings.sft_steps * DEMO_SFT_BATCH_SIZE / len(DEMO_BENCHMARKS))
    summary = train_sft(SFTConfig(model=model, output_dir=str(out / "sft"), benchmarks=DEMO_BENCHMARKS,
                                  limit=per_benchmark, steps=settings.sft_steps, batch_size=DEMO_SFT_BATCH_SIZE,
                                  lr=DEMO_SFT_LR, max_observation_tokens=DEMO_MAX_OBSERVATION_TOKENS,
                                  max_total_tokens=DEMO_SFT_MAX_TOTAL_TOKENS, seed=settings.seed, progress=False),
                        report=progress.note, on_step=on_step)
    progress.say(f"warm start: {summary['demonstrations']} demonstrations, loss {summary['first_loss']:.2f} -> "
                 f"{summary['last_loss']:.2f} in {settings.sft_steps} steps")
    return str(out / "sft")
