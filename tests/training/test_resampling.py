"""``stppo_agent.training.resampling``: DAPO's dynamic sampling in the live
rollouts -- uninformative groups replaced by resampled ones up to a cap, the batch keeping its shape, what was
dropped logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stppo_agent.algorithms import informative_groups
from stppo_agent.distributed.process_group import free_port
from stppo_agent.rollouts.batch import Trajectory, to_batch
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import merged
from stppo_agent.training.resampling import keep_informative_groups
from stppo_agent.training.trainer import Trainer
from tests.support.gloo_ranks import gloo_rank, start_ranks
from tests.support.runs import toy_config
from tests.support.training_parts import group_batch


def groups_batch(rewards_by_group: dict[int, list[float]]):
    trajectories = []
    for group, rewards in rewards_by_group.items():
        for reward in rewards:
            t = Trajectory(env=None, group_id=group, prompt_ids=[1, 2], reward=reward)
            t.append([3, 4], policy=True, turn=0, logprobs=[-1.0, -1.0])
            trajectories.append(t)
    return to_batch(trajectories, pad_id=0)


def test_uninformative_groups_are_replaced_by_resampled_ones_in_sampling_order():
    first = groups_batch({0: [1.0, 1.0], 1: [0.0, 1.0]})
    rounds = {1: groups_batch({10: [0.0, 0.0], 11: [1.0, 0.0]})}
    batch = keep_informative_groups(first, rounds.__getitem__, max_rounds=3, pad_id=0)
    assert batch.group_ids.tolist() == [1, 1, 11, 11]
    assert bool(informative_groups(batch.rewards, batch.group_ids).all())
    assert batch.stats["dynamic_sampling/rounds"] == 1.0
    assert batch.stats["dynamic_sampling/dropped_frac"] == 2 / 4
    assert batch.stats["reward"] == first.stats["reward"]  # the iteration's own prompts, unfiltered


def test_the_cap_stops_resampling_and_dropped_groups_fill_the_batch():
    played = []

    def play(round_number):
        played.append(round_number)
        return groups_batch({100 + round_number: [1.0, 1.0]})

    first = groups_batch({0: [0.0, 0.0], 1: [1.0, 0.0]})
    batch = keep_informative_groups(first, play, max_rounds=2, pad_id=0)
    assert played == [1, 2]
    assert batch.batch_size == first.batch_size and batch.group_ids.tolist() == [1, 1, 0, 0]
    assert batch.stats["dynamic_sampling/rounds"] == 2.0
    assert batch.stats["dynamic_sampling/dropped_frac"] == 3 / 4


def test_a_full_first_round_samples_nothing_more():
    first = groups_batch({0: [0.0, 1.0], 1: [1.0, 0.0]})
    batch = keep_informative_groups(first, lambda r: pytest.fail("resampled"), max_rounds=5, pad_id=0)
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and batch.stats["dynamic_sampling/rounds"] == 0.0


# per rank: the first round, then what each extra round plays. Rank 0 is full at once, rank 1 finds its second
# informative group only in the second extra round.
RANK_ROUNDS = {0: [{0: [0.0, 1.0], 1: [1.0, 0.0]}, {10: [1.0, 0.0]}, {11: [0.0, 1.0]}, {12: [0.0, 1.0]}],
               1: [{2: [1.0, 1.0], 3: [0.0, 1.0]}, {20: [1.0, 1.0]}, {21: [0.0, 1.0]}, {22: [1.0, 0.0]}]}


def _two_rank_main(rank: int, port: int, out: str) -> None:
    with gloo_rank(rank, port):
        played = []

        def play(round_number):
            played.append(round_number)
            return groups_batch(RANK_ROUNDS[rank][round_number])

        batch = keep_informative_groups(groups_batch(RANK_ROUNDS[rank][0]), play, max_rounds=3, pad_id=0)
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"played": played, "groups": batch.group_ids.tolist(), "stats": batch.stats}))


def test_ranks_take_extra_rounds_together_until_every_rank_is_full(tmp_path):
    """Rank 0 is full after its first round, rank 1 after two extra rounds: both play exactly two (the prompt
    sampler is shared, so a rank that plays alone would desynchronise it) and stop together, before the cap."""
    start_ranks(_two_rank_main, args=(free_port(), str(tmp_path)), nprocs=2)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["played"] == one["played"] == [1, 2]
    assert zero["groups"] == [0, 0, 1, 1]  # its own first round: informative already
    assert one["groups"] == [3, 3, 21, 21]  # 2 and 20 all-equal: dropped
    assert zero["stats"]["dynamic_sampling/rounds"] == one["stats"]["dynamic_sampling/rounds"] == 2.0
    assert zero["stats"]["dynamic_sampling/dropped_frac"] == 0.0
    assert one["stats"]["dynamic_sampling/dropped_frac"] == 2 / 4


def test_dapo_trains_on_informative_groups_and_logs_what_it_dropped(tiny_model, tmp_path):
    seen = []
    config = toy_config(tiny_model, tmp_path, "dapo", iterations=3,
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=2),
                        optimizer=dict(mini_batch_size=8, micro_batch_size=4, epochs=1),
                        monitor=dict(on_collapse="none"))
    trainer = Trainer(config, report=lambda _: None, batch_hook=seen.append)
    assert trainer.algo.dynamic_sampling
    trainer.train()
    records = read_metrics(tmp_path)
    assert all("dynamic_sampling/rounds" in r and "dynamic_sampling/dropped_frac" in r for r in records)
    assert any(r["dynamic_sampling/dropped_frac"] > 0 for r in records)  # pairs of 2 often agree on a toy reward
    for batch, record in zip(seen, records):
        assert batch.batch_size == 8
        informative = informative_groups(batch.rewards, batch.group_ids)
        if record["dynamic_sampling/rounds"] < trainer.algo.max_resample_rounds:
            assert bool(informative.all())  # enough were found: only informative groups are trained on
        rows = torch.argsort(informative.float(), descending=True, stable=True)
        assert torch.equal(rows, torch.arange(8))  # informative groups first, fillers last


def test_zero_rounds_means_no_cap_as_in_verl():
    played = []

    def play(round_number):  # twelve rounds of groups that all agree, then an informative one
        played.append(round_number)
        return groups_batch({100 + round_number: [1.0, 1.0] if round_number < 13 else [0.0, 1.0]})

    first = groups_batch({0: [0.0, 0.0], 1: [1.0, 0.0]})
    batch = keep_informative_groups(first, play, max_rounds=0, pad_id=0)
    assert played == list(range(1, 14))
    assert batch.group_ids.tolist() == [1, 1, 113, 113] and batch.stats["dynamic_sampling/rounds"] == 13.0


def dapo_trainer(model: Path, out: Path, **overrides) -> Trainer:
    values = dict(iterations=1, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                  optimizer=dict(mini_batch_size=16, micro_batch_size=8, epochs=1, max_grad_norm=1e6),
                  monitor=dict(on_collapse="none"))  # gradients compared before any clipping
    return Trainer(toy_config(model, out, "dapo", **merged(values, overrides)), report=lambda _: None)


def test_every_resampling_round_passes_the_search_error_check(tiny_model, tmp_path):
    """The first round's searches all succeed but its groups all agree; the extra round that would fill the whole
    batch had every search fail: the run stops instead of training on it."""
    from stppo_envs.retrieval import RetrievalError

    trainer = dapo_trainer(tiny_model, tmp_path)
    play = trainer.source._play

    def failing_extra_rounds(iteration, round_number):
        batch = play(iteration, round_number)
        if round_number == 0:
            batch.rewards = torch.zeros_like(batch.rewards)
        else:
            batch.stats.update(search_calls=0.0, search_errors=1.0, search_error_rate=1.0)
        return batch

    trainer.source._play = failing_extra_rounds
    with pytest.raises(RetrievalError, match=r"^iteration 1, resampling round 1: 100% of the searches failed"):
        trainer.source.next_batch(0)


def step(trainer: Trainer, batch) -> tuple[dict, torch.Tensor]:
    """The update's metrics and actor gradient for one optimizer step over ``batch``."""
    metrics = trainer.actor_gradients(batch)
    grads = [p.grad.flatten() for p in trainer.state.actor.parameters() if p.grad is not None]
    return metrics, torch.cat(grads).clone()


def test_filler_groups_do_not_shrink_the_other_groups_step(tiny_model, tmp_path):
    """A batch whose first group is a filler (all rewards equal) steps exactly as the batch without it: the filler
    counts in no denominator."""
    trainer = dapo_trainer(tiny_model, tmp_path)
    batch = trainer.rollout()
    first = batch.group_ids == batch.group_ids[0]
    pattern = torch.arange(batch.batch_size) % 2  # 0, 1, 0, 1 within every group of 4: informative
    batch.rewards = torch.where(first, 1.0, pattern.float())
    informative = batch.select(torch.nonzero(~first).flatten())
    trainer.score(batch)
    trainer.score(informative)
    with_filler, with_filler_gradient = step(trainer, batch)
    alone, alone_gradient = step(trainer, informative)
    torch.testing.assert_close(with_filler_gradient, alone_gradient, rtol=1e-5, atol=1e-8)
    assert with_filler["pg_loss"] == pytest.approx(alone["pg_loss"], rel=1e-5)
    assert with_filler["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)


def test_dynamic_sampling_with_a_critic_is_a_choice_and_allowed(tiny_model, tmp_path):
    # an all-equal group still has the critic's advantages; dropping it is what the demo asks for
    for algo in ("ppo", "st_ppo"):
        toy_config(tiny_model, tmp_path, algo, algorithm={"dynamic_sampling": True}).validate()


@pytest.mark.parametrize("overrides, message", [
    (dict(algo="dapo", rollout=dict(samples_per_prompt=1)),
     "algorithm.dynamic_sampling needs groups of >= 2 trajectories (a group of one never differs in reward, so "
     "every round would be dropped): set rollout.samples_per_prompt >= 2"),
])
def test_dynamic_sampling_is_refused_where_no_group_can_be_informative(tiny_model, tmp_path, overrides, message):
    config = toy_config(tiny_model, tmp_path, overrides.pop("algo"), **overrides)
    with pytest.raises(ValueError) as refused:
        config.validate()
    assert str(refused.value) == message


def test_the_cli_refuses_dynamic_sampling_with_groups_of_one(tiny_model, tmp_path, capsys):
    from tests.support.cli_in_process import stppo

    done = stppo("train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--model", str(tiny_model), "--output-dir",
                 str(tmp_path / "run"), "--iterations", "1", "--set", "algorithm.dynamic_sampling=true",
                 "--set", "rollout.samples_per_prompt=1", "--set", "rollout.max_turns=1", "--set",
                 "logging.progress=false", capsys=capsys)
    assert done.returncode == 1
    assert done.stderr.startswith("stppo train: error: algorithm.dynamic_sampling needs groups of >= 2 trajectories")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_uninformative_groups_are_replaced_until_the_batch_is_full():
    from stppo_agent.training.resampling import keep_informative_groups

    first = group_batch([(0, [1.0, 1.0]), (1, [0.0, 1.0]), (2, [0.0, 0.0])])
    first.stats = {"reward": 0.5}
    rounds = {1: group_batch([(10, [1.0, 1.0]), (11, [1.0, 0.0])]),
              2: group_batch([(20, [0.0, 1.0]), (21, [0.5, 0.0])])}
    played = []
    batch = keep_informative_groups(first, lambda r: played.append(r) or rounds[r], max_rounds=5, pad_id=0)
    assert played == [1, 2]
    assert batch.group_ids.tolist() == [1, 1, 11, 11, 20, 20]
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert batch.stats == {"reward": 0.5, "dynamic_sampling/rounds": 2.0, "dynamic_sampling/dropped_frac": 3 / 7}


def test_the_round_cap_fills_the_batch_with_dropped_groups_in_sampling_order():
    from stppo_agent.training.resampling import keep_informative_groups

    first = group_batch([(0, [1.0, 1.0]), (1, [0.0, 1.0]), (2, [0.0, 0.0])])
    more = group_batch([(10, [1.0, 1.0]), (11, [1.0, 0.0])])
    batch = keep_informative_groups(first, lambda r: more, max_rounds=1, pad_id=0)
    assert batch.group_ids.tolist() == [1, 1, 11, 11, 0, 0]
    assert batch.stats["dynamic_sampling/rounds"] == 1.0
    assert batch.stats["dynamic_sampling/dropped_frac"] == 3 / 5
    played = []
    uncapped = keep_informative_groups(  # 0: no cap (verl's meaning): rounds until the batch is full
        first, lambda r: played.append(r) or group_batch([(10 * r + 1, [0.0, 1.0])]), max_rounds=0, pad_id=0)
    assert played == [1, 2] and uncapped.group_ids.tolist() == [1, 1, 11, 11, 21, 21]
    assert uncapped.stats["dynamic_sampling/rounds"] == 2.0
    assert uncapped.stats["dynamic_sampling/dropped_frac"] == 2 / 5
    full = group_batch([(0, [1.0, 0.0]), (1, [0.0, 1.0])])
    kept = keep_informative_groups(full, lambda r: pytest.fail("the batch is full"), max_rounds=3, pad_id=0)
    assert kept.group_ids.tolist() == [0, 0, 1, 1] and kept.stats["dynamic_sampling/dropped_frac"] == 0.0
