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
    """Search-augmented question answering on one benchmark, with Search-R1's prompt, tags and observation format:
    one ``step`` is one turn of the policy.

    ## Description

    The policy answers a question in turns. Each turn it may search a corpus (``<search> query </search>``) and
    read the top passages, or answer (``<answer> text </answer>``). Search-R1's protocol, verbatim: a policy
    trained there plays here unchanged. Every registered id is this class with its ``benchmark``; without a
    ``dataset`` each serves the bundled demo set of its family (a fictional encyclopedia: 248 passages, questions
    no model knows the answer to), searched with BM25, so ``gymnasium.make(id)`` works offline.

    | id | benchmark | answer scored by | default split | demo subset |
    |---|---|---|---|---|
    | ``stppo/NQ-v0`` | nq | exact match | test | general |
    | ``stppo/TriviaQA-v0`` | triviaqa | exact match | test | general |
    | ``stppo/PopQA-v0`` | popqa | exact match | test | general |
    | ``stppo/HotpotQA-v0`` | hotpotqa | exact match | dev | multihop |
    | ``stppo/2Wiki-v0`` | 2wiki | exact match | dev | multihop |
    | ``stppo/MuSiQue-v0`` | musique | exact match | dev | multihop |
    | ``stppo/Bamboogle-v0`` | bamboogle | exact match | test | multihop |
    | ``stppo/MedQA-v0`` | medqa | the chosen option | test | medical |
    | ``stppo/MedMCQA-v0`` | medmcqa | the chosen option | dev | medical |
    | ``stppo/PubMedQA-v0`` | pubmedqa | the chosen option | test | medical |
    | ``stppo/MMLU-Med-v0`` | mmlu_med | the chosen option | test | medical |
    | ``stppo/SearchQA-v0`` | searchqa (any QA file) | exact match | test | general |

    ## Action Space

    ``UnicodeText(65536)``: any ``str`` of up to 65,536 characters, the policy's whole turn. The first complete
    ``<search>...</search>`` or ``<answer>...</answer>`` block decides (``<think>`` is free text). A turn with no
    complete block, nested tags, an empty block, a query over 4,096 characters, over 65,536 characters or not a
    ``str`` is an invalid action: it costs the turn, never raises (``stppo_envs.actions.parse_action``).

    ## Observation Space

    ``UnicodeText(65536)``. After ``reset``: the prompt (Search-R1's template with the question, which ends in
    ``?``; the options ``A. ...`` for multiple choice). After a search: the ``<information>`` block of the top
    ``topk`` passages, ``Doc i(Title: "t") text`` lines. After a search that failed (a dead server):
    ``<information>Search failed: why</information>``. After an invalid action: Search-R1's corrective message.
    ``""`` when the episode ends, and after a search in the last turn (its results could never be used, so it is
    not served). Observations are text to append to the transcript; a trainer tokenises them.

    ## Rewards

    0 on every step but the last. On the last, the score of the answer in [0, 1] by ``reward``: ``em`` (exact
    match after SQuAD normalisation, any golden answer), ``f1`` (token F1: partial credit for a partly right
    answer), ``acc`` (multiple choice: the option the answer names is the right one); ``auto`` is ``acc`` for
    multiple choice, ``em`` otherwise. No answer (truncated) scores 0. With ``format_reward`` = lambda > 0
    (Search-R1's format-aware reward) the reward is ``score * (1 - lambda) + lambda * format_ok``, where
    ``format_ok`` is 1 when the episode ended in an answer with no invalid turn.

    ## Starting State

    ``reset(options={"index": i})`` starts on example ``i`` of the loaded split. Without an index, the next example
    of a shuffled pass over the split: none repeats until every one has been seen; ``reset(seed=s)`` reseeds the
    shuffle, so the same seed gives the same sequence of examples.

    ## Episode End

    Termination: the action is an answer (``terminated=True``). Truncation: ``max_turns`` steps passed without an
    answer (``truncated=True``). They are never both true. ``step`` after the end raises until ``reset``.

    ## Information

    ``reset`` returns ``messages`` (the chat-format prompt), ``example_id``, ``benchmark``, ``index``, ``turn``
    (0), ``segments``, ``question`` and ``choices`` (the options, or None). Every ``step`` returns ``turn`` (turns
    completed), ``action_type`` (search, answer or invalid), ``example_id``, ``question``, ``segments`` and the
    episode's counts so far, ``search_calls``, ``invalid_actions`` and ``search_errors``; with ``invalid_reason``
    after an invalid action, ``query`` after a search, ``error`` (type and message) after a failed one. The last
    step adds ``prediction`` (None when truncated) and ``golden_answers``, and ``em`` and ``f1`` (open questions)
    or ``correct`` and ``predicted_letter`` (multiple choice).

    Turn boundaries: the k-th call of ``step`` (counted from 0) is turn k. ``info["segments"]`` holds what the call
    appended to the transcript as ``(role, text, turn)`` pieces -- the policy's action (``assistant``), then the
    env's observation (``environment``), both with ``turn=k``; the prompt is ``("user", prompt, -1)`` -- and
    ``info["turn"]`` is ``k + 1``. A trainer maps every character, and so every token, to the turn that produced
    it from these.

    ## Arguments

    - ``benchmark``: a benchmark name (``nq``, ``hotpotqa``, ``medqa``, ...; see ``BENCHMARKS``); each id sets it.
    - ``dataset``: where the questions come from: a local jsonl/json/csv/parquet file or folder (FlashRAG schema
      or the benchmark's own release format), a hub name (``org/name[:config]``), ``"hub"`` (FlashRAG_datasets for
      the QA benchmarks) or None (the bundled demo set); see :func:`load_examples`.
    - ``split``: the dataset split (the benchmark's evaluation split by default: the table above).
    - ``retriever``: a retriever object or spec: ``demo``, ``bm25:INDEX_DIR``, ``bm25-prebuilt:NAME``,
      ``dense:INDEX_DIR``, ``http://HOST:PORT`` (a ``stppo serve`` or Search-R1 retrieval server).
    - ``topk`` (3): passages per search. ``max_turns`` (4): steps before the episode is truncated.
    - ``reward`` (``auto``): ``em``, ``f1`` or ``acc``, as under Rewards. ``format_reward`` (0): lambda in [0, 1].
    - ``template`` / ``mcq_template``: prompt templates with ``{question}`` (and ``{options}``).
    - ``question_mark`` (True): end open-domain questions with ``?`` in the prompt, as Search-R1's data scripts do
      (NQ-open questions have none; Search-R1 models were trained and evaluated with it). False keeps them as given.
    - ``limit``, ``shuffle_seed``, ``family``: passed to the loader: keep the first ``limit`` examples of the
      file's order, or of ``shuffle_seed``'s shuffle; ``family`` (``qa`` or ``mcq``) for the generic ``searchqa``.
    - ``render_mode``: None or ``ansi`` (``render()`` returns the transcript so far).

    ## Version History

    - v0: the first version: Search-R1's prompt, tags, observations and corrective message; rewards em / f1 / acc
      with the optional format reward. Within v0, scoring revision 2 (recorded in evaluation results as
      ``stppo_envs.scoring.SCORING_VERSION``) changed some answers' scores: F1 of a yes/no answer or gold is all or
      nothing, and more ways of naming a multiple-choice option are read as that option.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, benchmark: str = "searchqa", dataset: str | None = None, split: str | None = None,
                 retriever: str | Retriever = "demo", topk: int = 3, max_turns: int = 4, reward: str = "auto",
                 format_reward: float = 0.0, template: str | None = None, mcq_template: str | None = None,
                 limit: int | None = None, shuffle_seed: int | None = None, family: str | None = None,
                 render_mode: str | None = None, question_mark: bool = True):
        check_settings(topk, max_turns, reward, format_reward, render_mode)
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
            scores = answer_scores(self.example, prediction)
            info.update(scores)
            format_ok = prediction is not None and self._counts["invalid_actions"] == 0
            reward = final_reward(scores, self.example, self.reward_name, self.format_reward, format_ok)
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


def check_settings(topk: Any, max_turns: Any, reward: str, format_reward: float, render_mode: str | None) -> None:
    """The constructor's checks of its numbers and names: a bad one raises ``ValueError`` naming it."""
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


def answer_scores(example: Example, prediction: str | None) -> dict[str, Any]:
    """The last step's scoring fields of ``info`` (the class docstring's Information): ``prediction`` (None when
    truncated), ``golden_answers``, then ``em`` and ``f1`` (open questions) or ``correct`` and ``predicted_letter``
    (multiple choice)."""
    scores: dict[str, Any] = {"prediction": prediction, "golden_answers": list(example.golden_answers)}
    if example.is_multiple_choice:
        scores["correct"] = scoring.choice_accuracy(prediction, example.choices, example.answer_letter)
        scores["predicted_letter"] = scoring.extract_choice(prediction, example.choices)
    else:
        scores["em"] = scoring.exact_match(prediction, example.golden_answers)
        scores["f1"] = scoring.f1_score(prediction, example.golden_answers)
    return scores


def final_reward(scores: dict[str, Any], example: Example, reward: str, format_reward: float, format_ok: bool) -> float:
    """The last step's reward (the class docstring's Rewards): the score ``reward`` names among ``scores`` (from
    :func:`answer_scores`; a multiple-choice question has one score, ``correct``, under every name; ``auto`` is
    ``acc`` there and ``em`` otherwise), mixed with ``format_ok`` by ``format_reward``."""
    if example.is_multiple_choice:
        score = scores["correct"]
    else:
        score = scores["f1"] if reward == "f1" else scores["em"]
    return score * (1.0 - format_reward) + format_reward * float(format_ok)
