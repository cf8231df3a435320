"""``stppo_agent.cli.arguments``: the argument types, BENCH=PATH pairs and the help format
(a default shown only where it is news)."""

from __future__ import annotations

import argparse

import pytest

from stppo_agent.cli.arguments import HelpFormatter, Parser, key_value, positive_int

# ---------------------------------------------------------------- arguments


def test_arguments_positive_int_accepts_one_and_refuses_zero_and_below():
    assert positive_int("1") == 1 and positive_int("12") == 12
    for text, value in (("0", 0), ("-3", -3)):
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            positive_int(text)
        assert str(refused.value) == f"must be >= 1, got {value}"
    with pytest.raises(ValueError):
        positive_int("two")


def test_arguments_key_value_canonical_benchmark_and_the_rest_of_the_value():
    assert key_value("nq=data/nq") == ("nq", "data/nq")
    assert key_value("HotpotQA=a=b") == ("hotpotqa", "a=b")  # the first '=' splits; the path may hold more
    assert key_value("nq=") == ("nq", "")
    with pytest.raises(ValueError) as refused:
        key_value("nq")
    assert str(refused.value) == "expected BENCH=PATH, got 'nq'"
    with pytest.raises(KeyError, match="did you mean hotpotqa"):
        key_value("hotpotq=x")


def test_arguments_help_formatter_adds_the_default_only_where_it_is_news():
    parser = Parser(prog="p")
    parser.add_argument("--topk", type=int, default=3, help="passages per search")
    parser.add_argument("--bare", type=int, default=5)
    parser.add_argument("--said", default="x", help="default x already")
    parser.add_argument("--needed", required=True, default="r", help="needed")
    parser.add_argument("--none", default=None, help="nothing")
    parser.add_argument("--flag", action="store_true", help="a flag")
    parser.add_argument("--many", action="append", default=[], help="repeatable")
    parser.add_argument("--hidden", default=argparse.SUPPRESS, help="suppressed")
    parser.add_argument("--zero", type=int, default=0, help="zero")
    helps = {a.dest: HelpFormatter("p")._get_help_string(a) for a in parser._actions}
    assert helps["topk"] == "passages per search (default: %(default)s)"
    assert helps["bare"] == "(default: %(default)s)"
    assert helps["zero"] == "zero (default: %(default)s)"  # 0 is a default worth showing (not None/False)
    assert helps["said"] == "default x already"
    assert helps["needed"] == "needed"
    assert helps["none"] == "nothing" and helps["flag"] == "a flag" and helps["many"] == "repeatable"
    assert helps["hidden"] == "suppressed"
    text = " ".join(parser.format_help().split())
    assert "passages per search (default: 3)" in text and "(default: x)" not in text and "zero (default: 0)" in text


def test_arguments_parser_uses_the_formatter_unless_told_otherwise():
    assert Parser(prog="p").formatter_class is HelpFormatter
    assert Parser(prog="p", formatter_class=argparse.RawTextHelpFormatter).formatter_class \
        is argparse.RawTextHelpFormatter
    assert Parser("p", "usage: p").prog == "p"  # positional arguments reach argparse too
    parser = Parser(prog="p", description="d")
    assert parser.prog == "p" and parser.description == "d"
    sub = parser.add_subparsers().add_parser("s")
    assert isinstance(sub, Parser) and sub.formatter_class is HelpFormatter  # sub-commands show defaults too
