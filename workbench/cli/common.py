"""Pieces every subcommand shares: the model argument, JSON or table output."""
from __future__ import annotations

import json
import sys


def add_model_argument(p, help_text: str = "a local Hugging Face model directory, or 'demo' (the bundled model)"):
    p.add_argument("model", help=help_text)


def add_json_flag(p):
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GB"
