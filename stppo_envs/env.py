"""``SearchQAEnv``: a turn-structured search-QA environment; one ``step`` is one turn.

Text in, text out: the observation after ``reset`` is the prompt; the action of a step is the policy's whole
turn (``<think>...</think><search>q</search>`` or ``...<answer>a</answer>``); the observation after a search
is the ``<information>`` block to append to the transcript. ``info["segments"]`` lists what each call added
as (role, text, turn), so a trainer can map every character to the turn that produced it.

Turn numbering: the k-th call of ``step`` (0-based) is turn k; its segments carry ``turn=k`` and its info
reports ``turn=k+1`` (turns completed). ``terminated`` means an answer was given; ``truncated`` means
``max_turns`` ran out first. They are never merged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import gymnasium as gym

from . import scoring
from .actions import INVALID_ACTION_MESSAGE, MAX_ACTION_CHARS, ActionType, ParsedAction, parse_action
from .data.loading import benchmark_info, load_examples
from .data.schema import Example
from .prompts import (
    SEARCH_R1_MCQ_TEMPLATE,
    SEARCH_R1_TEMPLATE,
    format_information,
    render_prompt,
    search_failure_observation,
    search_r1_question,
)
from .retrieval.base import Hit, RetrievalError, Retriever, sanitize_query  # noqa: F401 (re-exported)
from .retrieval.factory import make_retriever
from .spaces import UnicodeText

MAX_OBSERVATION_CHARS = 65536


class Segment(NamedTuple):
    """A piece of the transcript: ``role`` is user (prompt), assistant (policy) or environment."""

    role: str
    text: str
    turn: int  # -1 for the prompt


class SearchQAEnv(gym.Env[str, str]):
    """Search-augmented QA on one benchmark, with Search-R1's prompt, tags and observation format.

    Args:
        benchmark: a benchmark name (``nq``, ``hotpotqa``, ``medqa``, ...; see ``BENCHMARKS``).
        dataset: where the questions come from (see :func:`load_examples`); default: the bundled demo set.
        split: dataset split (the benchmark's standard evaluation split by default).
        retriever: a retriever object or spec string (``demo``, ``bm25:DIR``, ``dense:DIR``, ``http://...``).
        topk: passages per search.
        max_turns: steps before the episode is truncated.
        reward: ``em``, ``f1`` or ``acc``; ``auto`` is ``acc`` for multiple choice and ``em`` otherwise.
        format_reward: lambda of Search-R1's format-aware reward, ``score * (1 - lambda) + lambda * format_ok``,
            where ``format_ok`` means the episode ended in an answer with no invalid turn. 0 disables it.
        template / mcq_template: prompt templates with ``{question}`` (and ``{options}``).
        question_mark: end open-domain questions with ``?`` in the prompt, as Search-R1's data scripts do (NQ-open
            questions have none; Search-R1 models were trained and evaluated with it). False keeps them as given.
        limit, shuffle_seed, family: passed to the loader.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, benchmark: str = "searchqa", dataset: str | None = None, split: str | None = None,
                 retriever: str | Retriever = "demo", topk: int = 3, max_turns: int = 4, reward: str = "auto",
                 format_reward: float = 0.0, template: str | None = None, mcq_template: str | None = None,
                 limit: int | None = None, shuffle_seed: int | None = None, family: str | None = None,
                 render_mode: str | None = None, question_mark: bool = True):
        if not isinstance(topk, int) or not isinstance(max_turns, int) or isinstance(topk, bool):
            raise ValueError(f"topk and max_turns must be integers, got topk={topk!r}, max_turns={max_turns!r}")
        if topk < 1 or max_turns < 1:
            raise ValueError(f"topk and max_turns must be >= 1, got topk={topk}, max_turns={max_turns}")
        if reward not in ("auto", "em", "f1", "acc"):
            raise ValueError(f"reward must be auto, em, f1 or acc; got {reward!r}")
        if not 0.0 <= format_reward <= 1.0:
            raise ValueError(f"format_reward must be in [0, 1], got {format_reward}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.benchmark = benchmark_info(benchmark).name
        self.examples: tuple[Example, ...] = load_examples(benchmark, dataset, split, limit, shuffle_seed, family)
        if not self.examples:
            raise ValueError(f"{benchmark}: dataset {dataset!r} split {split!r} holds no examples")
        self.dataset, self.split = dataset, split
        self.retriever = make_retriever(retriever)
        self.topk, self.max_turns, self.reward_name, self.format_reward = topk, max_turns, reward, format_reward
        self.template = template or SEARCH_R1_TEMPLATE
        self.mcq_template = mcq_template or SEARCH_R1_MCQ_TEMPLATE
        self.question_mark = bool(question_mark)
        self.render_mode = render_mode
        self.observation_space = UnicodeText(MAX_OBSERVATION_CHARS)
        self.action_space = UnicodeText(MAX_ACTION_CHARS)
        self.example: Example | None = None
        self.transcript: list[Segment] = []
        self._turn = 0
        self._done = True
        self._counts = {"search_calls": 0, "invalid_actions": 0, "search_errors": 0}
        self._order: list[int] = []  # the rest of the current shuffled pass (resets without an index)

    # -- Gymnasium API -------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        """Start an episode on example ``options["index"]`` (sequential access: ``options={"index": i}``) or,
        without it, on the next example of a shuffled pass over the dataset: no example repeats until every
        one has been seen. ``seed`` reseeds the shuffle (Gymnasium's convention), so ``reset(seed=s)`` then
        plain ``reset()`` calls give the same sequence for the same ``s``."""
        super().reset(seed=seed)
        options = options or {}
        if "index" in options:
            index = int(options["index"])
            if not 0 <= index < len(self.examples):
                raise IndexError(f"options['index']={index} outside 0..{len(self.examples) - 1}")
        else:
            if seed is not None or not self._order:
                self._order = [int(i) for i in self.np_random.permutation(len(self.examples))]
            index = self._order.pop()
        self.example = self.examples[index]
        self._turn, self._done = 0, False
        self._counts = dict.fromkeys(self._counts, 0)
        prompt = self.prompt_for(self.example)
        self.transcript = [Segment("user", prompt, -1)]
        info = {
            "messages": [{"role": "user", "content": prompt}], "example_id": self.example.id,
            "benchmark": self.example.benchmark, "index": index, "turn": 0, "segments": list(self.transcript),
            "question": self.example.question,
            "choices": dict(self.example.choices) if self.example.choices is not None else None,
        }
        return prompt, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        parsed = self.begin_step(action)
        hits, error = None, None
        if self.needs_search(parsed):
            try:
                hits = self.retriever.search(sanitize_query(parsed.content), self.topk)
            except RetrievalError as exc:
                error = exc
        return self.finish_step(action, parsed, hits, error)

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return "".join(segment.text for segment in self.transcript)
        return None

    # -- two-phase step, so that a vector env can batch the searches of many envs --------------------------
    def begin_step(self, action: Any) -> ParsedAction:
        if self._done or self.example is None:
            raise RuntimeError("the episode is over (or was never started): call reset() before step()")
        return parse_action(action)

    def needs_search(self, parsed: ParsedAction) -> bool:
        """A search is served unless it is the last turn (its results could never be used)."""
        return parsed.type is ActionType.SEARCH and self._turn + 1 < self.max_turns

    def finish_step(self, action: Any, parsed: ParsedAction, hits: list[Hit] | None,
                    error: BaseException | None) -> tuple[str, float, bool, bool, dict]:
        turn = self._turn
        self._turn += 1
        info: dict[str, Any] = {"turn": self._turn, "action_type": parsed.type.value,
                                "example_id": self.example.id, "question": self.example.question}
        observation = ""
        if parsed.type is ActionType.INVALID:
            self._counts["invalid_actions"] += 1
            info["invalid_reason"] = parsed.reason
            observation = INVALID_ACTION_MESSAGE
        elif parsed.type is ActionType.SEARCH:
            info["query"] = parsed.content
            if error is not None:
                self._counts["search_errors"] += 1
                info["error"] = {"type": type(error).__name__, "message": str(error)}
                observation = search_failure_observation(error)
            elif hits is not None:
                self._counts["search_calls"] += 1
                observation = format_information(hits)[:MAX_OBSERVATION_CHARS]
        terminated = parsed.type is ActionType.ANSWER
        truncated = not terminated and self._turn >= self.max_turns
        reward = 0.0
        if terminated or truncated:
            self._done = True
            observation = ""
            prediction = parsed.content if terminated else None
            reward = self._final_reward(prediction, info)
        action_text = action if isinstance(action, str) else repr(action)
        new_segments = [Segment("assistant", action_text, turn), Segment("environment", observation, turn)]
        self.transcript.extend(new_segments)
        info.update(self._counts, segments=new_segments)
        return observation, reward, terminated, truncated, info

    @property
    def turn(self) -> int:
        """Turns completed in the current episode."""
        return self._turn

    # -- helpers ---------------------------------------------------------------------------------------------
    def prompt_for(self, example: Example) -> str:
        if example.is_multiple_choice:
            return render_prompt(self.mcq_template, example.question, example.choices)
        question = search_r1_question(example.question) if self.question_mark else example.question
        return render_prompt(self.template, question)

    def _final_reward(self, prediction: str | None, info: dict[str, Any]) -> float:
        example = self.example
        assert example is not None
        info["prediction"] = prediction
        info["golden_answers"] = list(example.golden_answers)
        if example.is_multiple_choice:
            info["correct"] = scoring.choice_accuracy(prediction, example.choices, example.answer_letter)
            info["predicted_letter"] = scoring.extract_choice(prediction, example.choices)
            scores = {"acc": info["correct"], "em": info["correct"], "f1": info["correct"]}
        else:
            info["em"] = scoring.exact_match(prediction, example.golden_answers)
            info["f1"] = scoring.f1_score(prediction, example.golden_answers)
            scores = {"em": info["em"], "f1": info["f1"], "acc": info["em"]}
        name = self.reward_name if self.reward_name != "auto" else ("acc" if example.is_multiple_choice else "em")
        score = scores[name]
        format_ok = float(prediction is not None and self._counts["invalid_actions"] == 0)
        return score * (1.0 - self.format_reward) + self.format_reward * format_ok



