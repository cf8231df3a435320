"""The rollout's generation before and after the 2026-12-05 changes, paired in one process.

    python benchmarks/generation_ab.py [--model smollm2|tiny] [--prompts 8] [--samples 4] [--new-tokens 48]
                                       [--repeats 4] [--threads 2]

One turn of ``HFGenerationBackend.generate`` over the same contexts (the first rollout's prompts, each --samples
times, as GRPO samples them; peers.py's shape by default), timed with the code as it is ("after") and with what it
did before, restored in the process ("before"): every row's prefill encoded (no shared prefill), transformers'
min_p warper built for min_p=0, the stop check's candidate test by ``torch.isin``. Both arms draw from the same seed
in a pair, and the script checks that they sampled the same tokens and log-probs; the order alternates pair by pair,
so the machine's drift falls on both. Prints each pair's after / before time and the median.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import _common  # noqa: F401  (puts the repository on sys.path)
import torch

import stppo_agent.rollouts.hf_generation as hf_generation
from stppo_agent.rollouts.hf_generation import StopOnStrings
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import LoggingConfig, OptimizerConfig, RolloutConfig
from stppo_agent.training.trainer import Trainer

AFTER_CONFIG, AFTER_CANDIDATE = hf_generation.generation_config, StopOnStrings.is_candidate


def before_config(*args, **kwargs):
    config = AFTER_CONFIG(*args, **kwargs)
    config.min_p = 0.0  # what the config said before: transformers then runs its (no-op) warper every step
    return config


def isin_candidate(self, token_ids: torch.Tensor) -> torch.Tensor:
    return torch.isin(token_ids, self.candidate_ids.to(token_ids.device))


def use(backend, before: bool) -> None:
    backend.share_prefill = not before
    hf_generation.generation_config = before_config if before else AFTER_CONFIG
    StopOnStrings.is_candidate = isin_candidate if before else AFTER_CANDIDATE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny (a random Llama, hidden 256, 4 layers), "
                                                          "or a model folder")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from stppo_agent.models.default_model import smollm2_path

    model = args.model
    if model == "smollm2":
        model = str(smollm2_path())
    elif model == "tiny":
        from trainer import make_model

        model = str(make_model(256, 4, None))
    rows = args.prompts * args.samples
    trainer = Trainer(TrainConfig(
        algo="grpo", algorithm={"kl_loss_coef": 0.0}, env="stppo/NQ-v0", model=model, output_dir=tempfile.mkdtemp(),
        rollout=RolloutConfig(prompts_per_iteration=args.prompts, samples_per_prompt=args.samples,
                              generation_batch_size=rows, max_turns=1, max_new_tokens_per_turn=args.new_tokens),
        optimizer=OptimizerConfig(mini_batch_size=rows, micro_batch_size=min(8, rows)),
        logging=LoggingConfig(progress=False, tensorboard=False)), report=lambda _: None)
    batch = trainer.rollout()  # warm-up, and the contexts
    width = batch.prompt_width
    contexts = [batch.input_ids[r, :width][batch.attention_mask[r, :width].bool()].tolist()
                for r in range(batch.batch_size)]
    backend = trainer.backend
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(args.repeats):
        sampled = {}
        for before in ((True, False) if repeat % 2 == 0 else (False, True)):
            use(backend, before)
            torch.manual_seed(1000 + repeat)
            started = time.perf_counter()
            generations = backend.generate(contexts, args.new_tokens, keys=list(range(len(contexts))))
            backend.end_rollout()
            seconds[before].append(time.perf_counter() - started)
            sampled[before] = [(g.token_ids, g.logprobs) for g in generations]
        use(backend, before=False)
        if sampled[True] != sampled[False]:
            raise SystemExit(f"repeat {repeat}: the two arms sampled different tokens or log-probs")
        tokens = sum(len(ids) for ids, _ in sampled[True])
        print(f"repeat {repeat}: before {seconds[True][-1]:.2f} s   after {seconds[False][-1]:.2f} s   "
              f"{tokens} tokens, identical in both", flush=True)
    ratios = [after / before for after, before in zip(seconds[False], seconds[True])]
    print(f"{len(contexts)} rows ({len({tuple(c) for c in contexts})} distinct prompts), {args.new_tokens} new tokens: "
          f"after / before {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
