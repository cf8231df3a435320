"""The search tool (stppo_agent/integrations/verl/tool.py) against a live ``stppo serve``, and the
``stppo_tool_agent`` loop (tool_agent.py): verl's tool agent, built as verl's AgentLoopWorker builds it, playing
rows exported for it whose prompt asks for the tool call, with the tool parsed by verl's hermes parser and run, the
turn record written and the episode scored by the env's rules."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.requires import require_verl

require_verl()

from stppo_agent.integrations.verl import data as export  # noqa: E402
from stppo_agent.integrations.verl.reward import compute_score  # noqa: E402
from stppo_agent.integrations.verl.turns import TURN_SPANS, TURN_TEXTS  # noqa: E402
from stppo_envs import SearchQAEnv  # noqa: E402
from tests.support.retrievers import KeywordRetriever  # noqa: E402
from tests.support.verl_agent_loops import ScriptedServer, build_loop, play, smollm2_tokenizer  # noqa: E402
from tests.support.verl_rows import parquet_rows  # noqa: E402

MULTI_TURN = {"multi_turn": {"max_user_turns": None, "max_assistant_turns": 6, "max_parallel_calls": 1,
                             "max_tool_response_length": 100000, "tool_response_truncate_side": "middle",
                             "format": "hermes"}, "full_determinism": False}


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    import time

    import requests

    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "stppo_agent.cli", "serve", "--retriever", "demo", "--port",
                               str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if requests.get(url + "/health", timeout=2).ok:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        else:
            pytest.fail(f"stppo serve did not start; see {log.name}")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def load_tool(url: str):
    """The tool as verl loads it from examples/verl/search_tool_config.yaml."""
    from omegaconf import OmegaConf
    from verl.tools.tool_registry import initialize_tools_from_config

    config = OmegaConf.load(REPO / "examples" / "verl" / "search_tool_config.yaml")
    config.tools[0].config.retrieval_service_url = url
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"stppo_tool_{os.getpid()}.yaml"
    OmegaConf.save(config, path)
    try:
        (tool,) = initialize_tools_from_config(str(path))
    finally:
        path.unlink()
    return tool


# -- the search tool ---------------------------------------------------------------------------------------------------
def test_the_search_tool_observes_what_the_env_observes_through_stppo_serve(live_server):
    tool = load_tool(live_server + "/retrieve")
    assert tool.name == "search"
    env = SearchQAEnv("nq", split="test", retriever=live_server, max_turns=3, topk=3)
    _, info = env.reset(options={"index": 0})
    observation = env.step(f"<search> {info['question']} </search>")[0]
    instance, _ = asyncio.run(tool.create())
    response, step_reward, metrics = asyncio.run(tool.execute(instance, {"query_list": [info["question"]]}))
    assert response.text == observation and "<information>Doc 1(Title: " in observation
    assert metrics == {"queries": 1, "search_errors": 0} and step_reward == 0.0


def test_a_dead_server_is_a_failed_search_observation_not_an_exception():
    tool = load_tool(f"http://127.0.0.1:{free_port()}/retrieve")
    tool.retriever.retries = 0
    response, _, metrics = asyncio.run(tool.execute("i", {"query": "anything"}))
    assert response.text.startswith("\n\n<information>Search failed: retrieval server")
    assert metrics["search_errors"] == 1


@pytest.mark.parametrize("arguments", [{"query_list": []}, {"query_list": ["  "]}, {"query_list": [3]}, {}])
def test_arguments_the_tool_refuses_are_the_envs_failed_search_block(arguments):
    tool = load_tool(f"http://127.0.0.1:{free_port()}/retrieve")
    response, _, metrics = asyncio.run(tool.execute("i", arguments))
    assert response.text == ("\n\n<information>Search failed: query_list must be a list of non-empty strings"
                             "</information>\n\n")
    assert metrics == {"search_errors": 1}


# -- the tool agent on rows exported for it ----------------------------------------------------------------------------
def tool_call_of(prompt: str, queries: list) -> str:
    """The tool call the prompt asks for, with ``queries`` in place of its example's."""
    (example,) = re.findall(r"<tool_call>.*?</tool_call>", prompt)
    call = json.loads(example[len("<tool_call>"):-len("</tool_call>")])
    call["arguments"]["query_list"] = queries
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def tool_row(tmp_path, max_turns: int) -> dict:
    """The first nq row exported for the tool agent."""
    return parquet_rows(export.export_verl(["nq"], "test", tmp_path, limit=1, max_turns=max_turns,
                                           agent_name=export.TOOL_AGENT)[0])[0]


def play_tool_row(row: dict, turns_text: list[str]):
    """``stppo_tool_agent`` on ``row`` with ``turns_text`` as the model's turns (each ending in EOS) and the search
    tool over a keyword retriever: (output, the response as verl's reward loop decodes it)."""
    tok = smollm2_tokenizer()
    tool = load_tool(f"http://127.0.0.1:{free_port()}/retrieve")
    tool.retriever = KeywordRetriever((("Penda", "Penda is a linguist."), ("Viththae", "Viththae is a chemist.")))
    script = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for text in turns_text]
    server = ScriptedServer(script)
    output = play(lambda: build_loop({"name": export.TOOL_AGENT}, server, rollout=MULTI_TURN, tools=[tool]), row)
    return output, tok.decode(output.response_ids, skip_special_tokens=True)


def score_of(row, output, text) -> float:
    """compute_score on what verl's reward loop hands over for this output."""
    extra_info = {**row["extra_info"], **output.extra_fields, "num_turns": output.num_turns}
    return compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], extra_info)


def test_tool_rows_ask_for_the_tool_call_that_verls_parser_runs(tmp_path):
    rows = parquet_rows(export.export_verl(["nq", "medqa"], "test", tmp_path, limit=2,
                                           agent_name=export.TOOL_AGENT)[0])
    prompt = rows[0]["prompt"][0]["content"]
    assert "<search>" not in prompt and rows[0]["agent_name"] == "stppo_tool_agent"
    assert '<tool_call>{"name": "search", "arguments": {"query_list": ["query"]}}</tool_call>' in prompt
    mcq = parquet_rows(tmp_path / "medqa_test.parquet")[0]["prompt"][0]["content"]
    assert "<search>" not in mcq and '<tool_call>{"name": "search"' in mcq and "Options:\nA. " in mcq


def test_an_episode_that_follows_the_prompt_searches_and_scores(tmp_path):
    row = tool_row(tmp_path, max_turns=2)
    call = tool_call_of(row["prompt"][0]["content"], ["Zaeththeiv Penda"])
    output, text = play_tool_row(row, [f"<think>Who is Penda?</think>\n{call}", "<answer> linguist </answer>"])
    assert "<information>Doc 1(Title: " in text and "Penda is a linguist." in text  # the tool ran
    assert output.reward_score == 1.0 and score_of(row, output, text) == 1.0
    assert [t.strip() for t in output.extra_fields[TURN_TEXTS]] == [f"<think>Who is Penda?</think>\n{call}",
                                                                    "<answer> linguist </answer>"]
    spans = output.extra_fields[TURN_SPANS]  # two runs of policy tokens, the tool response between them
    assert len(spans) == 2 and spans[0][1] < spans[1][0]
    assert sum(end - start for start, end in spans) == sum(output.response_mask)


@pytest.mark.parametrize("max_turns,expected", [(2, 1.0), (1, 0.0)])
def test_a_two_query_search_is_one_turn(tmp_path, max_turns, expected):
    """Two queries give two adjacent <information> blocks in one tool response: one observation, not a turn."""
    row = tool_row(tmp_path, max_turns=max_turns)
    call = tool_call_of(row["prompt"][0]["content"], ["Zaeththeiv Penda", "Kumsteth Viththae"])
    output, text = play_tool_row(row, [call, "<answer> linguist </answer>"])
    assert text.count("<information>Doc 1(Title: ") == 2
    assert output.reward_score == expected and score_of(row, output, text) == expected


@pytest.mark.parametrize("max_turns,expected", [(2, 1.0), (1, 0.0)])
def test_a_refused_tool_call_still_ends_its_turn(tmp_path, max_turns, expected):
    """The tool refuses an empty query list; the answer after it is the second turn, which a one-turn budget never
    reaches."""
    row = tool_row(tmp_path, max_turns=max_turns)
    output, text = play_tool_row(row, [tool_call_of(row["prompt"][0]["content"], []), "<answer> linguist </answer>"])
    assert "Search failed: query_list must be a list of non-empty strings" in text
    assert output.reward_score == expected and score_of(row, output, text) == expected


def test_information_the_policy_writes_is_text_of_its_turn(tmp_path):
    """A turn that quotes an <information> block and answers is one turn that answers (as the env reads it)."""
    row = tool_row(tmp_path, max_turns=1)
    turn = "<think>I know.</think><information>Doc 1(Title: x) y</information><answer> linguist </answer>"
    output, text = play_tool_row(row, [turn])
    env = SearchQAEnv("nq", split="test", limit=1, max_turns=1)
    env.reset(options={"index": 0})
    assert env.step(turn)[1] == 1.0
    assert output.reward_score == 1.0 and score_of(row, output, text) == 1.0
