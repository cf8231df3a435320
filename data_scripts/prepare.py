"""Fetch the benchmark datasets and retrieval corpora, and build their indexes.

Run on a machine that reaches the Hugging Face hub (every step also takes local files, which is how the tests
exercise it):

    python data_scripts/prepare.py datasets --out data/benchmarks                  # FlashRAG QA + medical MCQ
    python data_scripts/prepare.py datasets --out data/benchmarks --local ../shared/data   # from local files
    python data_scripts/prepare.py corpus wiki18 --out data/corpora                # Search-R1's wiki-18 (21M passages)
    python data_scripts/prepare.py corpus medical --out data/corpora               # MedRAG textbooks
    python data_scripts/prepare.py corpus wiki18 --out data/corpora --local wiki-18.jsonl.gz
    python data_scripts/prepare.py index --corpus data/corpora/wiki18.jsonl --out indexes/wiki18 [--dense-encoder M]

Datasets are written as ``OUT/<benchmark>/<split>.jsonl`` in the FlashRAG schema (``id``, ``question``,
``golden_answers``; MCQ records add ``choices`` and ``answer_letter``), which ``dataset=OUT/<benchmark>`` loads.
Corpora are written as pyserini JsonCollection files (``{"id", "contents": "\\"Title\\"\\ntext"}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stppo_envs import load_examples  # noqa: E402
from stppo_envs.retrieval.base import to_contents  # noqa: E402
from stppo_envs.retrieval.indexing import CorpusFormatError, iter_contents, json_record  # noqa: E402

# benchmark -> (hub source for load_examples, splits); MCQ hub sets whose schema differs are converted below
HUB_SOURCES = {
    "nq": ("hub", ["train", "test"]), "triviaqa": ("hub", ["train", "test"]), "popqa": ("hub", ["test"]),
    "hotpotqa": ("hub", ["train", "dev"]), "2wiki": ("hub", ["train", "dev"]), "musique": ("hub", ["train", "dev"]),
    "bamboogle": ("hub", ["test"]), "medqa": ("hub", ["test"]),
}
# local layout of the real-data fixture pack: benchmark -> (relative path, split it stands for)
LOCAL_SOURCES = {
    "nq": ("qa/nq_open_dev.jsonl", "test"), "hotpotqa": ("qa/hotpotqa_dev.json", "dev"),
    "bamboogle": ("qa/bamboogle_test.csv", "test"), "musique": ("qa/musique_100.json", "dev"),
    "medqa": ("medical/medqa_us_4opt_test.jsonl", "test"), "medmcqa": ("medical/medmcqa_dev.jsonl", "dev"),
    "pubmedqa": ("medical/pubmedqa_test.json", "test"), "mmlu_med": ("medical/mmlu_med", "test"),
}
WIKI18 = ("PeterJinGo/wiki-18-corpus", "wiki-18.jsonl.gz")  # Search-R1's corpus (hub dataset repo, file)
MEDRAG_TEXTBOOKS = "MedRAG/textbooks"
MMLU_MEDICAL = ("anatomy", "clinical_knowledge", "college_biology", "college_medicine", "medical_genetics",
                "professional_medicine")


def write_jsonl(rows: Iterable[dict], path: Path, *, empty_error: str | None = None) -> int:
    """Write ``rows`` to ``path`` atomically: a temporary file beside it, renamed when complete. A failure while
    reading the rows (a malformed source) leaves neither a partial ``path`` nor the temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    count = 0
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
                count += 1
        if count == 0 and empty_error:  # an empty corpus file would only fail later, at indexing
            raise CorpusFormatError(empty_error)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return count


def export_benchmark(benchmark: str, source: str, split: str, out: Path) -> Path:
    """Normalise one benchmark split through the project's adapters and write it in the FlashRAG schema."""
    examples = load_examples(benchmark, source, split)
    path = out / benchmark / f"{split}.jsonl"
    rows = []
    for example in examples:
        row = {"id": example.id, "question": example.question, "golden_answers": list(example.golden_answers)}
        if example.choices is not None:
            row.update(choices=dict(example.choices), answer_letter=example.answer_letter)
        rows.append(row)
    write_jsonl(rows, path)
    return path


def hub_mcq_records(benchmark: str) -> Iterator[dict]:
    """Medical MCQ sets whose hub schema differs from the raw releases, converted to the generic MCQ form."""
    import datasets

    if benchmark == "medmcqa":  # openlifescienceai/medmcqa: cop is 0-based there (1-based in the raw release)
        for row in datasets.load_dataset("openlifescienceai/medmcqa", split="validation"):
            yield {"id": row["id"], "question": row["question"], "choices": [row[f"op{c}"] for c in "abcd"],
                   "answer": int(row["cop"])}
    elif benchmark == "pubmedqa":
        for row in datasets.load_dataset("qiaojin/PubMedQA", "pqa_labeled", split="train"):
            yield {"id": str(row["pubid"]), "QUESTION": row["question"], "final_decision": row["final_decision"]}
    elif benchmark == "mmlu_med":
        for subject in MMLU_MEDICAL:
            for i, row in enumerate(datasets.load_dataset("cais/mmlu", subject, split="test")):
                yield {"id": f"{subject}-{i}", "question": row["question"], "choices": row["choices"],
                       "answer": int(row["answer"]), "subject": subject}


def cmd_datasets(args: argparse.Namespace) -> None:
    out = Path(args.out)
    wanted = args.benchmarks.split(",") if args.benchmarks else None
    if args.local:
        for benchmark, (relative, split) in LOCAL_SOURCES.items():
            if wanted is None or benchmark in wanted:
                print(export_benchmark(benchmark, str(Path(args.local) / relative), split, out))
        return
    for benchmark, (source, splits) in HUB_SOURCES.items():
        if wanted is None or benchmark in wanted:
            for split in splits:
                print(export_benchmark(benchmark, source, split, out))
    for benchmark in ("medmcqa", "pubmedqa", "mmlu_med"):
        if wanted is None or benchmark in wanted:
            raw = out / benchmark / "raw.jsonl"
            write_jsonl(hub_mcq_records(benchmark), raw)
            print(export_benchmark(benchmark, str(raw), "test", out))
            raw.unlink()


def convert_corpus(source: Path, out: Path) -> int:
    """Any supported corpus layout, gzipped or not (``iter_contents``) -> one pyserini JsonCollection file."""
    rows = ({"id": docid, "contents": contents} for docid, contents in iter_contents(source))
    return write_jsonl(rows, out, empty_error=f"{source}: no passages")


def medrag_rows(records: Iterable[dict]) -> Iterator[dict]:
    """MedRAG corpora (``id``, ``title``, ``content``) -> pyserini rows."""
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict) or "content" not in record:
            raise CorpusFormatError(f"MedRAG record {number}: no 'content' field" if isinstance(record, dict)
                                    else f"MedRAG record {number}: not a JSON object")
        yield {"id": str(record.get("id", number - 1)),
               "contents": to_contents(record.get("title", ""), record["content"])}


def local_medrag_records(path: Path) -> Iterator[dict]:
    """A local MedRAG JSON lines file, read as it streams; a bad line is an error naming it."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = json_record(line, number, path)
            if "content" not in record:
                raise CorpusFormatError(f"{path}, line {number} has no 'content' field (fields: {sorted(record)})")
            yield record


def cmd_corpus(args: argparse.Namespace) -> None:
    out_dir = Path(args.out)
    if args.name == "wiki18":
        source = Path(args.local) if args.local else _hub_file(*WIKI18)
        print(f"{convert_corpus(source, out_dir / 'wiki18.jsonl')} passages -> {out_dir / 'wiki18.jsonl'}")
    elif args.name == "medical":
        if args.local:
            records = local_medrag_records(Path(args.local))
        else:
            import datasets

            records = datasets.load_dataset(MEDRAG_TEXTBOOKS, split="train")
        count = write_jsonl(medrag_rows(records), out_dir / "medical.jsonl",
                            empty_error=f"{args.local or MEDRAG_TEXTBOOKS}: no passages")
        print(f"{count} passages -> {out_dir / 'medical.jsonl'}")


def _hub_file(repo: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo, filename, repo_type="dataset"))


def cmd_index(args: argparse.Namespace) -> None:
    from stppo_envs.retrieval.indexing import build_bm25_from_corpus

    out = Path(args.out)
    print(build_bm25_from_corpus(args.corpus, out / "bm25", threads=args.threads))
    if args.dense_encoder:
        from stppo_envs.retrieval.dense import build_dense_index

        print(build_dense_index(args.corpus, out / "dense", args.dense_encoder, index_type=args.index_type))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    ds = commands.add_parser("datasets")
    ds.add_argument("--out", required=True)
    ds.add_argument("--benchmarks", default=None, help="comma-separated subset")
    ds.add_argument("--local", default=None, help="a folder laid out like the real-data fixture pack")
    ds.set_defaults(handler=cmd_datasets)
    corpus = commands.add_parser("corpus")
    corpus.add_argument("name", choices=["wiki18", "medical"])
    corpus.add_argument("--out", required=True)
    corpus.add_argument("--local", default=None, help="a local corpus file instead of the hub")
    corpus.set_defaults(handler=cmd_corpus)
    index = commands.add_parser("index")
    index.add_argument("--corpus", required=True)
    index.add_argument("--out", required=True)
    index.add_argument("--dense-encoder", default=None, help="also build a dense index with this encoder")
    index.add_argument("--index-type", default="flat", choices=["flat", "hnsw", "ivf"])
    index.add_argument("--threads", type=int, default=4)
    index.set_defaults(handler=cmd_index)
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except (OSError, ValueError, KeyError) as exc:  # CorpusFormatError and DatasetFormatError are ValueErrors
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"prepare.py {args.command}: error: {' '.join(str(message).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
