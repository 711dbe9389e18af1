"""Write one self-contained HTML page about a run: model, plan, quality with standard errors, conversions and
their gaps, this host's profile against its bound, projections to devices, provenance (hashes, versions), and
the charts, with plotly.js inside the page so it opens offline.

    workbench report workspace --out report.html                 # the newest app run in the workspace
    workbench report workspace/app/run-20261130-210100 --out report.html --device 8gen3 --device rk3588
    workbench report out/ --out report.html                       # a folder of `quantize` / `convert` outputs

A `workbench profile DIR --json` output saved as RUN/profile.json is read too.
"""
from __future__ import annotations

from .common import count, add_json_flag, print_json
from ..errors import WorkbenchError

HELP = "write a self-contained HTML report of a run (opens offline)"


def add_arguments(p):
    p.add_argument("run", metavar="WORKSPACE_OR_RUN", help="a workspace (its newest app/run-*), an app run folder, "
                   "or a folder of `workbench quantize` / `workbench convert` outputs")
    p.add_argument("--out", required=True, help="the HTML file to write (replaced atomically)")
    p.add_argument("--device", action="append", help="project onto this device (repeat for more; default: every "
                   "profile `workbench devices` lists)")
    p.add_argument("--context", type=count(1), default=None, help="tokens in the KV cache for the projections "
                   "(default 1024)")
    p.add_argument("--pareto-device", help="the device whose projected speed the quality/size/speed chart uses "
                   "(default: the first with a known bandwidth)")
    add_json_flag(p)


def run(args) -> int:
    from ..charts.report import write_report
    if args.context is not None and args.context < 0:
        raise WorkbenchError(f"--context must be >= 0 (got {args.context})")
    report = write_report(args.run, args.out, devices=args.device, context=args.context,
                          pareto_device=args.pareto_device)
    summary = {"out": str(args.out), "run": report.record["run"], "figures": list(report.figures),
               "bytes": len(report.html.encode("utf-8"))}
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {args.out} ({summary['bytes'] / 1e6:.1f} MB, {len(report.figures)} charts) for the run in "
              f"{report.record['run']}; it opens offline in any browser")
    return 0
