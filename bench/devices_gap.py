"""The simulation-to-device gap for one plan: the workbench's PyTorch simulation beside CPU onnxruntime (ort-qdq's
QDQ graphs), MNN, the Hexagon HTP emulator (onnxruntime-qnn) and the RKNN simulator (rknn-toolkit2), each scored
against the float model (KL, top-1) for prefill and decode where it has them, with file size, time and peak memory.

    python bench/devices_gap.py                                    # demo model, INT8, 8 Gen 3
    python bench/devices_gap.py --bits 4 --max-tokens 4096 --html gap.html
    python bench/devices_gap.py --shape qwen2.5-0.5b --layers 2    # the 2-block Qwen2.5-0.5B shape

Each target runs in a child process of its own, so its peak resident memory is its own (RKNN: the larger of
that process and the toolkit's subprocess). A graph whose KL to the float model exceeds the simulation's by
``GAP_KL_RATIO`` (+ ``GAP_KL_FLOOR``), or whose top-1 agreement with the simulation is below ``GAP_TOP1``
(the rules ``workbench.convert`` flags conversions by), or that differs from CPU QDQ on the HTP by more than
``HTP_GAP_KL`` (``convert --target qnn --soc``'s rule), is flagged. A target whose toolchain is not installed
is a row saying what to install.
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.convert import DEFAULT_STATIC, GAP_KL_FLOOR, GAP_KL_RATIO, GAP_TOP1  # noqa: E402
from workbench.targets.qnn import HTP_GAP_KL  # noqa: E402

TARGETS = ("simulation", "ort-qdq", "mnn", "htp", "rknn")
GRAPHS = ("prefill", "decode")
HTP_WINDOWS, HTP_DECODE_WINDOWS, PROMPT = 4, 1, 64  # as bench/htp.py and convert --target qnn --soc score


# -- measuring (each in a child process) ------------------------------------------------------------------------

def _timed(fn, *args):
    """(value, seconds, peak RSS bytes of this process): run in a fresh child, so the peak is ``fn``'s own."""
    t0 = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def in_child(fn, *args):
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_timed, fn, *args).result()


def heldout_ids(lm, max_tokens: int | None):
    from workbench.assets import demo_text_path
    from workbench.textio import read_tokens
    ids, _ = read_tokens(lm.tokenizer, demo_text_path("heldout"), max_tokens=max_tokens)
    return ids


def run_simulation(model: str, bits: int, max_tokens: int | None) -> dict:
    """Quantize by the plan and score the PyTorch simulation against the float model (128-token windows)."""
    from workbench.convert import prepare_models
    from workbench.evaluate import evaluate
    prep = prepare_models(model, bits=bits)
    ids = heldout_ids(prep.float_lm, max_tokens)
    r = evaluate(prep.sim_lm.model, ids, reference=prep.float_lm.model, ctx=DEFAULT_STATIC[0], progress=False)
    return {"kl_divergence": r.kl_divergence, "top1_agreement": r.top1_agreement, "tokens": r.tokens}


def run_convert(model: str, target: str, bits: int, out: str, max_tokens: int | None) -> dict:
    from workbench.convert import convert
    return convert(model, target, out, bits=bits, max_tokens=max_tokens, static=DEFAULT_STATIC).to_dict()


def run_htp(model: str, qdq_dir: str, work: str, soc: str, n_windows: int = HTP_WINDOWS, prompt: int = PROMPT):
    """The float static graphs beside ort-qdq's QDQ graphs, compiled for ``soc`` and run on the HTP emulator."""
    import json
    from workbench.models import load_model
    from workbench.onnx.export import export_onnx
    from workbench.targets.htp import measure_htp
    q = Path(qdq_dir)
    # the shapes ort-qdq exported (its static past is shortened on a model with fewer positions)
    static = tuple(json.loads((q / "conversion.json").read_text())["details"]["qdq"]["static"])
    lm = load_model(model)
    fx = export_onnx(lm, Path(work) / "float", static=static, check=False)
    ids = heldout_ids(lm, None).tolist()
    windows = [ids[k * static[0]:(k + 1) * static[0]] for k in range(n_windows)]
    return measure_htp([fx.prefill_path, fx.decode_path], [q / "prefill.qdq.onnx", q / "decode.qdq.onnx"], windows,
                       device=soc, out_dir=Path(work) / "ctx", decode_windows=HTP_DECODE_WINDOWS, prompt=prompt,
                       isolated=False)


def run_rknn(model: str, bits: int, out: str):
    from workbench.targets.rknn import measure_rknn
    return measure_rknn(model, bits=bits, out_dir=out)


def missing_toolchain(target: str) -> str | None:
    """What to install for ``target``, or None when its toolchain is here."""
    if target == "htp":
        from workbench.targets.htp import INSTALL, qnn_available
        return None if qnn_available() else f"onnxruntime-qnn is not installed: {INSTALL}"
    if target == "rknn":
        from workbench.targets.rknn import RKNN_ENV_HINT, rknn_python
        return None if rknn_python() else f"rknn-toolkit2 is not installed: {RKNN_ENV_HINT}"
    if target == "mnn":
        try:
            import MNN  # noqa: F401
        except ImportError:
            return "MNN is not installed: pip install -c constraints.txt MNN"
    return None


# -- the table (pure: measurements in, rows out) ----------------------------------------------------------------

def graph_scores(kl=None, top1=None, top1_vs_sim=None, sim_kl=None, kl_vs_qdq=None, positions=None) -> dict | None:
    if kl is None:
        return None
    return {"kl": kl, "top1": top1, "top1_vs_sim": top1_vs_sim, "sim_kl": sim_kl, "kl_vs_qdq": kl_vs_qdq,
            "positions": positions}


def gap_of(g: dict | None) -> str | None:
    """Why one graph's scores are a gap from the simulation (convert's rules; HTP's against CPU QDQ), or None."""
    if not g:
        return None
    if g.get("sim_kl") is not None and g["kl"] > GAP_KL_RATIO * g["sim_kl"] + GAP_KL_FLOOR:
        return f"KL {g['kl']:.2e} > {GAP_KL_RATIO:g} x simulation {g['sim_kl']:.2e} + {GAP_KL_FLOOR:g}"
    if g.get("top1_vs_sim") is not None and g["top1_vs_sim"] < GAP_TOP1:
        return f"top-1 vs simulation {g['top1_vs_sim']:.3f} < {GAP_TOP1:g}"
    if g.get("kl_vs_qdq") is not None and g["kl_vs_qdq"] > HTP_GAP_KL:
        return f"KL vs CPU QDQ {g['kl_vs_qdq']:.3g} > {HTP_GAP_KL:g}"
    return None


def make_row(target: str, runtime: str, *, prefill=None, decode=None, bytes_=None, seconds=None, peak=None,
             note: str = "") -> dict:
    flags = [f"{name}: {why}" for name, g in (("prefill", prefill), ("decode", decode)) if (why := gap_of(g))]
    return {"target": target, "runtime": runtime, "prefill": prefill, "decode": decode, "bytes": bytes_,
            "seconds": seconds, "peak_bytes": peak, "gap": "; ".join(flags) or None, "note": note}


def simulation_row(sim: dict, seconds: float, peak: int) -> dict:
    return make_row("simulation", "PyTorch, the quantized model", seconds=seconds, peak=peak,
                    prefill=graph_scores(sim["kl_divergence"], sim["top1_agreement"], positions=sim["tokens"]),
                    note="decode with the KV cache computes what prefill does")


def convert_row(target: str, runtime: str, rep: dict, seconds: float, peak: int) -> dict:
    """A ``ConversionReport.to_dict()``: prefill on the text, decode teacher-forced where the target has it."""
    sim_kl = rep["simulation"].get("kl_divergence")
    pre = graph_scores(rep["kl_divergence"], rep["top1_agreement"], rep["top1_agreement_vs_simulation"], sim_kl,
                       positions=rep["eval_tokens"])
    d = rep.get("decode") or {}
    dec = graph_scores(d.get("kl_divergence"), d.get("top1_agreement"), d.get("top1_agreement_vs_simulation"),
                       sim_kl, positions=d.get("tokens"))
    graph_bytes = sum(f["bytes"] for f in rep["files"] if Path(f["path"]).suffix != ".json")
    return make_row(target, runtime, prefill=pre, decode=dec, bytes_=graph_bytes, seconds=seconds, peak=peak,
                    note="" if dec else "no decode graph scored")


def htp_row(m, sim_kl: float | None, seconds: float, peak: int) -> dict:
    """An ``HtpMeasurement``; its KL is judged against the simulation's and against CPU QDQ on the same windows."""
    gs = {g: graph_scores(getattr(m, g)["kl_vs_float"], getattr(m, g)["top1_vs_float"], sim_kl=sim_kl,
                          kl_vs_qdq=getattr(m, g)["kl_vs_simulation"], positions=getattr(m, g)["tokens"])
          for g in GRAPHS}
    return make_row("htp", f"onnxruntime-qnn HTP emulator, {m.device} (soc {m.soc_model}, v{m.arch})", **gs,
                    bytes_=m.context_bytes, seconds=seconds, peak=max(peak, m.peak_rss_bytes),
                    note=f"compile {m.compile_seconds:.0f} s; KL vs CPU QDQ prefill {m.prefill['kl_vs_simulation']:.1e}"
                         f", decode {m.decode['kl_vs_simulation']:.1e}")


def rknn_row(m, seconds: float, peak: int) -> dict:
    """An ``RknnMeasurement``: scores against the float model and the simulation on the same positions."""
    gs = {g: graph_scores(s.kl_divergence, s.top1_agreement, s.top1_agreement_vs_simulation,
                          s.simulation_kl_divergence, positions=s.positions)
          for g, s in (("prefill", m.prefill), ("decode", m.decode))}
    return make_row("rknn", f"rknn-toolkit2 simulator, rk3588 {m.dtype}", **gs, bytes_=m.rknn_bytes, seconds=seconds,
                    peak=max(peak, m.peak_rss_bytes), note=f"toolkit subprocess peak {m.peak_rss_bytes / 2**30:.2f} GiB")


def absent_row(target: str, why: str) -> dict:
    return make_row(target, "not run", note=why)


def _cell(g: dict | None, key: str, fmt: str) -> str:
    return "-" if not g or g.get(key) is None else format(g[key], fmt)


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (KL and top-1 against the float model; vs sim: top-1 against the simulation)."""
    head = ("| target | runtime | prefill KL | prefill top-1 | decode KL | decode top-1 | top-1 vs sim (pre / dec) "
            "| positions (pre / dec) | MB | s | peak GiB | gap |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p, d = r["prefill"], r["decode"]
        vs = f"{_cell(p, 'top1_vs_sim', '.4f')} / {_cell(d, 'top1_vs_sim', '.4f')}"
        at = f"{_cell(p, 'positions', ',')} / {_cell(d, 'positions', ',')}"
        mb = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.1f}"
        s = "-" if r["seconds"] is None else f"{r['seconds']:.0f}"
        gib = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
        gap = f"**GAP** {r['gap']}" if r["gap"] else ""
        runtime = r["runtime"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"| {r['target']} | {runtime} | {_cell(p, 'kl', '.2e')} | {_cell(p, 'top1', '.4f')} | "
                     f"{_cell(d, 'kl', '.2e')} | {_cell(d, 'top1', '.4f')} | {vs} | {at} | {mb} | {s} | {gib} | {gap} |")
    return "\n".join(lines)


# -- the run -----------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--shape", help="a bench/shapes.py shape instead of --model (e.g. qwen2.5-0.5b)")
    ap.add_argument("--layers", type=int, default=2, help="blocks of --shape (default 2)")
    ap.add_argument("--bits", type=int, default=8, choices=(4, 8), help="the uniform plan (default 8: INT8)")
    ap.add_argument("--soc", default="8gen3", help="Snapdragon device profile for the HTP (default 8gen3)")
    ap.add_argument("--max-tokens", type=int, help="score the simulation, ort-qdq and MNN on the first N held-out "
                                                   "tokens (default: all)")
    ap.add_argument("--windows", type=int, default=HTP_WINDOWS, help=f"128-token windows the HTP scores (default "
                                                                    f"{HTP_WINDOWS}; the first also decoded)")
    ap.add_argument("--prompt", type=int, default=PROMPT, help=f"HTP decode after this many tokens (default {PROMPT})")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--html", help="also write the chart (plotly) here")
    ap.add_argument("--work", help="folder for what the targets write (default: a temporary one)")
    args = ap.parse_args()
    targets = args.targets.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-devices-gap-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.shape:
        from shapes import build_shape
        model = str(build_shape(args.shape, work / f"{args.shape}-{args.layers}", layers=args.layers))
    rows, sim_kl = [], None
    runtimes = {"ort-qdq": "onnxruntime CPU, QDQ (A16)", "mnn": "MNN CPU"}
    for target in targets:
        why = missing_toolchain(target)
        if why:
            rows.append(absent_row(target, why))
            print(f"{target}: {why}", flush=True)
            continue
        print(f"{target}: running ...", flush=True)
        try:
            if target == "simulation":
                sim, s, peak = in_child(run_simulation, model, args.bits, args.max_tokens)
                sim_kl = sim["kl_divergence"]
                rows.append(simulation_row(sim, s, peak))
            elif target in runtimes:
                rep, s, peak = in_child(run_convert, model, target, args.bits, str(work / target), args.max_tokens)
                rows.append(convert_row(target, runtimes[target], rep, s, peak))
            elif target == "htp":
                if not (work / "ort-qdq" / "conversion.json").is_file():
                    rows.append(absent_row(target, "needs ort-qdq's QDQ graphs: keep ort-qdq in --targets"))
                    continue
                m, s, peak = in_child(run_htp, model, str(work / "ort-qdq"), str(work / "htp"), args.soc,
                                      args.windows, args.prompt)
                rows.append(htp_row(m, sim_kl, s, peak))
            else:
                m, s, peak = in_child(run_rknn, model, args.bits, str(work / "rknn"))
                rows.append(rknn_row(m, s, peak))
        except Exception as e:  # a toolchain that fails is a row saying how, not a crash of the whole table
            rows.append(absent_row(target, f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        print(f"{target}: done", flush=True)
    name = f"{args.shape} ({args.layers} blocks)" if args.shape else model
    print(f"\n{name}, INT{args.bits} plan; KL / top-1 against the float model\n")
    print(format_table(rows))
    if args.html:
        from workbench.charts.graph import make_device_gap_figure
        make_device_gap_figure(rows).write_html(args.html, include_plotlyjs=True)
        print(f"\nchart: {args.html}")
    print(f"files under {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
