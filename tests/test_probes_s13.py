"""Probes of user-facing promises (session 13): each test failed on the code before its fix."""

from __future__ import annotations

import codecs

from stppo_envs.data.loading import load_examples


def test_a_csv_saved_with_a_utf8_bom_loads_like_one_without(tmp_path):
    # Excel's "CSV UTF-8" export starts the file with a byte-order mark; the header's first name must not keep it.
    text = 'id,question,golden_answers\nb1,Who wrote Velmaria?,"Jane Doe"\nb2,Where is Ostrand?,inland\n'
    plain, bom = tmp_path / "plain.csv", tmp_path / "bom.csv"
    plain.write_text(text, encoding="utf-8")
    bom.write_bytes(codecs.BOM_UTF8 + text.encode("utf-8"))
    with_bom = load_examples("nq", dataset=bom)
    assert [(e.id, e.question, tuple(e.golden_answers)) for e in with_bom] == \
        [(e.id, e.question, tuple(e.golden_answers)) for e in load_examples("nq", dataset=plain)]
    assert [e.id for e in with_bom] == ["b1", "b2"]

