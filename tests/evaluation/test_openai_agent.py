"""``stppo_agent.evaluation.openai_agent``: the request an openai: agent
sends, its messages, stop strings, concurrency and failures."""

from __future__ import annotations

import threading

import pytest

from stppo_agent.evaluation import openai_agent
from stppo_agent.evaluation.openai_agent import OpenAIChatAgent, messages
from stppo_envs import Segment
from tests.support.evaluation import view


# -- openai_agent.py --------------------------------------------------------------------------------------------
class Response:
    def __init__(self, body, status=200):
        self.body, self.status = body, status

    def raise_for_status(self):
        if self.status >= 400:
            import requests

            raise requests.HTTPError(f"{self.status} Server Error")

    def json(self):
        if isinstance(self.body, Exception):
            raise self.body
        return self.body


def fake_post(monkeypatch, *bodies):
    sent = []

    def post(url, json, timeout, headers):
        sent.append({"url": url, "json": json, "timeout": timeout, "headers": headers})
        body = bodies[min(len(sent), len(bodies)) - 1]
        return body if isinstance(body, Response) else Response(body)

    monkeypatch.setattr(openai_agent.requests, "post", post)
    return sent


def reply(content, finish="stop", stop_reason=None):
    choice = {"message": {"content": content}, "finish_reason": finish}
    if stop_reason is not ...:
        choice["stop_reason"] = stop_reason
    return {"choices": [choice]}


def test_openai_agent_sends_the_model_messages_and_sampling_settings(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    sent = fake_post(monkeypatch, reply("<search> x </search>"))
    agent = OpenAIChatAgent.from_spec("http://h:8/v1/#qwen")
    assert agent.name == "openai:http://h:8/v1/#qwen" and agent.url == "http://h:8/v1/chat/completions"
    transcript = [Segment("user", "prompt", -1), Segment("assistant", "act", 0), Segment("environment", "", 0),
                  Segment("environment", "obs", 0)]
    assert agent.act([view(turn=1, transcript=transcript)]) == ["<search> x </search>"]
    assert sent == [{"url": "http://h:8/v1/chat/completions", "timeout": 120.0,
                     "headers": {"Authorization": "Bearer EMPTY"},
                     "json": {"model": "qwen", "max_tokens": 256, "temperature": 0.0,
                              "stop": ["</search>", "</answer>"],
                              "messages": [{"role": "user", "content": "prompt"},
                                           {"role": "assistant", "content": "act"},
                                           {"role": "user", "content": "obs"}]}}]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    assert OpenAIChatAgent("http://h/apiX", "m").url == "http://h/apiX/chat/completions"
    agent = OpenAIChatAgent("https://h/v1", "m", max_tokens=9, temperature=0.5, timeout=3.0)
    agent.act([view()])
    assert sent[-1]["headers"] == {"Authorization": "Bearer sk-env"} and sent[-1]["timeout"] == 3.0
    assert (sent[-1]["json"]["max_tokens"], sent[-1]["json"]["temperature"]) == (9, 0.5)
    assert OpenAIChatAgent("http://h", "m", api_key="sk-arg").api_key == "sk-arg"


def test_openai_agent_messages_alternate_roles_and_skip_empty_segments():
    transcript = [Segment("user", "p", -1), Segment("assistant", "a1", 0), Segment("environment", "o1", 0),
                  Segment("assistant", "", 1), Segment("assistant", "a2", 1)]
    assert messages(view(turn=2, transcript=transcript)) == [
        {"role": "user", "content": "p"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "o1"}, {"role": "assistant", "content": "a2"}]


def test_openai_agent_puts_the_stop_string_back(monkeypatch):
    agent = OpenAIChatAgent("http://h/v1", "m")
    cases = [(reply("<search> q", stop_reason="</search>"), "<search> q</search>"),  # vLLM names the stop string
             (reply("<answer> a", stop_reason=128001), "<answer> a</answer>"),  # a token id: close the open tag
             (reply("<search> q", finish=None, stop_reason="</search>"), "<search> q</search>"),
             (reply("<answer> a", stop_reason="EOS"), "<answer> a</answer>"),
             (reply("<answer> a", stop_reason=...), "<answer> a</answer>"),
             (reply("<search> q", finish="length"), "<search> q"),  # cut by max_tokens: nothing to close
             (reply("<search> q </search> <answer> a", stop_reason=...), "<search> q </search> <answer> a</answer>"),
             (reply("<answer> a </answer>", stop_reason=...), "<answer> a </answer>"),
             (reply("plain", stop_reason=...), "plain"),
             (reply(None), "")]
    for body, expected in cases:
        fake_post(monkeypatch, body)
        assert agent.act([view()]) == [expected], body


def test_openai_agent_reports_a_failed_endpoint_as_a_connection_error(monkeypatch):
    import requests

    agent = OpenAIChatAgent("http://h/v1", "m")
    for body in (Response({}, 500), Response({"choices": []}), Response({"x": 1}), Response(ValueError("no json")),
                 Response(requests.ConnectionError("refused"))):
        fake_post(monkeypatch, body)
        with pytest.raises(ConnectionError, match="chat endpoint http://h/v1/chat/completions failed: "):
            agent.act([view()])


def test_openai_agent_from_spec_refuses_malformed_specs():
    for spec in ("http://h/v1", "http://h/v1#", "h:8/v1#m", "ftp://h#m"):
        with pytest.raises(ValueError, match=f"openai agent spec must be openai:http://HOST:PORT/v1#MODEL, got "
                                             f"openai:{spec}$"):
            OpenAIChatAgent.from_spec(spec)
    agent = OpenAIChatAgent.from_spec("https://h/v1#org/m#2", max_tokens=4, concurrency=2)
    assert (agent.model, agent.max_tokens, agent.concurrency, agent.timeout) == ("org/m#2", 4, 2, 120.0)


def test_openai_agent_sends_concurrency_requests_at_once_in_order(monkeypatch):
    lock, state, all_in = threading.Lock(), {"now": 0, "most": 0, "wait": 0.01}, threading.Event()

    def post(url, json, timeout, headers):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            if state["now"] == 4:
                all_in.set()
        all_in.wait(state["wait"])  # held until every request is in flight (a loaded machine starts threads late)
        with lock:
            state["now"] -= 1
        return Response(reply(json["messages"][0]["content"], finish="length"))

    monkeypatch.setattr(openai_agent.requests, "post", post)
    episodes = [view(transcript=[Segment("user", f"p{i}", -1)]) for i in range(4)]
    assert OpenAIChatAgent("http://h", "m", concurrency=1).act(episodes) == ["p0", "p1", "p2", "p3"]
    assert state["most"] == 1
    state["wait"] = 10.0
    assert OpenAIChatAgent("http://h", "m").act(episodes) == ["p0", "p1", "p2", "p3"]
    assert state["most"] == 4  # the default (16) sends every episode's request at once
    pools = []

    class Pool(openai_agent.ThreadPoolExecutor):
        def __init__(self, workers):
            pools.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(openai_agent, "ThreadPoolExecutor", Pool)
    OpenAIChatAgent("http://h", "m").act(episodes)
    OpenAIChatAgent("http://h", "m", concurrency=3).act(episodes)
    assert pools == [16, 3]


# A stop tag the server stopped in is closed again.


@pytest.mark.parametrize("content, closed, action", [
    # a server that does not say which stop string it hit stopped at the one closing the *last* open tag: the
    # first unclosed tag (one the model only mentioned while thinking) got the closing, and the search was lost
    ("<think>use <answer> or search?</think>\n<search> capital of France", "search", "search"),
    ("<think>no <search> yet</think> <answer> Paris", "answer", "answer"),
    ("<search> q </search> <answer> a", "answer", "search"),  # the turn's first complete block decides
])
def test_openai_agent_closes_the_tag_the_server_stopped_in(monkeypatch, content, closed, action):
    from stppo_agent.evaluation import openai_agent
    from stppo_agent.evaluation.agents import EpisodeView
    from stppo_envs import Segment
    from stppo_envs.actions import parse_action

    class Response:
        def raise_for_status(self):
            pass

        def json(self):
            return {"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}

    monkeypatch.setattr(openai_agent.requests, "post", lambda *args, **kwargs: Response())
    agent = openai_agent.OpenAIChatAgent("http://h/v1", "m")
    [text] = agent.act([EpisodeView("q1", "Capital of France?", None, (Segment("user", "prompt", -1),), 0)])
    assert parse_action(text).type.value == action
    assert text == f"{content}</{closed}>"
