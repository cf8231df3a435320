""""Did you mean ...?" for a name that is not known: one rule for every lookup that refuses a name typed by a user
(algorithms, env ids, benchmarks, model aliases, config keys, retriever kinds, agent specs).

It lives in ``stppo_envs`` because both packages raise such errors and ``stppo_agent`` depends on ``stppo_envs``,
never the other way round.

>>> did_you_mean("st_ppp", ["ppo", "st_ppo", "grpo"])
' (did you mean st_ppo?)'
>>> unknown_name("algorithm", "st_ppp", ["ppo", "st_ppo"])
"unknown algorithm 'st_ppp' (did you mean st_ppo?); known: ppo, st_ppo"
"""

from __future__ import annotations

import difflib
from typing import Iterable

# difflib's default: "NQ-v1" finds "NQ-v0" and "st_ppp" finds "st_ppo", while "nope" suggests nothing rather than
# something arbitrary.
CUTOFF = 0.6


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name most like ``name`` (case-insensitive), or None when none is close."""
    by_lower: dict[str, str] = {}
    for candidate in sorted({str(k) for k in known}):
        by_lower.setdefault(candidate.lower(), candidate)
    matches = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=CUTOFF)
    return by_lower[matches[0]] if matches else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" (did you mean X?)"`` to append to an error message, or ``""`` when no known name is close."""
    match = closest(name, known)
    return f" (did you mean {match}?)" if match and match != name else ""


def unknown_name(kind: str, name: str, known: Iterable[str], listing: Iterable[str] | None = None) -> str:
    """The one-line refusal: the name, the closest known one, then the list (``listing`` when the list shown
    should differ from the names matched against, e.g. without aliases)."""
    known = list(known)
    shown = sorted(listing if listing is not None else known)
    return f"unknown {kind} {name!r}{did_you_mean(name, known)}; known: {', '.join(shown)}"
