"""Trainer throughput against raw baselines of the same model and batch, in one run.

    python benchmarks/trainer.py [--hidden 256] [--layers 4] [--trajectories 16] [--env stppo/NQ-v0]
                                 [--tokenizer FOLDER] [--long-context 2000]

Runs on the GPU when there is one (the trainer's device "auto"); the default tokenizer is SmolLM2's.

- update: policy tokens/s of ``Trainer.update`` (GRPO: actor only, like the baseline) against a raw loop doing
  the trainer's work by the most direct code and nothing more: the same length-sorted, trimmed micro-batches, LM
  head over the response positions only (``logits_to_keep``), log-prob of the taken token, masked mean loss,
  backward, gradient clipping, one AdamW step. Target >= 0.8. ST-PPO's figure (critic + clip-bias correction:
  about twice the work) is printed for reference.
- rollout: generated tokens/s of the multi-turn rollout (generation, env steps, observation tokenisation)
  against one plain ``model.generate`` call producing the same number of tokens per trajectory, with the KV
  cache reused across turns (the default) and without (every turn re-encodes the transcript). Target >= 0.95.
  The plain call is not an upper bound: it samples no observation tokens' context and steps no env, but its
  sampler (``torch.multinomial``, half of a rollout's profile on a CPU) is the rollout's too. Nor is it a lower
  one: it encodes every copy of a prompt (2 samples each here), where the rollout's first turn encodes each distinct
  prompt once (stppo_agent/rollouts/shared_prefill.py, on a CPU).
  Also printed: the same ratio against a plain ``generate`` given the rollout's in-place cache (what the rollout
  adds beyond the cache: the observation tokens are context a plain call does not hold).
- cache: ``generate`` after a long context (--long-context) with the rollout's in-place key/value cache
  (stppo_agent/rollouts/append_cache.py) against transformers' default DynamicCache.
- mismatch: mean |old - sample| log-prob per policy token between the trainer's scoring forward and the
  sampler (transformers generate), in float32, bfloat16 weights and bfloat16 autocast, and the k3 KL estimate of
  rollout_correction.

Every ratio is printed as the median over --repeats with its range (min-max): the pieces alternate within a
repeat, so each repeat gives one paired ratio, and the range shows how far machine noise moves it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repository on sys.path)
import torch

from stppo_agent.models.tiny import build_tiny_llama
from stppo_agent.rollouts.append_cache import new_cache
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.rollouts.hf_generation import CACHE_ARGUMENT
from stppo_agent.rollouts.turn_loop import encode_prompt
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.log_probs import position_ids
from stppo_agent.training.trainer import Trainer


def make_model(hidden: int, layers: int, tokenizer_path: str | None) -> Path:
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path or str(smollm2_path()))
    return build_tiny_llama(Path(tempfile.mkdtemp()) / "model", tokenizer, hidden=hidden, layers=layers)


def raw_update(model, batch: RolloutBatch, micro: int, max_grad_norm: float = 1.0) -> float:
    """Seconds for the trainer's work on ``batch`` written plainly: rows sorted by length, each micro-batch trimmed
    to its own longest row, logits for the response positions only, the taken tokens' log-probs, a masked mean
    over the batch's policy tokens, backward, gradient clipping and one AdamW step. What the trainer adds (ratios,
    clipping, metrics, its bookkeeping) is what the comparison measures."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    started = time.perf_counter()
    optimizer.zero_grad()
    order = torch.argsort(batch.lengths().cpu(), stable=True)
    tokens = batch.loss_mask.sum()
    for start in range(0, batch.batch_size, micro):
        part = batch.select(order[start:start + micro]).trimmed()
        width = part.response_ids.shape[1]
        logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask,
                       position_ids=position_ids(part.attention_mask), use_cache=False,
                       logits_to_keep=width + 1).logits[:, :width].float()  # positions P-1 .. P+T-2
        logprobs = logits.gather(-1, part.response_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
        loss = -(logprobs * part.loss_mask).sum() / tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    _synchronize(model)
    return time.perf_counter() - started


def spread(values: list[float], digits: int = 2) -> str:
    """Median and range over repeats: 1.03 (0.98-1.09)."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _synchronize(model) -> None:
    """GPU work is asynchronous: wait for it before reading the clock."""
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--env", default="stppo/NQ-v0", help="env id (stppo/Toy-v0 needs no retriever)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: SmolLM2's)")
    parser.add_argument("--long-context", type=int, default=2000,
                        help="context length of the in-place vs DynamicCache generation comparison")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_path = make_model(args.hidden, args.layers, args.tokenizer)
    common = dict(env=args.env, model=str(model_path), output_dir=tempfile.mkdtemp(), iterations=1,
                  prompts_per_iteration=args.trajectories // 2, samples_per_prompt=2, mini_batch_size=args.trajectories,
                  micro_batch_size=4, max_turns=3, max_new_tokens_per_turn=48, max_observation_tokens=256,
                  max_prompt_tokens=512, max_total_tokens=1024, progress=False, tensorboard=False)
    trainer = Trainer(TrainConfig(algo="grpo", algorithm={"kl_loss_coef": 0.0}, **common), report=lambda _: None)

    batch = trainer.rollout()  # warm-up (lazy inits, the retriever's first queries); sets the token count
    generated = int(batch.loss_mask.sum())
    per_trajectory = max(1, generated // batch.batch_size)
    prompts = [encode_prompt(trainer.state.tokenizer, env.transcript[0].text)
               for env in list(trainer.source.env_pool.values())[: batch.batch_size]]
    from stppo_agent.rollouts.batch import left_pad

    input_ids, attention = left_pad(prompts, trainer.state.tokenizer.pad_token_id, trainer.device)

    def plain_generate(in_place: bool = False) -> float:
        return generate_rate(trainer, input_ids, attention, per_trajectory, in_place)

    # Time spent inside the backend's generate, to split a rollout into generation and the rest (env steps,
    # observation tokenisation, batching).
    generate_seconds, keyed_calls = [0.0], [0]
    backend_generate = trainer.backend.generate

    # functools.wraps keeps generate's signature: the rollout passes trajectory keys (what cache reuse needs)
    # only to a backend whose signature has them
    @functools.wraps(backend_generate)
    def timed_generate(*args, **kwargs):
        keyed_calls[0] += kwargs.get("keys") is not None
        started = time.perf_counter()
        try:
            return backend_generate(*args, **kwargs)
        finally:
            generate_seconds[0] += time.perf_counter() - started

    trainer.backend.generate = timed_generate
    rollout_rates, generation_share = {True: [], False: []}, {True: [], False: []}
    plain_rates, plain_append_rates = [], []
    for _ in range(args.repeats):  # alternate, so machine noise hits all three alike
        for reuse in (True, False):
            trainer.backend.reuse_cache = reuse
            generate_seconds[0] = 0.0
            started = time.perf_counter()
            batch = trainer.rollout()
            seconds = time.perf_counter() - started
            rollout_rates[reuse].append(float(batch.loss_mask.sum()) / seconds)
            generation_share[reuse].append(generate_seconds[0] / seconds)
        plain_rates.append(plain_generate())
        plain_append_rates.append(plain_generate(in_place=True))
    if not keyed_calls[0]:
        raise SystemExit("the rollout never passed trajectory keys to generate: cache reuse was not measured")
    trainer.backend.reuse_cache = True
    trainer.backend.generate = backend_generate
    generated = int(batch.loss_mask.sum())

    trainer.score(batch)
    st_trainer = Trainer(TrainConfig(algo="st_ppo", **dict(common, output_dir=tempfile.mkdtemp())),
                         report=lambda _: None)
    st_trainer.score(batch)
    ours, raw, st = [], [], []
    micro = trainer.config.optimizer.micro_batch_size
    for _ in range(args.repeats):  # alternate, so machine noise hits all three alike
        started = time.perf_counter()
        trainer.update(batch)
        ours.append(time.perf_counter() - started)
        raw.append(raw_update(trainer.state.actor, batch, micro, trainer.config.optimizer.max_grad_norm))
        started = time.perf_counter()
        st_trainer.update(batch)
        st.append(time.perf_counter() - started)

    print(f"device {trainer.device}; model: random Llama hidden={args.hidden} layers={args.layers} "
          f"vocab={trainer.state.actor.config.vocab_size}; "
          f"{batch.batch_size} trajectories, {generated} policy tokens, {int(batch.attention_mask.sum())} tokens; "
          f"{args.repeats} repeats, ratios as median (min-max) of the repeats' paired ratios")
    raw_tps = generated / statistics.median(raw)
    print(f"update  grpo   {generated / statistics.median(ours):9.1f} tok/s   raw {raw_tps:9.1f} tok/s   "
          f"ratio {spread([r / o for o, r in zip(ours, raw)])}")
    print(f"update  st_ppo {generated / statistics.median(st):9.1f} tok/s   (actor + critic + clip-bias correction)   "
          f"ratio {spread([r / s for s, r in zip(st, raw)])}")
    plain_tps, plain_append_tps = statistics.median(plain_rates), statistics.median(plain_append_rates)
    for reuse, label in ((True, "KV cache reused"), (False, "re-encoded    ")):
        rates = rollout_rates[reuse]
        print(f"rollout {label} {statistics.median(rates):9.1f} tok/s   plain generate {plain_tps:9.1f} tok/s   "
              f"ratio {spread([r / p for r, p in zip(rates, plain_rates)])}   (in generate: "
              f"{statistics.median(generation_share[reuse]):.0%} of the rollout; against a plain generate with the "
              f"rollout's in-place cache, {plain_append_tps:.1f} tok/s: "
              f"{spread([r / p for r, p in zip(rates, plain_append_rates)])})")
    print(long_context_cache_speedup(trainer, args.long_context, args.repeats))
    for label, precision in (("float32", None), ("bfloat16 weights", {"dtype": "bfloat16"}),
                             ("bfloat16 autocast (float32 weights and heads)", {"autocast_dtype": "bfloat16"})):
        stats = batch.stats if precision is None else scored_rollout_stats(common, precision)
        print(f"mismatch {label}: mean |old - sample| {stats['rollout_logprob_diff']:.2e}   "
              f"KL {stats['rollout_correction/kl']:.2e}")


def generate_rate(trainer: Trainer, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                  in_place: bool) -> float:
    """Tokens/s of one plain sampled ``generate`` of exactly ``new_tokens`` per row, with the rollout's in-place
    cache or transformers' default one."""
    cache = {CACHE_ARGUMENT: new_cache(trainer.state.actor.config)} if in_place else {}
    started = time.perf_counter()
    with torch.no_grad():
        trainer.state.actor.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, top_k=0,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               pad_token_id=trainer.state.tokenizer.pad_token_id, **cache)
    _synchronize(trainer.state.actor)
    return new_tokens * input_ids.shape[0] / (time.perf_counter() - started)


def long_context_cache_speedup(trainer: Trainer, context: int, repeats: int, rows: int = 8,
                               new_tokens: int = 96) -> str:
    """Sampling speed of ``generate`` after a long context with the rollout's in-place cache against transformers'
    default DynamicCache, which copies the whole cache at every token (its cost grows with the context)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(100, trainer.state.actor.config.vocab_size, (rows, context), generator=generator)
    input_ids = input_ids.to(trainer.device)
    rates = {True: [], False: []}
    for _ in range(repeats):
        for in_place in (False, True):
            rates[in_place].append(generate_rate(trainer, input_ids, torch.ones_like(input_ids), new_tokens,
                                                 in_place))
    ours, default = statistics.median(rates[True]), statistics.median(rates[False])
    return (f"cache   {context}-token context, {rows} x {new_tokens} new tokens: in-place {ours:9.1f} tok/s   "
            f"DynamicCache {default:9.1f} tok/s   ratio {spread([a / b for a, b in zip(rates[True], rates[False])])}")


def scored_rollout_stats(common: dict, precision: dict) -> dict:
    """The batch statistics of one scored rollout by a fresh trainer in another precision."""
    trainer = Trainer(TrainConfig(algo="grpo", algorithm={"kl_loss_coef": 0.0}, **precision,
                                  **dict(common, output_dir=tempfile.mkdtemp())), report=lambda _: None)
    batch = trainer.rollout()
    trainer.score(batch)
    return batch.stats


if __name__ == "__main__":
    main()
