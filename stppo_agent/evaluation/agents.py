"""The agent protocol for evaluation, and scripted baselines that need no LLM.

An agent maps a batch of in-progress episodes to one action text each. An :class:`EpisodeView` carries
everything seen so far (question, options, transcript segments, turn), so the same agent object can serve any
number of episodes in any order. An agent that keeps state across an episode's turns (an LLM's token context
and KV cache) keys it by ``episode_id``, never by ``example_id``: one example may be played by several
episodes at once.

Scripted baselines sanity-check environments and retrieval:
- ``oracle`` answers with a golden answer (it is given the examples): EM / accuracy must be 1.0.
- ``no-search`` answers the sentinel "∅" at once: EM / accuracy must be 0.0 (no gold answer or option is "∅";
  "unknown", the obvious choice, is a gold answer in NQ-open).
- ``search-copy`` searches the question once, then answers with the title of the top passage (QA) or the
  option whose words overlap the passages most (MCQ): a retrieval-only baseline.
- ``gold-search`` searches the question, then each supporting passage it has not seen yet (multi-hop), then
  answers with a golden answer: Search-R1-format demonstrations for a supervised warm start (``stppo sft``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Protocol, Sequence

from stppo_envs import Example, Segment
from stppo_envs.scoring import normalize_answer

DEFAULT_MAX_OBSERVATION_TOKENS = 512
"""Training's default (``RolloutLimits.max_observation_tokens``; a test holds them equal, this module stays free
of torch): an ``hf:`` model is evaluated on observations cut as it was trained on them. The only value before the
setting existed, so provenance records the cut only where it differs (``null`` for an agent that reads whole
observations: ``openai:``)."""


def observation_budget(setting: int | None) -> int:
    """The cut an ``hf:`` agent applies for an evaluation's ``max_observation_tokens`` (unset: training's)."""
    return setting or DEFAULT_MAX_OBSERVATION_TOKENS


@dataclasses.dataclass(frozen=True)
class EpisodeView:
    """What an agent may see of one episode in progress."""

    example_id: str
    question: str
    choices: Mapping[str, str] | None
    transcript: tuple[Segment, ...]
    turn: int
    max_turns: int | None = None  # the env's turn limit, where known
    # Unique among the episodes of one run (evaluation: the example id, then "<id>#2", "<id>#3" for further
    # episodes of the same example); defaults to the example id for drivers that play each example once.
    episode_id: str | None = None

    def __post_init__(self):
        if self.episode_id is None:
            object.__setattr__(self, "episode_id", self.example_id)

    @property
    def last_observation(self) -> str:
        return self.transcript[-1].text


class Agent(Protocol):
    """Batched policy: one action text per episode view.

    An LLM agent that cuts each observation to a token budget says so in ``max_observation_tokens`` (``None``: it
    reads whole observations); evaluation records it, so results cut differently do not compare silently."""

    name: str

    def act(self, episodes: Sequence[EpisodeView]) -> list[str]: ...


class OracleAgent:
    """Answers with the first golden answer (the option letter for MCQ)."""

    name = "oracle"

    def __init__(self, examples: Sequence[Example]):
        self._gold = gold_answers(examples)

    def act(self, episodes: Sequence[EpisodeView]) -> list[str]:
        return [f"<think>I know this.</think>\n<answer> {self._gold[ep.example_id]} </answer>" for ep in episodes]


def gold_answers(examples: Sequence[Example]) -> dict[str, str]:
    """Example id -> the first golden answer (the option letter for multiple choice)."""
    return {e.id: (e.answer_letter if e.is_multiple_choice else e.golden_answers[0]) for e in by_id(examples)}


def by_id(examples: Sequence[Example]) -> list[Example]:
    """``examples``, refused when two share an id: agents that look an example up by id would answer one of
    them with the other's gold (loaders refuse such datasets; this guards examples built by hand)."""
    seen: set[str] = set()
    for example in examples:
        if example.id in seen:
            raise ValueError(f"example id {example.id!r} occurs more than once; scripted agents look examples up "
                             "by id, so each needs its own")
        seen.add(example.id)
    return list(examples)


class NoSearchAgent:
    """Gives up immediately without searching."""

    name = "no-search"

    def act(self, episodes: Sequence[EpisodeView]) -> list[str]:
        return ["<think>I will not search.</think>\n<answer> ∅ </answer>" for _ in episodes]


class GoldSearchAgent:
    """Searches the question, then the title of each supporting passage not retrieved yet (the second hop of a
    multi-hop question, from the dataset's supporting facts), then gives the golden answer -- on the last turn
    at the latest. Well-formed Search-R1 episodes to imitate."""

    name = "gold-search"

    def __init__(self, examples: Sequence[Example]):
        self._gold = gold_answers(examples)
        self._hops = {e.id: [str(t) for t in e.metadata.get("supporting_titles", ())] for e in by_id(examples)}

    def act(self, episodes: Sequence[EpisodeView]) -> list[str]:
        return [self._act_one(episode) for episode in episodes]

    def _act_one(self, episode: EpisodeView) -> str:
        last_turn = episode.max_turns is not None and episode.turn >= episode.max_turns - 1
        if episode.turn == 0 and not last_turn:
            return f"<think>I need to look this up.</think>\n<search> {episode.question} </search>"
        seen = "".join(segment.text for segment in episode.transcript if segment.role == "environment")
        missing = [title for title in self._hops[episode.example_id] if f'(Title: "{title}")' not in seen]
        if missing and not last_turn:
            return f"<think>I still need to know about {missing[0]}.</think>\n<search> {missing[0]} </search>"
        return f"<think>The documents answer it.</think>\n<answer> {self._gold[episode.example_id]} </answer>"


_TITLE = re.compile(r'Doc 1\(Title: "(.*?)"\)')


class SearchCopyAgent:
    """Search the question once, then copy from the top passages."""

    name = "search-copy"

    def act(self, episodes: Sequence[EpisodeView]) -> list[str]:
        return [self._act_one(ep) for ep in episodes]

    def _act_one(self, episode: EpisodeView) -> str:
        if episode.turn == 0:
            return f"<think>Let me look it up.</think>\n<search> {episode.question} </search>"
        information = episode.last_observation
        if episode.choices:
            return f"<answer> {best_overlapping_option(information, episode.choices)} </answer>"
        match = _TITLE.search(information)
        return f"<answer> {match.group(1) if match else 'unknown'} </answer>"


def best_overlapping_option(text: str, choices: Mapping[str, str]) -> str:
    """The option letter whose normalised words occur most often in ``text`` (first letter on ties).

    >>> best_overlapping_option("insulin lowers glucose", {"A": "aspirin", "B": "insulin"})
    'B'
    """
    words = normalize_answer(text).split()
    counts = {letter: sum(words.count(w) for w in normalize_answer(option).split())
              for letter, option in choices.items()}
    return max(counts, key=lambda letter: (counts[letter], -ord(letter[0])))


SCRIPTED_AGENTS: dict[str, Callable[[Sequence[Example]], Agent]] = {
    "oracle": OracleAgent,
    "no-search": lambda examples: NoSearchAgent(),
    "search-copy": lambda examples: SearchCopyAgent(),
    "gold-search": GoldSearchAgent,
}

BASELINE_AGENTS = frozenset(SCRIPTED_AGENTS)
"""The built-in scripted agents: they neither generate nor tokenise, so an LLM's limits (new tokens, the
observation cut) do not bear on their scores (plugins registered later may be LLMs, so they are not among them)."""
