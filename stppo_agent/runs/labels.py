"""Short, distinct labels for paths (result files, run folders): what tables and plot legends call them."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def distinct_labels(paths: Sequence[str | Path]) -> list[str]:
    """Short, distinct column labels for result paths: the folder's name (not ``results.json``), with as many
    parent folders as it takes to tell them apart.

    >>> distinct_labels(["runs/a/eval/results.json", "runs/b/eval/results.json", "x/c"])
    ['a/eval', 'b/eval', 'c']
    """
    parts = [Path(p).parent.parts if Path(p).name == "results.json" else Path(p).parts for p in paths]

    def label(own: tuple[str, ...]) -> str:
        for depth in range(1, len(own) + 1):
            if sum(other[-depth:] == own[-depth:] for other in parts) == 1:
                return "/".join(own[-depth:])
        return "/".join(own)

    return [label(own) for own in parts]
