"""Plain-text tables of the evaluation's printouts (`stppo eval`, `stppo compare`, the demo's before/after)."""

from __future__ import annotations

from typing import Sequence


def fixed_width_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header``, a rule, then ``rows``: columns two spaces apart, each as wide as its widest cell."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
