"""An hf: agent is cached per checkpoint folder's files: rewritten in place (a run trained again with
--overwrite), the folder's model is loaded afresh, and unchanged it is served from the cache."""

from __future__ import annotations

from stppo_agent.evaluation import agent_specs, hf_agent


def test_a_checkpoint_rewritten_in_place_is_loaded_afresh(monkeypatch, tmp_path):
    class Fake:
        def __init__(self, path, max_new_tokens, max_observation_tokens):
            self.path = path

    monkeypatch.setattr(hf_agent, "HFAgent", Fake)
    agent_specs._cached_hf_agent.cache_clear()
    try:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        (folder / "w.bin").write_bytes(b"12")
        first = agent_specs._hf_agent(str(folder), 8)
        assert agent_specs._hf_agent(str(folder), 8) is first
        (folder / "w.bin").write_bytes(b"123")
        second = agent_specs._hf_agent(str(folder), 8)
        assert second is not first and agent_specs._hf_agent(str(folder), 8) is second
    finally:
        agent_specs._cached_hf_agent.cache_clear()
