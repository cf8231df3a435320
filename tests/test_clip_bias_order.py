"""algorithm.clip_bias_order: where the S-PPO / ST-PPO scale 1 / max(1, ||C|| / kappa) applies relative to the
max_grad_norm clipping, and clip_bias_changed, whether it changed the gradient the optimizer is handed."""

from __future__ import annotations

import math

import pytest
import torch

from stppo_agent.algorithms import get_policy_loss
from stppo_agent.algorithms.clip_bias import changed_update
from stppo_agent.training.log_probs import token_logprobs

from .test_pins_training import make_batch, update_stage

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
