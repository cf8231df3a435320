"""Recorded rollouts, replay, per-step diagnostics and the off-policy metrics (issue 17)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from stppo_agent.cli import main
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.runs.recording import load_batch, recorded_iterations, recorded_world_size
from stppo_agent.training.config import merged
from stppo_agent.training.replay import replay
from stppo_agent.training.trainer import Trainer

from .test_trainer import toy_config

# Timing and throughput differ between any two runs; everything else an update logs must replay exactly.
TIMING = {"rollout_seconds", "iteration_seconds", "rollout_tokens_per_s", "update_tokens_per_s"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


def off_policy_config(model: Path, out: Path, algo: str, **overrides):
    """4 mini-batches x 2 epochs per iteration at a high learning rate: 7 of the 8 steps are off-policy."""
    values = dict(iterations=3, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                  optimizer=dict(mini_batch_size=4, micro_batch_size=2, epochs=2, actor_lr=2e-2),
                  logging=dict(save_rollouts=True))
    values = merged(values, overrides)
    return toy_config(model, out, algo, **values)


@pytest.fixture(scope="module")
def recorded_ppo(tiny_model, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("recorded") / "ppo"
    Trainer(off_policy_config(tiny_model, run, "ppo")).train()
    return run


def test_recording_holds_every_iteration_the_initial_weights_and_transcripts(recorded_ppo, tiny_model):
    folder = recorded_ppo / "rollouts"
    assert recorded_iterations(folder, 0) == [1, 2, 3]
    fmt = json.loads((folder / "format.json").read_text())
    assert fmt["format"] == "stppo-rollouts" and fmt["version"] == 2
    assert all(recorded_world_size(folder, i) == 1 for i in (1, 2, 3))  # per iteration: a resume may change it
    # the initial actor is the model the run started from, bit for bit
    from safetensors.torch import load_file

    start, saved = load_file(str(tiny_model / "model.safetensors")), load_file(
        str(folder / "initial" / "actor" / "model.safetensors"))
    assert start.keys() == saved.keys() and all(torch.equal(start[k], saved[k]) for k in start)
    assert not (folder / "initial" / "critic").exists()  # rebuilt from the actor on replay, as the run built it
    batch = load_batch(folder, 2, 0)
    assert batch.batch_size == 16 and batch.loss_mask.dtype == torch.bool
    assert bool((batch.turn_ids[~batch.loss_mask] == -1).all())
    # behaviour log-probs are those of the sampled tokens: negative on policy tokens, zero elsewhere
    assert bool((batch.sample_logprobs[batch.loss_mask] < 0).all())
    assert bool((batch.sample_logprobs[~batch.loss_mask] == 0).all())
    lines = [json.loads(x) for x in (folder / "iter-000002.rank-0.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and [x["row"] for x in lines] == list(range(16))
    assert [x["reward"] for x in lines] == batch.rewards.tolist()
    assert [x["group_id"] for x in lines] == batch.group_ids.tolist()
    first = lines[0]
    assert first["example_id"].startswith("toy-") and first["transcript"][0][0] == "prompt"
    roles = [segment[0] for segment in first["transcript"][1:]]
    assert roles[0] == "policy" and set(roles) <= {"policy", "observation"}
    assert read_metrics(recorded_ppo)[1]["reward"] == pytest.approx(float(batch.rewards.mean()))


def test_the_recorded_run_puts_ppo_off_policy(recorded_ppo):
    records = read_metrics(recorded_ppo)
    assert all(r["offpolicy/steps"] == 7 for r in records)
    assert max(r["offpolicy/clip_frac"] for r in records) > 0  # clipping happens, and only off-policy
    assert max(r["offpolicy/clip_frac"] for r in records) > max(r["clip_frac"] for r in records) - 1e-12


def test_replay_with_the_same_algorithm_reproduces_the_logged_update_metrics(recorded_ppo, tmp_path):
    replay(recorded_ppo, None, str(tmp_path / "again"), report=lambda _: None)
    original, again = read_metrics(recorded_ppo), read_metrics(tmp_path / "again")
    assert len(original) == len(again) == 3
    for a, b in zip(original, again):
        keys = set(a) - TIMING
        assert keys <= set(b)
        for key in sorted(keys):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    steps = [json.loads(x) for x in (tmp_path / "again" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 3 * 8 and [s["minibatch"] for s in steps[:8]] == list(range(8))
    for step in steps:  # PPO clips a token only where its ratio left the range (and the advantage agrees)
        assert step["clip_frac"] <= step["token_outside_frac"] + 1e-9
        if step["on_policy"]:
            assert step["token_outside_frac"] == step["turn_outside_frac"] == 0
    assert max(s["token_outside_frac"] for s in steps) > 0
    # PPO's replay measures ||C|| too, without rescaling: the diagnostics compare across rules
    assert max(s["clip_bias_norm"] for s in steps) > 0 and "clip_bias_scale" not in steps[-1]
    assert again[-1]["offpolicy/clip_bias_norm"] > 0 and "clip_bias_scale" not in again[-1]


def test_replay_through_st_ppo_diagnoses_every_step(recorded_ppo, tmp_path):
    out = tmp_path / "st"
    assert main(["replay", str(recorded_ppo), "--algo", "st_ppo", "--output-dir", str(out),
                 "--set", "algorithm.clip_bias_kappa=0.01"]) == 0
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 24
    for step in steps:
        if step["on_policy"]:  # nothing has moved: ratios 1 (up to float noise of another batch shape), C = 0
            assert step["grad_cos_to_first"] == pytest.approx(1.0)
            for key in ("ratio_max", "ratio_min", "turn_ratio_p99", "turn_ratio_max"):
                assert step[key] == pytest.approx(1.0, abs=1e-5)
            assert step["clip_frac"] == 0 and step["clip_bias_norm"] == 0 and step["clip_bias_scale"] == 1
        else:
            assert -1 <= step["grad_cos_to_first"] < 1
            assert step["ratio_min"] <= step["ratio_p99"] <= step["ratio_max"]
            assert step["turn_ratio_min"] <= step["turn_ratio_p99"] <= step["turn_ratio_max"]
    clipped = [s for s in steps if s["clip_frac"] > 0]
    assert clipped, "the replayed batches must clip"
    # kappa 0.01: wherever C is non-zero the correction divides the gradient by ||C|| / kappa
    for step in clipped:
        if step["clip_bias_norm"] > 0.01:
            assert step["clip_bias_scale"] == pytest.approx(step["clip_bias_norm"] / 0.01, rel=1e-5)
    last = read_metrics(out)[-1]
    assert last["offpolicy/clip_bias_scale"] > 1
    assert json.loads((out / "replay.json").read_text())["recorded_algo"] == "ppo"


def test_replay_differs_from_the_recording_under_another_rule(recorded_ppo, tmp_path):
    replay(recorded_ppo, "grpo", str(tmp_path / "grpo"), report=lambda _: None)
    original, grpo = read_metrics(recorded_ppo), read_metrics(tmp_path / "grpo")
    assert [r["reward"] for r in original] == [r["reward"] for r in grpo]  # the same recorded data
    assert original[0]["pg_loss"] != grpo[0]["pg_loss"]  # a different update rule
    assert "value_loss" in original[0] and "value_loss" not in grpo[0]


def test_replay_errors_are_clear(recorded_ppo, tiny_model, tmp_path):
    plain = tmp_path / "plain"
    Trainer(toy_config(tiny_model, plain, "ppo", iterations=1)).train()
    with pytest.raises(FileNotFoundError, match="logging.save_rollouts=true"):
        replay(plain, None, str(tmp_path / "x"))
    with pytest.raises(KeyError, match="unknown algorithm"):
        replay(recorded_ppo, "no_such_algo", str(tmp_path / "y"))
    with pytest.raises(ValueError, match="recorded only 3"):
        replay(recorded_ppo, None, str(tmp_path / "z"), iterations=5)
    other = build_tiny_llama(tmp_path / "other", word_tokenizer(["say", "ok", "red", "green", "blue", "gold", "extra"]))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        replay(recorded_ppo, None, str(tmp_path / "w"), [f"model={other}"])
    assert main(["replay", str(plain), "--output-dir", str(tmp_path / "v")]) == 1


def test_step_means_separate_off_policy_steps():
    from stppo_agent.monitoring.step_diagnostics import StepMeans

    means = StepMeans()
    means.add({"clip_frac": 0.0, "pg_loss": 1.0}, on_policy=True)
    means.add({"clip_frac": 0.3, "pg_loss": 2.0}, on_policy=False)
    means.add({"clip_frac": 0.1, "pg_loss": 3.0}, on_policy=False)
    out = means.means()
    assert out["clip_frac"] == pytest.approx(0.4 / 3) and out["pg_loss"] == 2.0
    assert out["offpolicy/clip_frac"] == pytest.approx(0.2) and out["offpolicy/steps"] == 2
    assert "offpolicy/pg_loss" not in out
    single = StepMeans()
    single.add({"clip_frac": 0.0}, on_policy=True)
    assert "offpolicy/clip_frac" not in single.means()
    assert not math.isnan(single.means()["clip_frac"])


def as_if_recorded_with_vllm(run: Path, copy: Path) -> Path:
    """``run``'s folder as a vLLM-backed run would have written it: config.yaml holds the backend and the rollout
    correction ``auto`` resolved to for it (token-level TIS at cap 2 for ppo)."""
    import shutil

    import yaml

    shutil.copytree(run, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["rollout"]["backend"] = "vllm"
    config["algorithm"].update(rollout_correction="tis", rollout_correction_level="token", rollout_correction_cap=2.0)
    (copy / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return copy


def test_replay_through_another_rule_keeps_the_recorded_rollout_correction(recorded_ppo, tmp_path):
    # issue 30, item 3: the correction belongs to the data (which engine sampled it), not to the update rule
    from stppo_agent.training.replay import replay_config

    run = as_if_recorded_with_vllm(recorded_ppo, tmp_path / "vllm-run")
    messages = []
    replay(run, "grpo", str(tmp_path / "grpo"), iterations=1, report=messages.append)
    algo = replay_config(run, "grpo", str(tmp_path / "unused")).algorithm_config()
    assert (algo.rollout_correction, algo.rollout_correction_level, algo.rollout_correction_cap) == ("tis", "token", 2)
    assert "rollout_correction/truncated_frac" in read_metrics(tmp_path / "grpo")[0]  # the correction ran
    said = [m for m in messages if m.startswith("rollout correction")]
    assert said and "tis" in said[0] and "kept from the recorded run" in said[0] and "vllm" in said[0], messages
    assert json.loads((tmp_path / "grpo" / "replay.json").read_text())["rollout_correction"] == "tis"
    # a turn-level rule corrects at its own level, as `auto` would have chosen for it under vLLM
    st = replay_config(run, "st_ppo", str(tmp_path / "unused")).algorithm_config()
    assert (st.rollout_correction, st.rollout_correction_level) == ("tis", "turn")
    # an explicit setting wins, and is said to
    off = replay_config(run, "grpo", str(tmp_path / "unused"), ["algorithm.rollout_correction=none"])
    assert off.algorithm_config().rollout_correction == "none"
    mis = replay_config(run, "st_ppo", str(tmp_path / "unused"), ["algorithm.rollout_correction=mis",
                                                                   "algorithm.rollout_correction_level=sequence"])
    assert (mis.algorithm_config().rollout_correction, mis.algorithm_config().rollout_correction_level) == \
        ("mis", "sequence")
    # a run recorded with transformers generate had no correction, and its replays have none
    plain = replay_config(recorded_ppo, "grpo", str(tmp_path / "unused")).algorithm_config()
    assert plain.rollout_correction == "none"


def test_replay_refuses_other_sampling_settings_than_the_recorded_ones(recorded_ppo, tmp_path):
    # the recorded tokens were drawn at the recorded temperature / top-p / top-k, and scoring must use the same
    # distribution (issue 30, item 1): a replay that rescored them at another temperature would see ratios != 1
    from stppo_agent.training.replay import replay_config

    recorded = replay_config(recorded_ppo, "grpo", str(tmp_path / "unused"))
    for override in ("rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=20"):
        with pytest.raises(ValueError, match="settings that sampled them.*drop that --set"):
            replay_config(recorded_ppo, "grpo", str(tmp_path / "unused"), [override])
    same = replay_config(recorded_ppo, "grpo", str(tmp_path / "unused"),
                         [f"rollout.temperature={recorded.rollout.temperature}"])
    assert same.rollout.temperature == recorded.rollout.temperature


def _split_as_ranks(batch, world: int) -> list:
    """The shares ``world`` processes would have sampled of ``batch``: prompts ``rank::world``, each prompt's
    samples together (what live rollouts give each rank)."""
    groups = sorted(set(batch.group_ids.tolist()))
    shares = []
    for rank in range(world):
        mine = set(groups[rank::world])
        rows = [row for row, group in enumerate(batch.group_ids.tolist()) if group in mine]
        shares.append(batch.select(rows).trimmed())
    return shares


def _record_with_world_sizes(source: Path, target: Path, worlds: dict[int, int]) -> Path:
    """A copy of ``source``'s recorded run whose iteration k was recorded by ``worlds[k]`` processes, written
    through the recorder in iteration order (as a run resumed with another process count writes it)."""
    import shutil

    from stppo_agent.runs.recording import RolloutRecorder

    target.mkdir()
    shutil.copy(source / "config.yaml", target / "config.yaml")
    shutil.copytree(source / "rollouts" / "initial", target / "rollouts" / "initial")
    tokenizer = word_tokenizer()
    for iteration, world in sorted(worlds.items()):
        batch = load_batch(source / "rollouts", iteration, 0)
        for rank, share in enumerate(_split_as_ranks(batch, world)):
            RolloutRecorder(target, tokenizer, rank, world).record(iteration, share)
    return target


def test_replay_reads_every_ranks_files_of_iterations_recorded_by_another_process_count(recorded_ppo, tmp_path):
    # issue 33, item 7: iteration 1 recorded by 2 processes, then a resume with 1 process recorded 2 and 3 (and
    # re-recorded 3, which the 2-process attempt had written before it was killed)
    from stppo_agent.runs.recording import RolloutRecorder

    run = _record_with_world_sizes(recorded_ppo, tmp_path / "mixed", {1: 2, 3: 2})
    resumed = RolloutRecorder(run, word_tokenizer(), 0, 1)
    for iteration in (2, 3):
        resumed.record(iteration, load_batch(recorded_ppo / "rollouts", iteration, 0))
    assert not (run / "rollouts" / "iter-000003.rank-1.safetensors").exists()  # the stale share is gone
    assert (run / "rollouts" / "iter-000001.rank-1.safetensors").exists()
    replay(run, None, str(tmp_path / "again"), report=lambda _: None)
    original, again = read_metrics(recorded_ppo), read_metrics(tmp_path / "again")
    assert [r["reward"] for r in again] == [r["reward"] for r in original]  # every row of every iteration
    for a, b in zip(original, again):  # the 2-process iteration merges into the 1-process batch, bit for bit
        for key in ("grad_norm", "pg_loss", "clip_frac", "value_loss", "response_tokens", "advantage/mean"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_replay_shares_a_recorded_iteration_among_another_number_of_processes(recorded_ppo, tmp_path):

    from stppo_agent.runs.recording import TENSOR_FIELDS

    def tensors_equal(a, b) -> bool:
        return a.prompt_width == b.prompt_width and all(
            torch.equal(getattr(a, n).cpu(), getattr(b, n).cpu()) for n in TENSOR_FIELDS)
    from stppo_agent.training.replay import RecordedRollouts

    run = _record_with_world_sizes(recorded_ppo, tmp_path / "two", {1: 2, 2: 1, 3: 1})
    whole = load_batch(recorded_ppo / "rollouts", 1, 0)
    for world in (1, 2):  # recorded by 2 (iteration 1) and by 1 (iteration 2), replayed by 1 and by 2 processes
        for rank in range(world):
            source = RecordedRollouts(run, word_tokenizer(), rank, world)
            for iteration in (1, 2):
                expected = _split_as_ranks(load_batch(recorded_ppo / "rollouts", iteration, 0), world)[rank] \
                    if world > 1 else load_batch(recorded_ppo / "rollouts", iteration, 0)
                got = source.next_batch(iteration - 1)
                assert got.group_ids.tolist() == expected.group_ids.tolist()
                assert torch.equal(got.trimmed().response_ids, expected.trimmed().response_ids)
                assert got.rewards.tolist() == expected.rewards.tolist()
                if world == 1 and iteration == 1:
                    assert tensors_equal(got, whole)
                    assert got.stats["reward"] == pytest.approx(float(whole.rewards.mean()))
    (run / "rollouts" / "iter-000001.rank-1.safetensors").unlink()
    with pytest.raises(ValueError, match="iteration 1 was recorded by 2 processes.*rank-1.*missing"):
        replay(run, None, str(tmp_path / "x"), report=lambda _: None)
