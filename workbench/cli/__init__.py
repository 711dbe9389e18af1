"""The ``workbench`` command: the library's steps for headless runs.

    workbench info demo
    workbench eval demo --ref demo --json

Each subcommand lives in its own module of this package with ``add_arguments(parser)`` and
``run(args) -> int``; add a module name to ``COMMANDS`` to expose a new one. Errors from bad
input exit with status 2 and one line on stderr, never a traceback; an unexpected exception (a
bug) also exits 2 with one line, which names the log file under ``<workspace>/logs`` that holds
its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from pathlib import Path

from ..errors import WorkbenchError, printable, storage_failure, storage_message
from ..files.workspace import output_lock

__all__ = ["main", "COMMANDS"]

# subcommand name -> module in this package
COMMANDS = {
    "info": "info",
    "eval": "eval_cmd",
    "finetune": "finetune",
    "prune": "prune_cmd",
    "distill": "distill_cmd",
    "calibrate": "calibrate",
    "quantize": "quantize",
    "sensitivity": "sensitivity",
    "plan": "plan_cmd",
    "overrides": "overrides_cmd",
    "export": "export",
    "inspect": "inspect_cmd",
    "convert": "convert",
    "profile": "profile_cmd",
    "generate": "generate_cmd",
    "project": "project_cmd",
    "devices": "devices_cmd",
    "report": "report_cmd",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are one line (``workbench <cmd>: error: ...``) and a one-line hint, not a usage block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a value starting with '-' and a digit (``--static -1,5``, ``--ram-gb -1e3``) is a value, refused by its
        # option's own check, not taken for an unknown flag ("expected one argument"); argparse matches only -N, -N.N
        self._negative_number_matcher = re.compile(r"^-\.?\d[\d.,eE+-]*$")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see `{self.prog} --help` for the options\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="workbench", description="Quantize small LLMs for edge NPUs and "
                           "measure what each choice costs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"{__name__}.{module}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.__doc__)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    notes = _print_notes(args.command)
    try:
        with _one_writer(args):
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # noqa: BLE001 - every failure leaves as one line; SystemExit passes through
        if isinstance(e, SystemExit):
            raise
        print(f"workbench {args.command}: {error_line(e, args, argv)}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("workbench").removeHandler(notes)


def _one_writer(args):
    """Hold ``--out``'s lock for the whole command: a second run into the same output is refused before any work."""
    import contextlib
    out = getattr(args, "out", None)
    if not isinstance(out, str) or not out:
        return contextlib.nullcontext()
    return output_lock(out)


def _print_notes(command: str) -> logging.Handler:
    """Show the library's notes (logger ``workbench``, e.g. model code that is not run) as one stderr line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"workbench {command}: note: %(message)s"))
    logger = logging.getLogger("workbench")
    logger.addHandler(handler)
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return handler


def error_line(e: BaseException, args=None, argv: list[str] = ()) -> str:
    """The one line shown for a failure: the message of an input error, else where a bug's traceback went.

    WorkbenchError is bad input with a message saying what to do; ValueError and OSError come from
    input checks and the file system (a missing file, a full disk) and read the same way. Anything
    else is a bug in the workbench: its traceback goes to a log file, not the screen.
    """
    full = storage_failure(e)
    if full is not None:  # a full disk or a file-size limit, whichever writer (safetensors, torch, numpy) said it
        out = getattr(args, "out", None)
        where = f"'{full[1]}'" if full[1] else f"into '{out}'" if out else "the output"
        return "error: " + printable(storage_message(full[0], where, "give --out on another disk" if out else None))
    if isinstance(e, (WorkbenchError, ValueError, OSError)):
        return "error: " + printable("; ".join(line.strip() for line in str(e).splitlines() if line.strip()))
    if isinstance(e, MemoryError):
        return "error: out of memory; close other programs, or use a smaller model, --max-tokens or --samples"
    log = write_bug_log(e, args, argv)
    return (f"internal error ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}); this is a "
            f"bug in the workbench: please report it with the traceback in {log}")


def write_bug_log(e: BaseException, args=None, argv: list[str] = ()) -> Path:
    """Keep the traceback and the command line under ``<workspace>/logs`` (the temp directory if unwritable)."""
    import shlex
    import tempfile
    import time
    import traceback

    from ..files.workspace import DEFAULT_WORKSPACE
    text = (f"workbench {shlex.join(argv)}\n"
            + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    name = f"error-{time.strftime('%Y%m%d-%H%M%S')}-{getattr(args, 'command', 'workbench')}.log"
    root = getattr(args, "workspace", None) or DEFAULT_WORKSPACE
    for folder in (Path(root) / "logs", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            path.write_text(text, encoding="utf-8")
            return path.resolve()
        except OSError:
            continue
    return Path("(no writable log directory)")


if __name__ == "__main__":
    sys.exit(main())
