"""GRPO and RLOO apply ``kl_in_reward`` (issue 30, item 4): the per-token KL penalty is subtracted from the outcome
reward before the group baseline, as verl does (its token-level rewards, penalty included, summed per sequence)."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.algorithms import ALGORITHMS, get_advantage_estimator


def group_of_three(kl_per_token: list[float]):
    mask = torch.tensor([[True, True, False, True]] * 3)
    rewards = torch.tensor([1.0, 1.0, 0.0])
    penalty = torch.tensor(kl_per_token).unsqueeze(1) * mask
    return dict(rewards=rewards, values=None, loss_mask=mask, group_ids=torch.tensor([7, 7, 7])), penalty


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_a_higher_kl_trajectory_gets_a_lower_advantage(name):
    estimator, config = get_advantage_estimator(name), ALGORITHMS["grpo"]
    inputs, penalty = group_of_three([0.0, 0.1, 0.0])  # the first two earned the same reward; the second drifted
    plain, _ = estimator(**inputs, config=config)
    penalised, returns = estimator(**inputs, config=config, kl_penalty=penalty)
    assert float(plain[0, 0]) == float(plain[1, 0])
    assert float(penalised[1, 0]) < float(penalised[0, 0])
    assert not torch.equal(plain, penalised) and torch.equal(penalised, returns)
    assert (penalised[~inputs["loss_mask"]] == 0).all()
    # the penalty is summed over the policy tokens: the scores are R - 3 * 0.1 for the drifting trajectory
    scores = torch.tensor([1.0, 1.0 - 0.3, 0.0])
    if name == "grpo":
        expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    else:
        expected = scores - (scores.sum() - scores) / 2
    torch.testing.assert_close(penalised[:, 0], expected)


def test_a_kl_penalty_of_zero_changes_nothing_and_a_uniform_one_cancels_in_the_baseline():
    estimator, config = get_advantage_estimator("grpo"), ALGORITHMS["grpo"]
    inputs, zero = group_of_three([0.0, 0.0, 0.0])
    plain, _ = estimator(**inputs, config=config)
    assert torch.equal(estimator(**inputs, config=config, kl_penalty=zero)[0], plain)
    _, uniform = group_of_three([0.2, 0.2, 0.2])
    torch.testing.assert_close(estimator(**inputs, config=config, kl_penalty=uniform)[0], plain)


def test_the_trainer_feeds_the_penalty_to_grpo(tmp_path):
    """``--algo grpo --set algorithm.kl_in_reward=...`` changes the advantages of a real batch."""
    import dataclasses

    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
    from stppo_agent.training.trainer import Trainer

    from .test_trainer import toy_config

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    trainer = Trainer(toy_config(model, tmp_path / "run", "grpo", iterations=1,
                                 algorithm={"kl_in_reward": 5.0, "kl_loss_coef": 0.0, "grpo_std_normalize": False},
                                 rollout=dict(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens_per_turn=3,
                                              max_total_tokens=40),
                                 optimizer=dict(mini_batch_size=8, micro_batch_size=8),
                                 monitor=dict(on_collapse="none")))
    with torch.no_grad():  # a reference away from the actor, so that the KL is not 0
        for parameter in trainer.state.reference.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    torch.manual_seed(0)
    batch = trainer.rollout()
    penalised, plain = batch.select(range(batch.batch_size)), batch.select(range(batch.batch_size))
    trainer.score(penalised)
    trainer.algo = dataclasses.replace(trainer.algo, kl_in_reward=0.0)
    trainer.score(plain)
    mask = batch.loss_mask
    assert not torch.allclose(penalised.advantages[mask], plain.advantages[mask])
    # Dr. GRPO (no std division): each advantage moves by -(K_b - mean_g K), K_b its summed penalty
    kl = torch.where(mask, penalised.old_logprobs - penalised.ref_logprobs, 0.0).sum(1)
    shift = penalised.advantages.sum(1) / mask.sum(1) - plain.advantages.sum(1) / mask.sum(1)
    for group in batch.group_ids.unique():
        rows = (batch.group_ids == group).nonzero().flatten()
        most, least = rows[kl[rows].argmax()], rows[kl[rows].argmin()]
        if float(kl[most] - kl[least]) > 1e-3:
            assert float(shift[most]) < float(shift[least])
