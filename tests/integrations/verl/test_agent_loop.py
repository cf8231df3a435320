"""The ``stppo_env`` agent loop (stppo_agent/integrations/verl/agent_loop.py), built as verl's AgentLoopWorker builds
it, behind a scripted stand-in for verl's server_manager: the episode of this project's own rollout, on the prompt
the exported row holds, through verl's chat-template settings, with the turn record the losses and the reward
function read."""

from __future__ import annotations

import json

import pytest

from tests.support.requires import require_verl

require_verl()

from stppo_agent.integrations.verl import agent_loop  # noqa: E402
from stppo_agent.integrations.verl import data as export  # noqa: E402
from stppo_agent.integrations.verl.reward import compute_score  # noqa: E402
from stppo_agent.integrations.verl.turns import TURN_SPANS, TURN_TEXTS  # noqa: E402
from stppo_envs import SearchQAEnv  # noqa: E402
from tests.support.retrievers import KeywordRetriever  # noqa: E402
from tests.support.verl_agent_loops import ScriptedServer, build_loop, play, smollm2_tokenizer  # noqa: E402
from tests.support.verl_rows import parquet_rows  # noqa: E402

LOOP = {"name": "stppo_env", "retriever": "keyword", "topk": 3, "max_observation_tokens": 512}


def char_by_char(tokenizer, text: str) -> list[int]:
    """A valid but non-canonical tokenisation: decoding and re-encoding it would give other ids."""
    return [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]


@pytest.fixture
def keyword(monkeypatch):
    retriever = KeywordRetriever((("Penda", "Penda is a linguist."), ("Homer", "Homer wrote the Iliad.")))
    monkeypatch.setitem(agent_loop._RETRIEVERS, "keyword", retriever)
    return retriever


class OurBackend:
    """The same script for this project's rollout, cut at stop strings as its generation backends cut."""

    def __init__(self, server: ScriptedServer, tokenizer):
        self.server, self.tokenizer, self.calls = server, tokenizer, 0

    def generate(self, contexts, max_new_tokens, keys=None):
        from stppo_agent.rollouts.generation import STOP_STRINGS, Generation, generated_length

        ids = (self.server.turns[self.calls] + self.server.tail)[:max_new_tokens]
        ids = ids[:generated_length(ids, self.tokenizer, STOP_STRINGS, [self.tokenizer.eos_token_id])]
        self.calls += 1
        return [Generation(ids, [-0.25 - 0.01 * i for i in range(len(ids))]) for _ in contexts]


@pytest.mark.parametrize("answer", ["linguist", "chemist"])
def test_the_loop_plays_the_episode_our_rollout_plays(keyword, tmp_path, answer):
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from stppo_agent.rollouts.turn_loop import RolloutLimits, collect_rollouts

    tok = smollm2_tokenizer()
    actions = ["<think>who?</think><search> Zaeththeiv Penda </search>", f"<answer> {answer} </answer>"]
    turns = [char_by_char(tok, action) for action in actions]
    tail = tok(" and more text", add_special_tokens=False)["input_ids"]
    row = parquet_rows(export.export_verl(["nq"], "test", tmp_path, limit=1, max_turns=3)[0])[0]
    assert _agent_loop_registry["stppo_env"]["_target_"].endswith("StppoEnvAgentLoop")

    server = ScriptedServer(turns, tail)
    output = play(lambda: build_loop(LOOP, server, rollout={"response_length": 300}), row)

    env = SearchQAEnv("nq", split="test", retriever=keyword, max_turns=3, limit=1)
    prompt_len = len(output.prompt_ids)
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=300, max_observation_tokens=512,
                           max_prompt_tokens=prompt_len, max_total_tokens=prompt_len + 300)
    ours = collect_rollouts(OurBackend(server, tok), tok, [env], [{"index": 0}], [0], limits)
    n = int(ours.attention_mask[0, ours.prompt_width:].sum())
    assert output.response_ids == ours.response_ids[0, :n].tolist()
    assert output.response_mask == ours.loss_mask[0, :n].long().tolist()
    assert output.response_logprobs == pytest.approx(ours.sample_logprobs[0, :n].tolist())
    assert output.reward_score == float(ours.rewards[0]) == (1.0 if answer == "linguist" else 0.0)
    assert output.prompt_ids == server.requests[0][0]
    # token in, token out: turn 2 was generated from the sampled ids of turn 1 (cut at </search>), not re-encoded
    assert server.requests[1][0][prompt_len:prompt_len + len(turns[0])] == turns[0]
    assert output.response_mask.count(1) == len(turns[0]) + len(turns[1]) and output.num_turns == 4
    assert server.requests[0][1]["stop"] == ["</search>", "</answer>"]
    # the turn record: where each turn's sampled ids lie, and its text as the env read it
    observation = len(output.response_ids) - len(turns[0]) - len(turns[1])
    assert output.extra_fields[TURN_SPANS] == [[0, len(turns[0])], [len(turns[0]) + observation, n]]
    assert output.extra_fields[TURN_TEXTS] == actions
    extra_info = {**row["extra_info"], **output.extra_fields, "num_turns": output.num_turns}
    assert compute_score("nq", tok.decode(output.response_ids), row["reward_model"]["ground_truth"],
                         extra_info) == output.reward_score


def test_a_row_exported_without_the_question_mark_is_played_with_its_own_prompt(keyword, tmp_path):
    questions = tmp_path / "iliad.jsonl"
    questions.write_text(json.dumps({"id": "q0", "question": "who wrote the iliad", "golden_answers": ["Homer"]}))
    path = export.export_verl(["nq"], "test", tmp_path / "out", dataset=str(questions), question_mark=False)[0]
    row = parquet_rows(path)[0]
    assert row["prompt"][0]["content"].endswith("Question: who wrote the iliad\n")
    tok = smollm2_tokenizer()
    server = ScriptedServer([tok("<answer> Homer </answer>", add_special_tokens=False)["input_ids"]])
    output = play(lambda: build_loop(LOOP, server), row)
    assert output.prompt_ids == tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    assert output.reward_score == 1.0


def test_a_row_whose_prompt_is_not_the_envs_is_refused(keyword, tmp_path):
    """A row the env would play with another prompt (here: exported with the question mark, then edited) is refused,
    not played with a prompt verl's dataset never held."""
    row = parquet_rows(export.export_verl(["nq"], "test", tmp_path, limit=1)[0])[0]
    row["prompt"] = [{"role": "user", "content": row["prompt"][0]["content"].replace("?\n", "\n")}]
    server = ScriptedServer([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"stppo_env agent loop: row nq test #0: .*export the rows again"):
        play(lambda: build_loop(LOOP, server), row)
    assert server.requests == []  # refused before generating anything


def test_verls_chat_template_settings_reach_the_prompt(keyword, tmp_path):
    """``data.apply_chat_template_kwargs`` (e.g. Qwen3's enable_thinking=False) shape the prompt as in verl's own
    loops."""
    tok = smollm2_tokenizer()
    tok = type(tok).from_pretrained(tok.name_or_path)  # a copy: the template below is this test's
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking"
                         " %}<think>\n\n</think>\n\n{% endif %}")
    row = parquet_rows(export.export_verl(["nq"], "test", tmp_path, limit=1)[0])[0]
    server = ScriptedServer([tok("<answer> linguist </answer>", add_special_tokens=False)["input_ids"]])
    output = play(lambda: build_loop(LOOP, server, tokenizer=tok, data={"apply_chat_template_kwargs":
                                                                {"enable_thinking": False}}), row)
    expected = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False,
                                       enable_thinking=False)
    assert output.prompt_ids == expected
    assert tok.decode(output.prompt_ids).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("setting", ["max_observation_tokens", "topk", "max_new_tokens_per_turn"])
def test_a_setting_below_one_is_refused_when_the_loop_is_built(keyword, setting):
    """``max_observation_tokens: 0`` would append no observation and run a search turn into the next one. (verl
    builds the loop through hydra, which wraps the error.)"""
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match=f"stppo_env agent loop: {setting} must be an integer >= 1, got 0"):
        build_loop({**LOOP, setting: 0}, ScriptedServer([]))
