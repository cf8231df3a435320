"""Rollouts keep sampled token ids exactly, mask every observation token, and enforce their limits
(on SmolLM2's real byte-level tokenizer, with multi-byte text)."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

import stppo_envs  # noqa: F401
from stppo_agent.rollouts.generation import Generation, generated_length
from stppo_agent.rollouts.hf_generation import HFGenerationBackend, StopOnStrings, stop_candidate_ids
from stppo_agent.rollouts.turn_loop import RolloutLimitError, RolloutLimits, collect_rollouts
from tests.support.retrievers import PASSAGES, KeywordRetriever


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer

    return load_tokenizer(str(smollm2_path()))


def char_by_char(tokenizer, text: str) -> list[int]:
    """A valid but non-canonical tokenisation: re-encoding its decoded text would give other ids."""
    return [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]


class ScriptedBackend:
    """Returns pre-set token ids per call, and records what it returned."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.calls = turns, []

    def generate(self, contexts, max_new_tokens, keys=None):
        ids = self.turns[len(self.calls)]
        self.calls.append([list(c) for c in contexts])
        return [Generation(ids[:max_new_tokens], [-0.5] * min(len(ids), max_new_tokens)) for _ in contexts]


def test_sampled_ids_are_kept_and_observations_masked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turn0 = char_by_char(tok, "<think>München? 東京</think>\n<search> Zürich 🚀 東京 </search>")
    turn1 = char_by_char(tok, "<answer> Isar </answer>") + [tok.eos_token_id]
    assert tok(tok.decode(turn0), add_special_tokens=False)["input_ids"] != turn0  # re-tokenising would differ
    backend = ScriptedBackend([turn0, turn1])
    envs = [gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES), max_turns=3).unwrapped for _ in range(2)]
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=200, max_observation_tokens=400,
                           max_prompt_tokens=400, max_total_tokens=2000)
    batch = collect_rollouts(backend, tok, envs, [{"index": 0}, {"index": 1}], [0, 1], limits)

    observation = envs[0].transcript[2].text
    assert "Zürich 🚀 café" in observation and "東京は日本" in observation
    obs_ids = tok(observation, add_special_tokens=False)["input_ids"]
    for row in range(2):
        n = int(batch.attention_mask[row, batch.prompt_width:].sum())
        ids = batch.response_ids[row, :n].tolist()
        mask = batch.loss_mask[row, :n].tolist()
        turns = batch.turn_ids[row, :n].tolist()
        assert ids == turn0 + obs_ids + turn1
        assert mask == [True] * len(turn0) + [False] * len(obs_ids) + [True] * len(turn1)
        assert turns == [0] * len(turn0) + [-1] * len(obs_ids) + [1] * len(turn1)
        assert not batch.loss_mask[row, n:].any() and (batch.turn_ids[row, n:] == -1).all()
    # the second turn was generated from the exact ids of the first turn plus the observation's ids
    prompt_ids = backend.calls[0][0]
    assert backend.calls[1][0] == prompt_ids + turn0 + obs_ids
    assert batch.rewards.tolist() == [0.0, 0.0] and batch.terminated.all()
    assert batch.sample_logprobs[batch.loss_mask].eq(-0.5).all()


def test_real_generation_keeps_sampled_ids(smollm2_tokenizer, tmp_path):
    """Random tokens from a tiny model over SmolLM2's vocabulary: byte pieces of multi-byte characters included."""
    from stppo_agent.models.tiny import build_tiny_llama

    tok = smollm2_tokenizer
    path = build_tiny_llama(tmp_path / "tiny", tok, hidden=16, layers=1, seed=3)
    from stppo_agent.models.loading import load_actor

    backend = HFGenerationBackend(load_actor(path), tok)
    recorded = []
    original = backend.generate

    def record(contexts, max_new_tokens):
        out = original(contexts, max_new_tokens)
        recorded.append([g.token_ids for g in out])
        return out

    backend.generate = record
    torch.manual_seed(0)
    envs = [gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES), max_turns=2).unwrapped for _ in range(3)]
    limits = RolloutLimits(max_turns=2, max_new_tokens_per_turn=12, max_observation_tokens=64, max_prompt_tokens=400,
                           max_total_tokens=800)
    batch = collect_rollouts(backend, tok, envs, [{"index": i} for i in range(3)], [0, 1, 2], limits)
    for row in range(3):
        policy_ids = batch.response_ids[row][batch.loss_mask[row]].tolist()
        assert policy_ids == [t for turn in recorded for t in turn[row]]
        in_response = batch.attention_mask[row, batch.prompt_width:].bool()
        observation_ids = batch.response_ids[row][~batch.loss_mask[row] & in_response]
        assert (batch.turn_ids[row][~batch.loss_mask[row]] == -1).all()
        assert observation_ids.tolist() == tok(envs[row].transcript[2].text, add_special_tokens=False)["input_ids"][:64]
    assert batch.sample_logprobs[batch.loss_mask].lt(0).all()


def test_generated_length_stops_after_stop_string_or_eos(smollm2_tokenizer):
    tok = smollm2_tokenizer
    head = tok("<search> x </search>", add_special_tokens=False)["input_ids"]
    tail = tok(" more text", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    assert generated_length(head + tail, tok, ["</search>"], [eos]) == len(head)
    assert generated_length(tail + [eos, eos, eos], tok, ["</search>"], [eos]) == len(tail) + 1
    assert generated_length(tail, tok, ["</search>"], [eos]) == len(tail)


def test_stop_strings_end_exactly_the_rows_that_completed_one(smollm2_tokenizer):
    tok = smollm2_tokenizer
    stops = ("</search>", "</answer>")
    candidates = stop_candidate_ids(tok, stops)
    # every token able to complete a stop string is a candidate: all that hold ">" when decoded alone
    brute = [i for i in range(len(tok)) if ">" in tok.decode([i], skip_special_tokens=False)]
    assert candidates.tolist() == brute and len(brute) < len(tok) // 100
    assert stop_candidate_ids(tok, stops) is candidates  # decoded once per tokenizer

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt = ids("Question?")
    rows = [ids(" <search> capital </search>"), ids(" <answer> Paris </answer>"), ids(" a > b, no tag"),
            ids(" <search> half"), ids(" </search")]
    width = max(map(len, rows))
    batch = torch.tensor([prompt + [tok.pad_token_id] * (width - len(r)) + r for r in rows])
    criterion = StopOnStrings(tok, stops, prompt_width=len(prompt), candidate_ids=candidates)
    assert criterion(batch, None).tolist() == [True, True, False, False, False]
    assert not criterion(batch[:, :len(prompt)], None).any()  # nothing generated yet


def test_limits_are_validated_and_named(smollm2_tokenizer):
    with pytest.raises(RolloutLimitError, match="max_total_tokens \\(100\\) must fit max_prompt_tokens"):
        RolloutLimits(max_prompt_tokens=90, max_new_tokens_per_turn=20, max_total_tokens=100).validate()
    with pytest.raises(RolloutLimitError, match="max_turns must be >= 1"):
        RolloutLimits(max_turns=0).validate()
    env = gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES)).unwrapped
    with pytest.raises(RolloutLimitError, match="over max_prompt_tokens=16"):
        collect_rollouts(ScriptedBackend([[1]]), smollm2_tokenizer, [env], [{"index": 0}], [0],
                         RolloutLimits(max_prompt_tokens=16, max_new_tokens_per_turn=8, max_total_tokens=64))


def test_total_token_budget_ends_a_trajectory(smollm2_tokenizer):
    tok = smollm2_tokenizer
    search = char_by_char(tok, "<search> München </search>")
    env = gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES), max_turns=4).unwrapped
    prompt_tokens = 300
    limits = RolloutLimits(max_turns=4, max_new_tokens_per_turn=40, max_observation_tokens=400,
                           max_prompt_tokens=prompt_tokens, max_total_tokens=prompt_tokens + 60)
    batch = collect_rollouts(ScriptedBackend([search] * 4), tok, [env], [{"index": 0}], [0], limits)
    assert batch.stats["truncated_max_total_tokens"] == 1.0 and batch.truncated.all()
    used = int(batch.attention_mask.sum())
    assert used <= limits.max_total_tokens


class PerTrajectoryBackend:
    """Each trajectory (told apart by the key the rollout passes) plays its own script; records every call's keys."""

    def __init__(self, scripts: list[list[list[int]]]):
        self.scripts, self.calls, self.row_of = scripts, [], {}

    def generate(self, contexts, max_new_tokens, keys=None):
        self.calls.append(list(keys))
        out = []
        for key in keys:
            row = self.row_of.setdefault(key, len(self.row_of))
            turn = sum(key in call for call in self.calls) - 1
            out.append(Generation(self.scripts[row][turn], [-0.5] * len(self.scripts[row][turn])))
        return out


def test_per_trajectory_counters_flags_and_keys(smollm2_tokenizer):
    from tests.support.retrievers import FailingRetriever

    tok = smollm2_tokenizer

    def ids(text, eos=False):
        return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])

    search, answer = ids("<search> München </search>"), ids("<answer> Isar </answer>", eos=True)
    scripts = [[ids("hello"), search, answer],  # invalid, search, answer
               [search, search, search],  # the third search comes on the last turn: not served, truncated
               [search, answer]]  # its retriever fails: a search error, then an answer
    envs = [gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES), max_turns=3).unwrapped for _ in range(2)]
    envs.append(gym.make("stppo/NQ-v0", retriever=FailingRetriever(), max_turns=3).unwrapped)
    backend = PerTrajectoryBackend(scripts)
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=64, max_observation_tokens=200,
                           max_prompt_tokens=400, max_total_tokens=2000)
    batch = collect_rollouts(backend, tok, envs, [{"index": 0}] * 3, [0, 1, 2], limits)

    assert batch.terminated.tolist() == [True, False, True]
    assert batch.truncated.tolist() == [False, True, False]
    assert batch.stats["turns"] == pytest.approx(8 / 3)
    assert batch.stats["search_calls"] == pytest.approx(1.0)  # 1 + 2 + 0 served searches
    assert batch.stats["invalid_action_rate"] == pytest.approx(1 / 8)
    assert batch.stats["search_error_rate"] == pytest.approx(1 / 4)
    assert batch.stats["answer_rate"] == pytest.approx(2 / 3)
    # stable, distinct keys per trajectory across turns (what KV-cache reuse hangs on), finished ones dropped
    first = backend.calls[0]
    assert len(set(first)) == 3 and backend.calls[1] == first and backend.calls[2] == first[:2]
    # actions reach the env (and so the transcripts in episodes.jsonl) without special tokens
    assert all(tok.eos_token not in segment.text for env in envs for segment in env.transcript)


@pytest.mark.parametrize("room", [0, -1])
def test_observations_cut_to_their_budget_are_counted(smollm2_tokenizer, room):
    # a cut observation hides passages from the policy: the share cut is a metric, as `stppo eval` reports it
    tok = smollm2_tokenizer
    search = char_by_char(tok, "<search> München </search>")
    answer = char_by_char(tok, "<answer> Isar </answer>") + [tok.eos_token_id]
    probe = gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES), max_turns=3).unwrapped
    probe.reset(options={"index": 0})
    observation = probe.step(tok.decode(search))[0]
    length = len(tok(observation, add_special_tokens=False)["input_ids"])
    envs = [gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES), max_turns=3).unwrapped for _ in range(2)]
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=200, max_observation_tokens=length + room,
                           max_prompt_tokens=400, max_total_tokens=2000)
    batch = collect_rollouts(ScriptedBackend([search, answer]), tok, envs, [{"index": 0}] * 2, [0, 1], limits)
    # an observation exactly as long as the budget is whole; one token more and it is cut
    assert batch.stats["observation_cut_rate"] == (0.0 if room == 0 else 1.0)
    observed = int((~batch.loss_mask & batch.attention_mask[:, batch.prompt_width:].bool())[0].sum())
    assert observed == length + room
