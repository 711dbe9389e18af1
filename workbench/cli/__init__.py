"""The ``workbench`` command: the library's steps for headless runs.

    workbench info demo
    workbench eval demo --ref demo --json

Each subcommand lives in its own module of this package with ``add_arguments(parser)`` and
``run(args) -> int``; add a module name to ``COMMANDS`` to expose a new one. Errors from bad
input exit with status 2 and one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import WorkbenchError

__all__ = ["main", "COMMANDS"]

# subcommand name -> module in this package
COMMANDS = {
    "info": "info",
    "eval": "eval_cmd",
    "finetune": "finetune",
    "calibrate": "calibrate",
    "quantize": "quantize",
    "sensitivity": "sensitivity",
    "plan": "plan_cmd",
    "overrides": "overrides_cmd",
    "export": "export",
    "inspect": "inspect_cmd",
    "convert": "convert",
    "profile": "profile_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="Quantize small LLMs for edge NPUs and "
                                     "measure what each choice costs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"{__name__}.{module}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.__doc__)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except WorkbenchError as e:
        print(f"workbench {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"workbench {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
