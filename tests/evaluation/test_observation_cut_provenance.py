"""What each agent read of an observation is recorded, and compared only where it bears on the score.

An ``hf:`` agent cuts observations to a token budget (training's 512 unless told); an ``openai:`` agent sends them
whole, so its result carries ``max_observation_tokens: null`` and does not compare silently with an ``hf:`` one.
An explicit cut an agent would not apply is refused. A built-in scripted baseline neither generates nor tokenises:
the LLM limits do not stop it from comparing with a model."""

from __future__ import annotations

import pytest

from stppo_agent.evaluation import openai_agent
from stppo_agent.evaluation.agent_specs import build_agent
from stppo_agent.evaluation.comparison import ProvenanceMismatchError, compare, provenance_differences
from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark, observation_cut
from tests.support.retrievers import KeywordRetriever


class _Response:
    def raise_for_status(self):
        pass

    def json(self):
        return {"choices": [{"message": {"content": "<answer> Paris </answer>"}, "finish_reason": "stop"}]}


def _openai_result(monkeypatch):
    monkeypatch.setattr(openai_agent.requests, "post", lambda *args, **kwargs: _Response())
    settings = EvalSettings("nq", limit=2, retriever=KeywordRetriever(), batch_size=2)
    return evaluate_benchmark("openai:http://h/v1#m", settings)


def test_an_openai_agents_result_records_that_it_read_whole_observations(monkeypatch):
    result = _openai_result(monkeypatch)
    assert result["provenance"]["max_observation_tokens"] is None
    assert result["metrics"]["n"] == 2


def _record(agent, **provenance):
    base = {"agent": agent, "dataset": "d", "retriever": "r", "topk": 3, "retriever_id": "bm25:x", "seed": 0,
            "max_new_tokens": 256}
    return {"benchmark": "nq", "metrics": {"em": 0.5, "n": 2}, "provenance": {**base, **provenance}}


def test_an_uncut_openai_result_does_not_compare_with_an_hf_one_at_the_default_cut(monkeypatch):
    uncut = _openai_result(monkeypatch)
    hf = _record("hf:ckpt", **{k: v for k, v in uncut["provenance"].items()
                               if k not in ("agent", "max_observation_tokens")})
    assert "max_observation_tokens" not in hf["provenance"]  # the default is not written down
    assert provenance_differences([hf, uncut]) == {"max_observation_tokens": [512, None]}
    with pytest.raises(ProvenanceMismatchError, match=r"max_observation_tokens: \[512, None\]"):
        compare([[hf], [uncut]], ["hf", "openai"])
    assert "NOT COMPARABLE: max_observation_tokens" in compare([[hf], [uncut]], ["hf", "openai"], force=True)


def test_two_openai_results_compare_and_so_do_two_hf_results_at_the_default():
    assert provenance_differences([_record("openai:u#a", max_observation_tokens=None),
                                   _record("openai:u#b", max_observation_tokens=None)]) == {}
    assert provenance_differences([_record("hf:a"), _record("hf:b")]) == {}


@pytest.mark.parametrize("spec", ["openai:http://h/v1#m", "oracle", "search-copy"])
def test_an_explicit_cut_is_refused_by_an_agent_that_reads_whole_observations(spec):
    with pytest.raises(ValueError, match=r"reads whole observations; --max-observation-tokens 256 applies to hf: "):
        build_agent(spec, [], 64, 256)
    assert build_agent(spec, [], 64) is not None  # unset, it builds


def test_an_hf_agent_is_built_with_the_cut_asked_for_or_trainings(monkeypatch):
    from stppo_agent.evaluation import agent_specs

    built = []
    monkeypatch.setattr(agent_specs, "_hf_agent", lambda path, new, cut: built.append((path, new, cut)) or "agent")
    build_agent("hf:ckpt", [], 64)
    build_agent("hf:ckpt", [], 64, 300)
    assert built == [("ckpt", 64, 512), ("ckpt", 64, 300)]


def test_the_recorded_cut_is_what_the_agent_says_it_read_before_the_setting():
    class Says:
        def __init__(self, cut):
            self.max_observation_tokens = cut

    class Silent:
        pass

    settings = EvalSettings("nq", max_observation_tokens=300)
    assert observation_cut(Says(None), settings) is None
    assert observation_cut(Says(128), settings) == 128
    assert observation_cut(Silent(), settings) == 300
    assert observation_cut(Silent(), EvalSettings("nq")) == 512


@pytest.mark.parametrize("key, value", [("max_new_tokens", 64), ("max_observation_tokens", 16),
                                        ("max_observation_tokens", None)])
def test_a_scripted_baseline_compares_with_a_model_under_any_llm_limit(key, value):
    baseline, model = _record("search-copy"), _record("hf:ckpt", **{key: value})
    assert provenance_differences([baseline, model]) == {}
    assert provenance_differences([model, baseline]) == {}
    # between two models the same difference still refuses, and so does a non-LLM field beside a baseline
    assert key in provenance_differences([_record("hf:other"), model])
    assert "topk" in provenance_differences([baseline, _record("hf:ckpt", topk=5)])


def test_a_registered_plugin_agent_is_not_taken_for_a_baseline(monkeypatch):
    from stppo_agent.evaluation.agents import SCRIPTED_AGENTS

    monkeypatch.setitem(SCRIPTED_AGENTS, "my-llm", lambda examples: None)  # as register_agent does; undone after
    assert "max_new_tokens" in provenance_differences([_record("my-llm"), _record("hf:ckpt", max_new_tokens=64)])
