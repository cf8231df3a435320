"""Supervised warm start: demonstrations from a teacher agent, laid out in tokens as rollouts are, and a loss on
the teacher's action tokens only."""

from __future__ import annotations

import json
import math

import pytest
import torch

from stppo_agent.cli import main
from stppo_agent.evaluation.results import evaluate_all
from stppo_agent.models.tiny import build_tiny_llama
from stppo_agent.rollouts.turn_loop import encode_observation, encode_prompt
from stppo_agent.training.sft import SFTConfig, demonstrations, train_sft, trajectory_from_transcript


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer

    return load_tokenizer(str(smollm2_path()))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", smollm2_tokenizer, hidden=32, layers=2, seed=1)


@pytest.mark.parametrize("max_turns", [2, 3])
def test_gold_search_searches_each_hop_then_answers_correctly(max_turns):
    """One search for single-hop questions; both hops of multi-hop ones when there are turns for it; the answer
    on the last turn at the latest."""
    for result in evaluate_all("gold-search", ["nq", "hotpotqa", "medqa"], {}, None, 6, "demo", 3, max_turns, 6, 0):
        metrics = result["metrics"]
        assert metrics.get("em", metrics.get("acc")) == 1.0, result["benchmark"]
        assert metrics["answer_rate"] == 1.0 and metrics["invalid_action_rate"] == 0.0
        hops = 2 if result["benchmark"] == "hotpotqa" and max_turns == 3 else 1
        assert metrics["mean_search_calls"] == hops, result["benchmark"]


def test_gold_search_follows_real_hotpotqa_supporting_facts(shared_data):
    """With HotpotQA's supporting facts, the second query is a supporting title the first search did not bring
    back (the demo corpus here has none of them, so it is the first one)."""
    dataset = str(shared_data / "qa/hotpotqa_distractor_100.json")
    results = evaluate_all("gold-search", ["hotpotqa"], {"hotpotqa": dataset}, None, 4, "demo", 3, 3, 4, 0)
    first = results[0]["episodes"][0]
    actions = [s["text"] for s in first["transcript"] if s["role"] == "assistant"]
    assert "<search> Alû </search>" in actions[1] and first["em"] == 1.0  # supporting facts: Alû, Lilu (mythology)


def test_demonstrations_are_tokenised_like_rollouts(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    transcript = demonstrations(SFTConfig(model="unused", output_dir="unused", benchmarks=("nq",), limit=2))[0]
    trajectory = trajectory_from_transcript(tokenizer, transcript, max_observation_tokens=32)
    assert trajectory.prompt_ids == encode_prompt(tokenizer, transcript[0]["text"])
    ids, mask = trajectory.response_ids, trajectory.policy_mask
    # runs of policy / non-policy tokens, in order, are the assistant texts and the (cut) observations
    runs, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            runs.append((mask[start], ids[start:end]))
            start = end
    expected = [(True, tokenizer(s["text"], add_special_tokens=False)["input_ids"]) if s["role"] == "assistant"
                else (False, encode_observation(tokenizer, s["text"], 32)) for s in transcript[1:] if s["text"]]
    assert runs == expected
    assert all(t == -1 for t, m in zip(trajectory.turn_ids, mask) if not m)
    assert sorted({t for t, m in zip(trajectory.turn_ids, mask) if m}) == [0, 1]


def test_sft_lowers_the_loss_and_saves_a_loadable_model(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    summary = train_sft(SFTConfig(model=str(tiny_model), output_dir=str(out), benchmarks=("nq", "medqa"), limit=8,
                                  steps=60, batch_size=4, lr=5e-3), report=lambda _: None)
    assert summary["demonstrations"] == 16
    assert summary["last_loss"] < 0.5 * summary["first_loss"]
    trained = AutoModelForCausalLM.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), initial.parameters()))
    assert json.loads((out / "sft.json").read_text())["config"]["teacher"] == "gold-search"


def test_a_teacher_that_never_earns_reward_is_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="earned no reward"):
        train_sft(SFTConfig(model=str(tiny_model), output_dir=str(tmp_path), benchmarks=("nq",), limit=4,
                            teacher="no-search", steps=1))


def test_sft_command(tiny_model, tmp_path, capsys):
    assert main(["sft", "--model", str(tiny_model), "--output-dir", str(tmp_path / "out"), "--benchmarks", "nq",
                 "--limit", "4", "--steps", "2", "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    assert "loss" in captured.out and (tmp_path / "out" / "config.json").exists()
    assert "warm start" in captured.err and "2/2" in captured.err  # the steps' progress bar (issue 28, 1)
    assert main(["sft", "--model", str(tiny_model), "--output-dir", str(tmp_path / "x"), "--benchmarks", "nq",
                 "--limit", "4", "--teacher", "no-search", "--steps", "1"]) == 1


def test_sft_cuts_observations_where_training_does(tiny_model, tmp_path):
    """One setting, one default: a demonstration never shows a cut observation that RL rollouts would not."""
    from stppo_agent.training.config import TrainConfig

    rollout = TrainConfig().rollout
    assert SFTConfig(model="m", output_dir="o").max_observation_tokens == rollout.max_observation_tokens == 512
    assert SFTConfig(model="m", output_dir="o").max_total_tokens == rollout.max_total_tokens
    common = ["sft", "--model", str(tiny_model), "--benchmarks", "nq", "--limit", "2", "--steps", "1"]
    assert main([*common, "--output-dir", str(tmp_path / "default")]) == 0
    assert main([*common, "--output-dir", str(tmp_path / "short"), "--max-observation-tokens", "24",
                 "--max-total-tokens", "700"]) == 0
    default = json.loads((tmp_path / "default" / "sft.json").read_text())["config"]
    short = json.loads((tmp_path / "short" / "sft.json").read_text())["config"]
    assert (default["max_observation_tokens"], default["max_total_tokens"]) == (512, 4096)
    assert (short["max_observation_tokens"], short["max_total_tokens"]) == (24, 700)
    with pytest.raises(SystemExit, match="2"):
        main([*common, "--output-dir", str(tmp_path / "x"), "--max-observation-tokens", "0"])


def test_sft_under_autocast_records_the_precision_it_used(tiny_model, tmp_path, monkeypatch):
    from stppo_agent.models import precision as mixed_precision

    monkeypatch.setattr(mixed_precision, "cpu_flags", lambda: {"avx512_bf16", "amx_tile", "amx_bf16"})
    assert main(["sft", "--model", str(tiny_model), "--output-dir", str(tmp_path / "out"), "--benchmarks", "nq",
                 "--limit", "4", "--steps", "2", "--batch-size", "2", "--autocast-dtype", "auto"]) == 0
    summary = json.loads((tmp_path / "out" / "sft.json").read_text())
    assert summary["config"]["autocast_dtype"] == "bfloat16" and math.isfinite(summary["last_loss"])
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == "float32"  # the weights stay float32


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_the_loss_on_action_tokens_alone_is_the_full_forwards(tiny_model, smollm2_tokenizer, autocast):
    """The warm start applies the output head only at the teacher's action tokens: the same log-probs as the
    full forward (token_logprobs) there, with and without autocast."""
    from stppo_agent.models.loading import load_actor
    from stppo_agent.models.precision import autocast_forward
    from stppo_agent.rollouts.batch import to_batch
    from stppo_agent.training.log_probs import token_logprobs
    from stppo_agent.training.sft import action_logprobs

    transcripts = demonstrations(SFTConfig(model="unused", output_dir="unused", benchmarks=("nq", "hotpotqa"),
                                           limit=2))
    batch = to_batch([trajectory_from_transcript(smollm2_tokenizer, t, 64) for t in transcripts],
                     smollm2_tokenizer.pad_token_id)
    model = autocast_forward(load_actor(str(tiny_model), "float32"), autocast)
    full, _ = token_logprobs(model, batch)
    actions = action_logprobs(model, batch)
    assert actions.shape == (int(batch.loss_mask.sum()),)
    torch.testing.assert_close(actions, full[batch.loss_mask], rtol=0, atol=1e-5)


def test_demo_command_wires_warm_start_training_and_evaluation(tiny_model, tmp_path, capsys, monkeypatch):
    """`stppo demo` on a tiny model: warm start, evaluation, ST-PPO, the same evaluation of the trained checkpoint,
    with every phase on the progress display."""
    from stppo_agent.training import demo
    from stppo_agent.training.demo_progress import DemoProgress

    calls = []

    class Recorder(DemoProgress):  # what each phase tells the display, in order
        def phase(self, name, total=0):
            calls.append(("phase", name, total))
            super().phase(name, total)

        def step(self, done, detail=""):
            calls.append(("step", self.name, done, detail))
            super().step(done, detail)

        def note(self, detail):
            calls.append(("note", self.name, detail))
            super().note(detail)

    monkeypatch.setattr(demo, "DemoProgress", Recorder)
    out = tmp_path / "demo"
    assert main(["demo", "--model", str(tiny_model), "--output-dir", str(out), "--sft-steps", "2",
                 "--iterations", "1", "--limit", "2", "--seed", "3", "--autocast-dtype", "none"]) == 0
    printed = capsys.readouterr().out
    assert "warm start: 9 demonstrations" in printed  # the teacher plays only what 2 steps of 4 use: 3 per benchmark
    assert "evaluation: before RL (after the warm start) -> after RL" in printed and "QA avg (EM)" in printed
    assert printed.splitlines()[-2].startswith("check: ")  # the tiny model's figures are outside the ranges
    # 2 mini-batches x 2 epochs: 3 of the iteration's 4 optimizer steps are off-policy, and the summary says so
    assert "on 3 off-policy steps: clip_frac" in printed and "trained on 8 trajectories, reward " in printed
    assert "of ST-PPO (seed 3, float32 forwards)" in printed.splitlines()[0]
    phases = [c[1] for c in calls if c[0] == "phase"]
    assert phases == ["warm start: the gold-search teacher's demonstrations", "warm start", "evaluation before RL",
                      "ST-PPO iteration", "evaluation after RL"]
    assert [c[2] for c in calls if c[0] == "step" and c[1] == "warm start"] == [1, 2]
    rl = [c[2] for c in calls if c[0] == "note" and c[1] == "ST-PPO iteration"]
    assert rl[:2] == ["rollout", "rollout turn 1/3 done (8 active)"] and "scoring" in rl
    assert [text for text in rl if text.startswith("update step")] == [f"update step {i}/4" for i in range(1, 5)]
    for name in ("evaluation before RL", "evaluation after RL"):
        turns = [c[2] for c in calls if c[0] == "note" and c[1] == name]
        assert turns[0] == "nq: turn 1/3 of 2 episodes" and any(t.startswith("medqa: turn") for t in turns)
    config = (out / "train" / "config.yaml").read_text()
    assert f"model: {out / 'sft'}" in config  # RL started from the warm-started weights
    assert "\n  epochs: 2" in config and "autocast_dtype: auto" not in config  # the precision auto chose is kept
    # the demo cuts observations at 160 tokens in its warm start, RL and evaluations alike
    assert "max_observation_tokens: 160" in config and "seed: 3" in config
    warm_start = json.loads((out / "sft" / "sft.json").read_text())["config"]
    assert (warm_start["max_observation_tokens"], warm_start["max_total_tokens"], warm_start["seed"]) == (
        160, 1024, 3)
    for folder, agent in (("eval_before", f"hf:{out / 'sft'}"),
                          ("eval", f"hf:{out / 'train' / 'checkpoints' / 'step-1' / 'actor'}")):
        results = json.loads((out / folder / "results.json").read_text())
        assert [r["benchmark"] for r in results] == ["nq", "hotpotqa", "medqa"]
        assert results[0]["provenance"]["agent"] == agent and results[0]["metrics"]["n"] == 2
        # evaluated as it was trained: observations cut at the warm start's and RL's 160 tokens, not eval's 512
        assert results[0]["provenance"]["max_observation_tokens"] == 160
    # the demo owns its folder: running it again replaces the first run instead of refusing at the RL step
    capsys.readouterr()
    assert main(["demo", "--model", str(tiny_model), "--output-dir", str(out), "--sft-steps", "0",
                 "--iterations", "1", "--limit", "1"]) == 0
    assert f"--overwrite: removing the run in {out / 'train'}" in capsys.readouterr().out
    assert f"model: {tiny_model}" in (out / "train" / "config.yaml").read_text()  # the second run's own config
