"""The token- and sequence-level update rules against their reference implementations (docs/algorithms.md,
"Stabilisers", "Checked against the reference implementations"): verl 0.9's registered policy losses -- ``cispo``,
``sapo``, ``geo_mean`` (GMPO), ``dppo_tv``, ``dppo_kl`` (written with the DPPO paper's authors), ``gspo`` and
``vanilla`` (PPO) -- called on the same batches, loss and gradient w.r.t. the current log-probs, with verl's
``loss_agg_mode`` and ActorConfig fields set to our preset's parameters; M2PO (no verl loss) against AReaL's mask
(``_get_m2po_loss_mask``: sort the squared log-ratios, drop the largest until the mean of the rest is below the
threshold, all but one when none does) and the paper's objective.

Tolerance: float64, rtol 1e-7 / atol 2e-8. verl divides each row's token sum by ``count + 1e-8``: a row's term moves
by up to 1e-8 of itself (the 1-token row), so these O(1) losses, whose rows partly cancel, differ by up to ~1e-8
absolute (8.8e-9 the largest seen); everything else is the same arithmetic. Where ours differs on purpose the test
holds the exact relation (``test_*differ*``).

verl is not a dependency of the project: without it this module is skipped; ``STPPO_REQUIRE_VERL=1`` (the verl CI
line of the Makefile) makes a missing verl an error instead.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.requires import require_verl

require_verl("the reference comparison needs verl 0.9 (docs/verl.md)")

import torch  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402

from stppo_agent.algorithms import ALGORITHMS, get_policy_loss  # noqa: E402

RTOL, ATOL = 1e-7, 2e-8
SEEDS = range(4)
SPREADS = (0.02, 0.6)  # mostly inside every bound / mostly far outside
LENGTHS = (14, 11, 7, 3, 12, 0, 1)  # right padding, one row without response tokens, one of a single token
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def turn_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Each maximal run of policy tokens of a row is one turn (-1 off the mask)."""
    starts = mask & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1]
    return torch.where(mask, starts.long().cumsum(1) - 1, torch.full_like(mask, -1, dtype=torch.long))


def make_batch(seed: int, spread: float, advantages: str = "token", extreme: bool = True, lengths=LENGTHS):
    """(old, new, advantages, mask, turn_ids), float64. Log-probs are log-probabilities (DPPO reads p = exp(log p)):
    old in (-4, 0), new = old + spread * N(0, 1) kept below 0; tokens far outside every bound (log-ratio +-6) and,
    with ``extreme``, beyond verl's [-20, 20] clamp (+26, -27); an observation gap inside row 4 (a second turn);
    padding holds finite values of the same kind (each implementation must mask them, not rely on zeros)."""
    generator = torch.Generator().manual_seed(seed)
    batch, length = len(lengths), max(lengths)
    mask = torch.arange(length).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    mask[4, 4:7] = False
    old = -(torch.rand(batch, length, generator=generator, dtype=torch.float64) * 4 + 1e-3)
    new = (old + spread * torch.randn(batch, length, generator=generator, dtype=torch.float64)).clamp(max=-1e-4)
    old[0, 1], new[0, 1] = -8.0, -2.0  # log-ratio +6
    old[2, 2], new[2, 2] = -0.5, -6.5  # log-ratio -6
    if extreme:
        old[0, 2], new[0, 2] = -30.0, -4.0  # +26: the ratio overflows any bound, verl clamps the log-ratio at 20
        old[1, 3], new[1, 3] = -0.01, -27.01  # -27
    if advantages == "token":
        adv = torch.randn(batch, length, generator=generator, dtype=torch.float64)
        adv[0, 1:3] = torch.tensor([1.3, -0.7], dtype=torch.float64)  # both signs on the far-off tokens
        adv[1, 3], adv[2, 2] = 0.9, -1.1
    else:  # one advantage per trajectory (GRPO's), both signs
        per_row = torch.randn(batch, 1, generator=generator, dtype=torch.float64)
        per_row[0], per_row[1] = abs(per_row[0]) + 0.1, -abs(per_row[1]) - 0.1
        adv = per_row.expand(batch, length).clone()
    return old, new, adv, mask, turn_ids_from_mask(mask)


def verl_config(loss_mode: str, agg: str, scale: float | None = None, **fields) -> FSDPActorConfig:
    """The ActorConfig verl's policy-loss functions read; clip_ratio_c 1e9 turns dual-clip PPO / DPPO's
    truncation off unless a test sets it."""
    values = dict(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio_c=1e9,
                  loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    values.update(fields)
    config = FSDPActorConfig(**values)
    if scale is not None:  # what verl's ppo_loss puts there from config.loss_scale_factor
        config.global_batch_info["loss_scale_factor"] = scale
    return config


def verl_loss(loss_mode, config, old, new, advantages, mask):
    theta = new.clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn(loss_mode)(old_log_prob=old, log_prob=theta, advantages=advantages,
                                            response_mask=mask.to(old.dtype), loss_agg_mode=config.loss_agg_mode,
                                            config=config)
    (grad,) = torch.autograd.grad(loss, theta)
    return loss.detach(), grad


def our_loss(config, old, new, advantages, mask, turn_ids):
    theta = new.clone().requires_grad_(True)
    loss, _, _ = get_policy_loss(config.policy_loss)(logprobs=theta, old_logprobs=old, advantages=advantages,
                                                     loss_mask=mask, turn_ids=turn_ids, config=config)
    (grad,) = torch.autograd.grad(loss, theta)
    return loss.detach(), grad


def assert_same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours[1], theirs[1], rtol=RTOL, atol=ATOL)


# -- the rules, each as (our preset with overrides, verl's loss_mode and ActorConfig fields) ------------------------
def _cispo(config):
    return "cispo", dict(clip_ratio_low=config.clip_low, clip_ratio_high=config.clip_high)


def _sapo(config):
    return "sapo", dict(tau_pos=config.tau_pos, tau_neg=config.tau_neg)


def _dppo(kind):
    def fields(config):
        return f"dppo_{kind}", dict(clip_ratio=config.clip_high, clip_ratio_low=config.clip_low,
                                     clip_ratio_high=config.clip_high, clip_ratio_c=config.is_cap)
    return fields


def _vanilla(config):
    return "vanilla", dict(clip_ratio=config.clip_low, clip_ratio_low=config.clip_low,
                           clip_ratio_high=config.clip_high)


# name: (preset, overrides, verl mapping, aggregations verl honours for it). The overrides put bounds where the
# random batches cross them (CISPO's preset has no lower bound; a cap inside the ratio range; SAPO's
# temperatures away from 1).
TOKEN_RULES = {
    "cispo": ("cispo", {}, _cispo, AGGS),
    "cispo_both_bounds": ("cispo", dict(clip_low=0.2, clip_high=0.28), _cispo, AGGS),
    "sapo": ("sapo", {}, _sapo, ("seq-mean-token-mean",)),  # verl's sapo always aggregates seq-mean-token-mean
    "sapo_steep": ("sapo", dict(tau_pos=3.0, tau_neg=5.0), _sapo, ("seq-mean-token-mean",)),
    "dppo_tv": ("dppo_tv", {}, _dppo("tv"), AGGS),
    "dppo_tv_capped": ("dppo_tv", dict(clip_low=0.05, clip_high=0.1, is_cap=1.5), _dppo("tv"), AGGS),
    # a cap above exp(20): the +26 token's weight is verl's clamped ratio exp(20), not exp(26)
    "dppo_tv_uncapped": ("dppo_tv", dict(is_cap=1e12), _dppo("tv"), AGGS),
    "dppo_kl": ("dppo_kl", {}, _dppo("kl"), AGGS),
    "dppo_kl_capped": ("dppo_kl", dict(clip_low=0.01, clip_high=0.02, is_cap=1.5), _dppo("kl"), AGGS),
}
TOKEN_CASES = [(rule, agg) for rule, (_, _, _, aggs) in TOKEN_RULES.items() for agg in aggs]


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rule,agg", TOKEN_CASES)
def test_token_rule_matches_verl(rule, agg, seed, spread):
    preset, overrides, mapping, _ = TOKEN_RULES[rule]
    config = dataclasses.replace(ALGORITHMS[preset], ratio_level="token", loss_agg=agg, loss_scale_factor=9.0,
                                 **overrides)
    old, new, adv, mask, turns = make_batch(seed, spread)
    loss_mode, fields = mapping(config)
    reference = verl_loss(loss_mode, verl_config(loss_mode, agg, scale=9.0, **fields), old, new, adv, mask)
    assert_same(our_loss(config, old, new, adv, mask, turns), reference)


@pytest.mark.parametrize("preset,agg", [("ppo", "token-mean"), ("grpo", "token-mean"), ("dapo", "token-mean"),
                                        ("dapo", "seq-mean-token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_clip_at_token_level_matches_verl_vanilla_without_dual_clip(preset, agg, seed, spread):
    """The PPO family's surrogate (no KL / entropy term here) is verl's ``vanilla`` with dual-clip off (our PPO has
    no dual clip). Log-ratios within +-20: see test_ppo_clip_and_gspo_differ_from_verl_beyond_its_clamps."""
    config = dataclasses.replace(ALGORITHMS[preset], loss_agg=agg)
    old, new, adv, mask, turns = make_batch(seed, spread, extreme=False)
    loss_mode, fields = _vanilla(config)
    reference = verl_loss(loss_mode, verl_config(loss_mode, agg, scale=config.loss_scale_factor, **fields), old, new,
                          adv, mask)
    assert_same(our_loss(config, old, new, adv, mask, turns), reference)


# -- sequence level: GSPO (ppo_clip at ratio_level sequence) and GMPO ---------------------------------------------
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_verl_with_one_advantage_per_trajectory(seed, spread, clip, agg):
    """Our sequence-level ppo_clip is verl's GSPO(-token) when every token of a trajectory has its advantage (GRPO's,
    the paper's setting), at the preset's bounds 3e-4 / 4e-4 (every ratio here is outside them) and at 0.05."""
    overrides = {} if clip is None else dict(clip_low=clip, clip_high=clip)
    config = dataclasses.replace(ALGORITHMS["gspo"], loss_agg=agg, **overrides)
    old, new, adv, mask, turns = make_batch(seed, spread, advantages="sequence", extreme=False)
    fields = dict(clip_ratio=config.clip_low, clip_ratio_low=config.clip_low, clip_ratio_high=config.clip_high)
    reference = verl_loss("gspo", verl_config("gspo", agg, **fields), old, new, adv, mask)
    assert_same(our_loss(config, old, new, adv, mask, turns), reference)


def test_gspo_with_token_advantages_differs_from_verls_gspo_token_in_the_gradient_only():
    """A deliberate reading (docs/algorithms.md): with advantages that vary inside a trajectory, our sequence-level
    ratio spreads each token's A over the whole trajectory (the gradient of agg(-min(s A_t, clip(s) A_t)) through
    s = exp(mean l)), while verl's GSPO-token gives token t the weight s A_t / |y| of its own advantage only. The
    loss values agree; the gradients agree on the sum over each trajectory and not token by token."""
    config = ALGORITHMS["gspo"]
    old, new, adv, mask, turns = make_batch(1, 0.6, advantages="token", extreme=False)
    fields = dict(clip_ratio=config.clip_low, clip_ratio_low=config.clip_low, clip_ratio_high=config.clip_high)
    ours = our_loss(config, old, new, adv, mask, turns)
    theirs = verl_loss("gspo", verl_config("gspo", config.loss_agg, **fields), old, new, adv, mask)
    torch.testing.assert_close(ours[0], theirs[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours[1].sum(1), theirs[1].sum(1), rtol=RTOL, atol=ATOL)
    assert not torch.allclose(ours[1], theirs[1], rtol=1e-3)
    # each of our tokens gets its trajectory's mean share
    lengths = mask.sum(1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(ours[1], torch.where(mask, theirs[1].sum(1, keepdim=True) / lengths, 0.0),
                               rtol=RTOL, atol=ATOL)


GMPO_LENGTHS = tuple(length for length in LENGTHS if length > 0)


@pytest.mark.parametrize("advantages", ["sequence", "token"])
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("seed", SEEDS)
def test_gmpo_at_sequence_level_matches_verl_geo_mean(seed, spread, clip, advantages):
    """GMPO preset (sequence level, seq-mean-token-mean) against verl's ``geo_mean`` (the GMPO authors' code,
    github.com/callsys/GMPO): sign-aware log-space clip per token, geometric mean per trajectory, times the
    trajectory's mean advantage -- also with per-token advantages. Every row has response tokens here: see
    test_gmpo_differs_from_verl_geo_mean_on_rows_without_response_tokens."""
    overrides = {} if clip is None else dict(clip_low=clip, clip_high=clip)
    config = dataclasses.replace(ALGORITHMS["gmpo"], **overrides)
    old, new, adv, mask, turns = make_batch(seed, spread, advantages=advantages, lengths=GMPO_LENGTHS)
    fields = dict(clip_ratio=config.clip_low, clip_ratio_low=config.clip_low, clip_ratio_high=config.clip_high)
    reference = verl_loss("geo_mean", verl_config("geo_mean", "seq-mean-token-mean", **fields), old, new, adv, mask)
    assert_same(our_loss(config, old, new, adv, mask, turns), reference)


def test_gmpo_differs_from_verl_geo_mean_on_rows_without_response_tokens():
    """verl's geo_mean takes torch.mean over every row of the micro-batch, a row without response tokens counting
    as a zero loss; ours averages over the trajectories that have policy tokens (the paper's 1/G over responses, and
    how every seq-mean aggregation of ours and verl's agg_loss count). Exact relation: verl = ours * rows_with_tokens
    / rows."""
    config = ALGORITHMS["gmpo"]
    old, new, adv, mask, turns = make_batch(2, 0.6, advantages="sequence")
    assert (mask.sum(1) == 0).sum() == 1
    fields = dict(clip_ratio=config.clip_low, clip_ratio_low=config.clip_low, clip_ratio_high=config.clip_high)
    theirs = verl_loss("geo_mean", verl_config("geo_mean", "seq-mean-token-mean", **fields), old, new, adv, mask)
    ours = our_loss(config, old, new, adv, mask, turns)
    share = float(mask.any(1).sum()) / mask.shape[0]
    torch.testing.assert_close(ours[0] * share, theirs[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours[1] * share, theirs[1], rtol=RTOL, atol=ATOL)


# -- the PPO family's differences, held exactly (stppo_agent/algorithms/losses.py) ----------------------------------
def test_ppo_clip_clamps_like_verl_and_gspo_differs_beyond_its_clamp():
    """verl clamps the token log-ratio to [-20, 20] in ``vanilla`` and the sequence log-ratio to <= 10 in ``gspo``
    before exp. Our ppo_clip clamps at 20 as verl does (an unclamped float32 log-ratio above 88 made the loss
    infinite), so it equals vanilla there too; our gspo does not clamp at 10. Only the unclipped branch sees a
    clamp: A < 0 with a ratio above the bound. Held exactly: gspo's loss differs by exactly that branch."""
    old, new, adv, mask, turns = make_batch(0, 0.02, extreme=True)  # token (0, 2): log-ratio +26, A = -0.7 < 0
    adv[0, 2] = -0.7
    config = dataclasses.replace(ALGORITHMS["grpo"], kl_loss_coef=0.0)
    ours = our_loss(config, old, new, adv, mask, turns)
    theirs = verl_loss("vanilla", verl_config("vanilla", "token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2),
                       old, new, adv, mask)
    assert_same(ours, theirs)
    assert ours[1][0, 2] == 0  # past the clamp: no gradient, as in verl
    far = new.clone().float()
    far[0, 2] = old[0, 2].float() + 100.0  # exp(100) overflows float32: the clamp keeps the loss finite
    assert torch.isfinite(our_loss(config, old.float(), far, adv.float(), mask, turns)[0])

    config = ALGORITHMS["gspo"]
    old, new, adv, mask, turns = make_batch(0, 0.02, advantages="sequence", extreme=False)
    new[3, :3] = old[3, :3] + 12.0  # a 3-token trajectory whose mean log-ratio is 12 > 10
    adv[3] = -0.5
    fields = dict(clip_ratio=config.clip_low, clip_ratio_low=config.clip_low, clip_ratio_high=config.clip_high)
    ours = our_loss(config, old, new, adv, mask, turns)
    theirs = verl_loss("gspo", verl_config("gspo", config.loss_agg, **fields), old, new, adv, mask)
    rows = float(mask.any(1).sum())
    gap = 0.5 * (torch.exp(torch.tensor(12.0, dtype=old.dtype)) - torch.exp(torch.tensor(10.0, dtype=old.dtype))) / rows
    torch.testing.assert_close(ours[0] - theirs[0], gap, rtol=1e-9, atol=0.0)
    assert theirs[1][3].abs().max() == 0 and ours[1][3, :3].abs().min() > 0  # verl's clamp stops the gradient


# -- M2PO: AReaL's mask and the paper's objective --------------------------------------------------------------------
def areal_m2po_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """AReaL's M2PO mask (areal/trainer/ppo/actor.py, ``_apply_m2po_masking``), token level: sort the policy
    tokens' squared log-ratios, largest first; drop the first k, k the first index where the mean of the rest is
    below the threshold, else all but the last (the smallest)."""
    squares = log_ratio[mask] ** 2
    count = squares.numel()
    ordered, order = torch.sort(squares, descending=True)
    rest_means = ordered.flip(0).cumsum(0).flip(0) / torch.arange(count, 0, -1, dtype=squares.dtype)
    below = torch.nonzero(rest_means < threshold).flatten()
    dropped = int(below[0]) if below.numel() else count - 1
    keep_sorted = torch.arange(count) >= dropped
    keep = torch.zeros(count, dtype=torch.bool)
    keep[order] = keep_sorted
    full = torch.zeros_like(mask)
    full[mask] = keep
    return full


def paper_m2po_loss(new, old, adv, mask, threshold):
    """-J_M2PO = -1/sum|o_i| sum_i sum_t M_it r_it A_it (arXiv 2510.01161; AReaL's docs/algorithms/m2po.md), M from
    the current-before-update (AReaL's proximal) log-probs against the behaviour ones."""
    theta = new.clone().requires_grad_(True)
    keep = areal_m2po_keep((new - old), mask, threshold)
    loss = -(keep * torch.exp(theta - old) * adv).sum() / mask.sum()
    (grad,) = torch.autograd.grad(loss, theta)
    return loss.detach(), grad, keep


@pytest.mark.parametrize("threshold", [0.04, 0.5, 1e-30])
@pytest.mark.parametrize("spread", (0.1, 0.6))
@pytest.mark.parametrize("seed", SEEDS)
def test_m2po_matches_areals_mask_and_the_papers_objective(seed, spread, threshold):
    """Token level, token-mean (the preset). threshold 0.04 is the paper's / AReaL's; 1e-30 is never reached, so
    every token but the smallest is dropped (AReaL keeps one). The +26 / -27 tokens are dropped by both (ours takes
    the clamped log-ratio's square, still the largest)."""
    config = dataclasses.replace(ALGORITHMS["m2po"], m2_threshold=threshold)
    old, new, adv, mask, turns = make_batch(seed, spread)
    loss, grad, keep = paper_m2po_loss(new, old, adv, mask, threshold)
    assert not keep[0, 2] and not keep[1, 3]
    assert 0 < keep.sum() < mask.sum()
    assert_same(our_loss(config, old, new, adv, mask, turns), (loss, grad))
