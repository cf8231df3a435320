"""Multi-turn PPO / ST-PPO in one file, CleanRL-style: the whole iteration on ``stppo/Toy-v0``, top to bottom.

    python examples/minimal_ppo.py --algo st_ppo --iterations 5

A reference to read, not the trainer. The math comes from the public API (``stppo_agent.algorithms``: presets,
advantage estimators, policy and value losses, the clip-bias correction; docs/algorithms.md), everything else is
torch, transformers and gymnasium. ``tests/examples/test_minimal_ppo.py`` holds this file's scoring and update equal
to the Trainer's on the same batch, so the math you read here is the math ``stppo train`` applies. Left out:
micro-batches, several processes, rollout correction (the sampler here is the actor itself, in float32: its weights
would all be 1), checkpoints, monitoring.

One iteration:

    rollout   play prompts x samples episodes; the policy's sampled tokens are kept as sampled (token-in/token-out),
              the env's observations are appended as tokens the loss never sees; each policy token records its turn
    score     old log-probs (the ratio's denominator), reference log-probs (the KL penalty in the reward), values,
              then advantages from the preset's registered estimator (GAE over policy tokens for ppo / st_ppo)
    update    epochs over shuffled mini-batches: the preset's policy loss (token- or turn-level ratios), the clip-bias
              correction for s_ppo / st_ppo, gradient clipping, AdamW; the critic's clipped value loss
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import gymnasium as gym
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification, PreTrainedTokenizerFast

import stppo_envs  # noqa: F401  (registers stppo/Toy-v0)
from stppo_agent.algorithms import (
    ALGORITHMS,
    ClipBiasCorrector,
    estimate_advantages,
    get_policy_loss,
    kl_reward_penalty,
    value_loss,
)


@dataclasses.dataclass
class Args:
    algo: str = "st_ppo"
    """a registered preset: ppo, turn_ppo, s_ppo, st_ppo, turn_gae, grpo, ... (not dapo: it resamples)"""
    iterations: int = 12
    prompts: int = 8
    """episodes' prompts per iteration (the toy env poses one: 'say red')"""
    samples: int = 4
    """episodes per prompt (a group, for the group-relative estimators)"""
    lr: float = 3e-3
    """actor and critic learning rate (AdamW): high, for a random 2-layer model to learn in a few iterations"""
    epochs: int = 2
    mini_batch_size: int = 16
    max_grad_norm: float = 1.0
    turns: int = 2
    """env steps per episode (the toy env's reward is the share of turns that said the target)"""
    max_new_tokens: int = 1
    """tokens the policy may say per turn; only the first word counts, so 1 learns fastest (more: longer turns)"""
    seed: int = 0


def parse_args(argv=None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args(argv)))


# -- model and tokenizer -------------------------------------------------------------------------------------------
WORDS = ("say", "ok", "red", "green", "blue", "gold")  # the toy env's prompt, observation and answers


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per word: <pad>=0, <eos>=1, <unk>=2, then WORDS (the vocabulary of ``stppo train --model tiny``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_models(tokenizer, seed: int):
    """A random 2-layer Llama (the actor), a critic on the same backbone with a fresh value head (how verl and the
    trainer build critics), and the frozen reference: a copy of the actor's initial weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         tie_word_embeddings=False)  # no dropout (Llama has none): on-policy ratios are exactly 1
    actor = LlamaForCausalLM(config)
    critic_config = copy.deepcopy(config)
    critic_config.num_labels = 1  # one output per position: V(s_t)
    critic_config.classifier_dropout = 0.0  # the head's dropout defaults to 0.1: values would differ on every pass
    critic = LlamaForTokenClassification(critic_config)
    critic.model.load_state_dict(actor.model.state_dict())
    torch.nn.init.zeros_(critic.score.weight)  # V = 0 at first: the first advantages are the plain returns, not noise
    torch.nn.init.zeros_(critic.score.bias)
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    return actor, critic, reference


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded row is computed as it would be alone."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


# -- rollout: multi-turn episodes, token-in / token-out --------------------------------------------------------------
@dataclasses.dataclass
class Batch:
    """B trajectories as the tensors of docs/algorithms.md (the names of the trainer's RolloutBatch). ``input_ids`` is
    the left-padded prompt (width P) then the right-padded response (width T); per-token tensors are (B, T)."""

    input_ids: torch.Tensor  # (B, P + T)
    attention_mask: torch.Tensor  # (B, P + T)
    prompt_width: int
    response_ids: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T) True exactly on tokens the policy sampled
    turn_ids: torch.Tensor  # (B, T) k on the policy tokens of the k-th env.step, -1 elsewhere
    rewards: torch.Tensor  # (B,) the episode's outcome
    group_ids: torch.Tensor  # (B,) which prompt the trajectory answers
    old_logprobs: torch.Tensor | None = None  # set by score()
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> "Batch":
        return Batch(**{f.name: (v[rows] if isinstance(v, torch.Tensor) else v)
                        for f in dataclasses.fields(self) for v in [getattr(self, f.name)]})


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@torch.no_grad()
def sample_turn(actor, contexts: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int,
                generator: torch.Generator) -> list[list[int]]:
    """Sample one turn for each context at temperature 1, until EOS or ``max_new_tokens``. The ids are returned as
    sampled: the text the env reads is decoded from them, and they (not a re-encoding of that text) are trained on.
    Without a KV cache: the toy contexts are a few tokens long."""
    ids, mask = left_pad(contexts, pad_id)
    new: list[list[int]] = [[] for _ in contexts]
    alive = torch.ones(len(contexts), dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = actor(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -1].float()
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
        for row in alive.nonzero().flatten().tolist():
            new[row].append(int(token[row]))  # an EOS is a policy token too: the policy chose to stop
        alive &= token != eos_id
        if not alive.any():
            break
        ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, alive[:, None].long()], 1)
    return new


def rollout(envs: list[gym.Env], actor, tokenizer, args: Args, generator: torch.Generator, iteration: int) -> Batch:
    """One episode per env, all envs in lock-step: one batched generation per turn."""
    n = len(envs)
    group_ids = [i // args.samples for i in range(n)]  # envs [g * samples, (g + 1) * samples) share prompt g
    prompts = [env.reset(seed=args.seed + 1_000_003 * iteration + i, options={"index": group_ids[i]})[0]
               for i, env in enumerate(envs)]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    response = [[] for _ in range(n)]
    policy = [[] for _ in range(n)]  # the loss mask
    turn_of = [[] for _ in range(n)]  # the turn ids
    rewards, done = [0.0] * n, [False] * n
    for turn in range(args.turns):
        active = [i for i in range(n) if not done[i]]
        if not active:
            break
        generated = sample_turn(actor, [prompt_ids[i] + response[i] for i in active], args.max_new_tokens,
                                tokenizer.eos_token_id, tokenizer.pad_token_id, generator)
        for i, ids in zip(active, generated):
            response[i] += ids
            policy[i] += [True] * len(ids)
            turn_of[i] += [turn] * len(ids)
            action = tokenizer.decode(ids, skip_special_tokens=True)  # the env reads text; the tokens stay as sampled
            observation, reward, terminated, truncated, _ = envs[i].step(action)
            if terminated or truncated:
                done[i], rewards[i] = True, float(reward)
                continue
            # the env's text is tokenised alone and appended: context for the next turn, never a policy token
            observed = tokenizer(observation, add_special_tokens=False)["input_ids"]
            response[i] += observed
            policy[i] += [False] * len(observed)
            turn_of[i] += [-1] * len(observed)
    prompt, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    width = max(len(r) for r in response)

    def right_pad(rows, value):
        return torch.tensor([r + [value] * (width - len(r)) for r in rows])

    response_ids = right_pad(response, tokenizer.pad_token_id)
    response_mask = right_pad([[1] * len(r) for r in response], 0)
    return Batch(input_ids=torch.cat([prompt, response_ids], 1),
                 attention_mask=torch.cat([prompt_mask, response_mask], 1), prompt_width=prompt.shape[1],
                 response_ids=response_ids, loss_mask=right_pad(policy, False),
                 turn_ids=right_pad(turn_of, -1), rewards=torch.tensor(rewards), group_ids=torch.tensor(group_ids))


# -- score: old and reference log-probs, values, advantages ----------------------------------------------------------
def token_logprobs(model, batch: Batch) -> torch.Tensor:
    """log pi(y_t | y_<t) of every response token (B, T): the logit at position P + t - 1 predicts token t."""
    width = batch.response_ids.shape[1]
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=position_ids(batch.attention_mask)).logits
    logits = logits[:, batch.prompt_width - 1: batch.prompt_width - 1 + width].float()
    return logits.log_softmax(-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)


def critic_values(critic, batch: Batch) -> torch.Tensor:
    """V(s_t) for every response position (B, T): the value of the state before token t (same alignment)."""
    width = batch.response_ids.shape[1]
    out = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                 position_ids=position_ids(batch.attention_mask)).logits
    return out[:, batch.prompt_width - 1: batch.prompt_width - 1 + width, 0].float()


@torch.no_grad()
def score(batch: Batch, actor, critic, reference, algo) -> None:
    batch.old_logprobs = token_logprobs(actor, batch)  # the ratio's denominator: the policy that sampled the batch
    batch.ref_logprobs = token_logprobs(reference, batch) if reference is not None else None
    batch.values = critic_values(critic, batch) if critic is not None else torch.zeros_like(batch.old_logprobs)
    # the KL to the reference is paid in the reward, per policy token (the PPO presets' kl_in_reward)
    kl_penalty = kl_reward_penalty(batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, algo) \
        if algo.kl_in_reward > 0 else None
    # the preset names the estimator; observation positions are skipped, not treated as zero-reward steps
    batch.advantages, batch.returns = estimate_advantages(
        algo.advantage, rewards=batch.rewards, values=batch.values, loss_mask=batch.loss_mask,
        group_ids=batch.group_ids, config=algo, kl_penalty=kl_penalty, turn_ids=batch.turn_ids)


# -- update: PPO epochs over mini-batches ------------------------------------------------------------------------------
def update(batch: Batch, actor, critic, actor_optimizer, critic_optimizer, algo, args: Args,
           iteration: int) -> dict[str, float]:
    """The actor's (and critic's) optimizer steps of one iteration; the means of their metrics."""
    policy_loss = get_policy_loss(algo.policy_loss)
    params = [p for p in actor.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(args.seed + iteration)  # the mini-batch order (as the trainer's)
    sums: dict[str, float] = {}
    steps = 0
    for _ in range(args.epochs):
        order = torch.randperm(len(batch.rewards), generator=generator)
        for start in range(0, len(order), args.mini_batch_size):
            mini = batch.select(order[start:start + args.mini_batch_size])
            actor_optimizer.zero_grad(set_to_none=True)
            logprobs = token_logprobs(actor, mini)
            # the preset's loss: ratio at its ratio_level (token for ppo; for st_ppo the geometric mean over each
            # turn's tokens), clipped surrogate, and bias = agg(c_t rho_t A_t), whose gradient is the clipping bias C
            loss, bias, metrics = policy_loss(
                logprobs=logprobs, old_logprobs=mini.old_logprobs, advantages=mini.advantages,
                loss_mask=mini.loss_mask, turn_ids=mini.turn_ids, config=algo,
                ref_logprobs=mini.ref_logprobs if algo.kl_loss_coef > 0 else None)
            corrector = ClipBiasCorrector(params, algo.clip_bias_kappa) if algo.clip_bias_correction else None
            if corrector is not None:
                corrector.accumulate(bias)  # C = grad(bias) by one extra backward, .grad untouched
            loss.backward()
            step = {k: float(v) for k, v in metrics.items()}
            scale = None
            if corrector is not None:  # S-PPO / ST-PPO: g = grad L / max(1, ||C|| / kappa)
                measured = corrector.measure()
                scale = measured["clip_bias_scale"]
                step.update({k: float(v) for k, v in measured.items()})
                if algo.clip_bias_order == "before_grad_clip":
                    corrector.scale_gradients(scale)
            step["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
            if scale is not None and algo.clip_bias_order == "after_grad_clip":
                corrector.scale_gradients(scale)
            actor_optimizer.step()
            if critic is not None:
                critic_optimizer.zero_grad(set_to_none=True)
                v_loss, v_metrics = value_loss(values=critic_values(critic, mini), old_values=mini.values,
                                               returns=mini.returns, loss_mask=mini.loss_mask, config=algo)
                v_loss.backward()
                step.update({k: float(v) for k, v in v_metrics.items()})
                step["critic_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(critic.parameters(),
                                                                               args.max_grad_norm))
                critic_optimizer.step()
            for key, value in step.items():
                sums[key] = sums.get(key, 0.0) + value
            steps += 1
    return {key: value / steps for key, value in sums.items()}


# -- the loop ----------------------------------------------------------------------------------------------------------
def main(argv=None) -> list[float]:
    """Train and print one line per iteration; returns the mean reward of each iteration's rollouts."""
    args = parse_args(argv)
    algo = ALGORITHMS[args.algo]
    if algo.dynamic_sampling:
        raise SystemExit(f"{args.algo} resamples prompts (DAPO); this loop does not: use stppo train")
    tokenizer = make_tokenizer()
    actor, critic, reference = make_models(tokenizer, args.seed)
    critic = critic if algo.use_critic else None
    reference = reference if algo.kl_in_reward > 0 or algo.kl_loss_coef > 0 else None
    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=args.lr, weight_decay=0.0)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.lr, weight_decay=0.0) if critic else None
    envs = [gym.make("stppo/Toy-v0", turns=args.turns) for _ in range(args.prompts * args.samples)]
    generator = torch.Generator().manual_seed(args.seed)  # the sampling stream
    curve = []
    for iteration in range(args.iterations):
        started = time.perf_counter()
        batch = rollout(envs, actor, tokenizer, args, generator, iteration)
        score(batch, actor, critic, reference, algo)
        metrics = update(batch, actor, critic, actor_optimizer, critic_optimizer, algo, args, iteration)
        curve.append(float(batch.rewards.mean()))
        extra = "".join(f" {k} {metrics[k]:.3f}" for k in ("turn_clip_frac", "clip_bias_scale") if k in metrics)
        print(f"iteration {iteration + 1:3d}  reward {curve[-1]:.3f}  pg_loss {metrics['pg_loss']:+.4f}  "
              f"clip_frac {metrics['clip_frac']:.3f}{extra}  {time.perf_counter() - started:.2f}s", flush=True)
    return curve


if __name__ == "__main__":
    torch.set_num_threads(1)  # a 2-layer model gains nothing from threads, and loses much on a busy machine
    main()
