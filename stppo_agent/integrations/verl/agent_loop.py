"""``stppo_env``: this project's env as a verl agent loop (rows exported with ``agent_name="stppo_env"``).

One episode per ``run``, exactly as this project's own rollouts play it (``stppo_agent.rollouts.turn_loop``): the
env's prompt through the tokenizer's chat template (with verl's ``data.apply_chat_template_kwargs``); per turn,
verl's ``server_manager`` generates from the exact token sequence until ``</search>``, ``</answer>``, EOS or the
budget, and the sampled ids are kept as they are (cut where the stop string completes, never decoded and
re-encoded); the turn's text goes to ``env.step`` (Search-R1's protocol, retrieval, invalid actions, the turn limit);
the observation is tokenised alone and appended with ``response_mask`` 0. The output carries the sampler's
log-probs, ``num_turns``, the env's reward as ``reward_score`` and the turn record (:mod:`.turns`).

The env is rebuilt from the row's ``extra_info`` (:mod:`.data`), and the prompt it plays must be the row's prompt:
a row exported with other env settings (the question mark, the dataset) is refused rather than played with
another prompt than the one verl's dataset filtered and logged.

Retrieval: ``retriever`` in the agent loop config (``agent.agent_loop_config_path``: a ``stppo serve`` URL, one
per node, or a local spec that each agent-loop worker loads once), default ``$STPPO_VERL_RETRIEVER`` or ``demo``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from stppo_agent.rollouts.generation import STOP_STRINGS, generated_length
from stppo_agent.rollouts.turn_loop import encode_observation, encode_prompt
from stppo_envs import SearchQAEnv
from stppo_envs.retrieval import make_retriever

from .turns import TURN_SPANS, TURN_TEXTS

AGENT_NAME = "stppo_env"
_RETRIEVERS: dict[str, Any] = {}  # one per spec and process: an index loads once per agent-loop worker


def shared_retriever(spec: str):
    if spec not in _RETRIEVERS:
        _RETRIEVERS[spec] = make_retriever(spec)
    return _RETRIEVERS[spec]


def positive_setting(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"stppo_env agent loop: {name} must be an integer >= 1, got {value!r} (agent loop config)")
    return value


def messages_of(raw_prompt) -> list[tuple[str, str]]:
    """The row's chat messages as (role, content) pairs (verl hands them over as dicts, parquet-read or not)."""
    return [(str(message["role"]), str(message["content"])) for message in list(raw_prompt or [])]


@register(AGENT_NAME)
class StppoEnvAgentLoop(AgentLoopBase):
    """Settings (agent loop config keys): ``retriever``, ``topk`` (3), ``max_new_tokens_per_turn`` (the response
    budget), ``max_observation_tokens`` (512, as this project's rollouts); each at least 1."""

    def __init__(self, *args, retriever: str | None = None, topk: int = 3, max_new_tokens_per_turn: int | None = None,
                 max_observation_tokens: int = 512, **kwargs):
        super().__init__(*args, **kwargs)
        self.response_length = self.rollout_config.response_length
        self.retriever_spec = retriever or os.environ.get("STPPO_VERL_RETRIEVER", "demo")
        self.topk = positive_setting("topk", topk)
        self.max_new_tokens_per_turn = (self.response_length if max_new_tokens_per_turn is None
                                        else positive_setting("max_new_tokens_per_turn", max_new_tokens_per_turn))
        # 0 would append no observation at all, and a search turn would run into the next one
        self.max_observation_tokens = positive_setting("max_observation_tokens", max_observation_tokens)
        self.eos_ids = [i for i in [self.tokenizer.eos_token_id] if i is not None]

    def make_env(self, extra_info: dict) -> SearchQAEnv:
        """The row's env, as :mod:`.data` recorded it."""
        question_mark = extra_info.get("question_mark")
        return SearchQAEnv(extra_info["benchmark"], dataset=extra_info.get("dataset") or None,
                           split=extra_info["split"], retriever=shared_retriever(self.retriever_spec), topk=self.topk,
                           max_turns=int(extra_info["max_turns"]), reward=extra_info.get("reward") or "auto",
                           format_reward=float(extra_info.get("format_reward") or 0.0),
                           question_mark=True if question_mark is None else bool(question_mark))

    def start(self, env: SearchQAEnv, extra_info: dict, raw_prompt) -> str:
        """The episode's prompt, after checking it is the row's."""
        prompt, _ = env.reset(options={"index": int(extra_info["index"])})
        if messages_of(raw_prompt) != [("user", prompt)]:
            raise ValueError(
                f"stppo_env agent loop: row {extra_info['benchmark']} {extra_info['split']} #{extra_info['index']}: "
                f"the env rebuilt from extra_info plays the prompt {prompt[-80:]!r}, not the row's "
                f"{messages_of(raw_prompt)!r:.200}; export the rows again with this version (stppo export verl)")
        return prompt

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        extra_info = kwargs["extra_info"]
        env = self.make_env(extra_info)
        prompt_ids = encode_prompt(self.tokenizer, self.start(env, extra_info, kwargs.get("raw_prompt")),
                                   self.apply_chat_template_kwargs)
        response, mask, logprobs, spans, texts = [], [], [], [], []
        reward, turns, observations, sampled_logprobs, request_id = 0.0, 0, 0, True, uuid4().hex
        for _ in range(env.max_turns):
            room = self.response_length - len(response)
            if room <= 0:
                break
            params = {**sampling_params, "stop": list(STOP_STRINGS),
                      "max_tokens": min(room, self.max_new_tokens_per_turn)}
            output = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids + response,
                                                        sampling_params=params)
            kept = generated_length(output.token_ids, self.tokenizer, STOP_STRINGS, self.eos_ids)
            ids = list(output.token_ids[:min(kept, room)])
            spans.append([len(response), len(response) + len(ids)])
            response += ids
            mask += [1] * len(ids)
            sampled_logprobs = sampled_logprobs and output.log_probs is not None
            logprobs += list(output.log_probs[:len(ids)]) if output.log_probs else [0.0] * len(ids)
            action = self.tokenizer.decode(ids, skip_special_tokens=True)
            texts.append(action)
            observation, step_reward, terminated, truncated, _ = await asyncio.to_thread(env.step, action)
            turns += 1
            if terminated or truncated:
                reward = float(step_reward)
                break
            obs_ids = encode_observation(self.tokenizer, observation, self.max_observation_tokens)
            obs_ids = obs_ids[:self.response_length - len(response)]
            response += obs_ids
            mask += [0] * len(obs_ids)
            logprobs += [0.0] * len(obs_ids)
            observations += 1
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response, response_mask=mask,
                               response_logprobs=logprobs if sampled_logprobs else None, reward_score=reward,
                               num_turns=1 + turns + observations, metrics={},
                               extra_fields={"turn_scores": [], "tool_rewards": [], TURN_SPANS: spans,
                                             TURN_TEXTS: texts})
