"""The verl bridge (stppo_agent/integrations/verl, docs/verl.md): presets as verl policy losses through verl's own
``ppo_loss`` call site, a preset's settings as overrides of verl's trainer config, and the parquet export through
verl's ``RLHFDataset``. The agent loops, the search tool, the reward function, the engine and whole updates through
verl's ``TrainingWorker`` have test files of their own beside this one.

verl is not a dependency of the project: without it this whole module is skipped by the marker below, which a CI
that installs verl (docs/verl.md, "Install") turns into a requirement with ``STPPO_REQUIRE_VERL=1``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.requires import require_verl

require_verl()

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from stppo_agent.algorithms import ALGORITHMS, get_policy_loss  # noqa: E402
from stppo_agent.integrations.verl import data as export  # noqa: E402
from stppo_agent.integrations.verl import losses as bridge  # noqa: E402
from stppo_agent.integrations.verl.settings import not_in_verl  # noqa: E402
from stppo_agent.models.tiny import word_tokenizer  # noqa: E402
from stppo_envs import BENCHMARKS, SearchQAEnv  # noqa: E402
from tests.support.verl_rows import PER_BENCHMARK, OnePassage, export_every_benchmark  # noqa: E402

VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
bridge.register_verl_losses()


# -- a batch as verl's agent loop leaves it: turns of assistant tokens (mask 1) between observations (mask 0) ------
TURNS = [  # per row: (assistant tokens, observation tokens) per turn; the last turn has no observation
    [(3, 2), (4, 3), (2, 0)],
    [(5, 0)],
    [(1, 1), (2, 2), (1, 1), (3, 0)],
    [(2, 4), (6, 0)],
]


def turn_layout(turns=TURNS) -> tuple[torch.Tensor, torch.Tensor]:
    """(response_mask (B, T) bool, turn ids (B, T) long, -1 off the mask), built turn by turn."""
    length = max(sum(a + o for a, o in row) for row in turns) + 2  # right padding too
    mask = torch.zeros(len(turns), length, dtype=torch.bool)
    ids = torch.full((len(turns), length), -1, dtype=torch.long)
    for b, row in enumerate(turns):
        position = 0
        for k, (assistant, observation) in enumerate(row):
            mask[b, position:position + assistant] = True
            ids[b, position:position + assistant] = k
            position += assistant + observation
    return mask, ids


def random_batch(seed: int = 0, spread: float = 0.3):
    torch.manual_seed(seed)
    mask, turn_ids = turn_layout()
    old = -torch.rand(mask.shape, dtype=torch.float32) * 3
    new = old + spread * torch.randn(mask.shape)
    advantages = torch.randn(mask.shape)
    return mask, turn_ids, old, new, advantages


def actor_config(loss_mode: str, agg: str = "token-mean", **overrides) -> FSDPActorConfig:
    values = dict(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio_c=1e9,
                  clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=agg,
                  policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    values.update(overrides)
    return FSDPActorConfig(**values)


def call_ppo_loss(config, mask, old, new, advantages, weights=None, dp_size=1, batch_num_tokens=None,
                  global_batch_size=None):
    """verl's ``ppo_loss`` on padded prompts of 2 tokens and the given responses; returns (loss, metrics, grad of
    the new log-probs). The model output is unpadded, as verl's engines hand it over."""
    batch, length = mask.shape
    prompt_len = 2
    new = new.clone().requires_grad_(True)
    flat = []
    for b in range(batch):  # prompt + response tokens; log-prob of response token t sits at position P + t - 1
        flat += [torch.zeros(prompt_len - 1), new[b], torch.zeros(1)]
    data = TensorDict({
        "prompts": torch.ones(batch, prompt_len, dtype=torch.long),
        "responses": torch.ones(batch, length, dtype=torch.long),
        "attention_mask": torch.ones(batch, prompt_len + length, dtype=torch.long),
        "response_mask": mask.long(), "old_log_probs": old, "advantages": advantages,
        **({"rollout_is_weights": weights} if weights is not None else {}),
    }, batch_size=[batch])
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                         global_batch_size=global_batch_size)
    loss, metrics = ppo_loss(config, {"log_probs": torch.cat(flat)}, data)
    (grad,) = torch.autograd.grad(loss, new)
    return loss.detach(), {k: getattr(m, "values", m) for k, m in metrics.items()}, grad


def metric(metrics, name):
    value = metrics[name]
    return float(value[0] if isinstance(value, list) else value)


# -- turn ids ---------------------------------------------------------------------------------------------------------
def test_turn_ids_are_the_maximal_runs_of_ones_of_the_response_mask():
    mask, expected = turn_layout()
    assert torch.equal(bridge.turn_ids_from_mask(mask), expected)
    assert torch.equal(bridge.turn_ids_from_mask(torch.zeros(2, 3)), torch.full((2, 3), -1))


# -- registration -----------------------------------------------------------------------------------------------------
def test_every_preset_is_registered_as_a_verl_policy_loss():
    assert {f"stppo_{name}" for name in ALGORITHMS} <= set(POLICY_LOSS_REGISTRY)
    assert set(ALGORITHMS) >= {"ppo", "turn_ppo", "s_ppo", "st_ppo", "grpo", "gspo", "so_grpo"}


def test_import_verl_registers_the_losses_through_the_entry_point(tmp_path):
    """The ``verl.plugins`` entry point the pyproject declares, as an installed distribution declares it; a preset
    registered before ``import verl`` is there too, and one registered later after register_verl_losses()."""
    dist = tmp_path / "stppo_verl_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: stppo-verl-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[verl.plugins]\nstppo = stppo_agent.integrations.verl.plugin\n")
    script = (
        "import dataclasses\n"
        "from stppo_agent.algorithms import ALGORITHMS, register_algorithm\n"
        "register_algorithm(dataclasses.replace(ALGORITHMS['turn_ppo'], name='early_user_preset'))\n"
        "import verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "assert 'stppo_turn_ppo' in R and 'stppo_early_user_preset' in R, sorted(R)\n"
        "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry\n"
        "assert 'stppo_env' in _agent_loop_registry\n"
        "register_algorithm(dataclasses.replace(ALGORITHMS['turn_ppo'], name='late_user_preset'))\n"
        "assert 'stppo_late_user_preset' not in R\n"
        "from stppo_agent.integrations.verl.losses import register_verl_losses\n"
        "assert register_verl_losses() == ['stppo_late_user_preset']\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# -- parity through verl's own call site -------------------------------------------------------------------------
@pytest.mark.parametrize("agg", VERL_AGG_MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_stppo_ppo_is_verl_vanilla_to_the_bit_through_ppo_loss(agg, weighted):
    mask, _, old, new, advantages = random_batch(spread=0.5)
    weights = torch.rand(mask.shape) * 2 if weighted else None
    global_info = dict(dp_size=2, batch_num_tokens=int(mask.sum()) * 3, global_batch_size=mask.shape[0] * 3)
    ours = call_ppo_loss(actor_config("stppo_ppo", agg), mask, old, new, advantages, weights, **global_info)
    verls = call_ppo_loss(actor_config("vanilla", agg), mask, old, new, advantages, weights, **global_info)
    assert metric(verls[1], "actor/pg_clipfrac") > 0  # the batch exercises clipping
    assert torch.equal(ours[0], verls[0]) and torch.equal(ours[2], verls[2])
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert metric(ours[1], name) == metric(verls[1], name), name
    assert metric(ours[1], "actor/stppo/turn_clip_frac") >= 0  # ours besides


def test_parity_needs_dual_clip_off_in_vanilla():
    """stppo_ppo has no dual clip: with vanilla's default clip_ratio_c = 3 the two differ where A < 0 and the
    ratio is above 3 (so the parity above compares like with like)."""
    mask, _, old, new, advantages = random_batch()
    new = torch.where(advantages < 0, old + 2.0, new)  # ratio e^2 > 3 on negative advantages
    ours = call_ppo_loss(actor_config("stppo_ppo", clip_ratio_c=3.0), mask, old, new, advantages)
    verls = call_ppo_loss(actor_config("vanilla", clip_ratio_c=3.0), mask, old, new, advantages)
    assert ours[0] > verls[0]


def microbatched_loss(loss_mode, agg, mask, old, new, advantages, split=2):
    """Sum of verl's ppo_loss over ``split`` micro-batches normalised by the whole batch (as verl's engines do)."""
    total_loss, total_grad, rows = 0.0, torch.zeros_like(new), mask.shape[0] // split
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    for start in range(0, mask.shape[0], rows):
        part = slice(start, start + rows)
        loss, _, grad = call_ppo_loss(actor_config(loss_mode, agg), mask[part], old[part], new[part],
                                      advantages[part], **info)
        total_loss, total_grad[part] = total_loss + loss, grad
    return total_loss, total_grad


@pytest.mark.parametrize("preset", [name for name, p in ALGORITHMS.items()
                                    if not p.clip_bias_correction and not_in_verl(p) is None])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_presets_equal_this_projects_own_losses_with_explicit_turn_ids(preset, agg):
    """Two micro-batches through verl's ppo_loss (turn ids from the mask) add up to our loss on the whole batch with
    turn ids given explicitly: value and gradient."""
    mask, turn_ids, old, new, advantages = random_batch(seed=1, spread=0.8)
    low, high = 0.2, 0.28
    config = dataclasses.replace(ALGORITHMS[preset], clip_low=low, clip_high=high, loss_agg=agg,
                                 loss_scale_factor=float(mask.shape[1]))  # verl's default: the padded length
    new_ours = new.clone().requires_grad_(True)
    expected, _, ours_metrics = get_policy_loss(config.policy_loss)(
        logprobs=new_ours, old_logprobs=old, advantages=advantages, loss_mask=mask, turn_ids=turn_ids, config=config)
    (expected_grad,) = torch.autograd.grad(expected, new_ours)
    # M2PO's mask is a statistic of the micro-batch it is given (in this project's trainer too): one micro-batch
    split = 1 if config.policy_loss == "m2po" else 2
    loss, grad = microbatched_loss(f"stppo_{preset}", agg, mask, old, new, advantages, split)
    assert float(ours_metrics.get("clip_frac", 1.0)) > 0
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)


def test_turn_level_clips_whole_turns_where_token_level_clips_tokens():
    """One turn whose token ratios are 1.5 and 1/1.5: no token-level average of it leaves the clip range at turn
    level (geometric mean 1), while token level clips the 1.5 token."""
    mask = torch.tensor([[True, True, False]])
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.4054651, -0.4054651, 0.0]])
    advantages = torch.ones(1, 3)
    turn = call_ppo_loss(actor_config("stppo_turn_ppo"), mask, old, new, advantages)
    token = call_ppo_loss(actor_config("stppo_ppo"), mask, old, new, advantages)
    assert metric(turn[1], "actor/pg_clipfrac") == 0.0 and metric(token[1], "actor/pg_clipfrac") == 0.5
    assert metric(turn[1], "actor/stppo/turn_clip_frac") == 0.0


def test_rollout_is_weights_scale_the_turn_level_loss():
    mask, _, old, new, advantages = random_batch(seed=2)
    plain = call_ppo_loss(actor_config("stppo_turn_ppo"), mask, old, new, advantages)
    halved = call_ppo_loss(actor_config("stppo_turn_ppo"), mask, old, new, advantages, torch.full(mask.shape, 0.5))
    torch.testing.assert_close(halved[0], plain[0] / 2)
    torch.testing.assert_close(halved[2], plain[2] / 2)


def test_a_turn_level_loss_reads_turns_from_the_record_not_from_the_mask():
    """A token dropped from the mask inside a turn (verl's rollout rejection) leaves its turn whole when the engine
    hands the record over; a record that leaves policy tokens outside its turns is refused."""
    from stppo_agent.integrations.verl import turns

    mask, turn_ids, old, new, advantages = random_batch(seed=3, spread=0.6)
    spans = [turns.spans_from_mask(row.tolist()) for row in mask.long()]
    holed = mask.clone()
    holed[0, 1] = holed[2, 3] = False  # inside row 0's first turn (3 tokens) and row 2's second (2 tokens)
    true_ids = torch.where(holed, turn_ids, torch.full_like(turn_ids, -1))
    config = dataclasses.replace(ALGORITHMS["turn_ppo"], clip_low=0.2, clip_high=0.28)
    new_ours = new.clone().requires_grad_(True)
    expected, _, _ = get_policy_loss("ppo_clip")(logprobs=new_ours, old_logprobs=old, advantages=advantages,
                                                 loss_mask=holed, turn_ids=true_ids, config=config)
    (expected_grad,) = torch.autograd.grad(expected, new_ours)
    with turns.recorded(spans):
        loss, _, grad = call_ppo_loss(actor_config("stppo_turn_ppo"), holed, old, new, advantages)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)
    from_mask, _, _ = call_ppo_loss(actor_config("stppo_turn_ppo"), holed, old, new, advantages)
    assert not torch.allclose(from_mask, loss)  # the runs of the mask read three turns where there are two
    with turns.recorded([row[:1] for row in spans]), pytest.raises(ValueError, match="outside its recorded turns"):
        call_ppo_loss(actor_config("stppo_turn_ppo"), holed, old, new, advantages)
    # a row from a loop that writes no record (None) is read from its mask (row 0: its hole splits its first turn)
    partial_ids = torch.where(torch.arange(len(spans))[:, None] == 0, bridge.turn_ids_from_mask(holed), true_ids)
    new_ours = new.clone().requires_grad_(True)
    expected, _, _ = get_policy_loss("ppo_clip")(logprobs=new_ours, old_logprobs=old, advantages=advantages,
                                                 loss_mask=holed, turn_ids=partial_ids, config=config)
    with turns.recorded([None if row == 0 else row_spans for row, row_spans in enumerate(spans)]):
        partial, _, _ = call_ppo_loss(actor_config("stppo_turn_ppo"), holed, old, new, advantages)
    torch.testing.assert_close(partial, expected.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(partial, loss)


@pytest.mark.parametrize("preset", [name for name, p in ALGORITHMS.items() if p.clip_bias_correction])
def test_presets_with_the_clip_bias_correction_refuse_without_its_engine(preset):
    mask, _, old, new, advantages = random_batch()
    level = ALGORITHMS[preset].ratio_level  # the loss that gives the same ratio without the correction
    expected = f"clip-bias norm.*VERL_ENGINE_VENDOR=stppo.*{'stppo_turn_ppo' if level == 'turn' else 'stppo_ppo '}"
    with pytest.raises(bridge.ClipBiasEngineMissingError, match=expected):
        call_ppo_loss(actor_config(f"stppo_{preset}"), mask, old, new, advantages)
    assert get_policy_loss_fn(f"stppo_{preset}") is not None


@pytest.mark.parametrize("preset,plain", [("st_ppo", "turn_ppo"), ("s_ppo", "ppo"), ("so_grpo", "turn_ppo")])
def test_with_the_engine_collecting_the_loss_hands_over_this_projects_bias_surrogate(preset, plain):
    """Inside the stppo engine's collector, a correction preset's loss is the plain one at its ratio level, and it
    hands the engine agg(c_t rho_t A_t) equal to this project's ppo_clip bias surrogate: verl's dp_size 2 times the
    sum over twice this rank's tokens is ours over this rank's tokens."""
    from stppo_agent.integrations.verl import correction

    mask, turn_ids, old, new, advantages = random_batch(spread=0.6)
    sink = []
    with correction.collecting(sink):
        loss, _, grad = call_ppo_loss(actor_config(f"stppo_{preset}"), mask, old, new, advantages, dp_size=2,
                                      batch_num_tokens=2 * int(mask.sum()))
    plain_loss, _, plain_grad = call_ppo_loss(actor_config(f"stppo_{plain}"), mask, old, new, advantages, dp_size=2,
                                              batch_num_tokens=2 * int(mask.sum()))
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    (bias, log_prob), = sink
    config = dataclasses.replace(ALGORITHMS[preset], clip_low=0.2, clip_high=0.28)
    _, ours, _ = get_policy_loss("ppo_clip")(logprobs=new, old_logprobs=old, advantages=advantages, loss_mask=mask,
                                             turn_ids=turn_ids, config=config, global_num_tokens=int(mask.sum()))
    assert bias.requires_grad and log_prob.requires_grad
    torch.testing.assert_close(bias.detach(), ours, rtol=1e-6, atol=0)


# -- the parquet export through verl's RLHFDataset ------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_every_benchmark(tmp_path_factory.mktemp("verl_data"))


def test_every_benchmark_is_exported_to_its_own_parquet(exported):
    assert [p.name for p in exported] == [f"{name}_test.parquet" for name in BENCHMARKS]


def test_the_parquet_loads_through_verls_rlhf_dataset_with_the_envs_prompts(exported, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config = OmegaConf.create({"cache_dir": str(tmp_path), "max_prompt_length": 4096, "prompt_key": "prompt"})
    dataset = RLHFDataset([str(p) for p in exported], tokenizer, config)  # QA and MCQ files concatenated
    assert len(dataset) == PER_BENCHMARK * len(BENCHMARKS)  # nothing filtered out as unreadable
    for position, name in ((0, "nq"), (PER_BENCHMARK * list(BENCHMARKS).index("medqa") + 1, "medqa")):
        row = dataset[position]
        env = SearchQAEnv(name, split="test", retriever=OnePassage(), limit=PER_BENCHMARK, max_turns=3)
        prompt, info = env.reset(options={"index": row["index"]})
        assert row["raw_prompt"] == [{"role": "user", "content": prompt}]
        assert row["data_source"] == name and row["extra_info"]["example_id"] == info["example_id"]
        assert row["agent_name"] == export.ENV_AGENT and row["reward_model"]["style"] == "rule"
    assert dataset[0]["reward_model"]["ground_truth"]["choices"] == []
    assert len(dataset[PER_BENCHMARK * list(BENCHMARKS).index("medqa")]["reward_model"]["ground_truth"]["choices"]) >= 2


# -- a preset's other settings as verl overrides -----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_preset_becomes_overrides_of_verls_own_trainer_config(name):
    from omegaconf import OmegaConf, open_dict
    from verl.trainer import config as verl_config

    from stppo_agent.integrations.verl.settings import NotInVerlError, verl_overrides

    preset = ALGORITHMS[name]
    if preset.advantage == "turn_gae" or preset.dynamic_sampling:
        with pytest.raises(NotInVerlError, match=f"preset {name}: .*use stppo_"):
            verl_overrides(name)
        return
    base = OmegaConf.load(Path(verl_config.__file__).parent / "_generated_ppo_trainer.yaml")
    OmegaConf.set_struct(base, True)  # an override naming a key verl does not have fails here
    overrides = verl_overrides(name)
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist([o for o in overrides if not o.startswith("+")]))
    with open_dict(merged):  # Hydra's "+key=value" adds a key verl's config does not declare
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([o[1:] for o in overrides if o.startswith("+")]))
    engine_selected = merged.ray_kwargs.ray_init.runtime_env.get("env_vars", {}).get("VERL_ENGINE_VENDOR")
    # the engine applies the correction and hands the turn record to turn-level losses
    needs_engine = preset.clip_bias_correction or preset.ratio_level == "turn"
    assert engine_selected == ("stppo" if needs_engine else None)
    assert (merged.actor_rollout_ref.actor.strategy == "fsdp2") == needs_engine
    actor = merged.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == f"stppo_{name}" and f"stppo_{name}" in POLICY_LOSS_REGISTRY
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (preset.clip_low, preset.clip_high)
    assert actor.loss_agg_mode == preset.loss_agg and actor.use_kl_loss == (preset.kl_loss_coef > 0)
    assert merged.algorithm.adv_estimator == preset.advantage
