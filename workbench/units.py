"""Sizes as the workbench prints them: one ``format_bytes`` for the CLI, the app and the report.

Decimal units (1 MB = 10^6 bytes), the units device memory, bandwidth (GB/s) and the projections are
given in, so a printed size can be set against a device's figure without converting.
"""
from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float) -> str:
    """``512 B``, ``1.50 kB``, ``12.35 MB``, ``1.234 GB`` (gigabytes from 0.1 GB, to three decimals)."""
    if abs(n) < 1e3:
        return f"{n:.0f} B"
    if abs(n) < 1e6:
        return f"{n / 1e3:.2f} kB"
    if abs(n) < 1e8:
        return f"{n / 1e6:.2f} MB"
    return f"{n / 1e9:.3f} GB"
