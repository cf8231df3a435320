"""`stppo train` and `stppo replay` end with a short summary read from the run folder; --json prints the last
iteration's metrics instead (issue 31.2)."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from stppo_agent.runs.run_summary import human_bytes, run_summary

from .cli_in_process import stppo as run_in_process

REPO = Path(__file__).resolve().parents[1]
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
