"""``stppo_agent.training.state``: the training state's one save/load pair -- a resume
puts back everything a checkpoint holds, a rollback the weights and optimizers at the lowered learning rate, and
every rank's random streams."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs import checkpoint as ck
from stppo_agent.runs.checkpoint import load_trainer_state
from stppo_agent.training.config import TrainConfig, from_dict, merged
from stppo_agent.training.live_rollouts import PromptSampler
from stppo_agent.training.model_setup import build_state
from stppo_agent.training.state import Restore, TrainingState
from tests.support.checkpoints import checkpoint_of, fake_run, manifest, resume, save
from tests.support.training_parts import config


def disturb(state) -> None:
    """Other optimizer moments and schedule positions than the saved state's."""
    for module, optimizer, scheduler in ((state.actor, state.actor_optimizer, state.actor_scheduler),
                                         (state.critic, state.critic_optimizer, state.critic_scheduler)):
        if optimizer is not None:
            module(torch.full((1, 2), 5.0)).sum().backward()
            optimizer.step()
            scheduler.last_epoch = 0


def test_checkpoint_states_hold_the_counters_the_config_and_every_optimizer(tmp_path):
    from stppo_agent.runs.trainer_state import run_config

    state, config = fake_run(tmp_path)
    tensors, saved = state.states(config, config.algorithm_config())
    assert {"actor_optimizer", "actor_scheduler", "torch_rng", "critic_optimizer", "critic_scheduler"} <= set(tensors)
    assert "stale_policy" not in tensors
    assert torch.equal(tensors["torch_rng"], torch.get_rng_state())
    assert tensors["actor_scheduler"]["last_epoch"] == 2 and tensors["critic_scheduler"]["base_lrs"] == [0.02]
    assert set(tensors["actor_optimizer"]["state"]) == {"weight", "bias"}
    assert {k: saved[k] for k in ("iteration", "optimizer_steps", "nan_skips_total", "sampler", "algo", "model",
                                  "actor_lr_scale")} == {
        "iteration": 6, "optimizer_steps": 13, "nan_skips_total": 2, "sampler": {"position": 42}, "algo": "ppo",
        "model": "tiny-model", "actor_lr_scale": 0.25}
    assert saved["config"] == run_config(config, config.algorithm_config())
    assert saved["config"]["optimizer"]["actor_lr"] == 0.01
    assert saved["config"]["algorithm"]["use_critic"] is True  # every algorithm field resolved
    json.dumps(saved)  # the random states are JSON
    grpo, grpo_config = fake_run(tmp_path, critic=False, rollout=dict(staleness=1))
    tensors, _ = grpo.states(grpo_config, grpo_config.algorithm_config())
    assert "critic_optimizer" not in tensors and "critic_scheduler" not in tensors
    assert tensors["stale_policy"]["model"]["w"].tolist() == [3.0, 3.0]


def test_resume_puts_back_optimizers_schedules_streams_counters_and_the_sampler(tmp_path):
    import random

    import numpy as np

    saved, _ = run = fake_run(tmp_path, rollout=dict(staleness=1))
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    folder = checkpoint_of(run, tmp_path / "run")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    fresh, _ = again = fake_run(tmp_path, rollout=dict(staleness=1))
    fresh.iteration, fresh.optimizer_steps, fresh.nan_skips_total, fresh.actor_lr_scale = 0, 0, 0, 1.0
    disturb(fresh)
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    messages = resume(again, folder)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert (fresh.iteration, fresh.optimizer_steps, fresh.nan_skips_total) == (6, 13, 2)
    assert fresh.sampler.loaded == {"position": 42} and fresh.stale_policy.loaded["model"]["w"].tolist() == [3.0, 3.0]
    assert fresh.stale_policy.loaded["pending"][0]["w"].tolist() == [4.0, 4.0]
    assert fresh.stale_policy.loaded["pending_from_actor"]
    for name in ("actor", "critic"):
        old, new = getattr(saved, f"{name}_optimizer"), getattr(fresh, f"{name}_optimizer")
        model = getattr(fresh, name)
        assert torch.equal(new.state[model.weight]["exp_avg"], old.state[getattr(saved, name).weight]["exp_avg"])
        assert getattr(fresh, f"{name}_scheduler").last_epoch == 2
    assert fresh.actor_lr_scale == 0.25
    assert fresh.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25 / 3)
    assert fresh.critic_optimizer.param_groups[0]["lr"] == pytest.approx(0.02 / 3)
    assert fresh.actor_optimizer.param_groups[0]["weight_decay"] == 0.05
    assert messages[0] == f"resumed from {folder} (iteration 6, 13 optimizer steps)"
    assert messages[1] == "actor learning rate 0.0025: optimizer.actor_lr 0.01 x0.25 from the run's rollbacks"
    assert len(messages) == 2


def test_a_resume_with_a_new_actor_lr_uses_it_as_given_and_says_so(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path, logging=dict(save_rollouts=True)), tmp_path / "run")
    fresh, _ = again = fake_run(tmp_path, optimizer=dict(actor_lr=0.5), logging=dict(save_rollouts=True))
    messages = resume(again, folder)
    assert fresh.actor_lr_scale == 1.0
    assert fresh.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.5 / 3)
    assert fresh.actor_scheduler.base_lrs == [0.5] and fresh.actor_optimizer.param_groups[0]["initial_lr"] == 0.5
    assert messages[1] == "changed since the checkpoint: optimizer.actor_lr 0.01 -> 0.5"
    assert messages[2] == ("optimizer.actor_lr 0.5 is the rate used from now on (the rollbacks' x0.25 applied to "
                           "the old one)")
    assert messages[3] == ("this run records its rollouts, and stppo replay applies one config (the one in "
                           "config.yaml) to every iteration: a replay will not reproduce the iterations before "
                           "this change exactly")
    assert len(messages) == 4


@pytest.mark.parametrize("change,warned", [({"iterations": 12, "checkpoint": {"every": 3, "keep": 5}}, False),
                                           ({"iterations": 12, "optimizer": {"epochs": 2}}, True)])
def test_a_recording_run_warns_about_replays_only_for_changes_a_replay_would_see(tmp_path, change, warned):
    # running longer or checkpointing more often leaves every recorded iteration's update as it was; more epochs
    # does not
    folder = checkpoint_of(fake_run(tmp_path, logging=dict(save_rollouts=True)), tmp_path / "run")
    messages = resume(fake_run(tmp_path, **change, logging=dict(save_rollouts=True)), folder)
    assert messages[1].startswith("changed since the checkpoint: iterations 100 -> 12")
    assert any("a replay will not reproduce" in m for m in messages) == warned


def test_a_resume_with_nothing_changed_and_no_rollback_says_only_where_it_resumed(tmp_path):
    saved, _ = run = fake_run(tmp_path, logging=dict(save_rollouts=True))
    saved.actor_lr_scale = 1.0
    folder = checkpoint_of(run, tmp_path / "run")
    fresh, _ = again = fake_run(tmp_path, logging=dict(save_rollouts=True))
    messages = resume(again, folder)
    assert fresh.actor_lr_scale == 1.0 and len(messages) == 1
    assert fresh.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.01 / 3)


def test_an_old_checkpoint_without_a_recorded_scale_takes_it_from_its_schedule(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")  # its schedule's base rate is actor_lr x 0.25
    saved = json.loads((folder / "trainer_state.json").read_text())
    del saved["actor_lr_scale"]
    (folder / "trainer_state.json").write_text(json.dumps(saved))
    (folder / "manifest.json").unlink()
    ck._write_manifest(folder)
    fresh, _ = again = fake_run(tmp_path)
    resume(again, folder)
    assert fresh.actor_lr_scale == pytest.approx(0.25)
    del saved["config"]  # older still: no config either, the run's config.yaml is gone, the current rate is used
    (folder / "trainer_state.json").write_text(json.dumps(saved))
    (folder / "manifest.json").unlink()
    ck._write_manifest(folder)
    fresh, _ = again = fake_run(tmp_path, optimizer=dict(actor_lr=0.0025))
    resume(again, folder)
    assert fresh.actor_lr_scale == pytest.approx(1.0)


def test_apply_learning_rates_scales_the_actor_only_at_the_schedules_step(tmp_path):
    state, config = fake_run(tmp_path, optimizer=dict(actor_lr=0.4, critic_lr=0.6, weight_decay=0.125))
    state.actor_lr_scale = 0.5
    state.apply_learning_rates(config)
    actor, critic = state.actor_optimizer.param_groups[0], state.critic_optimizer.param_groups[0]
    assert (actor["initial_lr"], actor["lr"], actor["weight_decay"]) == (0.2, pytest.approx(0.2 / 3), 0.125)
    assert (critic["initial_lr"], critic["lr"], critic["weight_decay"]) == (0.6, pytest.approx(0.6 / 3), 0.125)
    assert state.actor_scheduler.base_lrs == [0.2] and state.critic_scheduler.base_lrs == [0.6]
    assert state.actor_scheduler.get_last_lr() == [actor["lr"]]
    state.actor_scheduler.step()
    assert actor["lr"] == pytest.approx(0.2 / 4)
    grpo, grpo_config = fake_run(tmp_path, critic=False)
    grpo.apply_learning_rates(grpo_config)
    assert grpo.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25 / 3)


def test_restore_optimizers_puts_back_both_optimizers_and_schedules(tmp_path):
    saved, config = fake_run(tmp_path)
    tensors, _ = saved.states(config, config.algorithm_config())
    fresh, _ = fake_run(tmp_path)
    disturb(fresh)
    fresh.restore_optimizers(tensors)
    assert torch.equal(fresh.actor_optimizer.state[fresh.actor.weight]["exp_avg_sq"],
                       saved.actor_optimizer.state[saved.actor.weight]["exp_avg_sq"])
    assert torch.equal(fresh.critic_optimizer.state[fresh.critic.bias]["exp_avg"],
                       saved.critic_optimizer.state[saved.critic.bias]["exp_avg"])
    assert fresh.actor_scheduler.last_epoch == 2 and fresh.critic_scheduler.last_epoch == 2


def test_a_gpu_runs_cuda_random_state_is_saved_and_put_back(tmp_path, monkeypatch):
    streams = [torch.tensor([1, 2, 3], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: streams)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    saved, config = run = fake_run(tmp_path)
    assert saved.states(config, config.algorithm_config())[0]["cuda_rng"] == streams
    folder = checkpoint_of(run, tmp_path / "run")
    resume(fake_run(tmp_path), folder)
    assert len(restored) == 1 and restored[0][0].tolist() == [1, 2, 3]


def test_with_two_processes_the_checkpoint_holds_rank_1s_streams_and_rank_1_resumes_them_silently(tmp_path,
                                                                                                   monkeypatch):
    import random

    from stppo_agent.distributed import process_group

    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, local])
    saved, config = run = fake_run(tmp_path)
    random.seed(5)
    tensors, state = saved.states(config, config.algorithm_config())
    assert len(tensors["rank_rng"]) == 2 and len(state["rank_rng"]) == 2
    folder = checkpoint_of(run, tmp_path / "run")
    expected = random.random()
    monkeypatch.setattr(process_group, "rank", lambda: 1)
    fresh, _ = again = fake_run(tmp_path)
    random.seed(0)
    messages = resume(again, folder)
    assert random.random() == expected and fresh.iteration == 6
    assert messages == []  # rank 0 says what was resumed


def test_resume_itself_refuses_turning_recording_on_mid_run(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")
    with pytest.raises(ValueError, match="cannot change logging.save_rollouts .*iterations 1..6"):
        resume(fake_run(tmp_path, logging=dict(save_rollouts=True)), folder)


def test_a_newer_checkpoint_is_written_even_when_an_older_ones_optimizer_file_already_vanished(tmp_path):
    newest = {"checkpoint": {"optimizer": "newest"}}
    older = save(tmp_path, 1, config=newest)
    (older / ck.OPTIMIZER_FILE).unlink()  # still listed: the drop only has the manifest entry left to remove
    save(tmp_path, 2, config=newest)
    assert ck.OPTIMIZER_FILE not in manifest(older) and ck.valid_checkpoints(tmp_path) == [1, 2]


def without_recorded_scale(folder: Path) -> None:
    state = json.loads((folder / "trainer_state.json").read_text())
    del state["actor_lr_scale"]
    (folder / "trainer_state.json").write_text(json.dumps(state))
    (folder / "manifest.json").unlink()
    ck._write_manifest(folder)


def test_an_old_checkpoints_scale_is_measured_against_its_own_actor_lr_not_the_new_one(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")  # actor_lr 0.01, schedule at 0.0025
    without_recorded_scale(folder)
    fresh, _ = again = fake_run(tmp_path, optimizer=dict(actor_lr=0.02))
    messages = resume(again, folder)
    assert fresh.actor_lr_scale == 1.0
    assert messages[2] == ("optimizer.actor_lr 0.02 is the rate used from now on (the rollbacks' x0.25 applied to "
                           "the old one)")


def test_a_frozen_actor_without_a_recorded_scale_resumes_at_scale_1(tmp_path):
    folder = checkpoint_of(fake_run(tmp_path, optimizer=dict(actor_lr=0.0)), tmp_path / "run")
    without_recorded_scale(folder)
    fresh, _ = again = fake_run(tmp_path, optimizer=dict(actor_lr=0.0))
    messages = resume(again, folder)
    assert fresh.actor_lr_scale == 1.0 and len(messages) == 1


def test_a_new_actor_lr_without_rollbacks_is_only_listed_as_a_change(tmp_path):
    saved, _ = run = fake_run(tmp_path)
    saved.actor_lr_scale = 1.0
    folder = checkpoint_of(run, tmp_path / "run")
    messages = resume(fake_run(tmp_path, optimizer=dict(actor_lr=0.5)), folder)
    assert messages[1:] == ["changed since the checkpoint: optimizer.actor_lr 0.01 -> 0.5"]


def test_a_gpu_checkpoint_resumes_on_a_machine_without_cuda(tmp_path, monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(2, dtype=torch.uint8)])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    saved, config = run = fake_run(tmp_path)
    assert "cuda_rng" in saved.states(config, config.algorithm_config())[0]
    folder = checkpoint_of(run, tmp_path / "run")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fresh, _ = again = fake_run(tmp_path)
    resume(again, folder)
    assert restored == [] and fresh.iteration == 6


def test_rank_1_of_a_checkpoint_written_by_one_process_starts_a_fresh_stream_and_says_so(tmp_path, monkeypatch):
    from stppo_agent.distributed import process_group

    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")
    monkeypatch.setattr(process_group, "rank", lambda: 1)
    monkeypatch.setattr(process_group, "seed_everything", lambda seed: None)
    messages = resume(fake_run(tmp_path), folder)
    assert len(messages) == 1 and messages[0].startswith(
        "rank 1: the checkpoint holds no random state for this rank (written by 1 process(es))")


# The training state's one save/load pair: a resume puts back everything a checkpoint holds, bit for bit (the state
# saved again equals the state saved), and a rollback puts back the weights, the optimizers and the lagged generator
# at the run's lowered learning rate while the counters, the prompt position and the random streams go on.


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer(), hidden=8, layers=1)


def run_config(model: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(algo="ppo", env="stppo/Toy-v0", model=str(model), output_dir=str(out),
                  algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.0}, rollout=dict(staleness=1),
                  optimizer=dict(actor_lr=1e-2, critic_lr=2e-2, warmup_steps=4),
                  logging=dict(progress=False, tensorboard=False))
    values = merged(values, overrides)
    return from_dict(values)


def state_of(config: TrainConfig, checkpoint: Path | None = None) -> TrainingState:
    state = build_state(config, config.algorithm_config(), torch.device("cpu"), False, checkpoint, report=print)
    state.sampler = PromptSampler([5, 3], seed=config.seed)
    return state


def trained(state: TrainingState, steps: int = 3) -> TrainingState:
    """``steps`` optimizer steps of both models on arbitrary losses, the lag advanced, counters and the prompt
    position moved."""
    ids = torch.tensor([[3, 4, 5, 6]])
    for _ in range(steps):
        for model, optimizer, scheduler in ((state.actor, state.actor_optimizer, state.actor_scheduler),
                                            (state.critic, state.critic_optimizer, state.critic_scheduler)):
            optimizer.zero_grad()
            model(input_ids=ids).logits.float().pow(2).mean().backward()
            optimizer.step()
            scheduler.step()
        state.stale_policy.advance(state.actor)
        state.iteration += 1
        state.optimizer_steps += 1
    state.nan_skips_total, state.actor_lr_scale = 2, 0.5
    state.sampler.take(4)
    return state


def differences(a, b, where: str = "") -> list[str]:
    """Where nested states (dicts, lists, tuples of tensors and plain values) differ, bit for bit (a list and a
    tuple of equal items are equal: a state loaded from disk holds lists)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [where]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}/{i}")]
    return [] if a == b else [where]


def equal(a, b) -> bool:
    return not differences(a, b)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_a_resumed_state_saves_what_the_saved_one_saved(tiny_model, tmp_path):
    config = run_config(tiny_model, tmp_path / "run")
    algo = config.algorithm_config()
    saved = trained(state_of(config))
    saved.apply_learning_rates(config)  # a rollback's scale is in the rates when it is saved
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    folder = saved.save(tmp_path / "run", config, algo, sharded=False)
    assert folder == tmp_path / "run" / "checkpoints" / "step-3"
    before = saved.states(config, algo)  # the streams are as they were at the save
    draws = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))

    resumed = state_of(config, folder)  # the models are built from the checkpoint, as a resume builds them
    assert (resumed.iteration, resumed.optimizer_steps, resumed.actor_lr_scale) == (0, 0, 1.0)
    torch.manual_seed(0)
    messages = []
    resumed.load(folder, config, algo, Restore.RESUME, messages.append)
    assert (torch.rand(2).tolist(), random.random(), float(np.random.rand())) == draws
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    after = resumed.states(config, algo)
    assert differences(after[0], before[0]) == []  # optimizers, schedules, lagged generator, torch streams
    assert after[1] == before[1]  # counters, prompt position, Python / NumPy streams, config, scale
    assert (resumed.iteration, resumed.optimizer_steps, resumed.nan_skips_total) == (3, 3, 2)
    assert resumed.sampler.state() == saved.sampler.state() == {"epoch": 0, "cursor": 4}
    assert resumed.actor_lr_scale == 0.5 and resumed.nan_skips_in_a_row == 0  # not saved: counted afresh
    assert equal(weights(resumed.actor), weights(saved.actor)) and equal(weights(resumed.critic), weights(saved.critic))
    assert equal(weights(resumed.stale_policy.model), weights(saved.stale_policy.model))
    assert resumed.actor_optimizer.param_groups[0]["lr"] == saved.actor_optimizer.param_groups[0]["lr"]
    assert messages[0] == f"resumed from {folder} (iteration 3, 3 optimizer steps)"


def test_a_rollback_restores_weights_optimizers_and_the_lag_and_nothing_else(tiny_model, tmp_path):
    config = run_config(tiny_model, tmp_path / "run")
    algo = config.algorithm_config()
    saved = trained(state_of(config))
    saved.actor_lr_scale = 1.0
    folder = saved.save(tmp_path / "run", config, algo, sharded=False)
    kept = (weights(saved.actor), weights(saved.critic), weights(saved.stale_policy.model),
            load_trainer_state(folder)[0])
    trained(saved, steps=2)  # the run goes on past the checkpoint (and collapses)
    saved.iteration, saved.optimizer_steps = 9, 11
    saved.actor_lr_scale = 0.25  # two rollbacks' factor, lowered before the load
    position, streams = saved.sampler.state(), torch.get_rng_state()
    saved.load(folder, config, algo, Restore.ROLLBACK)
    assert equal(weights(saved.actor), kept[0]) and equal(weights(saved.critic), kept[1])
    assert equal(weights(saved.stale_policy.model), kept[2])
    now = saved.states(config, algo)[0]
    assert equal(now["actor_optimizer"]["state"], kept[3]["actor_optimizer"]["state"])
    assert equal(now["critic_optimizer"]["state"], kept[3]["critic_optimizer"]["state"])
    assert now["actor_scheduler"]["last_epoch"] == kept[3]["actor_scheduler"]["last_epoch"] == 3
    # the run's rate, at the checkpoint's schedule step: actor_lr x 0.25 x warm-up (step 3 of 4)
    assert saved.actor_optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25 * 1.0)
    assert saved.actor_scheduler.base_lrs == [pytest.approx(2.5e-3)]
    assert saved.critic_optimizer.param_groups[0]["lr"] == pytest.approx(2e-2)  # the critic's is not lowered
    assert (saved.iteration, saved.optimizer_steps, saved.actor_lr_scale) == (9, 11, 0.25)
    assert saved.sampler.state() == position and torch.equal(torch.get_rng_state(), streams)


def test_save_hands_the_gathered_states_and_the_protected_steps(monkeypatch, tmp_path):
    import stppo_agent.training.state as state_module
    from tests.support.training_states import linear_state

    saved = []
    monkeypatch.setattr(state_module, "save_checkpoint", lambda run_dir, iteration, **kw: saved.append(
        (run_dir, iteration, kw)) or run_dir / "saved")
    monkeypatch.setattr(state_module.TrainingState, "states", lambda self, config, algo: ("tensors", "json"))
    state = linear_state(iteration=7)
    state.tokenizer, state.critic = "tok", torch.nn.Linear(1, 1)
    gathered = {id(state.actor): "full actor", id(state.critic): "full critic"}
    monkeypatch.setattr(state_module, "full_model_state", lambda model: gathered[id(model)])
    cfg = config(checkpoint=dict(keep=3))
    assert state.save(tmp_path, cfg, cfg.algorithm_config(), sharded=True, protect=(2, 4)) == tmp_path / "saved"
    assert saved == [(tmp_path, 7, dict(actor=state.actor, tokenizer="tok", critic=state.critic,
                                        tensor_state="tensors", json_state="json", keep=3, actor_state="full actor",
                                        critic_state="full critic", protect=(2, 4)))]
    state.critic = None
    assert state.full_states(True) == ("full actor", None)
    state.save(tmp_path, cfg, cfg.algorithm_config(), sharded=True)
    assert saved[-1][2]["protect"] == () and saved[-1][2]["critic_state"] is None
    assert state.full_states(False) == (None, None)
