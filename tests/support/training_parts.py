"""The trainer's parts over tiny models: configs, hand-made batches, an update stage
with SGD at constant rates, recorders of what the parts report."""

from __future__ import annotations

import torch

from stppo_agent.training.config import TrainConfig, from_dict, merged

# -- config ---------------------------------------------------------------------------------------------------

def config(**values) -> TrainConfig:
    return from_dict(merged({"model": "m", "env": "stppo/Toy-v0"}, values))


# -- tiny in-memory models and batches -------------------------------------------------------------------------

VOCAB = 12


def tiny_lm(seed: int = 0, critic: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=None, eos_token_id=1, num_labels=1)
    model = (LlamaForTokenClassification if critic else LlamaForCausalLM)(cfg)
    for module in model.modules():  # the value head's dropout: scores must repeat (as disable_dropout does)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


class NoKeep(torch.nn.Module):
    """A causal LM whose forward has no ``logits_to_keep`` (the slicing path of response_logits)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False, **kwargs):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, **kwargs)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()


# (prompt, [(ids, policy, turn), ...]) of different lengths: left padding, masked observations, several turns
EPISODES = [([3, 4], [([5, 6], True, 0), ([7], False, -1), ([8, 9], True, 1)]),
            ([3, 4, 5, 6], [([9], True, 0)]),
            ([7], [([4, 4, 4], True, 0), ([5, 5], False, -1), ([6], True, 1)]),
            ([3, 8, 8], [([10, 11], True, 0)]),
            ([5, 5], [([3], True, 0), ([2, 2, 2], False, -1)]),
            ([6], [([7, 7], True, 0)])]


def make_batch(episodes=EPISODES, seed: int = 0):
    from stppo_agent.rollouts.batch import Trajectory, to_batch

    trajectories = []
    for number, (prompt, pieces) in enumerate(episodes):
        t = Trajectory(env=None, group_id=number // 2, prompt_ids=list(prompt), reward=float(number % 2))
        for ids, policy, turn in pieces:
            t.append(ids, policy=policy, turn=turn)
        trajectories.append(t)
    batch = to_batch(trajectories, pad_id=0)
    g = torch.Generator().manual_seed(seed)
    shape = batch.response_ids.shape
    batch.old_logprobs = -1.5 + 0.3 * torch.randn(shape, generator=g)
    batch.ref_logprobs = -1.5 + 0.3 * torch.randn(shape, generator=g)
    batch.advantages = torch.randn(shape, generator=g)
    batch.values = torch.randn(shape, generator=g)
    batch.returns = torch.randn(shape, generator=g)
    return batch


# -- ppo_update -----------------------------------------------------------------------------------------------

class Said(list):
    """What a stage said through its report or phase callback, in order."""

    def __call__(self, text: str) -> None:
        self.append(text)


def update_stage(algo: str = "ppo", critic: bool = True, lr: float = 0.1, **values):
    """The update stage over a real training state of tiny models with SGD optimizers at constant rates; its
    ``report`` and ``phase`` are :class:`Said` lists."""
    from pathlib import Path

    from stppo_agent.training.ppo_update import PPOUpdate
    from stppo_agent.training.stale_policy import StalePolicy
    from stppo_agent.training.state import TrainingState

    values = merged({"rollout": {"temperature": 0.7},
                     "optimizer": {"micro_batch_size": 2, "mini_batch_size": 4, "max_grad_norm": 1e6}}, values)
    cfg = config(algo=algo, **values)
    actor = tiny_lm(0)
    value_model = tiny_lm(1, critic=True) if critic else None
    actor_optimizer = torch.optim.SGD(actor.parameters(), lr=lr)
    critic_optimizer = torch.optim.SGD(value_model.parameters(), lr=lr) if critic else None
    state = TrainingState(
        tokenizer=None, actor=actor, actor_optimizer=actor_optimizer,
        actor_scheduler=torch.optim.lr_scheduler.LambdaLR(actor_optimizer, lambda step: 1.0),
        stale_policy=StalePolicy(actor, 0), critic=value_model, critic_optimizer=critic_optimizer,
        critic_scheduler=torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lambda step: 1.0) if critic else None)
    return PPOUpdate(state, cfg, cfg.algorithm_config(), run_dir=Path("runs/ppo"), report=Said(), phase=Said())


# -- resampling -------------------------------------------------------------------------------------------------

def group_batch(groups):
    """One trajectory per reward, ``groups`` = [(group_id, [rewards])]."""
    from stppo_agent.rollouts.batch import Trajectory, to_batch

    trajectories = []
    for gid, rewards in groups:
        for reward in rewards:
            t = Trajectory(env=None, group_id=gid, prompt_ids=[3], reward=reward)
            t.append([4, 5][: 1 + gid % 2], policy=True, turn=0)
            trajectories.append(t)
    return to_batch(trajectories, pad_id=0)


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


class RecordedBar:
    """A tqdm bar that records what it is told (see :func:`record_bars`)."""

    def __init__(self, iterable=None, **kwargs):
        self.iterable, self.kwargs, self.disable = iterable, kwargs, kwargs.get("disable", False)
        self.updates, self.postfixes, self.phases, self.refreshed, self.closed = [], [], [], [], False

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n):
        self.updates.append(n)

    def set_postfix(self, **values):
        self.postfixes.append(values)

    def set_postfix_str(self, text, refresh):
        self.phases.append(text)
        self.refreshed.append(refresh)

    def close(self):
        self.closed = True


def record_bars(monkeypatch, desc: str) -> list[RecordedBar]:
    """The bars named ``desc`` that ``tqdm.auto.tqdm`` makes from now on, recorded; transformers' loading bars go
    on through the real one."""
    import tqdm.auto

    bars, real = [], tqdm.auto.tqdm

    def make(*args, **kwargs):
        if kwargs.get("desc") != desc:
            return real(*args, **kwargs)
        bars.append(RecordedBar(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(tqdm.auto, "tqdm", make)
    return bars
