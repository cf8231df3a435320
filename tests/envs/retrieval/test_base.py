"""``stppo_envs.retrieval.base``: hits and their contents, error types,
``search_each``'s isolation of refused queries, the cache, and what survives pickling."""

from __future__ import annotations

import json
import pickle
import types

import pytest

from stppo_envs.retrieval import Hit, RetrievalError, RetrieverUnavailableError, base, bm25
from stppo_envs.retrieval.base import CachedRetriever, PartialSearchError, search_each
from tests.support.retrieval_backends import _Doc, _FakeSearcher, _lucene_dir
from tests.support.retrieval_server import _Backend


def test_hits_keep_the_stored_title_line_or_quote_the_title():
    assert base.Hit("1", 0.0, "Paris", "A city.").contents == '"Paris"\nA city.'
    assert base.Hit("1", 0.0, "Paris", "A city.", title_line="Paris").contents == "Paris\nA city."
    assert base.Hit("1", 0.0, "Paris", "x", title_line="Paris") == base.Hit("1", 0.0, "Paris", "x")  # not compared
    hit = base.hit_from_contents("7", 1.5, "Arkansas\nA state.\nMore.")
    assert (hit.docid, hit.score, hit.title, hit.text, hit.title_line) == ("7", 1.5, "Arkansas", "A state.\nMore.",
                                                                            "Arkansas")
    bare = base.hit_from_contents("8", 0.0, "no title line")
    assert (bare.title, bare.text, bare.title_line, bare.display_title) == ("", "no title line", None, '""')


@pytest.mark.parametrize("contents, parsed", [
    ('"Paris"\nCapital.', ("Paris", "Capital.")), ('  "Paris"  \nCapital.', ("Paris", "Capital.")),
    ('"\nx', ('"', "x")), ('""\nx', ("", "x")), ('"a\nx', ('"a', "x")), ("Rome\nx\ny", ("Rome", "x\ny")),
    ("alone", ("", "alone"))])
def test_parse_contents_unquotes_only_a_fully_quoted_title(contents, parsed):
    assert base.parse_contents(contents) == parsed


def test_passages_sha256_covers_ids_contents_order_and_boundaries():
    one = base.passages_sha256([("1", "a"), ("2", "b")])
    import hashlib

    expected = hashlib.sha256(b'["1", "a"]\n["2", "b"]\n').hexdigest()
    assert one == expected
    assert base.passages_sha256([(1, "\u00e9")]) == hashlib.sha256('["1", "\u00e9"]\n'.encode()).hexdigest()
    assert base.passages_sha256([]) == hashlib.sha256(b"").hexdigest()


def test_portable_name_drops_machine_directories(tmp_path):
    assert base.portable_name("/x/y/gt_model/model") == "gt_model/model"
    assert base.portable_name("/x/y/idx/index") == "idx/index" and base.portable_name("/x/y/e/encoder") == "e/encoder"
    assert base.portable_name("/x/y/some-index") == "some-index"
    assert base.portable_name("org/enc") == "org/enc"
    (tmp_path / "rel").mkdir()
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert base.portable_name("rel") == "rel" and base.portable_name("rel/model") == "rel/model"
    finally:
        os.chdir(cwd)


def test_sanitize_query_and_is_valid_unicode():
    assert base.is_valid_unicode("caf\u00e9") and not base.is_valid_unicode("a\ud800")
    assert base.sanitize_query(" a\x00b\x1fc\x7fd\te\nf\rg\x0bh\x0ci ") == "a b c d\te\nf\rg h i"
    assert base.sanitize_query("x\udfffy") == "x\ufffdy" and base.sanitize_query(" \x00 ") == "?"
    assert base.sanitize_query("\x08\x0e") == "?" and base.sanitize_query("ok") == "ok"


def test_error_types_nest_as_documented():
    assert issubclass(base.IndexNotFoundError, base.RetrievalError) and issubclass(base.IndexNotFoundError,
                                                                                   FileNotFoundError)
    assert issubclass(base.RetrieverUnavailableError, ConnectionError)
    assert issubclass(base.RetrievalError, RuntimeError)


def test_partial_search_error_messages_and_order():
    single = PartialSearchError([None], {0: RetrievalError("too many clauses")})
    assert str(single) == "too many clauses"
    several = PartialSearchError([None, [], None], {2: RetrievalError("late"), 0: RetrievalError("first")})
    assert str(several) == "2 of 3 queries failed; query 0: first"
    assert list(several.errors) == [0, 2] and several.results == [None, [], None]
    two = PartialSearchError([[], None], {1: RetrievalError("x")})
    assert str(two) == "1 of 2 queries failed; query 1: x"


def test_as_retrieval_error_names_a_foreign_exception():
    error = RetrievalError("mine")
    assert base.as_retrieval_error(error) is error
    wrapped = base.as_retrieval_error(ValueError("bad input"))
    assert type(wrapped) is RetrievalError and str(wrapped) == "ValueError: bad input"


class _Refuses(_Backend):
    """Refuses any batch holding a query with BAD in it, with ``error``."""

    def __init__(self, error=None):
        super().__init__()
        self.error = error or RetrievalError("refused")

    def batch_search(self, queries, k=10):
        self.calls.append((list(queries), k))
        if any("BAD" in q for q in queries):
            raise self.error
        return [[Hit(f"{q}#{j}", 0.0, q, "") for j in range(k)] for q in queries]


def test_search_each_splits_in_halves_down_to_the_refused_query():
    backend = _Refuses()
    rows, errors = search_each(backend, ["a", "b", "BAD", "d", "e"], 2)
    assert list(errors) == [2] and str(errors[2]) == "refused" and rows[2] is None
    assert [row[1].docid for i, row in enumerate(rows) if i != 2] == ["a#1", "b#1", "d#1", "e#1"]
    assert [queries for queries, _ in backend.calls] == [["a", "b", "BAD", "d", "e"], ["a", "b"], ["BAD", "d", "e"],
                                                         ["BAD"], ["d", "e"]]
    assert {k for _, k in backend.calls} == {2}
    rows, errors = search_each(_Refuses(), ["x", "BAD"], 1)
    assert list(errors) == [1] and rows[0][0].docid == "x#0"
    assert search_each(_Refuses(), [], 1) == ([], {})


def test_search_each_isolates_only_what_it_is_told_to():
    with pytest.raises(ValueError):  # a bug in the backend is not a refused query by default
        search_each(_Refuses(ValueError("bug")), ["BAD", "b"], 1)
    for queries in (["a", "BAD"], ["BAD", "b"], ["a", "BAD", "c", "d", "e"], ["a", "b", "c", "BAD"]):
        rows, errors = search_each(_Refuses(ValueError("bug")), queries, 1, isolate=Exception)  # in either half
        bad = queries.index("BAD")
        assert list(errors) == [bad] and str(errors[bad]) == "ValueError: bug", queries
        assert [row[0].docid for i, row in enumerate(rows) if i != bad] == [f"{q}#0" for q in queries if q != "BAD"]


def test_search_each_fails_every_query_at_once_when_the_backend_is_down():
    backend = _Refuses(RetrieverUnavailableError("down"))
    rows, errors = search_each(backend, ["BAD", "b", "c"], 1)
    assert rows == [None, None, None] and list(errors) == [0, 1, 2] and len(backend.calls) == 1
    assert all(str(e) == "down" for e in errors.values())


def test_search_each_keeps_a_partial_answer_as_it_came():
    class Partial(_Backend):
        def batch_search(self, queries, k=10):
            self.calls.append(queries)
            raise PartialSearchError([None, [Hit("b", 0.0, "", "")]], {0: RetrievalError("no")})

    backend = Partial()
    rows, errors = search_each(backend, ["a", "b"], 1)
    assert rows == [None, [Hit("b", 0.0, "", "")]] and list(errors) == [0] and len(backend.calls) == 1


def test_search_each_refuses_rows_that_do_not_match_the_queries():
    class Long(_Backend):
        def batch_search(self, queries, k=10):
            return super().batch_search(list(queries) + ["extra"], k)

    rows, errors = search_each(Long(), ["a", "b"], 1)
    assert rows == [None, None] and str(errors[1]) == "the backend returned 3 rows for 2 queries"


def test_batch_search_mixin_search_is_the_first_row():
    class Mixed(base.BatchSearchMixin):
        def batch_search(self, queries, k=10):
            return [[Hit(q, float(k), "", "")] for q in queries] + [["never"]]

    assert Mixed().search("q") == [Hit("q", 10.0, "", "")] and Mixed().search("q", 2)[0].score == 2.0


def test_the_cache_asks_the_backend_once_per_distinct_query_and_k():
    backend = _Backend()
    cached = CachedRetriever(backend)
    assert cached.maxsize == 65536
    rows = cached.batch_search(["a", "b", "a"], 1)
    assert [row[0].docid for row in rows] == ["a#0", "b#0", "a#0"] and backend.calls == [(["a", "b"], 1)]
    assert cached.search("a", 2)[0].docid == "a#0" and backend.calls[-1] == (["a"], 2)  # another k: asked again
    assert cached.batch_search(["b", "a"], 1) == [rows[1], rows[0]] and len(backend.calls) == 2
    assert cached.batch_search([], 1) == [] and len(backend.calls) == 2


def test_the_cache_evicts_the_least_recently_used_beyond_maxsize_and_pickles_its_size():
    backend = _Backend()
    cached = CachedRetriever(backend, maxsize=2)
    cached.batch_search(["a", "b"], 1)
    cached.search("a", 1)  # a is now the most recent
    cached.search("c", 1)  # evicts b
    backend.calls.clear()
    cached.batch_search(["a", "c", "b"], 1)
    assert backend.calls == [(["b"], 1)]
    clone = pickle.loads(pickle.dumps(cached))
    assert clone.maxsize == 2 and clone._cache.maxsize == 2 and len(clone._cache) == 0
    assert isinstance(clone.retriever, _Backend) and repr(clone) == f"CachedRetriever({clone.retriever!r})"


def test_the_cache_names_its_backends_index():
    class Named(_Backend):
        index_id = "bm25:abc"

    assert CachedRetriever(Named()).index_id == "bm25:abc"
    backend = _Backend()
    assert CachedRetriever(backend).index_id == repr(backend)


def test_reopens_after_pickling_drops_only_the_transient_attributes():
    class Holder(base.ReopensAfterPickling):
        _transient = ("_handle", "_other")

        def __init__(self):
            self.path, self._handle, self._other = "p", object(), 1

    state = Holder().__getstate__()
    assert state == {"path": "p", "_handle": None, "_other": None}
    holder = Holder()
    holder.__getstate__()
    assert holder._handle is not None  # the live object keeps its handle
    assert base.ReopensAfterPickling._transient == ()


def test_bm25_reads_raw_text_from_the_doc_when_the_result_has_none_and_names_what_fails(tmp_path):
    retriever = bm25.BM25Retriever(_lucene_dir(tmp_path / "idx"))
    retriever._searcher = _FakeSearcher(stored=False)
    assert retriever.search("q", 1) == [Hit("q-0", 10.0, "", "plain q-0")]
    assert bm25.BM25Retriever._to_hit(retriever._searcher, types.SimpleNamespace(
        docid=5, score=1, lucene_document=_Doc(json.dumps({"other": 1})))) == Hit("5", 1.0, "", "")
    with pytest.raises(RetrievalError, match="^index stores no raw text for gone-1: rebuild it with --storeRaw$"):
        bm25.BM25Retriever._to_hit(retriever._searcher, types.SimpleNamespace(docid="gone-1", score=1,
                                                                                lucene_document=None))
    retriever._searcher = _FakeSearcher(fail=RuntimeError("JavaException: boom\n  at org.apache.X\n  at Y"))
    with pytest.raises(RetrievalError, match=rf"^BM25 search failed on {tmp_path / 'idx'}: JavaException: boom$"):
        retriever.search("q", 1)
    retriever._searcher = _FakeSearcher(fail=KeyError())
    with pytest.raises(RetrievalError, match=r"failed on .*: KeyError$"):
        retriever.search("q", 1)
