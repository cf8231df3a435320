"""``stppo_tool_agent``: verl's own tool agent loop (``tool_agent``: the model calls the search tool of :mod:`.tool`
through its chat template's tool-call format, hermes ``<tool_call>`` by default), plus what the bridge needs from an
episode: the turn record (:mod:`.turns`) and the env's reward.

verl's ``tool_agent`` plays the episode unchanged. Afterwards each maximal run of 1s of the response mask it built is
one assistant turn (every tool response lies between two turns, with mask 0), recorded as ``stppo_turn_spans`` (for
the losses) and ``stppo_turn_texts`` (each turn decoded as the policy wrote it), and the episode is scored by
:func:`.reward.compute_score` on those turns (the env's rules, the row's ground truth and env settings), the
output's ``reward_score``. verl's reward function is then not called for these rows; ``compute_score`` on the same
response and ``extra_info`` gives the same score.

Rows for this loop: ``stppo export verl --agent-loop stppo_tool_agent`` (their prompt asks for the tool call).
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from .reward import compute_score
from .turns import TURN_SPANS, TURN_TEXTS, spans_from_mask

AGENT_NAME = "stppo_tool_agent"


@register(AGENT_NAME)
class StppoToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` with the turn record and the env's reward; settings as verl's tool agent
    (``actor_rollout_ref.rollout.multi_turn``: tool config, format, turn limits)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        output = await super().run(sampling_params, **kwargs)
        spans = spans_from_mask(output.response_mask)
        texts = [self.tokenizer.decode(output.response_ids[start:end], skip_special_tokens=True)
                 for start, end in spans]
        output.extra_fields.update({TURN_SPANS: spans, TURN_TEXTS: texts})
        extra_info = dict(kwargs.get("extra_info") or {})
        output.reward_score = compute_score(kwargs.get("data_source", ""), "", kwargs["reward_model"]["ground_truth"],
                                            {**extra_info, TURN_TEXTS: texts})
        return output
