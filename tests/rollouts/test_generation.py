"""``stppo_agent.rollouts.generation``: where a turn's generated text ends."""

from __future__ import annotations

from stppo_agent.algorithms.registry import accepts_keyword
from stppo_agent.rollouts.generation import generated_length

# -- generation ----------------------------------------------------------------------------------------------------

class CharTokenizer:
    """One character per token id (decode joins them); ids >= 100 are special and hidden when asked."""

    def decode(self, ids, skip_special_tokens):
        return "".join("" if (skip_special_tokens and i >= 100) else chr(i % 100 + 32) for i in ids)


def chars(text):
    return [ord(c) - 32 for c in text]


def test_generation_length_ends_at_eos_or_at_the_token_that_completes_a_stop_string():
    tok = CharTokenizer()
    ids = chars("ab</answer>cd")
    assert generated_length(ids, tok, ("</answer>",), []) == 11
    assert generated_length(ids, tok, ("</search>", "</answer>"), []) == 11
    assert generated_length(ids, tok, ("</search>",), []) == 13  # no stop string: all of it
    assert generated_length(ids, tok, (), [ord("c") - 32]) == 12  # through the EOS
    assert generated_length(ids, tok, ("</answer>",), [ord("b") - 32]) == 2  # EOS first
    assert generated_length(ids, tok, (), []) == 13
    assert generated_length(chars(">"), tok, (">",), []) == 1
    assert generated_length(chars("x>y"), tok, (">",), []) == 2
    assert generated_length(chars("xy>"), tok, (">",), []) == 3
    # a stop string made with a special token still counts (the text is decoded with special tokens)
    assert generated_length([ord("<") - 32, 100 + ord("/") - 32, ord(">") - 32, 5], tok, ("</>",), []) == 3


def test_generation_accepts_keyword_names_or_kwargs():
    def named(contexts, max_new_tokens, keys=None):
        pass

    def wrapper(*args, **kwargs):
        pass

    def positional(*args):
        pass

    assert accepts_keyword(named, "keys") and accepts_keyword(wrapper, "keys")
    assert not accepts_keyword(positional, "keys") and not accepts_keyword(named, "key")
