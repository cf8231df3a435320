"""``stppo_agent.evaluation.hf_agent``: the settings an hf: agent hands its
loader and backend, and the tokens it keeps per episode."""

from __future__ import annotations

import pytest

from stppo_agent.evaluation import hf_agent
from stppo_envs import Segment
from tests.support.evaluation import view


# -- hf_agent.py ------------------------------------------------------------------------------------------------
class FakeTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [len(w) for w in text.split()]}

    def decode(self, ids, skip_special_tokens=False):
        return ("S:" if skip_special_tokens else "") + " ".join(map(str, ids))


class FakeModel:
    def __init__(self, path, dtype):
        self.path, self.dtype, self.device, self.evaluated = path, dtype, None, False

    def to(self, device):
        self.device = device
        return self

    def eval(self):
        self.evaluated = True
        return self


class Generation:
    def __init__(self, ids):
        self.token_ids = ids


class FakeBackend:
    def __init__(self, model, tokenizer, sampling, batch_size, reuse_cache):
        self.model, self.sampling, self.batch_size, self.reuse_cache = model, sampling, batch_size, reuse_cache
        self.tokenizer = tokenizer
        self.calls, self.ended = [], 0

    def generate(self, contexts, max_new_tokens, keys):
        self.calls.append(([list(c) for c in contexts], max_new_tokens, list(keys)))
        return [Generation([7] * (i + 1)) for i in range(len(contexts))]

    def end_rollout(self):
        self.ended += 1


@pytest.fixture
def fake_hf(monkeypatch):
    from stppo_agent.models import default_model, loading

    monkeypatch.setattr(default_model, "resolve_model", lambda path: f"resolved/{path}")
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: FakeTokenizer() if path.startswith("resolved/") else
                        None)
    monkeypatch.setattr(loading, "load_actor", FakeModel)
    monkeypatch.setattr(hf_agent, "HFGenerationBackend", FakeBackend)


def test_hf_agent_hands_its_settings_to_the_loader_and_the_backend(fake_hf):
    from stppo_agent.rollouts.sampling import SamplingSettings

    agent = hf_agent.HFAgent("ckpt")
    assert agent.name == "hf:ckpt" and agent.model.path == "resolved/ckpt" and agent.model.dtype == "float32"
    assert agent.model.device == "cpu" and agent.model.evaluated  # no GPU here
    assert agent.backend.model is agent.model and agent.backend.tokenizer is agent.tokenizer
    assert isinstance(agent.tokenizer, FakeTokenizer)
    assert agent.backend.sampling == SamplingSettings(greedy=True) and agent.backend.batch_size == 16
    assert agent.backend.reuse_cache is True and (agent.max_new_tokens, agent.max_observation_tokens) == (256, 512)
    sampling = SamplingSettings(temperature=0.7, top_p=0.9)
    other = hf_agent.HFAgent("p", max_new_tokens=5, max_observation_tokens=2, sampling=sampling, device="meta",
                             batch_size=3, dtype="bfloat16", reuse_cache=False)
    assert (other.model.device, other.model.dtype, other.backend.sampling) == ("meta", "bfloat16", sampling)
    assert (other.backend.batch_size, other.backend.reuse_cache, other.max_new_tokens,
            other.max_observation_tokens) == (3, False, 5, 2)


def test_hf_agent_goes_to_the_gpu_when_there_is_one(fake_hf, monkeypatch):
    monkeypatch.setattr(hf_agent.torch.cuda, "is_available", lambda: True)
    assert hf_agent.HFAgent("ckpt").model.device == "cuda"
    assert hf_agent.HFAgent("ckpt", device="cpu").model.device == "cpu"


def test_hf_agent_keeps_each_episodes_tokens_and_counts_what_it_generated(fake_hf):
    agent = hf_agent.HFAgent("ckpt", max_new_tokens=6, max_observation_tokens=2)
    first = [view(episode_id="a", transcript=[Segment("user", "aa b", -1)]),
             view(episode_id="b", transcript=[Segment("user", "ccc", -1)])]
    assert agent.act(first) == ["S:7", "S:7 7"]
    assert agent.backend.calls[-1] == ([[1, 2, 1], [1, 3]], 6, ["a", "b"]) and agent.backend.ended == 1
    assert (agent.generated_tokens("a"), agent.generated_tokens("b"), agent.generated_tokens("zz")) == (1, 2, 0)
    obs = [Segment("user", "aa b", -1), Segment("assistant", "x", 0), Segment("environment", "dddd ee fff", 0)]
    assert agent.act([view(turn=1, episode_id="b", transcript=obs)]) == ["S:7"]
    # the observation cut to max_observation_tokens, appended to the episode's own context; no new rollout
    assert agent.backend.calls[-1] == ([[1, 3, 7, 7, 4, 2]], 6, ["b"]) and agent.backend.ended == 1
    assert agent.generated_tokens("b") == 3 and agent.generated_tokens("a") == 1
    agent.act([view(episode_id="b", transcript=[Segment("user", "x", -1)])])  # a new set: the old state goes
    assert agent.backend.ended == 2 and agent.generated_tokens("a") == 0 and agent.generated_tokens("b") == 1
    with pytest.raises(ValueError, match=r"two episodes of one batch share an episode_id: \['b', 'b'\]"):
        agent.act([view(episode_id="b"), view(episode_id="b")])
