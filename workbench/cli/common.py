"""Pieces every subcommand shares: the model argument, JSON or table output."""
from __future__ import annotations

import argparse
import json
import sys
from ..model.sweep_backends import backend_for
from ..quantize.plan import DEFAULT_SCALE_SEARCH


def add_model_argument(p, help_text: str = "a local Hugging Face model directory, or 'demo' (the bundled model; "
                                           "'demo-vl' the bundled vision-language model)"):
    p.add_argument("model", help=help_text)


def add_json_flag(p):
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def plus_minus(value: float, err: float | None, spec: str) -> str:
    """``value ± err``; the value alone where there is no spread to give (None, or NaN from a single window)."""
    if err is None or err != err:
        return format(value, spec)
    return f"{format(value, spec)} ± {format(err, spec.lstrip('+'))}"


def _converted(value: str, kind, what: str):
    """``kind(value)``, or the argparse refusal that says it must be ``what``."""
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, not {value!r}") from None


def count(minimum: int = 1, zero: str | None = None):
    """An argparse type: a whole number of at least ``minimum`` (or 0, meaning ``zero``, where given), refused
    before any work with what it must be."""
    def parse(value: str) -> int:
        n = _converted(value, int, "a whole number")
        if n < minimum and not (zero and n == 0):
            raise argparse.ArgumentTypeError(f"must be at least {minimum}" + (f" (or 0: {zero})" if zero else "")
                                             + f", got {n}")
        return n
    parse.__name__ = f"whole number >= {minimum}"
    return parse


def thread_count():
    """An argparse type for ``--threads``: 1 up to this machine's CPU cores. More only oversubscribes the cores, and
    runtimes asked for tens of thousands hang or crash creating them."""
    import os
    cores, whole = os.cpu_count() or 1, count(1)

    def parse(value: str) -> int:
        n = whole(value)
        if n > cores:
            raise argparse.ArgumentTypeError(f"must be at most {cores} (this machine's CPU cores), got {n}")
        return n
    parse.__name__ = f"whole number from 1 to {cores}"
    return parse


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite number in the given range (an open end excludes its bound), refused before any
    work with the range it must lie in."""
    import math

    def parse(value: str) -> float:
        x = _converted(value, float, "a number")
        too_low = low is not None and (x <= low if low_open else x < low)
        too_high = high is not None and (x >= high if high_open else x > high)
        if not math.isfinite(x) or too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {parse.__name__}, got {value}")
        return x
    ends = [f"{'>' if low_open else '>='} {low:g}" if low is not None else None,
            f"{'<' if high_open else '<='} {high:g}" if high is not None else None]
    parse.__name__ = "a finite number" + (" " + " and ".join(e for e in ends if e) if any(ends) else "")
    parse.bounds = (low, high, low_open, high_open)
    return parse


def add_budget_argument(p):
    """``--max-tokens``: how much of the evaluation text to score (default: sized to the model)."""
    p.add_argument("--max-tokens", type=_budget, default="auto",
                   help="evaluate on the first N tokens of the text; 'all' for the whole text; default 'auto': the "
                        "whole text for small models, about a minute of a 2-core CPU for large ones "
                        "(2,048 tokens at 0.5 B parameters); the standard errors shown say what it buys")


def _budget(value: str):
    if value in ("auto", "all"):
        return None if value == "all" else "auto"
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, 'auto' or 'all', not {value!r}") from None
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {n}")
    return n


def add_scale_search_argument(p, default: bool | None = None, says: str | None = None):
    """``--scale-search`` / ``--no-scale-search``; ``default`` None: the plan's value (``says`` tells which)."""
    if default is None and says is None:
        default = DEFAULT_SCALE_SEARCH
    p.add_argument("--scale-search", action=argparse.BooleanOptionalAction, default=default,
                   help="each group's range shrunk to the ratio (1.0 down to 0.5) with the least squared error instead "
                        "of min/max (RTN, GPTQ, and AWQ's unclipped q/k layers; AWQ's clips set the others); default: "
                        + (says or ("on" if default else "off")))


def add_device_argument(p):
    """``--device``: where the model runs (CPU by default; ``cuda`` when a GPU is present)."""
    p.add_argument("--device", type=_device, default="cpu",
                   help="run the model on this device: cpu (default), cuda or cuda:N (needs a CUDA build of torch "
                        "and a GPU)")


def _device(value: str) -> str:
    import torch
    if value == "cpu":
        return value
    if not value.startswith("cuda"):
        raise argparse.ArgumentTypeError(f"unknown device {value!r}: use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{value} was asked for but this torch ({torch.__version__}) sees no CUDA "
                                         "GPU; leave --device out to run on the CPU")
    return value


def add_backend_arguments(p, what: str, default: str = "1: this process") -> None:
    """``--workers`` and ``--ray``: where a sweep's independent tasks run (``workbench.model.sweep_backends``)."""
    p.add_argument("--workers", type=count(1),
                   help=f"processes {what} run on: on this machine without --ray (default {default}; forked "
                        "workers share the loaded model, no copy), Ray workers with it (default: one per CPU of "
                        "the cluster)")
    p.add_argument("--ray", metavar="auto|ADDRESS",
                   help=f"run {what} on Ray: auto starts one on 127.0.0.1 for this run, ADDRESS joins a running "
                        "cluster (docs/sweeps.md); needs `pip install ray==2.60.0`")


def backend_from_args(args, default_workers: int = 1):
    """The backend ``--ray`` and ``--workers`` name; ``default_workers`` local processes when neither is given."""
    ray = getattr(args, "ray", None)
    workers = getattr(args, "workers", None)
    return backend_for(ray, workers=workers if workers or ray else default_workers)
