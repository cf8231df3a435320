"""Load any supported benchmark from a local file, a folder, the bundled demo set, or the Hugging Face hub.

Everything goes through ``datasets`` (local files via its json/csv/parquet builders, hub names via
``load_dataset``; never with remote code), so split selection, seeded shuffling and caching behave as
users of that library expect.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterable

import datasets

from ..suggest import unknown_name
from .adapters import ID_FIELDS, example_from_record, record_id
from .schema import DatasetFormatError, Example

DEMO_DIR = Path(__file__).parent / "demo"
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_FLASHRAG_HUB = "RUC-NLPIR/FlashRAG_datasets"
_ROW_COLUMN = "__stppo_row"


@dataclasses.dataclass(frozen=True)
class BenchmarkInfo:
    """What the loader and the env registry need to know about one benchmark."""

    name: str  # canonical key, e.g. "nq"
    env_name: str  # the part of the env id, e.g. "NQ" in "stppo/NQ-v0"
    family: str  # "qa" (EM/F1 reward) or "mcq" (accuracy reward)
    demo_subset: str  # which bundled demo file stands in when no dataset is given
    hub: tuple[str, str | None] | None = None  # (path, config) for dataset="hub"
    default_split: str = "test"


BENCHMARKS: dict[str, BenchmarkInfo] = {
    info.name: info
    for info in (
        BenchmarkInfo("nq", "NQ", "qa", "general", (_FLASHRAG_HUB, "nq")),
        BenchmarkInfo("triviaqa", "TriviaQA", "qa", "general", (_FLASHRAG_HUB, "triviaqa")),
        BenchmarkInfo("popqa", "PopQA", "qa", "general", (_FLASHRAG_HUB, "popqa")),
        BenchmarkInfo("hotpotqa", "HotpotQA", "qa", "multihop", (_FLASHRAG_HUB, "hotpotqa"), "dev"),
        BenchmarkInfo("2wiki", "2Wiki", "qa", "multihop", (_FLASHRAG_HUB, "2wikimultihopqa"), "dev"),
        BenchmarkInfo("musique", "MuSiQue", "qa", "multihop", (_FLASHRAG_HUB, "musique"), "dev"),
        BenchmarkInfo("bamboogle", "Bamboogle", "qa", "multihop", (_FLASHRAG_HUB, "bamboogle")),
        BenchmarkInfo("medqa", "MedQA", "mcq", "medical", ("GBaker/MedQA-USMLE-4-options", None)),
        BenchmarkInfo("medmcqa", "MedMCQA", "mcq", "medical", None, "dev"),
        BenchmarkInfo("pubmedqa", "PubMedQA", "mcq", "medical", None),
        BenchmarkInfo("mmlu_med", "MMLU-Med", "mcq", "medical", None),
        BenchmarkInfo("searchqa", "SearchQA", "qa", "general"),  # generic: any QA dataset file
    )
}
_ALIASES = {"2wikimultihopqa": "2wiki", "mmlu-med": "mmlu_med", "mmlu_medical": "mmlu_med", "mmlu-medical": "mmlu_med"}


def benchmark_info(name: str) -> BenchmarkInfo:
    """Look a benchmark up by name (case-insensitive, common aliases accepted)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in BENCHMARKS:
        raise KeyError(unknown_name("benchmark", name, [*BENCHMARKS, *_ALIASES], listing=BENCHMARKS))
    return BENCHMARKS[key]


def load_examples(
    benchmark: str,
    dataset: str | os.PathLike | None = None,
    split: str | None = None,
    limit: int | None = None,
    shuffle_seed: int | None = None,
    family: str | None = None,
) -> tuple[Example, ...]:
    """Examples of ``benchmark`` from ``dataset``.

    ``dataset`` is ``None``/``"demo"`` (the bundled demo set of the benchmark's family), a local file
    (jsonl/json/csv/parquet) or folder of such files, ``"hub"`` (the benchmark's standard hub dataset, e.g.
    FlashRAG_datasets for QA) or any hub dataset name (``"org/name"`` or ``"org/name:config"``).
    Order is the file's unless ``shuffle_seed`` is given; ``limit`` keeps the first N after that.
    ``family`` overrides the benchmark's (``qa``/``mcq``), for the generic ``searchqa`` benchmark.
    """
    info = benchmark_info(benchmark)
    split = split or info.default_split
    key = _cache_key(dataset)
    return _load_cached(info.name, key, split, limit, shuffle_seed, family or info.family)


def _cache_key(dataset: str | os.PathLike | None) -> tuple[str | None, tuple]:
    """(normalised source, the (name, size, mtime_ns) of every data file it holds), so that an edited file is
    re-read -- also a file edited in place inside a folder, which leaves the folder's own mtime alone."""
    if dataset is None or str(dataset) == "demo":
        return None, ()
    path = Path(dataset).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _FILE_BUILDERS and p.is_file())
        return str(path.resolve()), tuple((p.name, *_file_stamp(p)) for p in files)
    if path.exists():
        return str(path.resolve()), _file_stamp(path)
    return str(dataset), ()


def _file_stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _load_cached(benchmark: str, key: tuple[str | None, tuple], split: str, limit: int | None,
                 shuffle_seed: int | None, family: str) -> tuple[Example, ...]:
    info = BENCHMARKS[benchmark]
    source = key[0]
    if source is None:
        table = _load_files([DEMO_DIR / f"{info.demo_subset}.jsonl"], family)
        if split.lower() not in SPLIT_NAMES:  # any other name would evaluate the test part under that name
            raise ValueError(f"the demo set has no split {split!r}: use train, or test (also dev, validation, "
                             "valid or val: the demo's evaluation part)")
        demo_split = "train" if split.lower() == "train" else "test"  # the demo set has train and test only
        table = table.filter(lambda row: row["split"] == demo_split)
        label = f"demo-{info.demo_subset}"
    else:
        table = _load_source(info, source, split, family)
        if Path(source).exists():  # a hub split is chosen by load_dataset
            table = _rows_of_split(table, source, split)
        label = benchmark
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    _check_unique_ids(table, label, split)
    # Rows without an id get one from their position in the file, so ids survive shuffling and limits.
    table = table.add_column(_ROW_COLUMN, list(range(len(table))))
    if shuffle_seed is not None:
        table = table.shuffle(seed=shuffle_seed)
    if limit is not None:
        table = table.select(range(min(limit, len(table))))
    return tuple(
        example_from_record(row, label, f"{label}-{split}-{row.pop(_ROW_COLUMN)}", family) for row in table
    )


def _rows_of_split(table: datasets.Dataset, source: str, split: str) -> datasets.Dataset:
    """A local dataset with a ``split`` column (one file holding every split, as the demo set does) serves only
    the rows of ``split`` (names compared in any case): all of them would put train questions in a test run."""
    if "split" not in table.column_names:
        return table
    values = [str(value).lower() if value is not None else None for value in table["split"]]
    keep = [row for row, value in enumerate(values) if value == split.lower()]
    if not keep:
        present = sorted({value for value in values if value is not None})
        raise DatasetFormatError(
            f"{source} has a split column with values {present} and no row of split {split!r}; pass --split with "
            f"one of those ({SPLIT_HINT})")
    return table.select(keep)


def _check_unique_ids(table: datasets.Dataset, label: str, split: str) -> None:
    """Every example of the split needs its own id: agents, rollouts and result records key an episode's state
    by it, so two questions sharing one would share state. The whole split is checked, before any limit."""
    columns = [name for name in ID_FIELDS if name in table.column_names]
    if not columns:
        return  # every row gets its position as id
    values = table.select_columns(columns).to_dict()
    rows: dict[str, list[int]] = {}
    for row, fields in enumerate(zip(*(values[name] for name in columns))):
        rows.setdefault(record_id(dict(zip(columns, fields)), f"{label}-{split}-{row}"), []).append(row)
    repeated = [(key, where) for key, where in rows.items() if len(where) > 1]
    if repeated:
        shown = ", ".join(f"{key!r} (rows {', '.join(map(str, where[:4]))}{', ...' if len(where) > 4 else ''})"
                          for key, where in repeated[:5])
        count = "1 id occurs" if len(repeated) == 1 else f"{len(repeated)} ids occur"
        raise DatasetFormatError(
            f"{label} {split}: {count} more than once: {shown}{', ...' if len(repeated) > 5 else ''}"
            " (rows count from 0; ids are compared as text, so 1 and \"1\" are one id). Each example needs its "
            "own id: episodes' state and results are keyed by it")


def _load_source(info: BenchmarkInfo, source: str, split: str, family: str) -> datasets.Dataset:
    path = Path(source)
    if path.is_dir():
        files = _files_in(path, split)
        if not files:
            raise DatasetFormatError(f"{path} holds no .jsonl/.json/.csv/.parquet files")
        return _load_files(files, family)
    if path.is_file():
        return _load_files([path], family)
    if source == "hub":
        if info.hub is None:
            raise DatasetFormatError(f"{info.name} has no standard hub dataset; pass a local file or a hub name")
        hub_path, config = info.hub
    elif "/" in source and not source.startswith((".", "/", "~")):
        hub_path, _, config = source.partition(":")
        config = config or None
    else:
        raise FileNotFoundError(
            f"dataset {source!r} is neither a local file/folder nor a hub name (org/name[:config]); "
            "`python data_scripts/prepare.py datasets` fetches the benchmark files on a connected machine"
        )
    try:
        return datasets.load_dataset(hub_path, config, split=split)
    except Exception as exc:
        raise DatasetFormatError(f"could not load {hub_path}:{config} split {split!r} from the hub: {exc}") from exc


SPLIT_NAMES = ("train", "dev", "validation", "valid", "val", "test")
SPLIT_HINT = "stppo train: --set env_kwargs.split=NAME; it reads the train split by default"


def _split_of(path: Path) -> set[str]:
    return set(re.split(r"[_\-.\s]+", path.stem.lower())) & set(SPLIT_NAMES)


def _files_in(folder: Path, split: str) -> list[Path]:
    """The folder's files of ``split`` (by name: ``*_test.csv``, ``nq_open_dev.jsonl``); all of them only when no
    file names a split. A folder whose files name other splits but not this one is an error, never a silent
    evaluation on training data."""
    files = sorted(p for p in folder.iterdir() if p.suffix in _FILE_BUILDERS and p.is_file())
    matching = [p for p in files if split.lower() in _split_of(p)]
    if matching:
        return matching
    named = {p.name: sorted(_split_of(p)) for p in files if _split_of(p)}
    if named:
        splits = sorted({name for names in named.values() for name in names})
        raise DatasetFormatError(
            f"{folder} has no file of split {split!r} (its files name splits {splits}: {', '.join(sorted(named))}); "
            f"pass --split with one of those ({SPLIT_HINT}), or the file itself as the dataset")
    return files


def _load_files(files: Iterable[Path], family: str) -> datasets.Dataset:
    files = list(files)
    suffixes = {p.suffix for p in files}
    if len(suffixes) != 1 or not suffixes <= set(_FILE_BUILDERS):
        raise DatasetFormatError(
            f"cannot mix or read file types {sorted(suffixes)}; use one of {sorted(_FILE_BUILDERS)}")
    suffix = suffixes.pop()
    if suffix != ".parquet":
        for path in files:
            _check_utf8(path)
    data_files = [str(p) for p in files]
    if suffix == ".json" and _is_json_object_of_records(files[0]):
        return _load_keyed_json(files)
    if suffix == ".csv" and family == "mcq" and not _csv_has_header(files[0]):
        return datasets.concatenate_datasets([_load_headerless_mcq_csv(path) for path in files])
    if suffix == ".csv":
        return _load_with_builder("csv", data_files, **_csv_as_text(_csv_header(files[0])))
    return _load_with_builder(_FILE_BUILDERS[suffix], data_files)


def _check_utf8(path: Path, block_size: int = 1 << 20) -> None:
    """A text file in another encoding (a Latin-1 export, say) would otherwise fail later as a bare
    UnicodeDecodeError from pyarrow or csv, naming neither the file nor the byte. Read in blocks: a corpus-sized
    file is not held in memory a second time before the loader reads it."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes handed to the decoder before this block; a character split across blocks waits in it
    with open(path, "rb") as file:
        while True:
            block = file.read(block_size)
            waiting = len(decoder.getstate()[0])
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                raise DatasetFormatError(f"{path} is not UTF-8 text ({exc.reason} at byte "
                                         f"{offset - waiting + exc.start}); save it as UTF-8") from exc
            if not block:
                return
            offset += len(block)


def _csv_as_text(columns: list[str]) -> dict:
    """Every CSV cell as the file's text: pandas would otherwise turn options named "None", "NA", "N/A",
    "null" or "nan" into missing values and "007" or "1.50" into numbers. Empty cells stay "" (a required
    one is refused by the adapters)."""
    return {"na_filter": False,
            "features": datasets.Features({name: datasets.Value("string") for name in columns})}


def _load_with_builder(builder: str, data_files: list[str], **kwargs) -> datasets.Dataset:
    for path in map(Path, data_files):
        if path.stat().st_size == 0 or not path.read_text(encoding="utf-8", errors="replace").strip():
            raise DatasetFormatError(f"{path} is empty: no records to load")
    # datasets' on-disk cache recognises a file by its size and float mtime, which misses an edit of the same
    # size within a float's resolution; naming the config by (size, mtime_ns) gives each version its own cache.
    stamps = repr([(name, *_file_stamp(Path(name))) for name in data_files])
    kwargs.setdefault("name", "stppo-" + hashlib.sha256(stamps.encode()).hexdigest()[:16])
    try:
        return datasets.load_dataset(builder, data_files=data_files, split="train", **kwargs)
    except Exception as exc:
        raise DatasetFormatError(f"could not read {', '.join(data_files)}: {_first_bad_line(data_files) or exc}") \
            from exc


def _first_bad_line(data_files: list[str]) -> str | None:
    """For JSON lines files, the file and line that is not a JSON object (datasets' own error names neither)."""
    for name in data_files:
        if not name.endswith(".jsonl"):
            continue
        with open(name, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    if not isinstance(json.loads(line), dict):
                        return f"{name}, line {number}: not a JSON object"
                except json.JSONDecodeError as exc:
                    return f"{name}, line {number} is not valid JSON ({exc.msg}): {line.strip()[:80]!r}"
    return None


def _load_headerless_mcq_csv(path: Path) -> datasets.Dataset:
    """MMLU's ``SUBJECT_test.csv`` files: no header row; the subject is the file name."""
    columns = _mmlu_columns(path)
    table = _load_with_builder("csv", [str(path)], column_names=columns, header=None, **_csv_as_text(columns))
    subject = path.stem.removesuffix("_test").removesuffix("_dev").removesuffix("_val")
    return table.add_column("subject", [subject] * len(table))


def _is_json_object_of_records(path: Path) -> bool:
    """PubMedQA ships ``{"PMID": {...}, ...}``; a JSON-lines file also starts with '{', but its first line is a
    complete object. utf-8-sig here and below: a byte-order mark at the start is not part of the JSON."""
    with open(path, encoding="utf-8-sig") as handle:
        first_line = next((line.strip() for line in handle if line.strip()), "")
    if not first_line.startswith("{"):
        return False
    try:
        json.loads(first_line)
        return False
    except json.JSONDecodeError:
        return True


def _load_keyed_json(files: list[Path]) -> datasets.Dataset:
    rows = []
    for path in files:
        with open(path, encoding="utf-8-sig") as handle:
            for key, value in json.load(handle, object_pairs_hook=functools.partial(_unique_keys, path)).items():
                if not isinstance(value, dict):
                    raise DatasetFormatError(f"{path}: value of key {key!r} is not an object")
                rows.append({"id": str(key), **value})
    return datasets.Dataset.from_list(rows)


def _unique_keys(path: Path, pairs: list[tuple[str, object]]) -> dict:
    """``json.load`` keeps only the last of two equal keys; in a keyed file that silently drops a record."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise DatasetFormatError(f"{path}: key {key!r} occurs more than once in one object")
        seen.add(key)
    return dict(pairs)


def _csv_header(path: Path) -> list[str]:
    # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which pandas drops but the csv module keeps
    with open(path, encoding="utf-8-sig", newline="") as handle:
        return next(csv.reader(handle), [])


def _csv_has_header(path: Path) -> bool:
    return any(cell.strip().lower() in {"question", "answer"} for cell in _csv_header(path))


def _mmlu_columns(path: Path) -> list[str]:
    with open(path, encoding="utf-8", newline="") as handle:
        width = len(next(csv.reader(handle), []))
    if width < 4:
        raise DatasetFormatError(f"{path}: a headerless MCQ CSV needs question, >= 2 options and answer columns")
    return ["question", *"ABCDEFGHIJ"[: width - 2], "answer"]
