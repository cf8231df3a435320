"""``stppo_agent.training.ppo_update``: mini-batches and accumulation, gradient
clipping and where the clip-bias scale applies, the critic step, skipped non-finite steps and what the iteration's
means keep of them, the global batch over ranks."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stppo_agent.algorithms import get_policy_loss
from stppo_agent.algorithms.clip_bias import changed_update
from stppo_agent.training.log_probs import token_logprobs
from tests.support.training_parts import make_batch, update_stage


def reference_actor_grads(t, mini):
    """The gradient of the policy loss over the whole mini-batch in one forward (no accumulation)."""
    from stppo_agent.algorithms import get_policy_loss
    from stppo_agent.training.log_probs import token_logprobs

    t.state.actor.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs(t.state.actor, mini, with_entropy=True, entropy_grad=t.algo.entropy_coef > 0,
                                       sampling=t.config.sampling())
    loss, _, metrics = get_policy_loss(t.algo.policy_loss)(
        logprobs=logprobs, old_logprobs=mini.old_logprobs, advantages=mini.advantages, loss_mask=mini.loss_mask,
        turn_ids=mini.turn_ids, config=t.algo, ref_logprobs=mini.ref_logprobs if t.algo.kl_loss_coef > 0 else None,
        entropy=entropy, global_num_tokens=mini.loss_mask.sum().float(),
        global_num_seqs=mini.loss_mask.any(1).sum().float())
    loss.backward()
    grads = [p.grad.clone() for p in t.state.actor.parameters()]
    t.state.actor.zero_grad(set_to_none=True)
    return grads, metrics


@pytest.mark.parametrize("algo, algorithm", [
    ("ppo", {"kl_loss_coef": 0.3, "entropy_coef": 0.05, "clip_low": 0.05, "clip_high": 0.05}),
    ("grpo", {"kl_loss_coef": 0.0, "loss_agg": "seq-mean-token-mean"}),
    ("gspo", {})])
def test_accumulated_micro_batch_gradients_are_the_whole_mini_batch_gradient(algo, algorithm):

    t = update_stage(algo, algorithm=algorithm, optimizer=dict(micro_batch_size=1))
    mini = make_batch().select([0, 2, 3, 4])
    want, metrics = reference_actor_grads(t, mini)
    out = t.actor_gradients(mini)
    got = [p.grad for p in t.state.actor.parameters()]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-4)
    norm = torch.sqrt(sum((w ** 2).sum() for w in want))
    assert out["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert out["pg_loss"] == pytest.approx(float(metrics["pg_loss"]), rel=1e-4, abs=1e-6)


def test_gradients_are_clipped_to_max_grad_norm_and_the_norm_before_is_reported():

    t = update_stage(optimizer=dict(max_grad_norm=1e-3))
    mini = make_batch().select([0, 1, 2, 3])
    want, _ = reference_actor_grads(t, mini)
    out = t.actor_gradients(mini)
    norm = float(torch.sqrt(sum((w ** 2).sum() for w in want)))
    assert norm > 0.01 and out["grad_norm"] == pytest.approx(norm, rel=1e-4)
    after = float(torch.sqrt(sum((p.grad ** 2).sum() for p in t.state.actor.parameters())))
    assert after == pytest.approx(1e-3, rel=1e-3)


def test_a_clip_bias_corrected_step_is_the_same_whatever_the_micro_batch_size():

    mini = make_batch().select([0, 1, 2, 3])
    grads, outs = [], []
    for micro in (1, 4):
        t = update_stage("st_ppo", optimizer=dict(micro_batch_size=micro, mini_batch_size=4))
        assert t.algo.clip_bias_correction
        outs.append(t.actor_gradients(mini))
        grads.append([p.grad.clone() for p in t.state.actor.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert outs[0]["grad_norm"] == pytest.approx(outs[1]["grad_norm"], rel=1e-4)
    corrector_keys = {k for k in outs[0] if k not in ("grad_norm", "learner_kl_to_reference")} - set(
        reference_actor_grads(update_stage("st_ppo"), mini)[1])
    assert corrector_keys and all(outs[0][k] == pytest.approx(outs[1][k], rel=1e-4, abs=1e-7)
                                  for k in corrector_keys)
    measured = update_stage("ppo", logging=dict(step_diagnostics=True)).actor_gradients(mini)
    assert {"clip_bias_norm", "pg_grad_norm"} <= corrector_keys
    # with step diagnostics ||C|| is measured for every algorithm, but only S-PPO / ST-PPO rescale by it
    assert {"clip_bias_norm", "pg_grad_norm"} <= set(measured) and "clip_bias_scale" not in measured
    assert not corrector_keys & set(update_stage("ppo").actor_gradients(mini))


def test_the_critic_step_fits_the_returns_from_the_old_values():
    from stppo_agent.algorithms import value_loss
    from stppo_agent.training.log_probs import critic_values

    t = update_stage(optimizer=dict(micro_batch_size=1))
    mini = make_batch().select([0, 2, 3, 5])
    loss, metrics = value_loss(values=critic_values(t.state.critic, mini), old_values=mini.values, returns=mini.returns,
                               loss_mask=mini.loss_mask, config=t.algo, global_num_tokens=mini.loss_mask.sum().float())
    loss.backward()
    want = [p.grad.clone() for p in t.state.critic.parameters()]
    before = [p.detach().clone() for p in t.state.critic.parameters()]
    out = t._critic_step(mini)
    norm = float(torch.sqrt(sum((w ** 2).sum() for w in want)))
    assert out["critic_grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert out["value_loss"] == pytest.approx(float(metrics["value_loss"]), rel=1e-4)
    for p, b, w in zip(t.state.critic.parameters(), before, want):  # one SGD step of lr 0.1 on that gradient
        assert torch.allclose(p.detach(), b - 0.1 * w, atol=1e-6)


def test_the_critic_gradient_is_clipped():

    t = update_stage(optimizer=dict(max_grad_norm=1e-4))
    before = [p.detach().clone() for p in t.state.critic.parameters()]
    out = t._critic_step(make_batch().select([0, 1, 2, 3]))
    assert out["critic_grad_norm"] > 1e-3
    moved = math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(t.state.critic.parameters(), before)))
    assert moved == pytest.approx(0.1 * 1e-4, rel=1e-3)


def test_an_update_steps_epochs_times_mini_batches_in_a_seeded_order():

    t = update_stage(seed=3, optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=2))
    t.state.iteration = 2
    batch = make_batch()
    batch.group_ids = torch.arange(6)
    updater, seen = t, []
    step = updater._optimizer_step
    updater._optimizer_step = lambda mini: seen.append(mini.group_ids.tolist()) or step(mini)
    before = [p.detach().clone() for p in t.state.actor.parameters()]
    metrics = updater.update(batch)
    g = torch.Generator().manual_seed(3 + 2)
    orders = [torch.randperm(6, generator=g).tolist() for _ in range(2)]
    assert seen == [orders[0][:4], orders[0][4:], orders[1][:4], orders[1][4:]]
    assert t.state.optimizer_steps == 4 and t.phase == [f"update step {i}/4" for i in range(1, 5)]
    assert metrics["offpolicy/steps"] == 3.0  # every step after the first
    assert metrics["nan_skips_total"] == 0 and metrics["actor_lr"] == 0.1
    assert metrics["update_tokens_per_s"] > 0
    assert "value_loss" in metrics and "pg_loss" in metrics and "critic_grad_norm" in metrics
    assert any(not torch.equal(p.detach(), b) for p, b in zip(t.state.actor.parameters(), before))


def test_update_counts_the_policy_tokens_it_trained_on(monkeypatch):
    import stppo_agent.training.ppo_update as ppo_update

    t = update_stage(optimizer=dict(epochs=3, mini_batch_size=6, micro_batch_size=6))
    batch = make_batch()
    clock = iter([5.0, 5.5])  # half a second (a lower bound of one second on the time would show)
    monkeypatch.setattr(ppo_update.time, "perf_counter", lambda: next(clock))
    metrics = t.update(batch)
    assert metrics["update_tokens_per_s"] == pytest.approx(3 * int(batch.loss_mask.sum()) / 0.5)
    monkeypatch.undo()
    one_epoch = update_stage(critic=False, optimizer=dict(epochs=1, mini_batch_size=4, micro_batch_size=4))
    assert one_epoch.update(make_batch())["offpolicy/steps"] == 1.0  # only the first is on


def test_a_non_finite_step_is_skipped_then_the_run_stops():
    from stppo_agent.training.ppo_update import TrainingDivergedError

    t = update_stage(monitor=dict(max_nan_skips=1))
    updater = t
    bad = make_batch().select([0, 1, 2, 3])
    bad.advantages[0, 0] = math.nan
    before = [p.detach().clone() for p in t.state.actor.parameters()]
    out = updater._optimizer_step(bad)
    assert out["skipped"] == 1.0 and math.isnan(out["grad_norm"])
    assert t.state.optimizer_steps == 0 and t.state.nan_skips_in_a_row == 1 and t.state.nan_skips_total == 1
    assert all(p.grad is None for p in t.state.actor.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.state.actor.parameters(), before))
    assert t.report == ["iteration 1: non-finite actor loss or gradient; update skipped (1 in a row)"]
    good = make_batch().select([0, 1, 2, 3])
    assert "skipped" not in updater._optimizer_step(good)
    assert t.state.nan_skips_in_a_row == 0 and t.state.nan_skips_total == 1 and t.state.optimizer_steps == 1
    updater._optimizer_step(bad)
    with pytest.raises(TrainingDivergedError) as info:
        updater._optimizer_step(bad)
    assert str(info.value) == (
        f"2 consecutive updates had NaN/inf losses or gradients; stopping. Checkpoints are in "
        f"{Path('runs/ppo/checkpoints')}; the newest may hold the weights that diverged (a skipped update keeps the "
        "last finite weights, not healthy ones). Lower the learning rate, raise optimizer.max_grad_norm headroom, or "
        "check the data and rewards, then --resume, or start a new run from an earlier checkpoint's actor "
        "(--model RUN/checkpoints/step-N/actor).")
    assert t.state.nan_skips_total == 3


def test_only_the_main_process_says_an_update_was_skipped(monkeypatch):
    from stppo_agent.distributed import process_group

    monkeypatch.setattr(process_group, "is_main", lambda: False)
    t = update_stage()
    bad = make_batch().select([0, 1, 2, 3])
    bad.advantages[0, 0] = math.nan
    assert t._optimizer_step(bad)["skipped"] == 1.0 and t.state.nan_skips_in_a_row == 1  # skipped, counted, unsaid
    assert t.report == []


def test_a_non_finite_critic_step_is_skipped_alone():

    t = update_stage()
    mini = make_batch().select([0, 1, 2, 3])
    mini.returns[1, 0] = math.inf
    before = [p.detach().clone() for p in t.state.critic.parameters()]
    out = t._optimizer_step(mini)
    assert out["skipped"] == 1.0 and t.state.optimizer_steps == 1  # the actor stepped
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.state.critic.parameters(), before))
    assert all(p.grad is None for p in t.state.critic.parameters())
    assert t.report == ["iteration 1: non-finite critic loss or gradient; update skipped (1 in a row)"]
    t2 = update_stage(critic=False)
    out = t2._optimizer_step(make_batch().select([0, 1, 2, 3]))
    assert "value_loss" not in out and t2.state.optimizer_steps == 1


def test_a_critic_step_with_finite_losses_and_an_infinite_gradient_is_skipped(monkeypatch):
    import stppo_agent.training.ppo_update as ppo_update

    t = update_stage()
    monkeypatch.setattr(ppo_update.process_group, "clip_grad_norm", lambda params, norm: torch.tensor(math.inf))
    before = [p.detach().clone() for p in t.state.critic.parameters()]
    out = t._critic_step(make_batch().select([0, 1, 2, 3]))
    assert out["skipped"] == 1.0 and math.isinf(out["critic_grad_norm"])
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.state.critic.parameters(), before))


def test_synced_last_skips_the_all_reduce_until_the_last_micro_batch():
    import contextlib

    from stppo_agent.training.ppo_update import PPOUpdate

    events = []

    class Wrapper:
        @contextlib.contextmanager
        def no_sync(self):
            events.append("off")
            yield
            events.append("on")

    for item in PPOUpdate._synced_last(["a", "b", "c"], Wrapper()):
        events.append(item)
    assert events == ["off", "a", "on", "off", "b", "on", "c"]
    assert list(PPOUpdate._synced_last(["a", "b"], None)) == ["a", "b"]
    assert list(PPOUpdate._synced_last(["a", "b"], torch.nn.Linear(1, 1))) == ["a", "b"]


def test_global_counts_are_policy_tokens_and_trajectories_never_zero():

    t = update_stage()
    batch = make_batch()
    tokens, seqs = t._global_counts(batch)
    assert float(tokens) == float(batch.loss_mask.sum()) and float(seqs) == 6.0
    batch.loss_mask[:] = False
    batch.loss_mask[1, 0] = True
    assert [float(x) for x in t._global_counts(batch)] == [1.0, 1.0]
    batch.loss_mask[:] = False
    t.world = 4
    assert [float(x) for x in t._global_counts(batch)] == [0.25, 0.25]


def test_whole_batch_statistics_only_for_m2po_over_several_micro_batches():

    mini = make_batch().select([0, 1, 2, 3])
    t = update_stage("m2po", optimizer=dict(micro_batch_size=1))
    updater = t
    micros = [micro for _, micro in updater._split(mini)]
    assert len(micros) == 4
    keywords = updater._whole_batch_keywords(micros)
    assert len(keywords) == 4 and all(k for k in keywords)
    assert updater._whole_batch_keywords(micros[:1]) == [{}]
    assert update_stage("ppo")._whole_batch_keywords(micros) == [{}, {}, {}, {}]
    grads = []
    for micro in (1, 4):
        t = update_stage("m2po", algorithm={"m2_threshold": 0.02}, optimizer=dict(micro_batch_size=micro))
        mini.old_logprobs = mini.old_logprobs + 0.0
        t.actor_gradients(mini)
        grads.append([p.grad.clone() for p in t.state.actor.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_step_diagnostics_hooks_see_every_micro_batch_and_the_step():

    calls = []

    class Diagnostics:
        def begin_iteration(self, iteration, on_policy_start):
            calls.append(("begin", iteration, on_policy_start))

        def observe_micro(self, micro, logprobs):
            calls.append(("micro", micro.batch_size, logprobs.shape == micro.response_ids.shape))

        def finish_step(self, params, out, steps):
            calls.append(("finish", len(params), "grad_norm" in out, steps))
            return {"diag": 1.0}

    t = update_stage(critic=False, optimizer=dict(mini_batch_size=6, micro_batch_size=2))
    t.state.iteration, t.state.optimizer_steps, t.diagnostics = 4, 7, Diagnostics()
    metrics = t.update(make_batch())
    params = len([p for p in t.state.actor.parameters() if p.requires_grad])
    assert calls == [("begin", 5, True), ("micro", 2, True), ("micro", 2, True), ("micro", 2, True),
                     ("finish", params, True, 7)]
    assert metrics["diag"] == 1.0


def test_ddp_all_reduces_once_per_optimizer_step():
    import contextlib


    class DDPLike(torch.nn.Module):
        def __init__(self, module, log):
            super().__init__()
            self.module, self.log = module, log

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        @contextlib.contextmanager
        def no_sync(self):
            self.log.append("no_sync")
            yield

    actor_log, critic_log = [], []
    t = update_stage(optimizer=dict(micro_batch_size=1))
    t.state.actor_train, t.state.critic_train = DDPLike(t.state.actor, actor_log), DDPLike(t.state.critic, critic_log)
    t._optimizer_step(make_batch().select([0, 1, 2, 3]))
    assert actor_log == ["no_sync"] * 3 and critic_log == ["no_sync"] * 3  # all but the last of 4 micro-batches


def test_the_off_policy_means_leave_out_the_first_step_alone():

    t = update_stage(seed=3, optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=2),
                     logging=dict(step_diagnostics=True))
    updater, steps = t, []
    step = updater._optimizer_step
    updater._optimizer_step = lambda mini: steps.append(step(mini)) or steps[-1]
    metrics = updater.update(make_batch())
    assert len(steps) == 4 and metrics["offpolicy/steps"] == 3.0
    for key in ("clip_frac", "clip_bias_norm"):
        assert len({s[key] for s in steps}) > 1  # the steps differ, so which one is left out shows
        assert metrics[f"offpolicy/{key}"] == pytest.approx(sum(s[key] for s in steps[1:]) / 3, rel=1e-9)
        assert metrics[key] == pytest.approx(sum(s[key] for s in steps) / 4, rel=1e-9)


def test_with_two_processes_the_update_gathers_the_global_batch_and_takes_its_rows(monkeypatch):
    import stppo_agent.training.ppo_update as ppo_update

    t = update_stage(critic=False, optimizer=dict(mini_batch_size=4, micro_batch_size=2))
    t.world, t.rank, t.state.tokenizer = 2, 1, SimpleNamespace(pad_token_id=7)
    calls, rows, real_rows = [], [], ppo_update.mini_batch_rows
    monkeypatch.setattr(ppo_update, "gather_global_batch", lambda batch, pad: calls.append(pad) or batch)
    monkeypatch.setattr(ppo_update, "mini_batch_rows", lambda order, start, size, rank, world: rows.append(
        (start, size, rank, world)) or real_rows(order, start, size, rank, world))
    monkeypatch.setattr(ppo_update.process_group, "all_reduce_sum", lambda value: value * 2)  # two equal ranks
    t.update(make_batch())
    assert calls == [7] and rows == [(0, 4, 1, 2), (4, 4, 1, 2)] and t.state.optimizer_steps == 2
    mini = make_batch().select([0, 1, 2])
    tokens, seqs = t._global_counts(mini)  # global counts / world: DDP averages gradients
    assert float(tokens) == float(mini.loss_mask.sum()) and float(seqs) == float(mini.loss_mask.any(1).sum())


@pytest.mark.parametrize("sharded", [True, False])
def test_the_clip_bias_corrector_gets_the_algorithms_settings_and_an_anchor(monkeypatch, sharded):
    import stppo_agent.training.ppo_update as ppo_update

    made, anchors = [], []

    class Corrector:
        def __init__(self, params, kappa=1.0, through_grad=False, rescale=True):
            made.append((len(params), kappa, through_grad, rescale))

        def accumulate(self, bias, anchor=None):
            anchors.append(anchor)

        def all_reduce(self):
            pass

        def measure(self):
            return {}

    monkeypatch.setattr(ppo_update, "ClipBiasCorrector", Corrector)
    t = update_stage("s_ppo", algorithm={"clip_bias_kappa": 2.5}, optimizer=dict(micro_batch_size=2))
    t.sharded = sharded
    t.actor_gradients(make_batch().select([0, 1, 2, 3]))
    params = len([p for p in t.state.actor.parameters() if p.requires_grad])
    assert made == [(params, 2.5, sharded, True)]
    assert len(anchors) == 2 and all(isinstance(a, torch.Tensor) and a.requires_grad for a in anchors)
    made.clear()
    update_stage("ppo", logging=dict(step_diagnostics=True)).actor_gradients(make_batch().select([0, 1]))
    assert made[0][1:] == (1.0, False, False)  # measured only: no rescaling


def test_a_registered_losss_own_metrics_are_weighted_by_policy_tokens(monkeypatch):
    from stppo_agent.algorithms import get_policy_loss, register_policy_loss

    ppo_clip = get_policy_loss("ppo_clip")

    def plain(**kwargs):
        loss, bias, metrics = ppo_clip(**kwargs)
        return loss, bias, {"micro_tokens": float(kwargs["loss_mask"].sum())}  # no parts: a plain number

    register_policy_loss("pins_plain_metrics", plain)
    t = update_stage("ppo", algorithm={"policy_loss": "pins_plain_metrics"}, optimizer=dict(micro_batch_size=1))
    mini = make_batch().select([0, 2, 3])
    tokens = [float(row.sum()) for row in mini.loss_mask]
    out = t.actor_gradients(mini)
    assert len(set(tokens)) > 1
    assert out["micro_tokens"] == pytest.approx(sum(n * n for n in tokens) / sum(tokens))


@pytest.mark.parametrize("broken", ["gradient", "another rank"])
def test_a_step_is_skipped_on_an_infinite_gradient_or_another_ranks_bad_loss(monkeypatch, broken):
    import stppo_agent.training.ppo_update as ppo_update

    t = update_stage(critic=False)
    if broken == "gradient":  # finite losses, an overflowing gradient
        monkeypatch.setattr(ppo_update.process_group, "clip_grad_norm", lambda params, norm: torch.tensor(math.inf))
    else:  # this rank's loss is finite, the all-reduced count of finite ranks is not the world
        monkeypatch.setattr(ppo_update.process_group, "all_reduce_sum", lambda value: value * 0)
    out = t._optimizer_step(make_batch().select([0, 1, 2, 3]))
    assert math.isnan(out["grad_norm"]) and out["skipped"] == 1.0 and t.state.optimizer_steps == 0


def test_the_whole_batch_statistic_scores_under_the_sampling_settings(monkeypatch):
    import stppo_agent.training.ppo_update as ppo_update
    from stppo_agent.training.log_probs import token_logprobs

    t = update_stage("m2po", critic=False, optimizer=dict(micro_batch_size=2), rollout=dict(temperature=0.7))
    seen = []

    def statistic(logprobs, old_logprobs, loss_mask, turn_ids, config):
        seen.append(logprobs)
        return [{} for _ in logprobs]

    monkeypatch.setattr(ppo_update, "WHOLE_BATCH_STATISTICS", {t.algo.policy_loss: statistic})
    updater = t
    micros = [micro for _, micro in updater._split(make_batch().select([0, 1, 2, 3]))]
    assert updater._whole_batch_keywords(micros) == [{}, {}]
    with torch.no_grad():
        for got, micro in zip(seen[0], micros):
            want = token_logprobs(t.state.actor, micro, sampling=t.config.sampling())[0]
            assert torch.allclose(got, want) and not torch.allclose(got, token_logprobs(t.state.actor, micro)[0])


# algorithm.clip_bias_order: where the S-PPO / ST-PPO scale 1 / max(1, ||C|| / kappa) applies relative to the
# max_grad_norm clipping, and clip_bias_changed, whether it changed the gradient the optimizer is handed.


ROWS = [0, 1, 2, 3]  # make_batch's behaviour log-probs are far from the tiny model's: much is clipped


def _trainer(order: str, max_grad_norm: float, kappa: float = 1.0):
    return update_stage("s_ppo", algorithm={"clip_bias_kappa": kappa, "clip_bias_order": order, "kl_in_reward": 0.0},
                        optimizer=dict(max_grad_norm=max_grad_norm))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _by_hand(t, mini) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, C) over the whole mini-batch in one forward: the policy loss's gradient and the clipping bias."""
    params = [p for p in t.state.actor.parameters() if p.requires_grad]
    logprobs, _ = token_logprobs(t.state.actor, mini, sampling=t.config.sampling())
    loss, bias, _ = get_policy_loss(t.algo.policy_loss)(
        logprobs=logprobs, old_logprobs=mini.old_logprobs, advantages=mini.advantages, loss_mask=mini.loss_mask,
        turn_ids=mini.turn_ids, config=t.algo, global_num_tokens=mini.loss_mask.sum().float(),
        global_num_seqs=mini.loss_mask.any(1).sum().float())
    g = torch.autograd.grad(loss, params, retain_graph=True)
    c = torch.autograd.grad(bias, params, allow_unused=True)
    return _flat(g), _flat([torch.zeros_like(p) if x is None else x for p, x in zip(params, c)])


def _applied(order: str, max_grad_norm: float, kappa: float) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    t = _trainer(order, max_grad_norm, kappa)
    mini = make_batch().select(ROWS)
    g, c = _by_hand(t, mini)
    out = t.actor_gradients(mini)
    return _flat([p.grad for p in t.state.actor.parameters() if p.requires_grad]), out, g, c


def _scale_and_norm() -> tuple[float, float, float]:
    """kappa giving a scale of 4 on this mini-batch, the scale, and ||g||."""
    _, _, g, c = _applied("before_grad_clip", 1e6, 1.0)
    kappa = float(c.norm()) / 4
    return kappa, float(c.norm()) / kappa, float(g.norm())


def _clipped(v: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What torch's clip_grad_norm_ does to one flat vector."""
    return v * min(1.0, max_norm / (float(v.norm()) + 1e-6))


@pytest.mark.parametrize("order", ["before_grad_clip", "after_grad_clip"])
def test_the_applied_gradient_is_the_hand_computed_one_in_either_order(order):
    kappa, scale, g_norm = _scale_and_norm()
    assert scale == pytest.approx(4.0)
    max_norm = 0.5 * g_norm / scale  # clipping binds in both orders
    applied, out, g, c = _applied(order, max_norm, kappa)
    assert out["clip_bias_scale"] == pytest.approx(float(c.norm()) / kappa, rel=1e-5)
    assert out["pg_grad_norm"] == pytest.approx(float(g.norm()), rel=1e-5)
    if order == "before_grad_clip":  # g / s is clipped to max_norm: PPO's own clipped gradient, the scale lost
        expected = _clipped(g / scale, max_norm)
        assert out["grad_norm"] == pytest.approx(float(g.norm()) / scale, rel=1e-5)
        assert float(applied.norm()) == pytest.approx(max_norm, rel=1e-5)
        torch.testing.assert_close(applied, _clipped(g, max_norm), rtol=1e-5, atol=1e-8)
        assert out["clip_bias_changed"] == 0.0
    else:  # g is clipped to max_norm, then divided: the scale always shows
        expected = _clipped(g, max_norm) / scale
        assert out["grad_norm"] == pytest.approx(float(g.norm()), rel=1e-5)
        assert float(applied.norm()) == pytest.approx(max_norm / scale, rel=1e-5)
        assert out["clip_bias_changed"] == 1.0
    torch.testing.assert_close(applied, expected, rtol=1e-5, atol=1e-8)
    cosine = float(applied @ g) / float(applied.norm() * g.norm())
    assert cosine == pytest.approx(1.0, abs=1e-6)  # a scale never turns the gradient


def test_without_binding_clipping_both_orders_apply_g_over_s():
    kappa, scale, g_norm = _scale_and_norm()
    before, out_before, g, _ = _applied("before_grad_clip", 1e6, kappa)
    after, out_after, _, _ = _applied("after_grad_clip", 1e6, kappa)
    torch.testing.assert_close(before, g / scale, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(after, g / scale, rtol=1e-5, atol=1e-8)
    assert out_before["clip_bias_changed"] == out_after["clip_bias_changed"] == 1.0


@pytest.mark.parametrize("side", [1 + 1e-3, 1 - 1e-3])
def test_before_grad_clip_changes_the_update_only_while_g_over_s_stays_under_max_grad_norm(side):
    kappa, scale, g_norm = _scale_and_norm()
    max_norm = side * g_norm / scale
    applied, out, g, _ = _applied("before_grad_clip", max_norm, kappa)
    ppo = _clipped(g, max_norm)  # what PPO applies from the same gradient
    if side > 1:  # g / s is under the threshold: applied as it is, shorter than PPO's
        assert out["clip_bias_changed"] == 1.0
        assert float(applied.norm()) < float(ppo.norm()) * (1 - 5e-4)
    else:  # clipping brings both to max_norm along g: the correction changed nothing
        assert out["clip_bias_changed"] == 0.0
        torch.testing.assert_close(applied, ppo, rtol=1e-5, atol=1e-8)


def test_the_changed_metric_at_its_boundaries():
    assert not changed_update(2.0, 4.0, 2.0, "before_grad_clip")  # ||g|| / s == max_grad_norm: clipped alike
    assert changed_update(2.0, 3.999, 2.0, "before_grad_clip")
    assert not changed_update(2.0, 4.001, 2.0, "before_grad_clip")
    assert changed_update(1.0001, 1e9, 2.0, "after_grad_clip")  # after clipping any scale above 1 shows
    for order in ("before_grad_clip", "after_grad_clip"):
        assert not changed_update(1.0, 0.1, 2.0, order)  # scale 1: the correction did nothing
        assert not changed_update(math.nan, 0.1, 2.0, order)


def test_the_order_is_checked_and_the_default_is_the_contracts():
    from stppo_agent.algorithms import ALGORITHMS, AlgorithmConfig

    assert {preset.clip_bias_order for preset in ALGORITHMS.values()} == {"before_grad_clip"}
    with pytest.raises(ValueError, match="clip_bias_order must be one of before_grad_clip, after_grad_clip; got 'x'"):
        AlgorithmConfig(clip_bias_order="x")


def test_without_the_correction_nothing_is_scaled_or_reported():
    t = update_stage("ppo", algorithm={"clip_bias_order": "after_grad_clip", "kl_in_reward": 0.0},
                     optimizer=dict(max_grad_norm=1e-3), logging=dict(step_diagnostics=True))
    out = t.actor_gradients(make_batch().select(ROWS))
    assert "clip_bias_scale" not in out and "clip_bias_changed" not in out and out["clip_bias_norm"] > 0
    applied = _flat([p.grad for p in t.state.actor.parameters() if p.requires_grad])
    assert float(applied.norm()) == pytest.approx(1e-3, rel=1e-4)


# Non-finite steps: counted once toward max_nan_skips, the count reset by a clean step, and
# nothing of them in the iteration's means.


# -- max_nan_skips counts optimizer steps (mini-batches), whichever model's half was non-finite --------------------

def _poisoned(actor: bool, critic: bool):
    mini = make_batch().select([0, 1, 2, 3])
    if actor:
        mini.advantages[0, 0] = math.nan
    if critic:
        mini.returns[1, 0] = math.inf
    return mini


def test_a_step_whose_actor_and_critic_both_fail_counts_once_toward_max_nan_skips():
    from stppo_agent.training.ppo_update import TrainingDivergedError

    t = update_stage(monitor=dict(max_nan_skips=2))
    updater = t
    for expected in (1, 2):  # max_nan_skips=2: two consecutive skipped updates are tolerated
        out = updater._optimizer_step(_poisoned(actor=True, critic=True))
        assert out["skipped"] == 1.0 and t.state.nan_skips_in_a_row == expected and t.state.nan_skips_total == expected
    with pytest.raises(TrainingDivergedError, match="^3 consecutive updates"):
        updater._optimizer_step(_poisoned(actor=True, critic=True))
    assert t.report[0] == "iteration 1: non-finite actor and critic loss or gradient; update skipped (1 in a row)"


def test_a_critic_that_fails_every_step_stops_the_run_though_the_actor_steps():
    from stppo_agent.training.ppo_update import TrainingDivergedError

    t = update_stage(monitor=dict(max_nan_skips=1))
    updater = t
    out = updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert out["skipped"] == 1.0 and t.state.optimizer_steps == 1 and t.state.nan_skips_in_a_row == 1
    with pytest.raises(TrainingDivergedError, match="^2 consecutive updates"):
        updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert t.state.optimizer_steps == 2  # the actor kept stepping: only the counter stopped the run


def test_a_clean_step_after_a_skipped_one_resets_the_count():

    t = update_stage(monitor=dict(max_nan_skips=1))
    updater = t
    updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert "skipped" not in updater._optimizer_step(_poisoned(actor=False, critic=False))
    assert t.state.nan_skips_in_a_row == 0 and t.state.nan_skips_total == 1


# -- a skipped (non-finite) step neither blinds the collapse monitor nor passes for healthy -------------------------

def test_an_iteration_with_a_skipped_step_logs_the_applied_steps_means_and_how_many_were_skipped():
    """One of the iteration's steps is non-finite and skipped: the iteration's means were NaN (grad_norm, pg_loss,
    ...), which the collapse monitor ignores, so the iteration where the trouble began was judged on nothing."""

    t = update_stage(seed=3, critic=False, optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=2))
    batch = make_batch()
    batch.advantages[0, 0] = math.nan  # in each epoch row 0's mini-batch is skipped, the other one steps
    metrics = t.update(batch)
    assert t.state.optimizer_steps == 2 and t.state.nan_skips_total == 2
    assert metrics["skipped"] == 2  # a count of steps, not a mean of flags (which was 1.0)
    assert math.isfinite(metrics["grad_norm"]) and math.isfinite(metrics["pg_loss"])
    clean = update_stage(seed=3, critic=False, optimizer=dict(epochs=1, mini_batch_size=4, micro_batch_size=2))
    assert "skipped" not in clean.update(make_batch())


def test_skipped_steps_trip_the_monitor_from_the_first_iteration_and_twice_in_a_row_raise_the_alarm():
    from stppo_agent.monitoring.collapse_rules import CollapseMonitor, MonitorSettings

    monitor = CollapseMonitor(MonitorSettings(warmup=3, window=4, patience=2))
    first = monitor.observe(1, {"grad_norm": 1.0, "skipped": 1})  # warming up: the limit applies anyway
    assert [trip.key for trip in first.trips] == ["skipped"] and not first.alarm
    assert first.metrics()["collapse/tripped"] == 1
    assert not monitor.observe(2, {"grad_norm": 1.0}).trips  # absent: nothing was skipped
    monitor.observe(3, {"grad_norm": 1.0, "skipped": 2})
    assert monitor.observe(4, {"grad_norm": 1.0, "skipped": 1}).alarm


def test_a_skipped_step_with_a_finite_loss_adds_nothing_to_the_means_nor_to_the_off_policy_steps():
    """An inf gradient under a finite loss: the step is skipped, and its pg_loss / clip_frac describe no applied
    step (they were averaged in with the applied ones, and the step counted in offpolicy/steps)."""

    t = update_stage(seed=3, critic=False, optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=2))
    updater = t
    real, calls = updater.actor_gradients, []

    def second_step_explodes(mini):
        calls.append(1)
        out = real(mini)
        if len(calls) == 2:  # the first off-policy step
            out.update(grad_norm=math.inf, pg_loss=1e6, clip_frac=1.0)
        return out

    updater.actor_gradients = second_step_explodes
    metrics = updater.update(make_batch())
    assert metrics["skipped"] == 1 and t.state.optimizer_steps == 3
    assert metrics["pg_loss"] < 1e3 and metrics["clip_frac"] < 1.0
    assert metrics["offpolicy/steps"] == 2  # steps 3 and 4; step 1 is on-policy, step 2 was skipped


def test_a_critic_only_skip_keeps_the_actors_metrics_and_drops_the_non_finite_ones():

    t = update_stage(seed=3, critic=True, optimizer=dict(epochs=1, mini_batch_size=4, micro_batch_size=2),
                     monitor=dict(max_nan_skips=100))
    batch = make_batch()
    batch.returns[:, 0] = math.inf  # every step's critic fails, every actor step applies
    steps = math.ceil(batch.batch_size / 4)
    metrics = t.update(batch)
    assert t.state.optimizer_steps == steps and t.state.nan_skips_total == steps
    assert metrics["skipped"] == steps
    assert math.isfinite(metrics["pg_loss"]) and math.isfinite(metrics["grad_norm"])  # the actor's, kept
    assert "critic_grad_norm" not in metrics  # inf in every step: dropped, not averaged into inf
