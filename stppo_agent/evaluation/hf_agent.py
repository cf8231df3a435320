"""An evaluation agent backed by a Hugging Face checkpoint (``hf:PATH``), greedy by default.

It keeps each episode's exact token ids (prompt via the chat template, its own generated ids, observations
tokenised alone), so evaluation sees the same token sequences training produced: no re-tokenisation.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stppo_agent.evaluation.agents import EpisodeView
from stppo_agent.rollouts.hf_generation import HFGenerationBackend
from stppo_agent.rollouts.sampling import SamplingSettings
from stppo_agent.rollouts.turn_loop import RolloutLimits, cut_observation, encode_prompt


class HFAgent:
    """Greedy (or sampled) generation with a causal LM checkpoint."""

    def __init__(self, path: str, *, max_new_tokens: int = 256,
                 max_observation_tokens: int = RolloutLimits.max_observation_tokens,
                 sampling: SamplingSettings = SamplingSettings(greedy=True), device: str | None = None,
                 batch_size: int = 16, dtype: str = "float32", reuse_cache: bool = True):
        from stppo_agent.models.default_model import resolve_model
        from stppo_agent.models.loading import load_actor, load_tokenizer

        self.name = f"hf:{path}"
        resolved = resolve_model(path)
        self.tokenizer = load_tokenizer(resolved)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_actor(resolved, dtype).to(device).eval()
        self.backend = HFGenerationBackend(self.model, self.tokenizer, sampling, batch_size=batch_size,
                                           reuse_cache=reuse_cache)
        self.max_new_tokens, self.max_observation_tokens = max_new_tokens, max_observation_tokens
        self._contexts: dict[str, list[int]] = {}
        self._generated: dict[str, int] = {}
        self._cut: dict[str, int] = {}

    def act(self, episodes: Sequence[EpisodeView]) -> list[str]:
        if all(episode.turn == 0 for episode in episodes):  # a new set of episodes: the last set's state goes
            self.backend.end_rollout()
            self._contexts.clear()
            self._generated.clear()
            self._cut.clear()
        contexts = [self._context(ep) for ep in episodes]
        keys = [episode.episode_id for episode in episodes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two episodes of one batch share an episode_id: {sorted(keys)}")
        # keyed by episode (never by example: one example may be played twice at once), so each continues
        # its key/value cache from its previous turn (same tokens as re-encoding the transcript, tested)
        generations = self.backend.generate(contexts, self.max_new_tokens, keys=keys)
        actions = []
        for key, generation in zip(keys, generations):
            self._contexts[key] += generation.token_ids
            self._generated[key] = self._generated.get(key, 0) + len(generation.token_ids)
            actions.append(self.tokenizer.decode(generation.token_ids, skip_special_tokens=True))
        return actions

    def generated_tokens(self, episode_id: str) -> int:
        """Tokens this agent generated in episode ``episode_id`` (for the evaluation's token count)."""
        return self._generated.get(episode_id, 0)

    def observations_cut(self, episode_id: str) -> int:
        """Observations of episode ``episode_id`` cut to ``max_observation_tokens`` (passages the agent never saw)."""
        return self._cut.get(episode_id, 0)

    def _context(self, episode: EpisodeView) -> list[int]:
        key = episode.episode_id
        if episode.turn == 0:
            self._generated[key], self._cut[key] = 0, 0
            self._contexts[key] = encode_prompt(self.tokenizer, episode.transcript[0].text)
        else:
            ids, cut = cut_observation(self.tokenizer, episode.transcript[-1].text, self.max_observation_tokens)
            self._cut[key] = self._cut.get(key, 0) + cut
            self._contexts[key] += ids
        return self._contexts[key]
