"""``stppo_agent.runs.run_summary``: the summary ``stppo train`` and ``stppo replay``
end with, read from the run folder; ``--json`` prints the last iteration's metrics instead."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from stppo_agent.runs.run_summary import human_bytes, run_summary
from tests.support.cli_in_process import stppo as run_in_process

TOY = ["--env", "stppo/Toy-v0", "--model", "tiny", "--set", "rollout.samples_per_prompt=4", "--set",
       "optimizer.actor_lr=1e-2",
       "--set", "optimizer.critic_lr=1e-2", "--set", "rollout.max_new_tokens_per_turn=1", "--set",
       "logging.tensorboard=false"]


def fake_run(folder: Path, algorithm: dict, records: list[dict], checkpoint_bytes: int = 0) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"algo": "st_ppo", "env": "stppo/NQ-v0,stppo/HotpotQA-v0",
                                                        "env_kwargs": {"retriever": "bm25:idx"},
                                                        "algorithm": algorithm,
                                                        "rollout": {"max_turns": 3, "max_new_tokens_per_turn": 64}}))
    lines = (json.dumps({"step": i + 1, **r}) + "\n" for i, r in enumerate(records))
    (folder / "metrics.jsonl").write_text("".join(lines))
    if checkpoint_bytes:
        step = folder / "checkpoints" / f"step-{len(records)}"
        step.mkdir(parents=True)
        (step / "weights").write_bytes(b"x" * checkpoint_bytes)
    return folder


def test_the_summary_reads_first_best_last_and_the_rules_own_figures(tmp_path):
    records = [{"reward": 0.1, "turn_clip_frac": 0.3, "clip_frac": 0.9, "clip_bias_scale": 1.5},
               {"reward": 0.7, "turn_clip_frac": 0.5, "clip_frac": 0.9, "clip_bias_scale": 2.0, "collapse/alarm": 1},
               {"reward": "nan", "turn_clip_frac": 0.2, "clip_frac": 0.9, "clip_bias_scale": 1.2},
               {"reward": 0.4, "turn_clip_frac": 0.1, "clip_frac": 0.9, "clip_bias_scale": 1.1}]
    run = fake_run(tmp_path / "run", {"ratio_level": "turn", "clip_bias_correction": True}, records, 2_500_000)
    lines = run_summary(run, "trained").splitlines()
    assert len(lines) <= 10
    text = "\n".join(lines)
    assert "0.100 (iteration 1) -> best 0.700 (iteration 2) -> 0.400 (iteration 4)" in text  # a NaN is skipped
    assert "turn clip share 0.300 -> 0.100 (max 0.500)" in text and "clip share 0.900" not in text
    assert "clip-bias correction scale 1.500 -> 1.100 (max 2.000)" in text
    assert "collapse alarm at iteration 2" in text
    assert f"checkpoints/step-4 ({human_bytes(2_500_000)})" in text and human_bytes(2_500_000) == "2.5 MB"
    command = next(line for line in lines if "stppo eval" in line).split("evaluate", 1)[1].strip()
    assert shlex.split(command) == ["stppo", "eval", "--agent", f"hf:{run}@latest", "--benchmarks", "nq,hotpotqa",
                                    "--retriever", "bm25:idx", "--max-turns", "3", "--max-new-tokens", "64",
                                    "--output-dir", str(run / "eval")]
    assert lines[-1].startswith(f"  run folder  {run}: 2.5 MB on disk")


def test_a_token_rule_without_correction_shows_token_clipping_only(tmp_path):
    run = fake_run(tmp_path / "run", {"ratio_level": "token", "clip_bias_correction": False},
                   [{"reward": 0.0, "clip_frac": 0.25, "turn_clip_frac": 0.5, "clip_bias_scale": 3.0}])
    text = run_summary(run)
    assert "token clip share 0.250 -> 0.250" in text and "correction" not in text and "turn clip" not in text
    assert "checkpoint  none written" in text and "stppo eval" not in text and "no collapse alarm" in text


@pytest.fixture
def stppo(tmp_path, capsys, monkeypatch):
    """`stppo ARGS` run in tmp_path (the commands name their folders relative to it, as in a user's shell)."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess:
        done = run_in_process(*args, capsys=capsys)
        assert done.returncode == 0, done.stderr[-3000:]
        return done
    return run


def test_train_and_replay_end_with_the_summary_and_its_eval_command_works(tmp_path, stppo):
    trained = stppo("train", "--algo", "st_ppo", "--output-dir", "toy", "--iterations", "2", *TOY,
                    "--set", "logging.save_rollouts=true").stdout
    summary = trained[trained.index("trained toy: st_ppo on stppo/Toy-v0, iterations 1-2"):].splitlines()
    assert len(summary) <= 10 and "{" not in trained, trained  # no JSON dump
    records = [json.loads(line) for line in (tmp_path / "toy" / "metrics.jsonl").read_text().splitlines()]
    assert f"{records[0]['reward']:.3f} (iteration 1)" in summary[1] and "turn clip share" in summary[2]
    assert "checkpoints/step-2 (" in trained and "toy: " in summary[-1] and " kB on disk" in summary[-1]
    command = shlex.split(next(line for line in summary if "stppo eval" in line).split("evaluate", 1)[1])
    assert command[:4] == ["stppo", "eval", "--agent", "hf:toy@latest"]
    stppo(*command[1:], "--limit", "1")  # as printed (cut to one question): it finds the checkpoint
    results = json.loads((tmp_path / "toy" / "eval" / "results.json").read_text())
    assert results[0]["provenance"]["agent"].endswith("step-2/actor")

    replayed = stppo("replay", "toy", "--algo", "turn_ppo", "--output-dir", "again").stdout
    assert "replay of toy written to again: turn_ppo on stppo/Toy-v0, iterations 1-2" in replayed
    assert "steps.jsonl" in replayed.splitlines()[-1] and "{" not in replayed


def test_json_prints_the_last_iterations_metrics_instead(tmp_path, stppo):
    out = stppo("train", "--algo", "grpo", "--output-dir", "toy", "--iterations", "1", "--json", *TOY).stdout
    metrics = json.loads(out[out.index("{"):])
    record = json.loads((tmp_path / "toy" / "metrics.jsonl").read_text())
    assert metrics["reward"] == record["reward"] and "run folder" not in out


def test_the_printed_eval_command_evaluates_the_data_and_settings_the_run_trained_on(tmp_path, stppo):
    """Run as printed, the command evaluates each trained benchmark on the run's own dataset (its evaluation split),
    with the run's retriever, top-k, turn and token limits and observation cut: what the results record."""
    questions = [{"id": f"q{i}", "question": f"who wrote book number {i}", "golden_answers": [f"author {i}"]}
                 for i in range(3)]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    trained = stppo("train", "--algo", "grpo", "--env", "stppo/NQ-v0,stppo/HotpotQA-v0", "--model", "tiny",
                    "--output-dir", "run", "--iterations", "1", "--set", "rollout.samples_per_prompt=2",
                    "--set", "rollout.prompts_per_iteration=2", "--set", "rollout.max_turns=2", "--set",
                    "rollout.max_new_tokens_per_turn=3",
                    "--set", "rollout.max_observation_tokens=40", "--set", "env_kwargs.dataset=mine.jsonl",
                    "--set", "env_kwargs.retriever=demo", "--set", "env_kwargs.topk=2", "--set",
                    "logging.tensorboard=false",
                    "--set", "logging.progress=false").stdout
    command = shlex.split(next(line for line in trained.splitlines() if "stppo eval" in line).split("evaluate", 1)[1])
    assert "(" not in trained.split("evaluate", 1)[1].splitlines()[1]  # default prompts: no caveat line
    stppo(*command[1:])
    results = {r["benchmark"]: r for r in json.loads((tmp_path / "run" / "eval" / "results.json").read_text())}
    assert sorted(results) == ["hotpotqa", "nq"]
    for record in results.values():
        provenance = record["provenance"]
        assert (provenance["dataset"], record["metrics"]["n"]) == ("mine.jsonl", len(questions))
        assert (provenance["retriever"], provenance["topk"], provenance["max_turns"]) == ("demo", 2, 2)
        assert (provenance["max_new_tokens"], provenance["max_observation_tokens"]) == (3, 40)
        assert provenance["agent"].endswith("checkpoints/step-1/actor")


def test_the_summary_says_when_the_run_used_prompts_eval_cannot_set(tmp_path):
    run = fake_run(tmp_path / "run", {"ratio_level": "token"}, [{"reward": 0.5}], 10)
    plain = run_summary(run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["env_kwargs"].update(question_mark=False, template="Q: {question}")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    lines = run_summary(run).splitlines()
    caveat = lines[next(i for i, line in enumerate(lines) if "stppo eval" in line) + 1]
    assert "env_kwargs template, question_mark, which stppo eval does not take" in caveat
    assert len(lines) == len(plain.splitlines()) + 1
    config["env_kwargs"].update(question_mark=True, template=None)  # the envs' defaults: nothing to say
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert run_summary(run).splitlines()[:-1] == plain.splitlines()[:-1]  # the last line: the folder's size


# -- run_summary ---------------------------------------------------------------------------------------------------
def test_run_summary_human_bytes_in_decimal_units_at_the_boundaries():
    from stppo_agent.runs.run_summary import human_bytes

    assert [human_bytes(n) for n in (0, 999, 1000, 1536000, 999_949, 10**9, 2.5e12, 10**15, 10**16)] == [
        "0 B", "999 B", "1.0 kB", "1.5 MB", "999.9 kB", "1.0 GB", "2.5 TB", "1000.0 TB", "10000.0 TB"]
    # a size that rounds up to 1000 of a unit is shown in the next one (not "1000.0 kB")
    assert [human_bytes(n) for n in (999_950, 999_999, 999_999_999, 999.6)] == ["1.0 MB", "1.0 MB", "1.0 GB",
                                                                                "1.0 kB"]


def test_run_summary_reward_line_first_best_last_and_the_earliest_of_equal_bests():
    from stppo_agent.runs.run_summary import reward_line

    records = [{"step": 1, "reward": 0.25}, {"step": 2, "reward": "nan"}, {"step": 3, "reward": 0.75},
               {"step": 4, "reward": True}, {"step": 5}, {"step": 6, "reward": 0.75}, {"step": 7, "reward": 0.5},
               {"step": 8, "reward": float("inf")}]
    assert reward_line(records) == "0.250 (iteration 1) -> best 0.750 (iteration 3) -> 0.500 (iteration 7)"
    assert reward_line([{"step": "2", "reward": -1}]) == "-1.000 (iteration 2) -> best -1.000 (iteration 2) -> " \
                                                          "-1.000 (iteration 2)"
    assert reward_line([{"step": 1, "loss": 1.0}]) == reward_line([]) == "no iteration recorded a reward"
    assert reward_line([{"step": 1, "reward": float("nan")}]) == "no iteration recorded a reward"


def test_run_summary_clipping_line_follows_the_rules_ratio_level_and_corrections():
    from stppo_agent.runs.run_summary import clipping_line

    records = [{"step": 1, "clip_frac": 0.1, "turn_clip_frac": 0.4, "clip_bias_scale": 1.0,
                "rollout_correction/truncated_frac": 0.0, "rollout_correction/masked_frac": 0.0},
               {"step": 2, "clip_frac": 0.3, "turn_clip_frac": 0.2, "clip_bias_scale": 0.5,
                "rollout_correction/truncated_frac": 0.0, "rollout_correction/masked_frac": 0.25},
               {"step": 3, "clip_frac": 0.2, "turn_clip_frac": 0.1, "clip_bias_scale": 0.75,
                "rollout_correction/masked_frac": 0.125}]
    assert clipping_line(records, {}) == ("token clip share 0.100 -> 0.200 (max 0.300); rollout-correction masked "
                                          "share 0.000 -> 0.125 (max 0.250)")
    assert clipping_line(records, {"ratio_level": "turn", "clip_bias_correction": True}) == (
        "turn clip share 0.400 -> 0.100 (max 0.400); clip-bias correction scale 1.000 -> 0.750 (max 1.000); "
        "rollout-correction masked share 0.000 -> 0.125 (max 0.250)")
    assert clipping_line(records, {"ratio_level": "sequence", "clip_bias_correction": False}).startswith(
        "sequence clip share 0.100 -> 0.200 (max 0.300); rollout-correction masked")
    truncated = [{"step": 1, "rollout_correction/truncated_frac": 0.5}]
    assert clipping_line(truncated, {}) == "rollout-correction truncated share 0.500 -> 0.500 (max 0.500)"
    assert clipping_line([{"step": 1, "rollout_correction/truncated_frac": 0.0}], {}) == "no clipping figures recorded"
    assert clipping_line([], {"clip_bias_correction": True}) == "no clipping figures recorded"


def test_run_summary_alarms_line_names_alarms_rollbacks_and_skipped_updates():
    from stppo_agent.runs.run_summary import alarms_line

    records = [{"step": 1, "nan_skips_total": 0}, {"step": 2, "collapse/alarm": True, "nan_skips_total": 2},
               {"step": 3, "collapse/alarm": 0, "collapse/rollback_to": 1, "nan_skips_total": 1},
               {"step": 4, "collapse/alarm": 1, "collapse/rollback_to": 3}]
    assert alarms_line(records) == ("collapse alarm at iteration 2, 4; rolled back to step 1, 3; 2 update(s) skipped "
                                    "for NaN/inf")
    assert alarms_line([{"step": 1, "nan_skips_total": 0}]) == "no collapse alarm"
    assert alarms_line([{"step": 1, "nan_skips_total": 1}]) == "no collapse alarm; 1 update(s) skipped for NaN/inf"
    assert alarms_line([{"step": 1, "collapse/rollback_to": 0}]) == "no collapse alarm; rolled back to step 0"


def test_run_summary_eval_command_on_the_trained_benchmarks_and_limits():
    from stppo_agent.runs.run_summary import eval_command

    config = {"env": "stppo/HotpotQA-v0, stppo/Toy-v0,stppo/NQ-v0", "env_kwargs": {"retriever": "bm25"},
              "max_turns": 3, "max_new_tokens_per_turn": 64}
    assert eval_command("runs/a b", config) == (
        "stppo eval --agent 'hf:runs/a b@latest' --benchmarks hotpotqa,nq --retriever bm25 --max-turns 3 "
        "--max-new-tokens 64 --output-dir 'runs/a b/eval'")
    assert eval_command("r", {"env": "stppo/Toy-v0", "env_kwargs": {"retriever": {"k": 1}}, "max_turns": 2.5,
                              "max_new_tokens_per_turn": 8}) == (
        "stppo eval --agent hf:r@latest --benchmarks nq --max-new-tokens 8 --output-dir r/eval")
    assert eval_command("r", {}) == "stppo eval --agent hf:r@latest --benchmarks nq --output-dir r/eval"
    assert eval_command("r", {"env_kwargs": None, "max_turns": 4}) == (
        "stppo eval --agent hf:r@latest --benchmarks nq --max-turns 4 --output-dir r/eval")


def test_run_summary_of_a_whole_run_folder(tmp_path, monkeypatch):
    from stppo_agent.runs.run_summary import folder_bytes, run_summary

    monkeypatch.chdir(tmp_path)
    run = Path("runs") / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("algo: st_ppo\nenv: stppo/MedQA-v0\nrollout:\n  max_turns: 2\noptimizer:\n"
                                     "  actor_lr: 1e-6\nalgorithm:\n  ratio_level: turn\n")
    (run / "metrics.jsonl").write_text(
        '{"step": 3, "reward": 0.5, "clip_frac": 0.9, "turn_clip_frac": 0.2}\n'
        '{"step": 4, "reward": 0.25, "turn_clip_frac": 0.1, "collapse/alarm": true}\n')
    (run / "checkpoints" / "step-3").mkdir(parents=True)
    (run / "checkpoints" / "step-4" / "actor").mkdir(parents=True)
    (run / "checkpoints" / "step-4" / "actor" / "w.bin").write_bytes(b"x" * 1500)
    (run / "checkpoints" / "step-4" / "t.json").write_bytes(b"y" * 100)
    size = folder_bytes(run)
    assert folder_bytes(run / "checkpoints") == 1600 and size > 1600
    assert run_summary(str(run), title="replay") == "\n".join([
        "replay runs/r1: st_ppo on stppo/MedQA-v0, iterations 3-4",
        "  reward      0.500 (iteration 3) -> best 0.500 (iteration 3) -> 0.250 (iteration 4)",
        "  clipping    turn clip share 0.200 -> 0.100 (max 0.200)",
        "  alarms      collapse alarm at iteration 4",
        "  checkpoint  runs/r1/checkpoints/step-4 (1.6 kB; 2 kept)",
        "  evaluate    stppo eval --agent hf:runs/r1@latest --benchmarks medqa --max-turns 2 --output-dir runs/r1/eval",
        f"  run folder  runs/r1: {size / 1000:.1f} kB on disk; every iteration's figures in metrics.jsonl"])
    (run / "steps.jsonl").write_text("{}\n")
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-3")
    lines = run_summary(run).splitlines()
    assert lines[4] == "  checkpoint  runs/r1/checkpoints/step-4 (1.6 kB)"  # one kept: no count
    assert lines[0].startswith("run runs/r1: ")
    assert lines[-1].endswith("every iteration's figures in metrics.jsonl (each optimizer step's: steps.jsonl)")
    empty = Path("empty")
    empty.mkdir()
    (empty / "config.yaml").write_text("- a list\n")
    assert run_summary(empty) == "\n".join([
        "run empty: ? on ?, no iteration recorded", "  reward      no iteration recorded a reward",
        "  clipping    no clipping figures recorded", "  alarms      no collapse alarm", "  checkpoint  none written",
        f"  run folder  empty: {folder_bytes(empty)} B on disk; every iteration's figures in metrics.jsonl"])
    assert folder_bytes(empty) == 9
    (empty / "config.yaml").unlink()
    assert run_summary(empty).splitlines()[0] == "run empty: ? on ?, no iteration recorded"
    (empty / "metrics.jsonl").write_text('{"step": 5}\n{"step": 6}\n{"step": 7}\n')
    assert run_summary(empty).splitlines()[0] == "run empty: ? on ?, iterations 5-7"
