"""stppo against TRL's GRPOTrainer doing the same work, iteration by iteration.

    python benchmarks/peers.py [--quick] [--iterations 5] [--warmup 1] [--model smollm2] [--threads N]
                               [--prompts 8] [--samples 4] [--new-tokens 48] [--micro 8] [--lr 1e-6]
                               [--env stppo/NQ-v0] [--reward f1] [--format-reward 0.2] [--device cpu] [--out FILE]

Two worker processes, one per framework, each with its own copy of the model, take turns: one iteration of stppo
(``Trainer.rollout``, ``score``, ``update``: `stppo train --algo grpo`'s iteration without its logging and
checkpoints), then one of TRL (one ``GRPOTrainer`` optimizer step, held at its step boundaries by a callback), the
order swapped every iteration, so that the machine's noise falls on both alike. The work is one turn per episode
of the env (``max_turns=1``): prompts x samples completions of up to --new-tokens tokens, each scored by the env's
own scorer, then GRPO advantages and one AdamW step over micro-batches. The two settle every difference they can:

- the same prompts in the same order (stppo's seeded sampler; the first prompt's tokens are compared), the same
  sampling (temperature 1, no top-k/top-p), the same stop strings (``</search>``, ``</answer>``: stppo's stopping
  criterion is given to TRL's ``generate``), the same scorer (the env's EM/F1 and format reward);
- the same optimizer object type and settings (``torch.optim.AdamW``, --lr, no weight decay, constant schedule,
  gradient clipping at 1), float32 weights and compute (TRL's bf16 and gradient-checkpointing defaults off), no
  reference model, the same thread count and allocator settings (``THP_MEM_ALLOC_ENABLE=1``, stppo's default).

Each worker reports those settings as they are in effect and the table says which agree. What is left is printed
beside the ratios: stppo sorts micro-batches by length, TRL computes per-token entropies in its training forward
and trains one end-of-turn token after a stop string. (Neither scores old log-probs with a forward of its own: with
one optimizer step per batch both take them from the training forward.)
Per iteration: seconds, generation / scoring / update split,
generated tokens and tokens/s, mean reward; at the end the medians, the paired ratios with their range, peak
memory (RSS; CUDA's peak on a GPU) and both reward curves. ``--quick``: a tiny random Llama with SmolLM2's
tokenizer, one iteration, no warm-up (CI: plumbing, not a measurement). Needs TRL (``pip install .[trl]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repository on sys.path)

from stppo_agent.training.config_sections import (
    CheckpointConfig,
    LoggingConfig,
    MonitorConfig,
    OptimizerConfig,
    RolloutConfig,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str
    env: str
    env_kwargs: dict
    prompts: int
    samples: int
    new_tokens: int
    micro: int
    lr: float
    threads: int
    device: str
    iterations: int  # warm-up included
    seed: int = 0


def peak_memory_gb(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def timed(function, seconds: list):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - started
    return wrapper


def threads() -> int:
    import torch

    return torch.get_num_threads()


def optimizer_settings(optimizer) -> dict:
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    group = optimizer.param_groups[0]
    return {"optimizer": type(optimizer).__name__, "lr": group["lr"], "weight_decay": group["weight_decay"],
            "fused": bool(group.get("fused")), "foreach": group.get("foreach")}


# -- stppo ------------------------------------------------------------------------------------------------------------
class StppoSide:
    def __init__(self, s: Settings):
        from stppo_agent.training.config import TrainConfig
        from stppo_agent.training.trainer import Trainer

        config = TrainConfig(algo="grpo", algorithm={"kl_loss_coef": 0.0}, env=s.env, env_kwargs=s.env_kwargs,
                             model=s.model, output_dir=tempfile.mkdtemp(prefix="peers-stppo-"), iterations=s.iterations,
                             device=s.device, seed=s.seed,
                             rollout=RolloutConfig(prompts_per_iteration=s.prompts, samples_per_prompt=s.samples,
                                                   generation_batch_size=s.prompts * s.samples, max_turns=1,
                                                   max_new_tokens_per_turn=s.new_tokens),
                             optimizer=OptimizerConfig(mini_batch_size=s.prompts * s.samples, micro_batch_size=s.micro,
                                                       actor_lr=s.lr),
                             logging=LoggingConfig(progress=False, tensorboard=False),
                             checkpoint=CheckpointConfig(every=10**9), monitor=MonitorConfig(on_collapse="none"))
        self.trainer = Trainer(config, report=lambda _: None)
        self.generate_seconds = [0.0]
        self.trainer.backend.generate = timed(self.trainer.backend.generate, self.generate_seconds)
        self.s = s

    def settings(self) -> dict:
        trainer, sampling, actor = self.trainer, self.trainer.config.sampling(), self.trainer.state.actor
        return {**optimizer_settings(trainer.state.actor_optimizer),
                "max_grad_norm": trainer.config.optimizer.max_grad_norm,
                "dtype": str(next(actor.parameters()).dtype), "attention": actor.config._attn_implementation,
                "gradient_checkpointing": actor.is_gradient_checkpointing, "bf16": False,
                "reference_model": trainer.state.reference is not None, "threads": threads(),
                "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                "stop_strings": list(trainer.backend.stop_strings),
                "max_new_tokens": trainer.config.rollout.max_new_tokens_per_turn,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "completions_per_optimizer_step": trainer.config.optimizer.mini_batch_size,
                "micro_batch": trainer.config.optimizer.micro_batch_size}

    def iteration(self) -> dict:
        trainer = self.trainer
        self.generate_seconds[0] = 0.0
        started = time.perf_counter()
        batch = trainer.rollout()
        rolled = time.perf_counter()
        trainer.score(batch, old_from_update=trainer.old_logprobs_from_update(batch))  # as the training loop does
        scored = time.perf_counter()
        trainer.update(batch)
        done = time.perf_counter()
        trainer.state.iteration += 1
        pool, width = trainer.source.env_pool, batch.prompt_width
        return {"seconds": done - started, "generate": self.generate_seconds[0],
                "score": rolled - started - self.generate_seconds[0] + scored - rolled, "update": done - scored,
                "scoring_forward": scored - rolled, "tokens": int(batch.loss_mask.sum()),
                "reward": float(batch.rewards.float().mean()),
                "questions": [pool[(p * self.s.samples, 0)].example.id for p in range(self.s.prompts)],
                "first_prompt": batch.input_ids[0, :width][batch.attention_mask[0, :width].bool()].tolist()}


# -- TRL --------------------------------------------------------------------------------------------------------------
class TrlSide:
    """A ``GRPOTrainer`` whose ``train()`` runs in this process, held between optimizer steps by :meth:`callback`:
    each step waits for the parent's go and reports its figures."""

    def __init__(self, s: Settings, conn):
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteriaList, TrainerCallback
        from transformers.trainer_callback import PrinterCallback
        from trl import GRPOConfig, GRPOTrainer

        from stppo_agent.rollouts.envs import make_env
        from stppo_agent.rollouts.generation import STOP_STRINGS
        from stppo_agent.rollouts.hf_generation import StopOnStrings, stop_candidate_ids
        from stppo_agent.training.live_rollouts import PromptSampler

        self.s, self.conn = s, conn
        self.scorer = make_env(s.env, s.env_kwargs)  # the env whose reward stppo's episodes get
        # the questions of stppo's sampler, in its order: TRL takes them in dataset order (shuffle_dataset=False)
        pairs = PromptSampler([len(self.scorer.examples)], s.seed).take(s.prompts * s.iterations)
        rows = [{"prompt": [{"role": "user", "content": self.scorer.prompt_for(self.scorer.examples[i])}], "index": i}
                for _, i in pairs]
        tokenizer = AutoTokenizer.from_pretrained(s.model)
        model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        args = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="peers-trl-"), max_steps=s.iterations, learning_rate=s.lr,
            per_device_train_batch_size=s.micro, gradient_accumulation_steps=s.prompts * s.samples // s.micro,
            num_generations=s.samples, max_completion_length=s.new_tokens, beta=0.0, bf16=False,
            gradient_checkpointing=False, shuffle_dataset=False, logging_strategy="no", save_strategy="no",
            report_to="none", disable_tqdm=True, seed=s.seed, use_cpu=s.device == "cpu", max_grad_norm=1.0)
        self.record: dict = {}
        self.trainer = GRPOTrainer(model=model, reward_funcs=self.env_reward, args=args, processing_class=tokenizer,
                                   train_dataset=Dataset.from_list(rows), optimizers=(optimizer, schedule))
        candidates = stop_candidate_ids(tokenizer, STOP_STRINGS)
        generate, self.generate_seconds, self.step_seconds = model.generate, [0.0], [0.0]

        def generate_with_stops(*args, **kwargs):  # stppo's stop strings (TRL's generate has none)
            width = kwargs["input_ids"].shape[1]
            self.record.setdefault("first_prompt", kwargs["input_ids"][0][kwargs["attention_mask"][0].bool()].tolist())
            kwargs["stopping_criteria"] = StoppingCriteriaList([StopOnStrings(tokenizer, STOP_STRINGS, width,
                                                                              candidates)])
            return generate(*args, **kwargs)

        model.generate = timed(generate_with_stops, self.generate_seconds)
        self.trainer._generate_and_score_completions = timed(self.trainer._generate_and_score_completions,
                                                             self.step_seconds)
        side = self

        class Lockstep(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                side.conn.recv()  # the parent's go
                side.record.clear()
                side.generate_seconds[0] = side.step_seconds[0] = 0.0
                side.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                seconds = time.perf_counter() - side.started
                side.conn.send({"seconds": seconds, "generate": side.generate_seconds[0],
                                "score": side.step_seconds[0] - side.generate_seconds[0],
                                "update": seconds - side.step_seconds[0], **side.record})

        self.trainer.add_callback(Lockstep())
        self.trainer.remove_callback(PrinterCallback)  # its end-of-training summary line
        self.stop_strings = list(STOP_STRINGS)

    def env_reward(self, completions, index, completion_ids, **kwargs) -> list[float]:
        """The env's reward of each completion as the one turn of an episode (what stppo's episodes get)."""
        rewards = []
        for completion, i in zip(completions, index):
            self.scorer.reset(options={"index": i})
            rewards.append(float(self.scorer.step(completion[0]["content"])[1]))
        self.record.update(tokens=sum(len(ids) for ids in completion_ids), reward=sum(rewards) / len(rewards),
                           questions=[self.scorer.examples[i].id for i in index[::self.s.samples]])
        return rewards

    def settings(self) -> dict:
        trainer, config = self.trainer, self.trainer.generation_config
        model = trainer.model
        return {**optimizer_settings(trainer.optimizer), "max_grad_norm": trainer.args.max_grad_norm,
                "dtype": str(next(model.parameters()).dtype), "attention": model.config._attn_implementation,
                "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
                "reference_model": getattr(trainer, "ref_model", None) is not None, "threads": threads(),
                "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"), "stop_strings": self.stop_strings,
                "max_new_tokens": config.max_new_tokens, "temperature": config.temperature, "top_p": config.top_p,
                "top_k": config.top_k or 0, "bf16": bool(trainer.args.bf16),
                "completions_per_optimizer_step": trainer.args.per_device_train_batch_size
                * trainer.args.gradient_accumulation_steps, "micro_batch": trainer.args.per_device_train_batch_size}


def worker(kind: str, s: Settings, conn) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed checkpointing settings

    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    if kind == "stppo":
        side = StppoSide(s)
        conn.send(side.settings())
        for _ in range(s.iterations):
            conn.recv()
            conn.send(side.iteration())
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        side = TrlSide(s, conn)
        conn.send(side.settings())
        side.trainer.train()
    conn.send({"peak_memory_gb": peak_memory_gb(s.device)})
    conn.recv()


# -- the pair ---------------------------------------------------------------------------------------------------------
SIDES = ("stppo", "trl")
PHASES = ("seconds", "generate", "score", "update")
LEFT_OVER = (
    "stppo's sampler keeps every step's processed scores to record the behaviour log-probs (a log-softmax over "
    "the vocabulary per token); TRL's transformers path records none",
    "stppo sorts micro-batches by length (less padding); TRL keeps the generation order",
    "TRL computes per-token entropies in its training forward (for its metrics)",
    "TRL trains on one end-of-turn token after a stop string (its EOS mask); its token counts include it",
    "sampling draws differ (each framework's own random stream): completions, lengths and rewards differ; "
    "tokens/s compares the rates",
)


def run_pair(s: Settings, warmup: int) -> dict:
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no torch state shared with this one
    pipes, processes = {}, {}
    for kind in SIDES:
        parent, child = context.Pipe()
        processes[kind] = context.Process(target=worker, args=(kind, s, child), daemon=True)
        processes[kind].start()
        pipes[kind] = parent
    settings = {kind: pipes[kind].recv() for kind in SIDES}
    load = [os.getloadavg()[0]]
    rows: dict[str, list[dict]] = {kind: [] for kind in SIDES}
    for iteration in range(s.iterations):
        for kind in SIDES if iteration % 2 == 0 else SIDES[::-1]:  # who goes first alternates too
            pipes[kind].send("go")
            rows[kind].append(pipes[kind].recv())
    load.append(os.getloadavg()[0])
    memory = {kind: pipes[kind].recv()["peak_memory_gb"] for kind in SIDES}
    for kind in SIDES:
        pipes[kind].send("exit")
        processes[kind].join(timeout=60)
    return {"sides": settings, "rows": rows, "warmup": warmup, "load": load, "peak_memory_gb": memory}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(s: Settings, result: dict, header: str) -> list[str]:
    settings, warmup = result["sides"], result["warmup"]
    rows = {kind: result["rows"][kind][warmup:] for kind in SIDES}
    lines = [header, f"load average (1 min) {result['load'][0]:.1f} at the start, {result['load'][1]:.1f} at the end",
             f"{'iter':>4}  {'side':5} {'seconds':>8} {'generate':>9} {'score':>7} {'update':>7} {'tokens':>7} "
             f"{'tok/s':>7} {'reward':>7}"]
    for i in range(len(result["rows"]["stppo"])):
        for kind in SIDES:
            r = result["rows"][kind][i]
            tag = "warm" if i < warmup else str(i - warmup + 1)
            lines.append(f"{tag:>4}  {kind:5} {r['seconds']:8.2f} {r['generate']:9.2f} {r['score']:7.2f} "
                         f"{r['update']:7.2f} {r['tokens']:7d} {r['tokens'] / r['seconds']:7.1f} {r['reward']:7.3f}")
    lines.append("per iteration, median of each side; ratio stppo/TRL as the median (range) of the paired iterations:")
    for phase in PHASES:
        ours, theirs = ([r[phase] for r in rows[kind]] for kind in SIDES)
        lines.append(f"  {phase:9} stppo {statistics.median(ours):7.2f} s   trl {statistics.median(theirs):7.2f} s   "
                     f"ratio {spread([a / max(b, 1e-9) for a, b in zip(ours, theirs)])}")
    rates = [(a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"]) for a, b in zip(rows["stppo"], rows["trl"])]
    lines.append(f"  tokens/s  stppo {statistics.median(r['tokens'] / r['seconds'] for r in rows['stppo']):7.1f}   "
                 f"trl {statistics.median(r['tokens'] / r['seconds'] for r in rows['trl']):7.1f}   "
                 f"ratio {spread(rates)}")
    memory = result["peak_memory_gb"]
    kind = "CUDA" if s.device.startswith("cuda") else "RSS"
    lines.append(f"  peak memory ({kind})  stppo {memory['stppo']:.2f} GB   trl {memory['trl']:.2f} GB")
    for kind in SIDES:
        curve = " ".join(f"{r['reward']:.3f}" for r in result["rows"][kind])
        lines.append(f"reward per iteration ({kind}, warm-up first): {curve}")
    same_questions = all(a["questions"] == b["questions"] for a, b in zip(*(result["rows"][k] for k in SIDES)))
    first = [result["rows"][kind][0]["first_prompt"] for kind in SIDES]
    lines.append(f"same questions in the same order: {'yes' if same_questions else 'NO'}; "
                 f"same prompt tokens: {'yes' if first[0] == first[1] else 'NO'}")
    agree, differ = [], []
    for key in settings["stppo"]:
        if key in settings["trl"]:
            values = [settings[kind][key] for kind in SIDES]
            (agree if values[0] == values[1] else differ).append((key, values))
    lines.append("same settings: " + ", ".join(f"{key}={values[0]}" for key, values in agree))
    lines += [f"SETTING DIFFERS: {key}: stppo {values[0]}, trl {values[1]}" for key, values in differ]
    lines.append("work that still differs (beside the ratios):")
    lines += [f"  - {item}" for item in LEFT_OVER]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, one iteration, no warm-up (CI)")
    parser.add_argument("--model", default="smollm2", help="model spec (stppo's grammar; default SmolLM2-135M)")
    parser.add_argument("--iterations", type=int, default=5, help="measured iterations per side")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured iterations per side first")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (the GRPO group)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--micro", type=int, default=8, help="completions per forward/backward")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--env", default="stppo/NQ-v0")
    parser.add_argument("--dataset", default=None, help="the env's dataset (default: its demo set)")
    parser.add_argument("--reward", default="f1", help="the env's reward: em, f1 or acc")
    parser.add_argument("--format-reward", type=float, default=0.2,
                        help="Search-R1's format reward: paid for an answer in tags, so rewards vary from the start")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both frameworks)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    if (args.prompts * args.samples) % args.micro:
        parser.error(f"--micro ({args.micro}) must divide prompts x samples ({args.prompts * args.samples})")
    from stppo_agent.models.default_model import resolve_model, smollm2_path

    if args.quick:
        from transformers import AutoTokenizer

        from stppo_agent.models.tiny import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", AutoTokenizer.from_pretrained(smollm2_path()),
                                     hidden=64, layers=2))
        args.iterations, args.warmup = 1, 0
    else:
        model = resolve_model(args.model)
    env_kwargs = {"split": "train", "reward": args.reward, "format_reward": args.format_reward}
    if args.dataset:
        env_kwargs["dataset"] = args.dataset
    # the settings stppo's command line makes, for both workers (torch reads them once, at import)
    os.environ["THP_MEM_ALLOC_ENABLE"] = os.environ.get("THP_MEM_ALLOC_ENABLE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    s = Settings(model=model, env=args.env, env_kwargs=env_kwargs, prompts=args.prompts, samples=args.samples,
                 new_tokens=args.new_tokens, micro=args.micro, lr=args.lr, threads=args.threads, device=args.device,
                 iterations=args.iterations + args.warmup)
    import trl

    name = "a tiny random Llama (--quick)" if args.quick else args.model
    header = (f"peers: stppo `train --algo grpo` vs TRL {trl.__version__} GRPOTrainer; model {name}; "
              f"{args.env} ({env_kwargs}), one turn per episode; {args.prompts} prompts x {args.samples} completions, "
              f"{args.new_tokens} new tokens, micro-batches of {args.micro}, one optimizer step per iteration; "
              f"device {args.device}, {args.threads} threads; {args.iterations} measured iterations after "
              f"{args.warmup} warm-up, alternating")
    result = run_pair(s, args.warmup)
    lines = report(s, result, header)
    print("\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps({"run": dataclasses.asdict(s), **result, "report": lines}, indent=1))


if __name__ == "__main__":
    main()
