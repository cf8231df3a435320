"""``stppo_envs.retrieval.indexing``: corpora of every layout read as UTF-8,
the refusals naming the line, and BM25 builds moved into place when finished."""

from __future__ import annotations

import codecs
import gzip
import json
from pathlib import Path

import pytest

from stppo_envs.retrieval import bm25, indexing
from stppo_envs.retrieval.indexing import CorpusFormatError, iter_contents, iter_corpus

# ---------------------------------------------------------------- corpus reading (indexing)




def test_jsonl_corpora_pass_contents_through_and_number_missing_ids_by_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": 7, "contents": "\\"T\\"\\nbody", "docid": "no"}\n\n'
                      '{"docid": "d2", "title": "U", "text": "t2"}\n{"text": "t3"}\n', encoding="utf-8")
    assert list(iter_contents(corpus)) == [("7", '"T"\nbody'), ("d2", '"U"\nt2'), ("3", '""\nt3')]
    assert list(iter_corpus(corpus)) == [("7", "T", "body"), ("d2", "U", "t2"), ("3", "", "t3")]
    # a .json file whose first line is an object is read as JSON lines too
    lines = tmp_path / "c.json"
    lines.write_text('{"id": "a", "contents": "x"}\n{"id": "b", "contents": "y"}\n')
    assert list(iter_contents(lines)) == [("a", "x"), ("b", "y")]
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as handle:
        handle.write('\n{"id": "g", "contents": "é"}\n{"contents": "h"}\n')
    # JSON lines by the name even when the first line is blank; a missing id is the line's number from 0
    assert list(iter_contents(gz)) == [("g", "é"), ("2", "h")]
    blank_first = tmp_path / "b.jsonl"
    blank_first.write_text('\n{"contents": "x"}\n')
    assert list(iter_contents(blank_first)) == [("1", "x")]
    blank_first.write_text('not json\n{"contents": "x"}\n')
    with pytest.raises(CorpusFormatError, match=r"b.jsonl, line 1: not JSON \(Expecting value\)$"):
        list(iter_contents(blank_first))


def test_json_list_and_title_object_corpora(tmp_path):
    listed = tmp_path / "l.json"
    listed.write_text(json.dumps([{"title": "A", "text": "a"}, {"id": "x", "contents": "c"}]))
    assert list(iter_contents(listed)) == [("0", '"A"\na'), ("x", "c")]
    keyed = tmp_path / "k.json"
    keyed.write_text(json.dumps({"T1": ["s1. ", "s2."], "T2": "plain"}, indent=1))
    assert list(iter_contents(keyed)) == [("0", '"T1"\ns1. s2.'), ("1", '"T2"\nplain')]
    gz = tmp_path / "k.json.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps([{"title": "G", "text": "g"}], indent=1))
    assert list(iter_contents(gz)) == [("0", '"G"\ng')]


@pytest.mark.parametrize("content, message", [
    ('{"id": 1, "contents": "x"}\nnot json\n', r"c.jsonl, line 2: not JSON \(Expecting value\)$"),
    ('{"id": 1, "contents": "x"}\n[1]\n', r"c.jsonl, line 2: not a JSON object \(a list\)$"),
    ('{"id": 1, "title": "x"}\n', r"c.jsonl: passage 0 has neither 'contents' nor 'text' \(fields: \['id', "
                                  r"'title'\]\)$"),
])
def test_bad_jsonl_corpora_name_the_line(tmp_path, content, message):
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(CorpusFormatError, match=message):
        list(iter_contents(tmp_path / "c.jsonl"))


def test_bad_corpora_of_other_layouts(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("[1, {")
    with pytest.raises(CorpusFormatError, match=r"c.json: not JSON lines, and not JSON either \("):
        list(iter_contents(path))
    path.write_text("[1]")
    with pytest.raises(CorpusFormatError, match=r"c.json: passage 0 is not a JSON object \(a int\)$"):
        list(iter_contents(path))
    path.write_text("42")
    with pytest.raises(CorpusFormatError, match=r"c.json: unsupported corpus layout \(a JSON int\)$"):
        list(iter_contents(path))
    path.write_bytes(b'{"id": 1, "contents": "\xff"}\n')
    with pytest.raises(CorpusFormatError, match=r"c.json: not UTF-8 text \(invalid start byte at byte 23\)$"):
        list(iter_contents(path))
    with pytest.raises(FileNotFoundError, match="^corpus file not found: .*missing.jsonl$"):
        list(iter_contents(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        list(iter_contents(tmp_path))
    bad_gz = tmp_path / "b.jsonl.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(CorpusFormatError, match=r"b.jsonl.gz: not a readable gzip file \(Not a gzipped file"):
        list(iter_contents(bad_gz))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"id": 1, "contents": "x"}\n' * 50)[:40])
    with pytest.raises(CorpusFormatError, match=r"cut.jsonl.gz: not a readable gzip file \(.+\)"):
        list(iter_contents(cut))


def test_write_jsonl_collection_and_its_refusals(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "contents": "\\"É\\"\\nx"}\n{"id": "b", "title": "B", "text": "y"}\n')
    out = tmp_path / "out"
    out.mkdir()
    assert indexing.write_jsonl_collection(corpus, out) == 2
    assert (out / "corpus.jsonl").read_text(encoding="utf-8") == \
        '{"id": "a", "contents": "\\"É\\"\\nx"}\n{"id": "b", "contents": "\\"B\\"\\ny"}\n'
    corpus.write_text('{"id": "a", "contents": "x"}\n{"id": "a", "contents": "y"}\n')
    with pytest.raises(CorpusFormatError, match=r"c.jsonl: duplicate passage id 'a'$"):
        indexing.write_jsonl_collection(corpus, out)
    corpus.write_text("\n")
    with pytest.raises(CorpusFormatError, match=r"c.jsonl: no passages$"):
        indexing.write_jsonl_collection(corpus, out)


def test_prepare_output_dir(tmp_path):
    assert indexing.prepare_output_dir(tmp_path / "a" / "b" / "c") == tmp_path / "a" / "b" / "c"
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "c").exists()
    (tmp_path / "empty").mkdir()
    assert indexing.prepare_output_dir(str(tmp_path / "empty")) == tmp_path / "empty"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="full exists and is not empty; remove it or choose another --out$"):
        indexing.prepare_output_dir(tmp_path / "full")


def _fake_bm25_build(calls):
    def build(collection, out_dir, *, threads=1, quiet=True):
        calls.append(((collection / "corpus.jsonl").read_text(), threads, quiet, Path(out_dir).parent))
        Path(out_dir).mkdir()
        (Path(out_dir) / "segments_1").write_text("lucene")
        return Path(out_dir)
    return build


@pytest.mark.parametrize("existing", [False, True])
def test_build_bm25_from_corpus_moves_a_finished_index_into_place(tmp_path, monkeypatch, capsys, existing):
    calls = []
    monkeypatch.setattr(bm25, "build_bm25_index", _fake_bm25_build(calls))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "contents": "x"}\n')
    if existing:
        (tmp_path / "idx").mkdir()
    out = indexing.build_bm25_from_corpus(corpus, tmp_path / "idx", threads=3, quiet=False)
    assert out == tmp_path / "idx" and (out / "segments_1").read_text() == "lucene"
    assert calls[0][:3] == ('{"id": "a", "contents": "x"}\n', 3, False)
    assert calls[0][3].parent == tmp_path and calls[0][3].name.startswith(".idx.")  # scratch beside OUT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "idx"]  # no scratch left
    assert capsys.readouterr().out == "indexed 1 passages\n"
    indexing.build_bm25_from_corpus(corpus, tmp_path / "idx2")
    assert calls[1][1:3] == (1, True)


# ---------------------------------------------------------------- indexing


def test_indexing_reads_and_writes_corpora_as_utf8_whatever_the_locale(tmp_path, monkeypatch):
    opened = []
    real_open, real_gzip_open = open, gzip.open

    def recording_open(file, mode="r", *args, **kwargs):
        opened.append((Path(file).name, mode, kwargs.get("encoding")))
        return real_open(file, mode, *args, **kwargs)

    def recording_gzip_open(file, mode="rb", *args, **kwargs):
        opened.append((Path(file).name, mode, kwargs.get("encoding")))
        return real_gzip_open(file, mode, *args, **kwargs)

    # the locale here is UTF-8 anyway; what is checked is that no read or write depends on it
    monkeypatch.setattr(indexing, "open", recording_open, raising=False)
    monkeypatch.setattr(indexing.gzip, "open", recording_gzip_open)
    plain = tmp_path / "c.jsonl"
    plain.write_text('{"id": "a", "contents": "é"}\n', encoding="utf-8")
    packed = tmp_path / "c.json.gz"
    with real_gzip_open(packed, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps([{"title": "É", "text": "x"}]))
    assert list(iter_contents(plain)) == [("a", "é")] and list(iter_contents(packed)) == [("0", '"É"\nx')]
    out = tmp_path / "out"
    out.mkdir()
    assert indexing.write_jsonl_collection(plain, out) == 1
    assert {name for name, _, _ in opened} == {"c.jsonl", "c.json.gz", "corpus.jsonl"}
    assert all(encoding is not None and codecs.lookup(encoding).name == "utf-8" for _, _, encoding in opened)
    assert [mode for name, mode, _ in opened if name == "corpus.jsonl"] == ["w"]
    assert {mode for name, mode, _ in opened if name == "c.json.gz"} == {"rt"}


def test_a_title_object_corpus_takes_any_value_as_the_passage_text(tmp_path):
    keyed = tmp_path / "k.json"
    keyed.write_text(json.dumps({"T1": 42, "T2": ["a", 1]}, indent=1))
    assert list(iter_contents(keyed)) == [("0", '"T1"\n42'), ("1", '"T2"\na1')]


def test_read_errors_of_gzip_corpora_are_named_and_others_pass_through(tmp_path, monkeypatch):
    def broken(exc):
        def open_text(path):
            raise exc
        return open_text

    packed = tmp_path / "c.jsonl.gz"
    packed.write_bytes(b"")
    monkeypatch.setattr(indexing, "_open_text", broken(EOFError()))
    with pytest.raises(CorpusFormatError, match=r"c.jsonl.gz: not a readable gzip file \(EOFError\)$"):
        list(iter_contents(packed))
    plain = tmp_path / "c.jsonl"
    plain.write_text("{}\n")
    monkeypatch.setattr(indexing, "_open_text", broken(OSError("disk failed")))
    with pytest.raises(OSError, match="^disk failed$") as info:
        list(iter_contents(plain))
    assert not isinstance(info.value, CorpusFormatError)


def test_a_title_object_corpus_written_on_one_line_is_not_taken_for_json_lines(tmp_path):
    keyed = tmp_path / "hotpot.json"
    keyed.write_text(json.dumps({"T1": ["s1. ", "s2."], "T2": ["x"]}))  # json.dump writes one line
    assert list(iter_contents(keyed)) == [("0", '"T1"\ns1. s2.'), ("1", '"T2"\nx')]
    one_passage = tmp_path / "one.json"  # a JSON-lines file of one passage under a .json name stays one
    one_passage.write_text('{"id": "p", "text": "t", "title": "T"}\n')
    assert list(iter_contents(one_passage)) == [("p", '"T"\nt')]
    # JSON lines under a .json name with misnamed fields stays JSON lines: the error names the passage's fields
    misnamed = tmp_path / "misnamed.json"
    misnamed.write_text('{"id": "a", "body": "x"}\n\n{"id": "b", "body": "y"}\n')
    with pytest.raises(CorpusFormatError, match=r"misnamed.json: passage 0 has neither 'contents' nor 'text' "
                                                r"\(fields: \['body', 'id'\]\)$"):
        list(iter_contents(misnamed))


# A corpus saved with a UTF-8 byte-order mark reads like one without.


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.json", "corpus.jsonl.gz"])
def test_a_corpus_saved_with_a_utf8_bom_reads_like_one_without(tmp_path, name):
    # a dataset file with a BOM loaded, the corpus beside it was refused: "Unexpected UTF-8 BOM"
    import gzip

    from stppo_envs.retrieval.indexing import iter_contents

    records = [{"id": "d1", "contents": "\"Velmaria\"\nVelmaria is a country."}, {"id": "d2", "title": "Ostrand",
                                                                               "text": "Ostrand is inland."}]
    text = (json.dumps(records) if name == "corpus.json" else "\n".join(map(json.dumps, records)) + "\n")
    data = codecs.BOM_UTF8 + text.encode("utf-8")
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert list(iter_contents(path)) == [("d1", "\"Velmaria\"\nVelmaria is a country."),
                                         ("d2", "\"Ostrand\"\nOstrand is inland.")]
