"""What the tests of the bridge's verl agent loops share (tests/integrations/verl/test_agent_loop.py and
test_tool_agent.py): the tokenizer, a scripted stand-in for verl's ``server_manager``, an agent loop built the way
verl's ``AgentLoopWorker`` builds it (hydra, from an agent loop config entry), and an episode on a row
(tests/support/verl_rows.py)."""

from __future__ import annotations

import asyncio
import functools

from omegaconf import OmegaConf

from tests.support.verl_rows import row_kwargs


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer

    return load_tokenizer(str(smollm2_path()))


class ScriptedServer:
    """A stand-in for verl's server_manager: each call returns the next scripted turn followed by ``tail`` (what a
    sampler returns when it does not cut at stop strings), with log-probs; records every request."""

    def __init__(self, turns: list[list[int]], tail: list[int] = ()):
        self.turns, self.tail, self.requests = turns, list(tail), []

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.requests.append((list(prompt_ids), dict(sampling_params)))
        ids = (self.turns[len(self.requests) - 1] + self.tail)[:sampling_params.get("max_tokens", 10**9)]
        return TokenOutput(token_ids=ids, log_probs=[-0.25 - 0.01 * i for i in range(len(ids))])


def build_loop(entry: dict, server, tokenizer=None, rollout: dict | None = None, data: dict | None = None,
               tools: list = ()):
    """The agent loop registered under ``entry["name"]``, instantiated from ``entry`` as verl's worker does."""
    import hydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset

    rollout = {"prompt_length": 1024, "response_length": 400, **(rollout or {})}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})
    entry = OmegaConf.create({"_target_": _agent_loop_registry[entry["name"]]["_target_"], **entry})
    return hydra.utils.instantiate(config=entry, trainer_config=DictConfigWrap(config), server_manager=server,
                                   tokenizer=tokenizer or smollm2_tokenizer(), processor=None, hf_model_type=None,
                                   dataset_cls=RLHFDataset, data_config=DictConfigWrap(OmegaConf.create(data or {})),
                                   tools=ToolListWrap(list(tools)))


def play(make_loop, row: dict, **sampling):
    """One episode of the loop ``make_loop()`` builds, on ``row``: built inside the event loop that runs it, as in
    verl's worker (the loop keeps the event loop it was built in)."""
    async def episode():
        return await make_loop().run({"temperature": 1.0, "logprobs": True, **sampling}, **row_kwargs(row))

    return asyncio.run(episode())
