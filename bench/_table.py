"""The result table every benchmark prints: scenario left, figures right-aligned."""

from __future__ import annotations

from collections.abc import Sequence


def render(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first and last column left-aligned."""
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    last = len(header) - 1

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if 0 < i < last else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(row) for row in lines)])
