"""``stppo_agent.training.sft``: demonstrations from a teacher agent laid out in tokens
as rollouts are, a loss on the teacher's action tokens only, its settings, order and progress."""

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
from tests.support.training_parts import VOCAB, NoKeep, dataclasses_replace, make_batch, record_bars, tiny_lm

# -- sft --------------------------------------------------------------------------------------------------------

TRANSCRIPT = [{"role": "user", "text": "say red", "turn": -1},
              {"role": "assistant", "text": "ok red", "turn": 0},
              {"role": "env", "text": "green blue gold red", "turn": 0},
              {"role": "assistant", "text": "", "turn": 1},
              {"role": "env", "text": "", "turn": 1},
              {"role": "assistant", "text": "gold", "turn": 2}]


def test_a_transcript_becomes_the_tokens_of_a_rollout():
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.rollouts.turn_loop import encode_prompt
    from stppo_agent.training.sft import trajectory_from_transcript

    tok = word_tokenizer()
    ids = {w: tok.convert_tokens_to_ids(w) for w in ("say", "ok", "red", "green", "blue", "gold")}
    t = trajectory_from_transcript(tok, TRANSCRIPT, 2)
    assert t.prompt_ids == encode_prompt(tok, "say red") and t.group_id == 0 and t.env is None
    assert t.response_ids == [ids["ok"], ids["red"], ids["green"], ids["blue"], ids["gold"]]
    assert t.policy_mask == [True, True, False, False, True] and t.turn_ids == [0, 0, -1, -1, 2]
    assert trajectory_from_transcript(tok, TRANSCRIPT, 4).response_ids[2:6] == [ids[w] for w in
                                                                              ("green", "blue", "gold", "red")]
    for bad in ([], [{"role": "assistant", "text": "x", "turn": 0}]):
        with pytest.raises(ValueError, match="^a transcript starts with the user prompt$"):
            trajectory_from_transcript(tok, bad, 2)


@pytest.mark.parametrize("keep", [True, False])
def test_the_sft_loss_reads_the_action_tokens_only(keep):
    from stppo_agent.training.log_probs import token_logprobs
    from stppo_agent.training.sft import action_logprobs

    model = tiny_lm().eval()
    batch = make_batch()
    with torch.no_grad():
        got = action_logprobs(model if keep else NoKeep(model), batch)
        want, _ = token_logprobs(model, batch)
    assert got.shape == (int(batch.loss_mask.sum()),)
    assert torch.allclose(got, want[batch.loss_mask], atol=1e-5)


def test_demonstrations_are_the_rewarded_episodes_of_every_benchmark(monkeypatch):
    import stppo_agent.training.sft as sft

    seen = []

    def evaluate(teacher, settings):
        seen.append((teacher, settings))
        return {"episodes": [{"reward": 1.0, "transcript": [settings.benchmark, 1]},
                             {"reward": 0.0, "transcript": [settings.benchmark, 2]},
                             {"reward": 0.5, "transcript": [settings.benchmark, 3]}]}

    monkeypatch.setattr(sft, "evaluate_benchmark", evaluate)
    cfg = sft.SFTConfig(model="m", output_dir="o", benchmarks=("nq", "hotpotqa"), datasets={"nq": "nq.jsonl"},
                        split="dev", limit=5, teacher="hf:big", retriever="bm25:x", topk=2, max_turns=3, seed=3)
    assert sft.demonstrations(cfg) == [["nq", 1], ["nq", 3], ["hotpotqa", 1], ["hotpotqa", 3]]
    teacher, settings = seen[0]
    assert teacher == "hf:big" and seen[1][1].benchmark == "hotpotqa" and seen[1][1].dataset is None
    assert (settings.benchmark, settings.dataset, settings.split, settings.limit, settings.retriever, settings.topk,
            settings.max_turns, settings.seed) == ("nq", "nq.jsonl", "dev", 5, "bm25:x", 2, 3, 3)
    monkeypatch.setattr(sft, "evaluate_benchmark", lambda teacher, settings: {"episodes": [
        {"reward": 0.0, "transcript": []}]})
    with pytest.raises(ValueError, match=r"^the teacher 'hf:big' earned no reward on nq, hotpotqa: no demonstrations"):
        sft.demonstrations(cfg)


def test_sft_settings_are_checked_before_any_episode(monkeypatch):
    import stppo_agent.training.sft as sft

    monkeypatch.setattr(sft, "demonstrations", lambda config: pytest.fail("validated first"))
    for values, message in (({"steps": 0}, r"^steps and batch_size must be >= 1$"),
                            ({"batch_size": 0}, r"^steps and batch_size must be >= 1$"),
                            ({"max_observation_tokens": 0}, r"^max_observation_tokens must be >= 1, got 0$"),
                            ({"max_total_tokens": 0}, r"^max_total_tokens must be >= 1, got 0$"),
                            ({"autocast_dtype": "float16"}, r"^autocast_dtype=float16 is refused"),
                            ({"dtype": "float16"}, r"^dtype=float16 is refused")):
        with pytest.raises(ValueError, match=message):
            sft.train_sft(sft.SFTConfig(model="m", output_dir="o", **values))


def sft_run(monkeypatch, tmp_path, transcripts, **values):
    import stppo_agent.training.sft as sft
    from stppo_agent.models.tiny import word_tokenizer

    batches, models = [], []
    monkeypatch.setattr(sft, "demonstrations", lambda config: transcripts)
    monkeypatch.setattr(sft, "load_tokenizer", lambda path: word_tokenizer())
    monkeypatch.setattr(sft, "load_actor", lambda path, dtype: models.append((path, dtype)) or tiny_lm(2))
    to_batch = sft.to_batch

    def record(trajectories, pad):
        batches.append(to_batch(trajectories, pad))
        return batches[-1]

    monkeypatch.setattr(sft, "to_batch", record)
    reports = []
    cfg = sft.SFTConfig(model="m", output_dir=str(tmp_path / "out"), device="cpu", progress=False, **values)
    return sft.train_sft(cfg, report=reports.append), batches, models, reports


def test_sft_trains_shuffled_passes_and_saves_the_model(monkeypatch, tmp_path, capsys):
    import json

    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": word, "turn": 0}]
                   for word in ("red", "green", "blue", "gold ok say red green")]
    summary, batches, models, reports = sft_run(monkeypatch, tmp_path, transcripts, steps=3, batch_size=2,
                                                   max_total_tokens=4, lr=0.01, seed=1)
    assert models == [("m", "float32")]
    assert "warm start" not in capsys.readouterr().err  # progress=False: no bar
    assert reports[0] == "sft: 3 demonstrations by gold-search (1 over max_total_tokens skipped), 3 steps of 2"
    assert reports[1].startswith("sft step 1/3: loss ") and len(reports) == 2
    assert [b.batch_size for b in batches] == [2, 2, 2]
    flat = [tuple(ids) for b in batches for ids in b.response_ids.tolist()]
    assert len(set(flat[:3])) == 3  # the first pass shows each demonstration once
    assert summary["demonstrations"] == 3 and summary["seconds"] > 0 and summary["config"]["lr"] == 0.01
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    losses = json.loads((out / "sft_losses.json").read_text())
    assert len(losses) == 3 and losses[0] == summary["first_loss"] and losses[-1] == summary["last_loss"]
    assert json.loads((out / "sft.json").read_text())["demonstrations"] == 3
    from transformers import AutoModelForCausalLM

    from stppo_agent.training.log_probs import token_logprobs

    saved, start = AutoModelForCausalLM.from_pretrained(out), tiny_lm(2)
    with torch.no_grad():
        first = batches[0]
        assert summary["first_loss"] == pytest.approx(-float(token_logprobs(start, first)[0][first.loss_mask].mean()),
                                                      rel=1e-5)  # the mean NLL of the action tokens alone
        moved = max(float((a - b).abs().max()) for a, b in zip(saved.parameters(), start.parameters()))
    assert 0.005 < moved < 0.05  # three AdamW steps of lr 0.01


@pytest.mark.filterwarnings("error::UserWarning")  # the error message must not warn (float() of a grad tensor did)
def test_sft_reports_progress_through_on_step_and_stops_on_a_non_finite_loss(monkeypatch, tmp_path):
    import stppo_agent.training.sft as sft
    from stppo_agent.models.tiny import word_tokenizer

    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": "red", "turn": 0}]]
    monkeypatch.setattr(sft, "demonstrations", lambda config: transcripts)
    monkeypatch.setattr(sft, "load_tokenizer", lambda path: word_tokenizer())
    monkeypatch.setattr(sft, "load_actor", lambda path, dtype: tiny_lm(2))
    steps, reports = [], []
    cfg = sft.SFTConfig(model="m", output_dir=str(tmp_path / "out"), device="cpu", progress=False, steps=11,
                        batch_size=1)
    summary = sft.train_sft(cfg, report=reports.append, on_step=lambda *a: steps.append(a))
    assert [s[:2] for s in steps] == [(i, 11) for i in range(12)] and math.isnan(steps[0][2])
    assert [s[2] for s in steps[1:]] == json_losses(tmp_path / "out") and len(reports) == 1
    assert summary["first_loss"] > summary["last_loss"]  # one demonstration, eleven steps: it is learned
    reports.clear()
    sft.train_sft(dataclasses_replace(cfg, steps=10), report=reports.append)
    assert [r.split(":")[0] for r in reports[1:]] == ["sft step 1/10", "sft step 10/10"]
    monkeypatch.setattr(sft, "action_logprobs", lambda model, batch: torch.full((2,), math.nan, requires_grad=True))
    with pytest.raises(FloatingPointError, match=r"^sft step 1: the loss is nan; lower --lr$"):
        sft.train_sft(cfg, report=reports.append)
    with pytest.raises(ValueError, match=r"^every demonstration is longer than max_total_tokens=2$"):
        sft.train_sft(dataclasses_replace(cfg, max_total_tokens=2), report=reports.append)


def json_losses(folder):
    import json

    return json.loads((folder / "sft_losses.json").read_text())


def test_the_sft_forward_gets_the_mask_positions_and_no_cache():
    from stppo_agent.training.log_probs import position_ids
    from stppo_agent.training.sft import action_logprobs

    seen = {}
    inner = tiny_lm().eval()

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None,
                    output_hidden_states=None, logits_to_keep=0):
            seen.update(attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                        logits_to_keep=logits_to_keep)
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep)

        def get_output_embeddings(self):
            return inner.get_output_embeddings()

    batch = make_batch()
    with torch.no_grad():
        action_logprobs(Recorder(), batch)
    assert seen["attention_mask"] is batch.attention_mask and seen["use_cache"] is False
    assert torch.equal(seen["position_ids"], position_ids(batch.attention_mask)) and seen["logits_to_keep"] == 1


def test_sft_draws_its_order_from_the_seed(monkeypatch, tmp_path):
    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": word, "turn": 0}]
                   for word in ("red", "green", "blue", "gold", "ok")]

    def order(seed, name):
        _, batches, _, _ = sft_run(monkeypatch, tmp_path / name, transcripts, steps=2, batch_size=2, seed=seed)
        return [ids for b in batches for ids in b.response_ids.tolist()]

    first = order(1, "a")
    assert order(1, "b") == first and order(2, "c") != first


def test_an_action_is_tokenised_without_the_special_tokens_a_prompt_gets():
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.training.sft import trajectory_from_transcript

    words = word_tokenizer()

    def with_bos(text, add_special_tokens=True):  # a tokenizer that adds BOS (SmolLM2's and Qwen's do not; Llama's do)
        return {"input_ids": [1] * add_special_tokens + words(text, add_special_tokens=False)["input_ids"]}

    t = trajectory_from_transcript(with_bos, TRANSCRIPT, 4)
    assert t.prompt_ids[0] == 1 and 1 not in t.response_ids


def test_the_sft_loss_reads_the_last_hidden_state_of_a_deeper_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from stppo_agent.training.log_probs import token_logprobs
    from stppo_agent.training.sft import action_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                         pad_token_id=0, bos_token_id=None, eos_token_id=1)).eval()
    batch = make_batch()
    with torch.no_grad():
        assert torch.allclose(action_logprobs(model, batch), token_logprobs(model, batch)[0][batch.loss_mask],
                              atol=1e-5)


def test_sft_hands_its_settings_to_every_step(monkeypatch, tmp_path):
    """The model and tokenizer path, the config to the teacher, the observation cut, the length boundary, the
    autocast dtype, the gradient clip, the bar and the time measured: what one short run hands each step."""
    import time

    import stppo_agent.training.sft as sft
    from stppo_agent.models.tiny import word_tokenizer

    seen = {"clip": []}
    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": "red", "turn": 0},
                    {"role": "env", "text": "green blue gold red", "turn": 0},
                    {"role": "assistant", "text": "gold", "turn": 1}]]
    monkeypatch.setattr(sft, "demonstrations", lambda config: seen.update(teacher_config=config) or transcripts)
    monkeypatch.setattr(sft, "load_tokenizer", lambda path: seen.update(tokenizer=path) or word_tokenizer())
    monkeypatch.setattr(sft, "load_actor", lambda path, dtype: tiny_lm(2))
    autocast_forward = sft.autocast_forward
    monkeypatch.setattr(sft, "autocast_forward", lambda model, dtype: seen.update(autocast=dtype) or
                        autocast_forward(model, dtype))
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, norm: seen["clip"].append(norm) or
                        clip(params, norm))
    batches, to_batch = [], sft.to_batch
    monkeypatch.setattr(sft, "to_batch", lambda trajectories, pad: batches.append(to_batch(trajectories, pad)) or
                        batches[-1])
    bars = record_bars(monkeypatch, "warm start")
    prompt = len(word_tokenizer()("say red")["input_ids"])
    cfg = sft.SFTConfig(model="the/model", output_dir=str(tmp_path / "out"), device="cpu", steps=1, batch_size=1,
                        max_observation_tokens=1, max_total_tokens=prompt + 3, autocast_dtype="bfloat16", seed=5)
    started = time.perf_counter()
    summary = sft.train_sft(cfg, report=lambda _: None)  # steps=1, a one-token observation: the smallest allowed
    elapsed = time.perf_counter() - started
    assert seen["tokenizer"] == "the/model" and seen["teacher_config"].seed == 5
    assert seen["autocast"] == "bfloat16" and seen["clip"] == [1.0]
    assert batches[0].response_ids.shape[1] == 3  # red, green (the observation cut to 1), gold: exactly the limit
    bar, = bars
    assert bar.kwargs == {"desc": "warm start", "unit": "step", "disable": False} and bar.closed
    assert bar.postfixes == [{"loss": f"{summary['last_loss']:.3f}", "refresh": False}]
    assert 0 < summary["seconds"] < elapsed
    assert summary["config"]["autocast_dtype"] == "bfloat16" and summary["demonstrations"] == 1


def test_sft_resolves_auto_precision_for_its_device(monkeypatch, tmp_path):
    from stppo_agent.models.precision import resolve_autocast_dtype

    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": "red", "turn": 0}]]
    summary, *_ = sft_run(monkeypatch, tmp_path, transcripts, steps=1, batch_size=1, autocast_dtype="auto")
    assert summary["config"]["autocast_dtype"] == resolve_autocast_dtype("auto", torch.device("cpu"))
    assert summary["config"]["autocast_dtype"] != "auto"


# Supervised warm start: demonstrations from a teacher agent, laid out in tokens as rollouts are, and a loss on the
# teacher's action tokens only.


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
    assert "warm start" in captured.err and "2/2" in captured.err  # the steps' progress bar
    assert main(["sft", "--model", str(tiny_model), "--output-dir", str(tmp_path / "x"), "--benchmarks", "nq",
                 "--limit", "4", "--teacher", "no-search", "--steps", "1"]) == 1


def test_sft_cuts_observations_where_training_does(tiny_model, tmp_path):
    """One setting, one default: a demonstration never shows a cut observation that RL rollouts would not."""
    from stppo_agent.training.config import TrainConfig

    defaults = SFTConfig(model="m", output_dir="o")
    rollout = TrainConfig().rollout
    assert defaults.max_observation_tokens == rollout.max_observation_tokens == 512
    assert defaults.max_total_tokens == rollout.max_total_tokens
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
