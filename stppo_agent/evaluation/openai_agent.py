"""An agent behind any OpenAI-compatible chat endpoint (vLLM, SGLang, TGI, ...): ``openai:http://HOST:PORT/v1#MODEL``.

The transcript becomes chat messages (prompt as user, each action as assistant, each observation as user).
Generation stops at ``</search>`` / ``</answer>``; OpenAI-style servers drop the stop string from the text, so it
is put back (vLLM reports it as ``stop_reason``; otherwise an unclosed tag is closed).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import requests

from stppo_agent.evaluation.agents import EpisodeView
from stppo_agent.rollouts.generation import STOP_STRINGS

# The last opening tag with no closing after it: a server stopped at the stop string that closes it (an earlier
# unclosed tag is one the model only mentioned, "<think>use <answer> or search?</think>").
_LAST_OPEN_TAG = re.compile(r"[\s\S]*<(search|answer)>(?![\s\S]*</\1>)")


class OpenAIChatAgent:
    """Greedy by default; one request per episode, sent concurrently."""

    max_observation_tokens = None
    """It sends whole observations: the server tokenises them, and only its context length limits them (so its
    results do not compare silently with an ``hf:`` agent's, which cuts them as training did)."""

    def __init__(self, base_url: str, model: str, *, max_tokens: int = 256, temperature: float = 0.0,
                 timeout: float = 120.0, concurrency: int = 16, api_key: str | None = None):
        self.name = f"openai:{base_url}#{model}"
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self.timeout, self.concurrency = timeout, concurrency
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY", "EMPTY")

    @classmethod
    def from_spec(cls, spec: str, **kwargs) -> "OpenAIChatAgent":
        """``http://HOST:PORT/v1#MODEL`` (the part after ``openai:``)."""
        url, sep, model = spec.partition("#")
        if not sep or not model or not url.startswith(("http://", "https://")):
            raise ValueError(f"openai agent spec must be openai:http://HOST:PORT/v1#MODEL, got openai:{spec}")
        return cls(url, model, **kwargs)

    def act(self, episodes: Sequence[EpisodeView]) -> list[str]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._act_one, episodes))

    def _act_one(self, episode: EpisodeView) -> str:
        payload = {"model": self.model, "messages": messages(episode), "max_tokens": self.max_tokens,
                   "temperature": self.temperature, "stop": list(STOP_STRINGS)}
        try:
            response = requests.post(self.url, json=payload, timeout=self.timeout,
                                     headers={"Authorization": f"Bearer {self.api_key}"})
            response.raise_for_status()
            choice = response.json()["choices"][0]
        except (requests.RequestException, KeyError, IndexError, ValueError) as exc:
            raise ConnectionError(f"chat endpoint {self.url} failed: {exc}") from exc
        text = choice["message"].get("content") or ""
        stop = choice.get("stop_reason")
        if isinstance(stop, str) and stop in STOP_STRINGS:
            return text + stop
        unclosed = _LAST_OPEN_TAG.match(text)
        if choice.get("finish_reason") == "stop" and unclosed:
            return text + f"</{unclosed.group(1)}>"
        return text


def messages(episode: EpisodeView) -> list[dict[str, str]]:
    out = [{"role": "user", "content": episode.transcript[0].text}]
    for segment in episode.transcript[1:]:
        if segment.text:
            out.append({"role": "assistant" if segment.role == "assistant" else "user", "content": segment.text})
    return out
