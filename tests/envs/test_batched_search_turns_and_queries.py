"""Each env's own turn decides whether its search is served when the searches of several envs go out together:
``step_envs``, the vector env and evaluation's
``run_episodes`` must ask every env, never the first one of the batch, whether its search could still be used.
Envs at different turns (or with different ``max_turns``) in one batch tell the two apart. A batched search
must also send the query sanitised, as a single env's ``step`` does. In-memory retrievers."""

from __future__ import annotations

import pytest

from stppo_agent.evaluation.evaluate import run_episodes
from stppo_envs import SearchQAEnv
from stppo_envs.vector import SearchQAVectorEnv, step_envs
from tests.support.retrievers import KeywordRetriever

PASSAGES = [(f"T{i}", f"passage {i} about paris") for i in range(6)]


class RecordingRetriever(KeywordRetriever):
    def __init__(self):
        super().__init__(PASSAGES)
        self.asked: list[tuple[list[str], int]] = []

    def batch_search(self, queries, k=10):
        self.asked.append((list(queries), k))
        return super().batch_search(queries, k)


def _pair(retriever, turns, topk=2):
    """Envs with the given max_turns each, reset on examples 0, 1, ..."""
    envs = [SearchQAEnv("nq", retriever=retriever, topk=topk, max_turns=t) for t in turns]
    for i, env in enumerate(envs):
        env.reset(options={"index": i})
    return envs


@pytest.mark.parametrize("turns, served", [((1, 4), ["paris 1"]), ((4, 1), ["paris 0"])])
def test_step_envs_serves_a_search_by_its_own_envs_turn(turns, served):
    retriever = RecordingRetriever()
    envs = _pair(retriever, turns)
    results = step_envs(envs, ["<search> paris 0 </search>", "<search> paris 1 </search>"])
    assert retriever.asked == [(served, 2)]
    last = turns.index(1)
    assert results[last][0] == "" and results[last][3] is True and results[last][4]["search_calls"] == 0
    assert results[1 - last][0].count("Doc ") == 2 and results[1 - last][4]["search_calls"] == 1


@pytest.mark.parametrize("turns, served", [((1, 4), ["paris 1"]), ((4, 1), ["paris 0"])])
def test_the_vector_env_serves_a_search_by_its_own_envs_turn(turns, served):
    retriever = RecordingRetriever()
    vec = SearchQAVectorEnv([SearchQAEnv("nq", retriever=retriever, topk=2, max_turns=t) for t in turns])
    vec.reset(options={"indices": [0, 1]})
    observations, _, _, truncated, infos = vec.step(["<search> paris 0 </search>", "<search> paris 1 </search>"])
    assert retriever.asked == [(served, 2)]
    assert truncated.tolist() == [t == 1 for t in turns]
    assert infos["search_calls"].tolist() == [int(t > 1) for t in turns]


def test_the_vector_env_judges_a_search_after_an_autoreset_by_that_envs_own_turn():
    retriever = RecordingRetriever()
    vec = SearchQAVectorEnv([SearchQAEnv("nq", retriever=retriever, topk=2, max_turns=2) for _ in range(2)])
    vec.reset(options={"indices": [0, 1]})
    vec.step(["<answer> x </answer>", "<search> a </search>"])  # env 0 ends; env 1 has one turn left
    vec.step(["<search> ignored </search>", "<search> b </search>"])  # env 0 resets; env 1's last turn
    assert [q for q, _ in retriever.asked] == [["a"]]  # b came on env 1's last turn: never served
    vec.step(["<search> c </search>", "<search> ignored </search>"])  # env 0 at turn 0 of 2; env 1 resets
    assert [q for q, _ in retriever.asked] == [["a"], ["c"]]


class _AnswerFirstSearchOthers:
    """Episode of example 0 answers at once; the others search on every turn."""

    name = "answer-first"

    def act(self, episodes):
        return ["<answer> x </answer>" if e.example_id.endswith("-0") else f"<search> {e.question} </search>"
                for e in episodes]


def test_run_episodes_serves_a_search_by_its_own_episodes_turn_not_the_first_slots():
    retriever = RecordingRetriever()
    envs = [SearchQAEnv("nq", retriever=retriever, topk=2, max_turns=3, limit=2) for _ in range(2)]
    records = run_episodes(envs, _AnswerFirstSearchOthers(), [0, 1])
    assert [r["turns"] for r in records] == [1, 3]
    assert [r["search_calls"] for r in records] == [0, 2]  # turns 0 and 1; the last turn's search is not served
    assert len(retriever.asked) == 2 and all(k == 2 for _, k in retriever.asked)


RAW = "<search> paris\x00 capital\ud800 </search>"
SANITISED = "paris  capital\ufffd"  # NUL to a space, a lone surrogate to U+FFFD, as SearchQAEnv.step sends it


def test_step_envs_sends_the_query_sanitised_like_a_single_step():
    retriever = RecordingRetriever()
    envs = _pair(retriever, (4, 4))
    results = step_envs(envs, [RAW, "<answer> x </answer>"])
    assert retriever.asked == [([SANITISED], 2)]
    assert results[0][4]["query"] == "paris\x00 capital\ud800"  # info keeps what the policy wrote


def test_the_vector_env_sends_the_query_sanitised_like_a_single_step():
    retriever = RecordingRetriever()
    vec = SearchQAVectorEnv([SearchQAEnv("nq", retriever=retriever, topk=2) for _ in range(2)])
    vec.reset(options={"indices": [0, 1]})
    vec.step(["<answer> x </answer>", RAW])
    assert retriever.asked == [([SANITISED], 2)]


def test_run_episodes_sends_the_query_sanitised_like_a_single_step():
    retriever = RecordingRetriever()

    class Raw:
        def act(self, episodes):
            return [RAW if e.turn == 0 else "<answer> x </answer>" for e in episodes]

    run_episodes([SearchQAEnv("nq", retriever=retriever, topk=2, limit=1)], Raw(), [0])
    assert retriever.asked == [([SANITISED], 2)]
