"""The copy tier's supervised warm start: teach a model to repeat ``stppo/Copy-v0``'s sequences until its *sampled*
accuracy reaches a middling target, so that RL afterwards can raise the reward or lose it.

    python benchmarks/copy_warm_start.py MODEL OUT [--target 0.4] [--device cpu]

Training data are the env's own transcripts played by a perfect policy, tokenised as a rollout tokenises them
(the prompt through the chat template when the tokenizer has one, each observation alone, the policy's tokens of
a turn followed by EOS where the turn's token budget leaves room for it), with the loss on the policy's tokens
only. Every few steps the mean probability of the right token at each policy position (teacher forced, on fixed
held-out transcripts) estimates the accuracy of sampling at temperature 1; training stops at the first estimate
at or above ``--target``. On a random copy-tier Llama (benchmarks/stress.py's `copy` tier) that takes seconds:
copying jumps from chance to perfect within ~30 steps at lr 3e-3, so the default lr is lower and the estimate
is read every step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _common  # noqa: F401  (puts the repository on sys.path)


def transcripts(tokenizer, seeds, length: int, vocabulary: int, turns: int, max_new_tokens_per_turn: int):
    """(ids, labels) per seed: a perfect episode of the env as the rollout would hold it; labels -100 off-policy."""
    from stppo_agent.rollouts.turn_loop import encode_observation, encode_prompt
    from stppo_envs.copy_task import CopyEnv

    env = CopyEnv(length=length, vocabulary=vocabulary, turns=turns)
    out = []
    for seed in seeds:
        prompt, _ = env.reset(seed=int(seed))
        ids = list(encode_prompt(tokenizer, prompt))
        labels = [-100] * len(ids)
        for turn in range(turns):
            action = " ".join(env.sequences[turn])
            policy = tokenizer(action, add_special_tokens=False)["input_ids"]
            if len(policy) > max_new_tokens_per_turn:
                raise SystemExit(f"a copy of {length} symbols is {len(policy)} tokens with this tokenizer, over "
                                 f"rollout.max_new_tokens_per_turn={max_new_tokens_per_turn}; raise it")
            if len(policy) < max_new_tokens_per_turn:  # the turn ends by EOS, not by its budget
                policy.append(tokenizer.eos_token_id)
            ids += policy
            labels += policy
            observation, *_ = env.step(action)
            if observation:
                context = encode_observation(tokenizer, observation, 4 * length + 64)
                ids += context
                labels += [-100] * len(context)
        out.append((ids, labels))
    return out


def stack(pairs, pad_id: int, device):
    import torch

    width = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for row, (i, lab) in enumerate(pairs):
        ids[row, :len(i)], labels[row, :len(lab)], mask[row, :len(i)] = torch.tensor(i), torch.tensor(lab), 1
    return ids.to(device), labels.to(device), mask.to(device)


def sampled_accuracy(model, batch) -> float:
    """Mean probability of the right token over the policy positions: the expected share a temperature-1 sampler
    gets right, teacher forced."""
    import torch

    ids, labels, mask = batch
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        keep = target != -100
        probs = logits.softmax(-1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    return float(probs[keep].mean())


def warm_start(model: str, out: Path, target: float = 0.4, lr: float = 1e-3, batch_size: int = 32,
               max_steps: int = 2000, length: int = 16, vocabulary: int = 64, turns: int = 2,
               max_new_tokens_per_turn: int = 16, device: str = "cpu", seed: int = 0) -> dict:
    """Train ``model`` (a Hugging Face folder) on perfect copies until :func:`sampled_accuracy` >= ``target``; save
    it with its tokenizer at ``out`` and return (and write as ``out/warm_start.json``) what it took."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = out / "warm_start.json"
    if record.exists():
        return json.loads(record.read_text())
    tokenizer = AutoTokenizer.from_pretrained(model)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
        policy.train()
        optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
        data = np.random.default_rng(seed)
        shape = (length, vocabulary, turns, max_new_tokens_per_turn)
        held_out = stack(transcripts(tokenizer, range(10**6, 10**6 + 128), *shape), tokenizer.pad_token_id, device)
        accuracy, step = sampled_accuracy(policy, held_out), 0
        while accuracy < target and step < max_steps:
            ids, labels, mask = stack(transcripts(tokenizer, data.integers(0, 10**6, batch_size), *shape),
                                      tokenizer.pad_token_id, device)
            loss = policy(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            accuracy = sampled_accuracy(policy, held_out)
    finally:
        torch.random.set_rng_state(state)
    if accuracy < target:
        raise SystemExit(f"the copy warm start reached a sampled accuracy of {accuracy:.3f} in {max_steps} steps, "
                         f"short of {target}; raise --lr or --max-steps")
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"model": model, "steps": step, "sampled_accuracy": accuracy, "target": target, "lr": lr,
            "batch_size": batch_size, "seed": seed, "length": length, "vocabulary": vocabulary, "turns": turns}
    record.write_text(json.dumps(info) + "\n")
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--target", type=float, default=0.4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--max-new-tokens-per-turn", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(json.dumps(warm_start(args.model, args.out, args.target, args.lr, max_steps=args.max_steps,
                                max_new_tokens_per_turn=args.max_new_tokens_per_turn, device=args.device)))


if __name__ == "__main__":
    main()
