"""Supervised warm start: fine-tune a model on a teacher agent's successful episodes before RL.

A small model rarely emits Search-R1's ``<search>`` / ``<answer>`` format on its own, so RL on it gets no reward
to learn from. A teacher -- the ``gold-search`` script (search the question, answer the golden answer), or any
agent spec such as ``hf:BIG_MODEL`` or ``openai:URL#MODEL`` (rejection-sampling fine-tuning) -- plays the
benchmark envs; its episodes that earned the reward become the training data.

Episodes are laid out in tokens as rollouts are (the prompt through the chat template, each observation alone and
cut to ``max_observation_tokens``, whose default is training's: a demonstration never shows a cut that RL would
not); the teacher's actions are encoded from their text (a rollout keeps the ids it sampled), and the loss is the
mean negative log-likelihood of those action tokens only: observations and the prompt are masked, as in the PPO
loss.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from stppo_agent.evaluation.agent_specs import resolve_agent_spec
from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
from stppo_agent.models.loading import load_actor, load_tokenizer, resolve_device
from stppo_agent.models.precision import autocast_forward, validate_autocast_dtype, with_resolved_precision
from stppo_agent.rollouts.batch import Trajectory, to_batch
from stppo_agent.rollouts.turn_loop import RolloutLimits, encode_observation, encode_prompt
from stppo_agent.training.log_probs import accepts_logits_to_keep, position_ids


@dataclasses.dataclass
class SFTConfig:
    model: str
    output_dir: str
    benchmarks: Sequence[str] = ("nq", "hotpotqa")
    datasets: dict[str, str] = dataclasses.field(default_factory=dict)  # benchmark -> dataset; none: demo set
    split: str = "train"
    limit: int | None = None  # examples per benchmark
    teacher: str = "gold-search"
    retriever: str = "demo"
    topk: int = 3
    max_turns: int = 3  # two searches (both hops of a multi-hop question) and the answer
    # the same limits, and defaults, as `stppo train` (TrainConfig takes them from RolloutLimits too)
    max_observation_tokens: int = RolloutLimits.max_observation_tokens
    max_total_tokens: int = RolloutLimits.max_total_tokens
    steps: int = 60
    batch_size: int = 4
    lr: float = 2e-5
    dtype: str = "float32"
    autocast_dtype: str | None = None  # as in training: bfloat16 / auto forwards, float32 weights
    device: str = "auto"
    seed: int = 0
    progress: bool = True  # a "warm start" bar on stderr: the steps take minutes on a CPU


def demonstrations(config: SFTConfig) -> list[list[dict[str, Any]]]:
    """Transcripts of the teacher's rewarded episodes on every benchmark of ``config``."""
    transcripts = []
    for benchmark in config.benchmarks:
        settings = EvalSettings(benchmark, config.datasets.get(benchmark), config.split, config.limit,
                                config.retriever, config.topk, config.max_turns, seed=config.seed)
        result = evaluate_benchmark(config.teacher, settings)
        transcripts += [episode["transcript"] for episode in result["episodes"] if episode["reward"] > 0]
    if not transcripts:
        raise ValueError(f"the teacher {config.teacher!r} earned no reward on {', '.join(config.benchmarks)}: "
                         "no demonstrations to learn from")
    return transcripts


def trajectory_from_transcript(tokenizer, transcript: Sequence[dict[str, Any]],
                               max_observation_tokens: int) -> Trajectory:
    """Token ids of one episode as a rollout would hold them; ``policy_mask`` marks the teacher's actions."""
    if not transcript or transcript[0]["role"] != "user":
        raise ValueError("a transcript starts with the user prompt")
    trajectory = Trajectory(env=None, group_id=0, prompt_ids=encode_prompt(tokenizer, transcript[0]["text"]))
    for segment in transcript[1:]:
        if not segment["text"]:
            continue
        if segment["role"] == "assistant":
            ids = tokenizer(segment["text"], add_special_tokens=False)["input_ids"]
            trajectory.append(ids, policy=True, turn=segment["turn"])
        else:
            trajectory.append(encode_observation(tokenizer, segment["text"], max_observation_tokens), policy=False,
                              turn=segment["turn"])
    return trajectory


def action_logprobs(model, batch) -> torch.Tensor:
    """log pi of the teacher's action tokens (flattened, ``batch.loss_mask``'s order).

    The output head is applied only where the loss is: the observations and the prompt, most of a demonstration's
    tokens, never go through the vocabulary-wide head and log-sum-exp (the same values as
    :func:`~stppo_agent.training.log_probs.token_logprobs` at the masked positions, for a fifth less work)."""
    width = batch.response_ids.shape[1]
    kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=position_ids(batch.attention_mask), use_cache=False, output_hidden_states=True)
    if accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1  # the head's own output is not used
    hidden = model(**kwargs).hidden_states[-1]  # after the final norm: what the head reads
    predicting = hidden[:, batch.prompt_width - 1: batch.prompt_width - 1 + width][batch.loss_mask]
    logits = model.get_output_embeddings()(predicting).float()
    chosen = batch.response_ids[batch.loss_mask].unsqueeze(-1)
    return logits.gather(-1, chosen).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def train_sft(config: SFTConfig, report: Callable[[str], None] = print,
              on_step: Callable[[int, int, float], None] | None = None) -> dict[str, Any]:
    """Fine-tune ``config.model`` on the teacher's demonstrations (``hf:RUN@latest`` and the other checkpoint specs
    resolved as ``stppo eval`` resolves them); save a Hugging Face folder in ``output_dir``, which is checked before
    any work (:func:`check_output_dir`) and replaced whole (:func:`replace_folder`).
    ``on_step(done, steps, loss)`` is called as the steps begin (``done`` 0, loss NaN: the demonstrations are
    ready and the model loaded) and after each optimizer step, instead of the report's step lines (the demo's
    progress display)."""
    if config.steps < 1 or config.batch_size < 1:
        raise ValueError("steps and batch_size must be >= 1")
    for name in ("max_observation_tokens", "max_total_tokens"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    validate_autocast_dtype(config.autocast_dtype, config.dtype)  # before minutes of teacher episodes
    check_output_dir(Path(config.output_dir))
    teacher, chosen = resolve_agent_spec(config.teacher)  # hf:RUN@latest -> that checkpoint's actor
    if chosen:
        report(f"teacher {chosen}")
    config = dataclasses.replace(config, teacher=teacher)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config.model)
    transcripts = demonstrations(config)
    trajectories = [trajectory_from_transcript(tokenizer, t, config.max_observation_tokens) for t in transcripts]
    kept = [t for t in trajectories if len(t.prompt_ids) + len(t.response_ids) <= config.max_total_tokens]
    if not kept:
        raise ValueError(f"every demonstration is longer than max_total_tokens={config.max_total_tokens}")
    report(f"sft: {len(kept)} demonstrations by {config.teacher} ({len(trajectories) - len(kept)} over "
           f"max_total_tokens skipped), {config.steps} steps of {config.batch_size}")
    device = resolve_device(config.device)
    config = with_resolved_precision(config, device)
    model = autocast_forward(load_actor(config.model, config.dtype).to(device), config.autocast_dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    order: list[int] = []
    losses = []
    started = time.perf_counter()
    from tqdm.auto import tqdm

    bar = tqdm(range(config.steps), desc="warm start", unit="step", disable=not config.progress)
    if on_step is not None:
        on_step(0, config.steps, float("nan"))
    for step in bar:
        if len(order) < config.batch_size:  # a fresh shuffled pass over the demonstrations
            order += random.sample(range(len(kept)), len(kept))
        batch = to_batch([kept[i] for i in order[:config.batch_size]], tokenizer.pad_token_id).to(device)
        del order[:config.batch_size]
        loss = -action_logprobs(model, batch).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"sft step {step + 1}: the loss is {loss.item()}; lower --lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_step is not None:
            on_step(step + 1, config.steps, losses[-1])
        elif (step + 1) % 10 == 0 or step == 0:
            report(f"sft step {step + 1}/{config.steps}: loss {losses[-1]:.3f}")
    bar.close()
    summary = {"first_loss": losses[0], "last_loss": losses[-1], "demonstrations": len(kept),
               "seconds": time.perf_counter() - started,
               "config": dataclasses.asdict(config)}

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        (folder / "sft_losses.json").write_text(json.dumps(losses))
        (folder / SFT_RECORD).write_text(json.dumps(summary, indent=1, default=list))

    replace_folder(Path(config.output_dir), write)
    return summary


SFT_RECORD = "sft.json"  # written last: a folder holding it holds a whole model of an earlier `stppo sft`


def check_output_dir(out: Path) -> None:
    """Where the fine-tuned model may go, checked before any work: a writable place that is new, empty or an
    earlier ``stppo sft`` output (replaced whole). A training run's folder is refused (``hf:RUN@...`` would no longer
    reach its checkpoints), and so is another model or any other content (the new folder replaces it whole)."""
    from stppo_agent.evaluation.agent_specs import folder_listing, is_run_like
    from stppo_agent.evaluation.results import check_writable

    check_writable(out, beside=True)
    if not out.exists():
        return
    if not out.is_dir():
        raise NotADirectoryError(f"--output-dir {out} is a file; choose a new or empty folder")
    if is_run_like(out) or (out / "checkpoints").is_dir():
        raise FileExistsError(f"--output-dir {out} holds a training run ({folder_listing(out)}); stppo sft writes a "
                              "model folder: choose a new or empty one")
    if (out / SFT_RECORD).is_file():
        return
    if (out / "config.json").exists():
        raise FileExistsError(f"--output-dir {out} holds another model (config.json; no {SFT_RECORD} of stppo sft); "
                              "choose a new or empty folder")
    if any(out.iterdir()):
        raise FileExistsError(f"--output-dir {out} is not empty ({folder_listing(out)}) and holds no earlier stppo sft "
                              "model; choose a new or empty folder")


def replace_folder(out: Path, write: Callable[[Path], None]) -> None:
    """``write`` a folder beside ``out``, then put it in ``out``'s place: ``out`` never holds a partial model, and a
    failure part-way leaves what it held before."""
    out = Path(os.path.abspath(out))  # "." has no name to put a folder beside
    out.parent.mkdir(parents=True, exist_ok=True)
    staging, old = (out.with_name(f".{out.name}.{kind}-{os.getpid()}") for kind in ("partial", "replaced"))
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir()
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)
