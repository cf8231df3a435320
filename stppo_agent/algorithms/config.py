"""Algorithm settings and the named presets of docs/algorithms.md.

A preset is a frozen :class:`AlgorithmConfig`; every field can be overridden with ``dataclasses.replace``
(or ``--set`` on the command line). Registered presets live in :data:`ALGORITHMS`.
"""

from __future__ import annotations

import dataclasses

from .registry import Registry

RATIO_LEVEL_NAMES = ("token", "turn", "sequence")
CLIP_BIAS_ORDERS = ("before_grad_clip", "after_grad_clip")
# built-in policy losses with a trust region of their own, which never read clip_ratio_c (ppo_clip's dual clip)
_NO_DUAL_CLIP = ("cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po")
LOSS_AGG_NAMES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3", "low_var_kl")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """Everything the advantage estimator and the losses read."""

    name: str = "custom"
    """Preset name, for logs."""
    advantage: str = "gae"
    """Advantage estimator, by registered name: gae, grpo, rloo, or one registered by the user."""
    policy_loss: str = "ppo_clip"
    """Policy loss, by registered name."""
    ratio_level: str = "token"
    """Importance-ratio level: token (PPO), turn (Turn-PPO/ST-PPO: geometric mean per turn), sequence (GSPO)."""
    clip_bias_correction: bool = False
    """Divide the policy gradient by max(1, ||C|| / kappa), C the clipping-bias gradient (S-PPO, ST-PPO)."""
    clip_bias_kappa: float = 1.0
    """kappa of the clip-bias normalisation: a bias norm up to kappa leaves the gradient unchanged."""
    clip_bias_order: str = "before_grad_clip"
    """Where the clip-bias scale applies: before_grad_clip (the gradient is divided, then clipped to
    max_grad_norm: a no-op whenever ||g|| / scale still exceeds max_grad_norm) or after_grad_clip (the clipped
    gradient is divided, so a scale above 1 always shrinks the applied gradient)."""
    clip_low: float = 0.2
    """Lower clip epsilon: ratios below 1 - clip_low are clipped for negative advantages (1: no lower bound, CISPO's
    paper form). GMPO reads it in log space, DPPO as its divergence threshold for negative advantages."""
    clip_high: float = 0.2
    """Upper clip epsilon: ratios above 1 + clip_high are clipped for positive advantages (GMPO: log space; DPPO:
    the divergence threshold for positive advantages)."""
    clip_ratio_c: float | None = None
    """Dual clip of the ppo_clip loss (verl's clip_ratio_c, 3.0 there): for A < 0 a ratio above c contributes the
    constant -c * A, no gradient (the unclipped branch would weigh the token by its whole ratio). At the
    ratio_level in use; None: off. Must be > 1."""
    loss_agg: str = "token-mean"
    """token-mean (sum over policy tokens / their number), seq-mean-token-mean, or seq-mean-token-sum-norm (each
    trajectory's token sum / loss_scale_factor, averaged over trajectories: Dr. GRPO's constant normaliser)."""
    loss_scale_factor: float = 1024.0
    """The constant of seq-mean-token-sum-norm (Dr. GRPO: the generation budget in tokens)."""
    tau_pos: float = 1.0
    """SAPO's gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """SAPO's gate temperature for non-positive advantages."""
    is_cap: float = 20.0
    """DPPO's truncation cap of the stop-gradient importance weight."""
    m2_threshold: float = 0.04
    """M2PO's bound on the second moment of the log-ratio of the tokens left in the loss."""
    dynamic_sampling: bool = False
    """DAPO: drop the groups whose rewards are all equal (see ``informative_groups``) and sample more prompts until
    the batch is full (stppo_agent/training/resampling.py); groups kept only to fill it get token weight 0. Needs a
    group-relative advantage and samples_per_prompt >= 2."""
    max_resample_rounds: int = 10
    """DAPO's cap on extra sampling rounds per iteration (verl's max_num_gen_batches); 0: no cap (sample until every
    group of the batch is informative)."""
    gamma: float = 1.0
    """GAE discount over policy tokens (Search-R1 uses 1)."""
    lam: float = 1.0
    """GAE lambda (Search-R1 uses 1)."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over all policy tokens of the batch."""
    grpo_std_normalize: bool = True
    """Divide GRPO advantages by the group std (False: Dr. GRPO)."""
    use_critic: bool = True
    """Train a value head (PPO family); GRPO-style algorithms need none."""
    value_clip: float = 0.5
    """eps_v of the clipped value loss."""
    kl_in_reward: float = 0.0
    """Coefficient of the k1 KL penalty subtracted from the reward at every policy token."""
    kl_loss_coef: float = 0.0
    """Coefficient of the KL-to-reference loss term."""
    kl_estimator: str = "low_var_kl"
    """k1, k2, k3 or low_var_kl (k3 clamped to [-10, 10])."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    rollout_correction: str = "auto"
    """Rollout-training mismatch correction: none, tis (truncate the weight pi_old / pi_sample at the cap) or mis
    (drop tokens whose weight exceeds it); auto: tis with the vLLM backend, none with transformers generate."""
    rollout_correction_level: str = "auto"
    """token, turn (geometric mean over the turn) or sequence; auto: turn for turn-level algorithms, else token."""
    rollout_correction_cap: float = 2.0
    """The cap of tis / mis (verl's default)."""
    hyperparameters: tuple = ()
    """(name, value) pairs of the hyper-parameters the rules define for themselves (a plugin's): set them as
    ``algorithm.NAME``; read them with :meth:`hyperparameter`."""

    def hyperparameter(self, name: str):
        """The value of the rule's own hyper-parameter ``name``: as set, else its declared default."""
        from .hyperparameters import declared_hyperparameters

        values = dict(self.hyperparameters)
        if name in values:
            return values[name]
        declared = declared_hyperparameters(self)
        if name not in declared:
            raise KeyError(f"no hyper-parameter {name!r} declared by policy loss {self.policy_loss} or advantage "
                           f"estimator {self.advantage}; declared: {', '.join(declared) or 'none'}")
        return declared[name].default

    def __post_init__(self):
        _check_choice("ratio_level", self.ratio_level, RATIO_LEVEL_NAMES)
        _check_choice("loss_agg", self.loss_agg, LOSS_AGG_NAMES)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATOR_NAMES)
        _check_choice("rollout_correction", self.rollout_correction, ("auto", "none", "tis", "mis"))
        _check_choice("rollout_correction_level", self.rollout_correction_level, ("auto", *RATIO_LEVEL_NAMES))
        if self.rollout_correction_cap < 1:
            raise ValueError(f"rollout_correction_cap must be >= 1, got {self.rollout_correction_cap}")
        if not (0 <= self.clip_low <= 1 and self.clip_high >= 0):
            raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        for field in ("loss_scale_factor", "tau_pos", "tau_neg", "is_cap", "m2_threshold"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.max_resample_rounds < 0:
            raise ValueError(f"max_resample_rounds must be >= 0, got {self.max_resample_rounds}")
        _check_choice("clip_bias_order", self.clip_bias_order, CLIP_BIAS_ORDERS)
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 (or unset), got {self.clip_ratio_c}")
        if self.clip_ratio_c is not None and self.policy_loss in _NO_DUAL_CLIP:
            raise ValueError(f"clip_ratio_c is the dual clip of the ppo_clip loss; policy_loss {self.policy_loss} has "
                             "a trust region of its own and does not read it: unset it")
        if self.clip_bias_kappa <= 0:
            raise ValueError(f"clip_bias_kappa must be > 0, got {self.clip_bias_kappa}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field} must be one of {', '.join(choices)}; got {value!r}")


ALGORITHMS: Registry[AlgorithmConfig] = Registry("algorithm")


def register_algorithm(config: AlgorithmConfig) -> AlgorithmConfig:
    """Add a named preset (selectable with ``--algo NAME``)."""
    return ALGORITHMS.register(config.name, config)


_PPO = AlgorithmConfig(name="ppo", advantage="gae", ratio_level="token", use_critic=True, kl_in_reward=0.001)
_GRPO = AlgorithmConfig(name="grpo", advantage="grpo", ratio_level="token", use_critic=False,
                        kl_loss_coef=0.001, kl_estimator="k3")

for _preset in (
    _PPO,
    dataclasses.replace(_PPO, name="turn_ppo", ratio_level="turn"),
    dataclasses.replace(_PPO, name="s_ppo", clip_bias_correction=True),
    dataclasses.replace(_PPO, name="st_ppo", ratio_level="turn", clip_bias_correction=True),
    _GRPO,
    # GSPO (paper and verl) averages per sequence: with token-mean, long sequences would weigh more and the
    # gradient would lose the 1/|y| factor of its sequence-level ratio.
    dataclasses.replace(_GRPO, name="gspo", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                        kl_loss_coef=0.0, loss_agg="seq-mean-token-mean"),
    dataclasses.replace(_GRPO, name="so_grpo", ratio_level="turn", clip_bias_correction=True),
    dataclasses.replace(_PPO, name="turn_gae", advantage="turn_gae", ratio_level="turn"),
    # The 2025-26 stabilisers (docs/algorithms.md, "Stabilisers": which default comes from the paper, which from
    # verl). Critic-free with GRPO advantages and no KL term (verl's use_kl_loss=False) unless the paper says so.
    dataclasses.replace(_GRPO, name="cispo", policy_loss="cispo", clip_low=1.0, clip_high=0.2, kl_loss_coef=0.0),
    dataclasses.replace(_GRPO, name="sapo", policy_loss="sapo", loss_agg="seq-mean-token-mean", kl_loss_coef=0.0),
    dataclasses.replace(_GRPO, name="gmpo", policy_loss="gmpo", ratio_level="sequence", clip_low=0.4,
                        clip_high=0.4, loss_agg="seq-mean-token-mean", kl_loss_coef=0.0),
    dataclasses.replace(_GRPO, name="dppo_tv", policy_loss="dppo_tv", clip_low=0.15, clip_high=0.15, is_cap=1e4,
                        kl_loss_coef=0.0),
    dataclasses.replace(_GRPO, name="dppo_kl", policy_loss="dppo_kl", clip_low=0.05, clip_high=0.05, is_cap=1e4,
                        kl_loss_coef=0.0),
    dataclasses.replace(_GRPO, name="m2po", policy_loss="m2po", m2_threshold=0.04, kl_loss_coef=0.0),
    dataclasses.replace(_GRPO, name="dr_grpo", grpo_std_normalize=False, loss_agg="seq-mean-token-sum-norm",
                        loss_scale_factor=1024.0, kl_loss_coef=0.0),
    dataclasses.replace(_GRPO, name="dapo", clip_low=0.2, clip_high=0.28, kl_loss_coef=0.0, dynamic_sampling=True,
                        max_resample_rounds=10),
):
    register_algorithm(_preset)
