"""Record adapters: one raw row of a benchmark file -> :class:`Example`.

QA benchmarks are read in the FlashRAG schema (``{"id", "question", "golden_answers"}``, the format of the
FlashRAG_datasets collection Search-R1 trains on) and in the raw formats of their original releases (NQ-open
``answer`` lists, HotpotQA ``_id``/``answer``, MuSiQue ``answer_aliases``, Bamboogle's ``Question,Answer``
CSV, TriviaQA ``answer.aliases``, PopQA ``possible_answers``). Medical MCQ sets are read in the MIRAGE/raw
formats (MedQA ``options``/``answer_idx``, MedMCQA ``opa..opd``/``cop``, PubMedQA ``QUESTION``/
``final_decision``, MMLU's headerless ``question,A,B,C,D,answer`` CSV) and in a generic
``{"question", "choices", "answer"}`` form.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping

from .schema import DatasetFormatError, Example

Record = Mapping[str, Any]
Adapter = Callable[[Record, str, str], Example]  # (record, benchmark, fallback id) -> Example

_LETTERS = "ABCDEFGHIJ"
ID_FIELDS = ("id", "_id", "qid", "question_id")
_QUESTION_FIELDS = ("question", "Question", "QUESTION", "query")
_METADATA_FIELDS = ("type", "level", "subject_name", "topic_name", "meta_info", "subject", "answerable")


def _first_field(record: Record, names: tuple[str, ...], benchmark: str, what: str) -> Any:
    for name in names:
        if record.get(name) not in (None, ""):
            return record[name]
    raise DatasetFormatError(
        f"{benchmark}: a record has no {what} field (looked for {', '.join(names)}); its fields are "
        f"{sorted(record)}"
    )


def record_id(record: Record, fallback: str) -> str:
    """The record's id as text (so 1 and "1" are one id), or ``fallback`` when it has none."""
    for name in ID_FIELDS:
        if record.get(name) not in (None, ""):
            return str(record[name])
    return fallback


def _metadata(record: Record) -> dict[str, Any]:
    metadata = {name: record[name] for name in _METADATA_FIELDS if record.get(name) is not None}
    titles = supporting_titles(record)
    if titles:
        metadata["supporting_titles"] = titles
    return metadata


def supporting_titles(record: Record) -> list[str]:
    """Titles of the passages a multi-hop answer rests on, hop by hop where the format says the order.

    >>> supporting_titles({"supporting_facts": [["Alu", 3], ["Lilu", 0], ["Alu", 1]]})  # HotpotQA
    ['Alu', 'Lilu']
    >>> supporting_titles({"metadata": {"supporting_facts": {"title": ["A", "B"], "sent_id": [0, 2]}}})  # FlashRAG
    ['A', 'B']
    >>> supporting_titles({"paragraphs": [{"idx": 0, "title": "X"}, {"idx": 1, "title": "Y", "is_supporting": True}],
    ...                    "question_decomposition": [{"paragraph_support_idx": 1}]})  # MuSiQue
    ['Y']
    """
    if record.get("supporting_titles"):
        return [str(t) for t in record["supporting_titles"]]
    facts = record.get("supporting_facts")
    if facts is None and isinstance(record.get("metadata"), Mapping):
        facts = record["metadata"].get("supporting_facts")
    if isinstance(facts, Mapping):
        facts = [[title] for title in facts.get("title", [])]
    if facts:
        return list(dict.fromkeys(str(fact[0]) for fact in facts if fact))
    paragraphs = record.get("paragraphs")
    if isinstance(paragraphs, list):
        by_index = {p.get("idx", i): p for i, p in enumerate(paragraphs) if isinstance(p, Mapping)}
        steps = [step.get("paragraph_support_idx") for step in record.get("question_decomposition") or []
                 if isinstance(step, Mapping)]
        ordered = [by_index[i] for i in steps if i in by_index] or \
            [p for p in by_index.values() if p.get("is_supporting")]
        return list(dict.fromkeys(str(p["title"]) for p in ordered if p.get("title")))
    return []


def _as_answer_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("[") and stripped.endswith("]"):  # PopQA stores a JSON list as a string
            try:
                return [str(v) for v in json.loads(stripped) if v is not None]
            except json.JSONDecodeError:
                pass
        return [value]
    if isinstance(value, Mapping):  # TriviaQA: {"value", "aliases", "normalized_aliases", ...}
        return _as_answer_list(value.get("value")) + _as_answer_list(value.get("aliases"))
    return [str(v) for v in value if v is not None]  # a null entry is no answer, not the text "None"


def qa_example(record: Record, benchmark: str, fallback_id: str) -> Example:
    """Any open-domain QA row (FlashRAG or raw release format) -> Example. A row with options is refused: read as
    open QA it would lose its options from the prompt and be scored against its answer key ("B") as an answer."""
    options = next((name for name in _OPTION_FIELDS if _holds_options(record.get(name))), None)
    if options is not None:
        raise DatasetFormatError(
            f"{benchmark}: record {record_id(record, fallback_id)!r} is a multiple-choice record (it has "
            f"{options!r}), but {benchmark} is open QA: load it as a multiple-choice benchmark (medqa, medmcqa, "
            "pubmedqa, mmlu_med) or with family='mcq' (SearchQAEnv, load_examples)"
        )
    question = str(_first_field(record, _QUESTION_FIELDS, benchmark, "question"))
    answers: list[str] = []
    for name in ("golden_answers", "answer", "answers", "Answer", "possible_answers", "answer_aliases"):
        answers += _as_answer_list(record.get(name))
    answers = list(dict.fromkeys(a for a in answers if a.strip()))  # dedupe, keep order
    if not answers:
        raise DatasetFormatError(
            f"{benchmark}: record {record_id(record, fallback_id)!r} has no answer (looked for golden_answers, "
            f"answer, answers, Answer, possible_answers); its fields are {sorted(record)}"
        )
    return Example(
        id=record_id(record, fallback_id), question=question.strip(), golden_answers=tuple(answers),
        benchmark=benchmark, metadata=_metadata(record),
    )


def _mcq(record: Record, benchmark: str, fallback_id: str, choices: dict[str, str], letter: str) -> Example:
    question = str(_first_field(record, _QUESTION_FIELDS, benchmark, "question")).strip()
    letter = letter.strip().upper()
    if letter not in choices:
        raise DatasetFormatError(
            f"{benchmark}: record {record_id(record, fallback_id)!r} has answer {letter!r}, not one of "
            f"{sorted(choices)}"
        )
    return Example(
        id=record_id(record, fallback_id), question=question, golden_answers=(choices[letter], letter),
        benchmark=benchmark, choices=choices, answer_letter=letter, metadata=_metadata(record),
    )


_OPTION_FIELDS = ("choices", "options", "opa")  # generic / MedQA / MedMCQA


def _holds_options(value: Any) -> bool:
    """A field that holds at least one option (FlashRAG's QA rows may carry an empty ``choices``)."""
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(_present(v) for v in value)
    return _present(value)


def _present(value: Any) -> bool:
    """An option cell that holds an option: not missing, not an empty CSV cell (a row with fewer options than
    the file has columns). The text "None" or "NA" is an option like any other."""
    return value is not None and str(value).strip() != ""


def _choices_from(value: Any) -> dict[str, str]:
    if isinstance(value, Mapping):
        return {str(k).strip().upper(): str(v) for k, v in value.items() if _present(v)}
    values = list(value)
    if len(values) > len(_LETTERS):
        raise DatasetFormatError(f"{len(values)} options; at most {len(_LETTERS)} (A-J) are supported")
    return {_LETTERS[i]: str(v) for i, v in enumerate(values) if _present(v)}


def mcq_example(record: Record, benchmark: str, fallback_id: str) -> Example:
    """Any supported multiple-choice row -> Example, by the fields it has."""
    if "options" in record and "answer_idx" in record:  # MedQA (MIRAGE / GBaker)
        return _mcq(record, benchmark, fallback_id, _choices_from(record["options"]), str(record["answer_idx"]))
    if "opa" in record and "cop" in record:  # MedMCQA, cop is 1-based in the original release
        choices = {letter: str(record[f"op{letter.lower()}"]) for letter in "ABCD"
                   if _present(record.get(f"op{letter.lower()}"))}
        raw_cop = record["cop"]
        cop = str(int(raw_cop) if isinstance(raw_cop, float) and raw_cop.is_integer() else raw_cop).strip()
        if cop not in ("1", "2", "3", "4"):
            raise DatasetFormatError(f"{benchmark}: cop must be 1-4 (original MedMCQA release), got {record['cop']!r}")
        cop = int(cop)
        return _mcq(record, benchmark, fallback_id, choices, "ABCD"[cop - 1])
    if "final_decision" in record:  # PubMedQA: yes / no / maybe
        choices = {"A": "yes", "B": "no", "C": "maybe"}
        decision = str(record["final_decision"]).strip().lower()
        letters = {text: letter for letter, text in choices.items()}
        if decision not in letters:
            raise DatasetFormatError(f"{benchmark}: final_decision must be yes/no/maybe, got {decision!r}")
        example = _mcq(record, benchmark, fallback_id, choices, letters[decision])
        contexts = record.get("CONTEXTS")
        if contexts:
            return _with_metadata(example, contexts=list(contexts))
        return example
    # MMLU's CSV and any letter-column table: A, B and as many more options as the file has (the loader reads
    # a headerless CSV of >= 2 options; a true/false set has only A and B)
    if "A" in record and "B" in record and "answer" in record:
        choices = {letter: str(record[letter]) for letter in _LETTERS if _present(record.get(letter))}
        return _mcq(record, benchmark, fallback_id, choices, str(record["answer"]))
    if "choices" in record and ("answer" in record or "answer_idx" in record):
        answer = record.get("answer_idx", record.get("answer"))
        letter = _LETTERS[int(answer)] if isinstance(answer, int) else str(answer)
        return _mcq(record, benchmark, fallback_id, _choices_from(record["choices"]), letter)
    raise DatasetFormatError(
        f"{benchmark}: unrecognised multiple-choice record with fields {sorted(record)}; expected MedQA "
        "(options, answer_idx), MedMCQA (opa..opd, cop), PubMedQA (QUESTION, final_decision), MMLU "
        "(question, A, B[, C ...], answer) or generic (question, choices, answer)"
    )


def _with_metadata(example: Example, **extra: Any) -> Example:
    return dataclasses.replace(example, metadata={**example.metadata, **extra})


def example_from_record(record: Record, benchmark: str, fallback_id: str, family: str) -> Example:
    """Dispatch on the benchmark family (``qa`` or ``mcq``); an already-normalised record passes through."""
    if record.get("choices") is not None and record.get("answer_letter"):  # our own Example.to_dict()
        return _mcq(record, benchmark, fallback_id, _choices_from(record["choices"]), str(record["answer_letter"]))
    adapter: Adapter = mcq_example if family == "mcq" else qa_example
    return adapter(record, benchmark, fallback_id)
