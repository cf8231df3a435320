"""``stppo_envs.spaces``: the Text space's bounds and samples."""

from __future__ import annotations

import numpy as np

from stppo_envs.spaces import _PRINTABLE, _TAGS, UnicodeText


def test_unicode_text_bounds_and_samples():
    space = UnicodeText(10, min_length=2, seed=0)
    assert (space.min_length, space.max_length) == (2, 10) and repr(space) == "UnicodeText(2, 10)"
    assert space.contains("ab") and space.contains("a" * 10) and space.contains("é ?")
    assert not space.contains("a") and not space.contains("a" * 11) and not space.contains(b"abc")
    samples = [space.sample() for _ in range(200)]
    assert all(2 <= len(s) <= 10 for s in samples)
    assert {len(s) for s in samples} >= {2, 10}
    long = UnicodeText(10_000, seed=1)
    lengths = [len(long.sample()) for _ in range(200)]
    assert max(lengths) <= 256 and max(lengths) > 200 and min(lengths) < 40
    text = "".join(long.sample() for _ in range(50))
    assert any(tag in text for tag in _TAGS[:4]) and set(text) <= set(_PRINTABLE) | set("".join(_TAGS))
    assert any(c.isdigit() for c in text) and any(c in "éüßñçøΩπ中文字" for c in text)  # not only tags
    assert UnicodeText(50, seed=3).sample() == UnicodeText(50, seed=3).sample()
    assert UnicodeText(50, seed=3).sample() != UnicodeText(50, seed=4).sample()
    padded = UnicodeText(400, min_length=300, seed=0).sample()
    assert 300 <= len(padded) <= 400
    assert UnicodeText(0).sample() == ""
    fixed = UnicodeText(300, min_length=256, seed=0)
    assert {len(fixed.sample()) for _ in range(20)} == {256}  # the cap is 256 characters, inclusive
    one = UnicodeText(1, min_length=1, seed=0)
    assert len({one.sample() for _ in range(40)}) > 5  # the one character is drawn, not padding
    padded_runs = [UnicodeText(30, min_length=20, seed=s).sample().endswith("   ") for s in range(60)]
    assert sum(padded_runs) <= 3  # at least min_length drawn characters: no padding to reach it
    text = "".join(UnicodeText(10_000, seed=2).sample() for _ in range(60))
    tags = sum(text.count(tag) for tag in _TAGS)
    assert 0.015 * len(text) < tags < 0.06 * len(text)  # ~30% of pieces are tags, the others 1-15 characters
    assert "XXXX" not in text
    charset = UnicodeText(5, seed=0)
    probability = np.zeros(len(charset.character_set))
    probability[charset.character_index("a")] = 1.0
    assert charset.sample(probability=(4, probability)) == "aaaa"
    masked = UnicodeText(5, seed=0).sample(mask=(3, None))
    assert len(masked) == 3 and space.character_set == frozenset(_PRINTABLE)
