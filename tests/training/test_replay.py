"""``stppo_agent.training.replay``: recorded rollouts replayed -- the config a replay
runs with, the batches it serves each rank, per-step diagnostics and the off-policy metrics."""

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
from tests.support.runs import TIMING, toy_config


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
    from stppo_agent.algorithms.metrics import StepMeans

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
    # the correction belongs to the data (which engine sampled it), not to the update rule
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
    # distribution: a replay that rescored them at another temperature would see ratios != 1
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
    # iteration 1 recorded by 2 processes, then a resume with 1 process recorded 2 and 3 (and
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


# --- replay: the config a replay runs with, the batches it serves --------------------------------------------


def synthetic_batch(groups: int, per_group: int = 2):
    from stppo_agent.rollouts.batch import RolloutBatch

    rows = groups * per_group
    return RolloutBatch(
        input_ids=torch.arange(rows * 3).reshape(rows, 3) % 7 + 3, attention_mask=torch.ones(rows, 3, dtype=torch.long),
        prompt_width=1, response_ids=torch.arange(rows * 2).reshape(rows, 2) % 7 + 3,
        loss_mask=torch.ones(rows, 2, dtype=torch.bool), turn_ids=torch.zeros(rows, 2, dtype=torch.long),
        sample_logprobs=torch.zeros(rows, 2), rewards=torch.arange(rows, dtype=torch.float),
        group_ids=torch.arange(rows) // per_group, terminated=torch.ones(rows, dtype=torch.bool),
        truncated=torch.zeros(rows, dtype=torch.bool), stats={"reward": 1.0})


def recorded_run(tmp_path: Path, iterations=(1, 2, 3), worlds: dict | None = None, backend: str = "hf",
                 algo: str = "ppo", algorithm: dict | None = None, critic: bool = False, **config) -> Path:
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.runs.recording import RolloutRecorder
    from stppo_agent.training.config import from_dict, merged

    run = tmp_path / "recorded"
    values = dict(algo=algo, env="stppo/Toy-v0", model="tiny-model", output_dir=str(run),
                  iterations=config.pop("planned", len(iterations)), algorithm=algorithm or {"clip_high": 0.3},
                  logging=dict(progress=False, tensorboard=False, save_rollouts=True),
                  rollout=dict(backend=backend, temperature=0.9), distributed=dict(share_retriever=True))
    original = from_dict(merged(values, config))
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(original.to_yaml(resolved=original.algorithm_config()))
    (run / "rollouts" / "initial" / "actor").mkdir(parents=True)
    if critic:
        (run / "rollouts" / "initial" / "critic").mkdir()
    tokenizer = word_tokenizer()
    RolloutRecorder(run, tokenizer, 0, 1)  # format.json
    for iteration in iterations:
        world = (worlds or {}).get(iteration, 1)
        whole = synthetic_batch(4)
        for rank in range(world):
            share = whole.select(torch.isin(whole.group_ids, torch.arange(4)[rank::world]).nonzero().flatten())
            RolloutRecorder(run, tokenizer, rank, world).record(iteration, share)
    return run


def test_replay_config_keeps_the_recorded_run_but_not_its_recording_settings(tmp_path):
    from stppo_agent.training.replay import replay_config

    run = recorded_run(tmp_path)
    config = replay_config(run, None, str(tmp_path / "out"), ["optimizer.actor_lr=0.5"])
    assert (config.algo, config.iterations, config.optimizer.actor_lr) == ("ppo", 3, 0.5)
    assert config.output_dir == str(tmp_path / "out")
    assert (config.logging.save_rollouts, config.rollout.backend, config.distributed.share_retriever) == (False, "hf",
                                                                                                          False)
    assert config.logging.step_diagnostics is True and config.rollout.temperature == 0.9
    assert config.model == str(run / "rollouts" / "initial" / "actor") and config.critic_model is None
    assert config.algorithm_config().clip_high == 0.3  # the same algorithm keeps the recorded overrides
    assert replay_config(run, "ppo", str(tmp_path / "o")).algorithm_config().clip_high == 0.3
    other = replay_config(run, "grpo", str(tmp_path / "o"))
    assert other.algo == "grpo" and other.algorithm_config().clip_high != 0.3
    assert replay_config(run, None, str(tmp_path / "o"), iterations=2).iterations == 2
    with pytest.raises(ValueError, match=r"^iterations=4: /.* recorded only 3$"):
        replay_config(run, None, str(tmp_path / "o"), iterations=4)
    with pytest.raises(ValueError, match="recorded only 3"):
        replay_config(run, None, str(tmp_path / "o"), ["iterations=4"])
    stopped = recorded_run(tmp_path / "s", planned=10)  # a run stopped after 3 of its 10 iterations
    assert replay_config(stopped, None, "o").iterations == 3
    with_critic = recorded_run(tmp_path / "c", critic=True)
    assert replay_config(with_critic, None, "o").critic_model == str(with_critic / "rollouts" / "initial" / "critic")


@pytest.mark.parametrize("override, said", [("rollout.temperature=0.7",
                                             "rollout.temperature=0.9 recorded, rollout.temperature=0.7 asked"),
                                            ("rollout.top_p=0.5",
                                             "rollout.top_p=1.0 recorded, rollout.top_p=0.5 asked"),
                                            ("rollout.top_k=3", "rollout.top_k=0 recorded, rollout.top_k=3 asked")])
def test_replay_config_refuses_another_sampling_distribution(tmp_path, override, said):
    from stppo_agent.training.replay import replay_config

    with pytest.raises(ValueError, match=(f"^a replay scores the recorded tokens with the settings that "
                                          f"sampled them; {said}: drop that --set$")):
        replay_config(recorded_run(tmp_path), "grpo", "o", [override])


def test_replay_config_refuses_a_folder_without_a_complete_recording(tmp_path):
    from stppo_agent.training.replay import replay_config

    with pytest.raises(FileNotFoundError, match=r"^/.* is not a run folder \(/.*/config.yaml is missing\)$"):
        replay_config(tmp_path, None, "o")
    with pytest.raises(FileNotFoundError, match="^/.*/rollouts holds no recorded iteration$"):
        replay_config(recorded_run(tmp_path / "a", iterations=()), None, "o")
    with pytest.raises(ValueError, match=r"recorded iterations are not 1..N \(\[1, 3\]\.\.\.\); was the run resumed"):
        replay_config(recorded_run(tmp_path / "b", iterations=(1, 3)), None, "o")
    with pytest.raises(ValueError, match=(r"recorded iterations are not 1..N \(\[2, 3\]\.\.\.\); was the "
                                          r"run resumed from a checkpoint after deleting recordings\?$")):
        replay_config(recorded_run(tmp_path / "d", iterations=(2, 3)), None, "o")
    with pytest.raises(ValueError, match=r"not 1..N \(\[1, 2, 3, 4, 5\]\.\.\.\)"):
        replay_config(recorded_run(tmp_path / "f", iterations=(1, 2, 3, 4, 5, 7)), None, "o")
    torn = recorded_run(tmp_path / "e", worlds={2: 2})
    (torn / "rollouts" / "iter-000002.rank-1.safetensors").unlink()
    with pytest.raises(ValueError, match=("^/.*/rollouts: iteration 2 was recorded by 2 processes, but "
                                          "the share of rank-1 is missing; a replay would use part of "
                                          "its data$")):
        replay_config(torn, None, "o")


def test_the_rollout_correction_follows_the_data_into_another_rule(tmp_path):
    from stppo_agent.training.config import load_config
    from stppo_agent.training.replay import describe_correction, recorded_correction, replay_config

    vllm = recorded_run(tmp_path / "v", backend="vllm", algorithm={"rollout_correction": "tis",
                                                                    "rollout_correction_level": "token",
                                                                    "rollout_correction_cap": 3.0})
    original = load_config(vllm / "config.yaml")
    assert recorded_correction(original) == {"rollout_correction": "tis", "rollout_correction_cap": 3.0}
    st = replay_config(vllm, "st_ppo", "o").algorithm_config()
    assert (st.rollout_correction, st.rollout_correction_level, st.rollout_correction_cap) == ("tis", "turn", 3.0)
    by_hand = recorded_run(tmp_path / "h", backend="vllm", algorithm={"rollout_correction": "mis",
                                                                       "rollout_correction_level": "sequence"})
    assert recorded_correction(load_config(by_hand / "config.yaml")) == {
        "rollout_correction": "mis", "rollout_correction_cap": 2.0, "rollout_correction_level": "sequence"}
    grpo = replay_config(vllm, "grpo", "o")
    assert describe_correction(grpo, original, []) == (
        "rollout correction: tis at token level, cap 3, kept from the recorded run (its batches were sampled by "
        "vllm); --set algorithm.rollout_correction=none|tis|mis to change it")
    off = replay_config(vllm, "grpo", "o", ["algorithm.rollout_correction=none"])
    assert describe_correction(off, original, ["algorithm.rollout_correction=none"]) == (
        "rollout correction: none (set here; the recorded run used tis)")
    plain = recorded_run(tmp_path / "p")
    assert describe_correction(replay_config(plain, "grpo", "o"), load_config(plain / "config.yaml"), []).startswith(
        "rollout correction: none, kept from the recorded run (its batches were sampled by hf)")


def test_recorded_rollouts_serve_each_rank_its_share_of_every_iteration(tmp_path):
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.training.replay import RecordedRollouts

    run = recorded_run(tmp_path, worlds={1: 2, 2: 1})

    def source(rank, world):
        return RecordedRollouts(run, word_tokenizer(), rank, world)

    one = source(0, 1)
    assert one.iterations == [1, 2, 3] and one.state() == {} and one.load({"x": 1}) is None
    assert one.next_batch(0).group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # two shares merged, prompt order
    assert one.next_batch(1).rewards.tolist() == list(map(float, range(8)))
    for rank in (0, 1):
        assert source(rank, 2).next_batch(0).group_ids.tolist() == [rank, rank, rank + 2, rank + 2]  # as recorded
        assert source(rank, 2).next_batch(1).group_ids.tolist() == [rank, rank, rank + 2, rank + 2]  # r::world
    assert source(3, 4).next_batch(2).group_ids.tolist() == [3, 3]
    from stppo_agent.runs.recording import RolloutRecorder

    RolloutRecorder(run, word_tokenizer(), 0, 1).record(4, synthetic_batch(3))
    with pytest.raises(ValueError, match="iteration 4 holds 3 prompts, which 2 processes cannot share evenly"):
        source(1, 2).next_batch(3)
    assert source(0, 1).next_batch(3).group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match=("^recorded iteration 3 holds 4 prompts, which 3 processes "
                                          "cannot share evenly: replay it with a number of processes "
                                          "that divides that$")):
        source(0, 3).next_batch(2)
    with pytest.raises(ValueError, match=(r"^tokenizer mismatch: the model's tokenizer differs from the "
                                          r"one that recorded /.* \(vocab_sha256, vocab_size\); recorded "
                                          r"token ids would mean other text$")):
        RecordedRollouts(run, word_tokenizer(["other", "words"]))


def test_replay_builds_the_trainer_on_the_recording_and_writes_replay_json(tmp_path, monkeypatch):
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.rollouts.vllm_generation import VLLMGenerationBackend
    from stppo_agent.training.live_rollouts import RolloutContext
    from stppo_agent.training.replay import RecordedRollouts, replay

    run = recorded_run(tmp_path, backend="vllm", algorithm={"rollout_correction": "tis"})
    built = []

    class FakeTrainer:
        def __init__(self, config, report, rollout_source, resume, overwrite):
            self.config, self.report, self.rollout_source = config, report, rollout_source
            self.intent = (resume, overwrite)
            self.algo = config.algorithm_config()
            Path(config.output_dir).mkdir(parents=True)
            built.append(self)

        def train(self):
            return {"done": self.config.iterations}

    monkeypatch.setattr(trainer_module, "Trainer", FakeTrainer)
    messages = []
    out = tmp_path / "out"
    assert replay(run, "grpo", str(out), iterations=2, report=messages.append) == {"done": 2}
    trainer = built[0]
    assert trainer.config.algo == "grpo" and trainer.report == messages.append
    assert trainer.intent == (False, False)  # a folder holding a run is refused unless --resume or --overwrite
    engine = VLLMGenerationBackend.__new__(VLLMGenerationBackend)
    source = trainer.rollout_source(RolloutContext(trainer.config, trainer.algo, out, word_tokenizer(), engine, 1, 2))
    assert isinstance(source, RecordedRollouts) and source.folder == run / "rollouts"
    assert (source.rank, source.world, source.env_kwargs) == (1, 2, None)
    assert source.sampled_by_actor is False  # another rule than the recorded one
    written = {"replay_of": str(run.resolve()), "recorded_algo": "ppo", "algo": "grpo", "iterations": 2,
               "rollout_correction": "tis"}
    assert (out / "replay.json").read_text() == json.dumps(written, indent=1) + "\n"
    assert messages == ["rollout correction: tis at token level, cap 2, kept from the recorded run (its batches were "
                        "sampled by vllm); --set algorithm.rollout_correction=none|tis|mis to change it"]
    with pytest.raises(ValueError, match="^the replay's --output-dir must differ from the recorded run's folder$"):
        replay(run, None, str(run))
    assert len(built) == 1


def test_every_changed_sampling_setting_is_named(tmp_path):
    from stppo_agent.training.replay import replay_config

    with pytest.raises(ValueError, match="; rollout.temperature=0.9, rollout.top_p=1.0 recorded, "
                                         "rollout.temperature=0.7, rollout.top_p=0.5 asked: "):
        replay_config(recorded_run(tmp_path), "grpo", "o", ["rollout.temperature=0.7", "rollout.top_p=0.5"])


# A replay refuses another rollout staleness than the recorded one.


def test_replay_refuses_another_rollout_staleness_than_the_recorded_one(tmp_path):
    # the recorded tokens were sampled by weights K iterations old; a replay with another K took its behaviour
    # log-probs from other weights than those that sampled them (iteration 3 of a K=1 recording replayed with K=2
    # logged other ratios and clip fractions, while temperature, top_p and top_k are refused)
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
    from stppo_agent.training.replay import replay_config
    from stppo_agent.training.trainer import Trainer
    from tests.support.runs import toy_config

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    run = tmp_path / "run"
    Trainer(toy_config(model, run, "ppo", iterations=1,
                       rollout=dict(prompts_per_iteration=2, samples_per_prompt=2, staleness=1),
                       optimizer=dict(mini_batch_size=4, micro_batch_size=4, epochs=1),
                       logging=dict(save_rollouts=True))).train()
    for other in (0, 2):
        with pytest.raises(ValueError, match=r"rollout.staleness=1 recorded, rollout.staleness=%d asked" % other):
            replay_config(run, "grpo", str(tmp_path / "unused"), [f"rollout.staleness={other}"])
    assert replay_config(run, "grpo", str(tmp_path / "unused"),
                         ["rollout.stale_objective=decoupled"]).rollout.staleness == 1
