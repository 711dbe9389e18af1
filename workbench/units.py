"""Sizes and text tables as the workbench prints them: one ``format_bytes`` and one ``text_table`` for the CLI,
the app and the report.

Decimal units (1 MB = 10^6 bytes), the units device memory, bandwidth (GB/s) and the projections are
given in, so a printed size can be set against a device's figure without converting.

    print(text_table([("layer", "bytes"), ("lm_head", "1,024")], right={1}, rule="-"))
"""
from __future__ import annotations

from typing import Collection, Sequence

__all__ = ["format_bytes", "text_table"]


def format_bytes(n: float) -> str:
    """``512 B``, ``1.50 kB``, ``12.35 MB``, ``1.234 GB`` (gigabytes from 0.1 GB, to three decimals)."""
    if abs(n) < 1e3:
        return f"{n:.0f} B"
    if abs(n) < 1e6:
        return f"{n / 1e3:.2f} kB"
    if abs(n) < 1e8:
        return f"{n / 1e6:.2f} MB"
    return f"{n / 1e9:.3f} GB"


def text_table(rows: Sequence[Sequence], right: Collection[int] = (), gap: str = "  ", rule: str | None = None) -> str:
    """``rows`` (the first one the header) as lines whose columns line up however long a cell is: each column as
    wide as its widest cell, the columns whose index is in ``right`` right-aligned (numbers), the others left;
    ``rule``: a character repeated under the header, as wide as the table. No line ends in spaces."""
    cells = [[str(c) for c in row] for row in rows]
    if not cells:
        return ""
    n = max(len(r) for r in cells)
    cells = [r + [""] * (n - len(r)) for r in cells]
    widths = [max(len(r[i]) for r in cells) for i in range(n)]
    lines = [gap.join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in cells]
    if rule:
        lines.insert(1, rule * (sum(widths) + len(gap) * (n - 1)))
    return "\n".join(lines)
