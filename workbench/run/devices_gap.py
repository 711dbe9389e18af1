"""The simulation-to-device gap for one plan: the workbench's PyTorch simulation beside what each runtime or NPU
toolchain installed here computes for it, all scored against the float model.

    gap = measure_devices_gap("demo", bits=8, targets=("simulation", "ort-qdq", "htp"), max_tokens=512,
                              soc="8gen3", work="out/devices-gap")
    print(format_table(gap.rows))          # KL / top-1 prefill and decode, size, time, peak, flags
    read_devices_gap("out/devices-gap/devices_gap.json")

Targets (``TARGETS``): ``simulation`` (the quantized model in PyTorch), ``ort-qdq`` (onnxruntime's CPU on the
QDQ graphs, prefill and teacher-forced decode), ``mnn``, ``mnn-llm`` (MNN's LLM engine on its own model directory),
``executorch`` (ExecuTorch's runtime on an XNNPACK ``.pte`` holding the plan's codes), ``htp`` (the Hexagon HTP
emulator of onnxruntime-qnn running ort-qdq's QDQ graphs compiled for a Snapdragon) and ``rknn`` (the RK3588
simulator of rknn-toolkit2). A runtime that times itself (MNN-LLM's own prefill / decode counters, ExecuTorch's
``Method.execute`` calls) has its prefill and decode tok/s in its row (``speed``) beside its KL, top-1 and size.
Each runs in a child process of its own, so its time and peak resident memory are its own (RKNN: the larger of
that process and the toolkit's subprocess). A graph whose KL to the float model exceeds the simulation's by
``GAP_KL_RATIO`` (+ ``GAP_KL_FLOOR``), or whose top-1 agreement with the simulation is below ``GAP_TOP1`` (the
rules ``workbench.targets.convert`` flags conversions by), or that differs from CPU QDQ on the HTP by more than
``HTP_GAP_KL`` (``convert --target qnn --soc``'s rule), is flagged. A target whose toolchain is not installed,
or that fails, is a row saying what to install or how it failed; the other rows are unaffected. A flagged CPU QDQ
graph is compared with the simulation block by block (``workbench.run.layerwise``: the residual stream after every
attention and MLP), and its row says where it departs (``cause``), or that no single layer does.

The result is written atomically as ``devices_gap.json`` (``GAP_FILE``) in the work folder after every target,
beside the conversions it made; ``workbench report`` shows the table of every such file in a run.
bench/devices_gap.py, the app's Export tab and the report all go through this module.
"""
from __future__ import annotations

import json
import re
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Sequence

from ..targets.convert import DEFAULT_STATIC, GAP_KL_FLOOR, GAP_KL_RATIO, GAP_TOP1, convert, prepare_models
from ..errors import PlanError, WorkbenchError
from ..model.load import is_quantized_dir, quantized_source, load_model
from ..quantize.plan import QuantPlan
from ..model.sweep_backends import LocalBackend
from ..targets.qnn import HTP_GAP_KL
from ..files.workspace import atomic_write_json, read_json_file
from ..assets import demo_text_path
from ..evaluation.evaluate import evaluate
from ..evaluation.textio import read_tokens
from ..targets.executorch import INSTALL as ET_INSTALL
from ..targets.htp import float_layers_refused, htp_soc, HtpRefused, INSTALL, measure_htp, qnn_available
from ..targets.rknn import measure_rknn
from .layerwise import compare_blocks

__all__ = ["TARGETS", "GRAPHS", "GAP_FILE", "HTP_WINDOWS", "HTP_DECODE_WINDOWS", "PROMPT", "TARGET_TITLES",
           "DevicesGap", "missing_toolchain", "toolchains", "measure_devices_gap", "read_devices_gap",
           "graph_scores", "gap_of", "gap_label", "gap_advice", "GapAdvice", "runtime_speed", "make_row", "simulation_row", "convert_row", "htp_row", "rknn_row",
           "absent_row",
           "format_table", "TABLE_HEADER", "GAP_RULE", "table_cells", "in_child"]

TARGETS = ("simulation", "ort-qdq", "mnn", "mnn-llm", "executorch", "htp", "rknn")
TARGET_TITLES = {"simulation": "simulation (PyTorch)", "ort-qdq": "CPU onnxruntime (QDQ)", "mnn": "MNN (CPU)",
                 "mnn-llm": "MNN's LLM engine (CPU)", "executorch": "ExecuTorch (XNNPACK, CPU)",
                 "htp": "Hexagon HTP emulator", "rknn": "RK3588 simulator"}
GRAPHS = ("prefill", "decode")
GAP_FILE = "devices_gap.json"
HTP_WINDOWS, HTP_DECODE_WINDOWS, PROMPT = 4, 1, 64  # as bench/htp.py and convert --target qnn --soc score
CONVERT_RUNTIMES = {"ort-qdq": "onnxruntime CPU, QDQ (A16)", "mnn": "MNN CPU", "mnn-llm": "MNN-LLM engine, CPU",
                    "executorch": "ExecuTorch runtime, XNNPACK CPU"}


# -- measuring (each in a child process) ------------------------------------------------------------------------

def _timed(fn, *args):
    """(value, seconds, peak RSS bytes of this process): run in a fresh child, so the peak is ``fn``'s own."""
    t0 = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def in_child(fn, *args):
    """``fn(*args)`` in a fresh (spawned) process: (value, seconds, that process's peak RSS bytes)."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_timed, fn, *args).result()


def _plan_of(plan: dict | None) -> QuantPlan | None:
    return None if plan is None else QuantPlan.from_dict(plan)


def _heldout_ids(lm, max_tokens: int | None):
    ids, _ = read_tokens(lm.tokenizer, demo_text_path("heldout"), max_tokens=max_tokens)
    return ids


def _run_simulation(model: str, plan: dict | None, bits: int | None, max_tokens: int | None) -> dict:
    """Quantize by the plan and score the PyTorch simulation against the float model (128-token windows)."""
    prep = prepare_models(model, plan=_plan_of(plan), bits=bits)
    ids = _heldout_ids(prep.float_lm, max_tokens)
    r = evaluate(prep.sim_lm.model, ids, reference=prep.float_lm.model, ctx=DEFAULT_STATIC[0], progress=False)
    return {"kl_divergence": r.kl_divergence, "top1_agreement": r.top1_agreement, "tokens": r.tokens}


def _run_convert(model: str, target: str, plan: dict | None, bits: int | None, out: str,
                 max_tokens: int | None) -> dict:
    return convert(model, target, out, plan=_plan_of(plan), bits=bits, max_tokens=max_tokens).to_dict()


def _float_model(model: str) -> str:
    """The float model behind ``model`` (itself, or the one a quantized directory was made from)."""
    if is_quantized_dir(model):
        source = quantized_source(Path(model))
        if not source or not Path(source).exists():
            raise WorkbenchError(f"the float model that '{model}' was quantized from ({source}) is not there; the "
                                 "HTP comparison needs it")
        return source
    return model


def _run_htp(model: str, qdq_dir: str, work: str, soc: str, n_windows: int = HTP_WINDOWS, prompt: int = PROMPT,
             plan: dict | None = None):
    """The float static graphs beside ort-qdq's QDQ graphs, compiled for ``soc`` and run on the HTP emulator; a
    plan keeping layers in float (16-bit QDQ weights) that the SoC's HTP generation refuses, before compiling."""
    from ..onnx.export import export_onnx
    lm = load_model(_float_model(model))
    if plan is not None:
        refused = float_layers_refused(QuantPlan.from_dict(plan).resolve(i.name for i in lm.layers), htp_soc(soc))
        if refused:
            raise HtpRefused(f"{htp_soc(soc).label} runs no 16-bit weights, and the plan keeps {', '.join(refused)} in "
                             f"float (16-bit weights in CPU QDQ's graphs): make the plan for it (`workbench plan ... "
                             f"--target qnn --soc {soc}`) or give those layers int8")
    q = Path(qdq_dir)
    # the shapes ort-qdq exported (its static past is shortened on a model with fewer positions)
    static = tuple(json.loads((q / "conversion.json").read_text())["details"]["qdq"]["static"])
    fx = export_onnx(lm, Path(work) / "float", static=static, check=False)
    ids = _heldout_ids(lm, None).tolist()
    windows = [ids[k * static[0]:(k + 1) * static[0]] for k in range(n_windows)]
    return measure_htp([fx.prefill_path, fx.decode_path], [q / "prefill.qdq.onnx", q / "decode.qdq.onnx"], windows,
                       device=soc, out_dir=Path(work) / "ctx", decode_windows=HTP_DECODE_WINDOWS, prompt=prompt,
                       isolated=False)


def _run_layerwise(model: str, plan: dict | None, bits: int | None, qdq_dir: str, work: str) -> dict:
    """Where CPU QDQ's prefill graph leaves the simulation, block by block (``workbench.run.layerwise``), on the first
    window of the held-out text."""
    from ..onnx.export import export_onnx
    q = Path(qdq_dir)
    static = tuple(json.loads((q / "conversion.json").read_text())["details"]["qdq"]["static"])
    prep = prepare_models(model, plan=_plan_of(plan), bits=bits)
    fx = export_onnx(prep.float_lm, Path(work) / "float", static=static, check=False)
    window = _heldout_ids(prep.float_lm, None).tolist()[:static[0]]
    return compare_blocks(fx.prefill_path, q / "prefill.qdq.onnx", prep.float_lm.model, prep.sim_lm.model, window,
                          what="CPU QDQ").to_dict()


def _run_rknn(model: str, plan: dict | None, bits: int | None, out: str):
    return measure_rknn(model, bits=bits, plan=_plan_of(plan), out_dir=out)


def missing_toolchain(target: str) -> str | None:
    """What to install for ``target``, or None when its toolchain is here."""
    if target == "htp":
        return None if qnn_available() else f"onnxruntime-qnn is not installed: {INSTALL}"
    if target == "rknn":
        from ..targets.rknn import RKNN_ENV_HINT, RknnError, rknn_python
        try:
            return None if rknn_python() else f"rknn-toolkit2 is not installed: {RKNN_ENV_HINT}"
        except RknnError as e:  # $WORKBENCH_RKNN_PYTHON naming no python: what to fix, not what to install
            return str(e)
    if target in ("mnn", "mnn-llm"):
        import importlib.util
        if importlib.util.find_spec("MNN") is None:
            return "MNN is not installed: pip install -c constraints.txt MNN"
    if target == "executorch":
        import importlib.util
        if importlib.util.find_spec("executorch") is None or importlib.util.find_spec("torchao") is None:
            return f"ExecuTorch is not installed: {ET_INSTALL}"
    return None


def toolchains() -> dict[str, str | None]:
    """``{target: None when installed, else what to install}`` for every target."""
    return {t: missing_toolchain(t) for t in TARGETS}


# -- the table (pure: measurements in, rows out) ----------------------------------------------------------------

def graph_scores(kl=None, top1=None, top1_vs_sim=None, sim_kl=None, kl_vs_qdq=None, positions=None) -> dict | None:
    if kl is None:
        return None
    return {"kl": kl, "top1": top1, "top1_vs_sim": top1_vs_sim, "sim_kl": sim_kl, "kl_vs_qdq": kl_vs_qdq,
            "positions": positions}


def _judged(g: dict | None) -> tuple[str, str] | None:
    """The rule a graph fails (convert's rules; HTP's against CPU QDQ) as (reason, bar label), or None."""
    if not g:
        return None
    if g.get("sim_kl") is not None and g["kl"] > GAP_KL_RATIO * g["sim_kl"] + GAP_KL_FLOOR:
        return (f"KL {g['kl']:.2e} > {GAP_KL_RATIO:g} x simulation {g['sim_kl']:.2e} + {GAP_KL_FLOOR:g}",
                f"KL {g['kl']:.1e} > {GAP_KL_RATIO:g}x sim's {g['sim_kl']:.1e} + {GAP_KL_FLOOR:g}")
    if g.get("top1_vs_sim") is not None and g["top1_vs_sim"] < GAP_TOP1:
        return (f"top-1 vs simulation {g['top1_vs_sim']:.3f} < {GAP_TOP1:g}",
                f"top-1 vs sim {g['top1_vs_sim']:.3f} < {GAP_TOP1:g}")
    if g.get("kl_vs_qdq") is not None and g["kl_vs_qdq"] > HTP_GAP_KL:
        reason = f"KL vs CPU QDQ {g['kl_vs_qdq']:.3g} > {HTP_GAP_KL:g}"
        return reason, reason
    return None


def gap_of(g: dict | None) -> str | None:
    """Why one graph's scores are a gap from the simulation, or None."""
    judged = _judged(g)
    return judged[0] if judged else None


def gap_label(g: dict | None) -> str | None:
    """The quantity ``gap_of`` judged a graph by, short enough for a bar's label ("GAP: top-1 vs sim 0.948 <
    0.95"), or None when the graph is not a gap: a label must show what its rule compares, not a neighbouring
    figure (top-1 against the float model passing 0.95 while top-1 against the simulation fails)."""
    judged = _judged(g)
    return f"GAP: {judged[1]}" if judged else None
    if g.get("sim_kl") is not None and g["kl"] > GAP_KL_RATIO * g["sim_kl"] + GAP_KL_FLOOR:
        return f"GAP: KL {g['kl']:.1e} > {GAP_KL_RATIO:g}x sim's {g['sim_kl']:.1e} + {GAP_KL_FLOOR:g}"
    if g.get("top1_vs_sim") is not None and g["top1_vs_sim"] < GAP_TOP1:
        return f"GAP: top-1 vs sim {g['top1_vs_sim']:.3f} < {GAP_TOP1:g}"
    if g.get("kl_vs_qdq") is not None and g["kl_vs_qdq"] > HTP_GAP_KL:
        return f"GAP: KL vs CPU QDQ {g['kl_vs_qdq']:.3g} > {HTP_GAP_KL:g}"
    return None


WIDER = {"int2": "int4", "int3": "int4", "int4": "int8", "int8": "fp16"}  # one step wider, for a layer a gap names
_BLOCK_PARTS = {"attention": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                "mlp": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


@dataclass
class GapAdvice:
    """What to try for a flagged row: one sentence, and where it can be done by a button, the layers to set and
    the precision to set them to (``apply`` makes that plan)."""

    text: str
    layers: list[str] = field(default_factory=list)
    precision: str | None = None

    def apply(self, plan: QuantPlan) -> QuantPlan:
        for name in self.layers:
            plan = plan.with_override(name, self.precision)
        return plan


def gap_advice(row: dict, plan: QuantPlan | None, layer_names: Sequence[str] = ()) -> GapAdvice | None:
    """The next step for a flagged row (None when it is not flagged): the layers its layer-wise cause names one
    precision wider (a button can set them), the output layer where the departure is after the blocks, or the
    setting to change where no single layer is the cause or no layer-wise comparison ran."""
    if not row.get("gap"):
        return None
    lw = row.get("layerwise") or {}
    names = list(layer_names)

    def widen(layers: list[str], where: str) -> GapAdvice:
        layers = [n for n in layers if not names or n in names]
        now = {plan.precision_name_for(n) if plan else None for n in layers}
        current = next(iter(now)) if len(now) == 1 else None
        to = WIDER.get(current or "", "int8" if current is None else "fp16")
        if row["target"] == "rknn":
            to = "fp16"  # the RK3588 keeps a plan's float layers float16 (hybrid quantization); its integers are int8
        return GapAdvice(f"try {where} ({', '.join(n.rsplit('.', 1)[-1] for n in layers) or 'its layers'}) at {to}"
                         f"{f' instead of {current}' if current else ''}, then compare again", layers, to)

    cause = row.get("cause") or ""
    at = re.search(r"at block (\d+)'s (attention|mlp)", cause)
    if at or lw.get("first_block") is not None:
        block, part = (int(at[1]), at[2]) if at else (lw["first_block"], "attention")
        module, projs = _BLOCK_PARTS[part]
        return widen([f"model.layers.{block}.{module}.{p}" for p in projs], f"block {block}'s {part}")
    if "lm_head" in cause:
        return widen(["lm_head"], "the output layer")
    if cause.startswith("no single layer"):
        return GapAdvice("no single layer is the cause: every layer rounds slightly differently from the simulation; "
                         "try a smaller group size (64 or 32) or the scale search in Precisions, then compare again")
    if row["target"] == "htp":
        return GapAdvice("the HTP departs from CPU QDQ on the same graphs: its own kernels round differently; run "
                         "ort-qdq too, whose layer-wise comparison names the layers to widen, or try another SoC")
    if row["target"] == "rknn":
        return GapAdvice("the RK3588 quantizes activations to int8 (w8a8): keep the most sensitive layers at fp16 "
                         "(Precisions' sensitivity sweep names them; fp16 layers stay float16 on the NPU), then "
                         "compare again")
    return GapAdvice("no layer-wise comparison ran for this target: run ort-qdq too, whose comparison names the "
                     "layers to widen, or widen the most sensitive layers in Precisions, then compare again")


def runtime_speed(speed: dict | None) -> dict | None:
    """A conversion's ``details.runtime_speed`` (the runtime timing itself: its own counters, or a clock around
    its own calls) as a row's ``speed``: prefill and decode tok/s, threads and where the times come from."""
    if not speed:
        return None
    return {"runtime": speed["runtime"], "prefill_tps": speed["prefill_tokens_per_second"],
            "decode_tps": speed["decode_tokens_per_second"], "threads": speed.get("threads"),
            "prompt_tokens": speed.get("prompt_tokens"), "source": speed.get("source")}


def make_row(target: str, runtime: str, *, prefill=None, decode=None, bytes_=None, seconds=None, peak=None,
             note: str = "", error: str | None = None, speed: dict | None = None) -> dict:
    flags = [f"{name}: {why}" for name, g in (("prefill", prefill), ("decode", decode)) if (why := gap_of(g))]
    return {"target": target, "runtime": runtime, "prefill": prefill, "decode": decode, "bytes": bytes_,
            "seconds": seconds, "peak_bytes": peak, "gap": "; ".join(flags) or None, "note": note, "error": error,
            "cause": None, "layerwise": None, "speed": speed}


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
    speed = runtime_speed((rep.get("details") or {}).get("runtime_speed"))  # a runtime that times itself
    notes = ([] if dec else ["no decode graph scored"]) + ([
        f"tok/s: {speed['runtime']}'s own, {speed['threads']} thread(s), {speed['prompt_tokens']}-token prompt"]
        if speed else [])
    return make_row(target, runtime, prefill=pre, decode=dec, bytes_=graph_bytes, seconds=seconds, peak=peak,
                    note="; ".join(notes), speed=speed)


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
                    peak=max(peak, m.peak_rss_bytes), note=f"toolkit subprocess peak {m.peak_rss_bytes / 1e9:.2f} GB")


def absent_row(target: str, why: str, *, error: bool = False) -> dict:
    """A target that did not run: not installed (``why`` says what to install) or failed (``error``)."""
    return make_row(target, "failed" if error else "not run", note=why, error=why if error else None)


def _cell(g: dict | None, key: str, fmt: str) -> str:
    return "-" if not g or g.get(key) is None else format(g[key], fmt)


TABLE_HEADER = ("target", "runtime", "prefill KL", "prefill top-1", "decode KL", "decode top-1",
                "top-1 vs sim (pre / dec)", "positions (pre / dec)", "MB", "prefill tok/s", "decode tok/s", "s",
                "peak GB", "gap")  # decimal units throughout (workbench.units): MB and GB, never GiB beside MB


# what ``gap_of`` judges a gap by, in words: shown with every table of rows (and wherever "no gap" is said)
GAP_RULE = (f"gap: KL to the float model above {GAP_KL_RATIO:g}x the simulation's + {GAP_KL_FLOOR:g}, top-1 "
            f"agreement with the simulation below {GAP_TOP1:g}, or (HTP) KL to CPU QDQ above {HTP_GAP_KL:g}")


def _tps(r: dict, key: str) -> str:
    """A row's own-runtime speed (``-`` where the runtime does not time itself, or a file written before)."""
    speed = r.get("speed")
    return "-" if not speed or speed.get(key) is None else f"{speed[key]:,.0f}"


def table_cells(r: dict) -> list[str]:
    """One row as the strings of ``TABLE_HEADER`` (the app, the report and the Markdown table show these)."""
    p, d = r["prefill"], r["decode"]
    return [r["target"], r["runtime"] + (f" ({r['note']})" if r["note"] else ""),
            _cell(p, "kl", ".2e"), _cell(p, "top1", ".4f"), _cell(d, "kl", ".2e"), _cell(d, "top1", ".4f"),
            f"{_cell(p, 'top1_vs_sim', '.4f')} / {_cell(d, 'top1_vs_sim', '.4f')}",
            f"{_cell(p, 'positions', ',')} / {_cell(d, 'positions', ',')}",
            "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.1f}", _tps(r, "prefill_tps"), _tps(r, "decode_tps"),
            "-" if r["seconds"] is None else f"{r['seconds']:.0f}",
            "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e9:.2f}",
            (r["gap"] or "") + (f". Layer-wise: {r['cause']}" if r.get("gap") and r.get("cause") else "")]


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (KL and top-1 against the float model; vs sim: top-1 against the simulation),
    and under it, after a blank line, the rule a gap is flagged by (``GAP_RULE``)."""
    head = "| " + " | ".join(TABLE_HEADER) + " |"
    lines = [head, "|" + "---|" * len(TABLE_HEADER)]
    for r in rows:
        cells = table_cells(r)
        if r["gap"]:
            cells[-1] = f"**GAP** {cells[-1]}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", GAP_RULE])


# -- the run ----------------------------------------------------------------------------------------------------

@dataclass
class DevicesGap:
    """One comparison: what was measured (model, plan, SoC, budget) and one row per target, in ``TARGETS`` order."""

    model: str
    plan: dict | None  # QuantPlan.to_dict(); a quantized model's own plan
    plan_hash: str | None
    soc: str
    max_tokens: int | None
    windows: int  # the HTP's 128-token windows
    rows: list[dict] = field(default_factory=list)
    work_dir: str = ""
    vl_rows: list[dict] = field(default_factory=list)  # a VLM's vision path per target (``workbench.run.vl_gap``)
    created: str = ""
    seconds: float = 0.0
    complete: bool = False  # every asked target has its row

    @property
    def flagged(self) -> list[dict]:
        return [r for r in self.rows if r["gap"]]

    def row(self, target: str) -> dict | None:
        return next((r for r in self.rows if r["target"] == target), None)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DevicesGap":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def save(self, path: str | Path | None = None) -> Path:
        """Written atomically (a run killed part-way leaves the previous complete file, never half of one)."""
        return atomic_write_json(Path(path) if path else Path(self.work_dir) / GAP_FILE, self.to_dict())


def read_devices_gap(path: str | Path) -> DevicesGap:
    """A ``devices_gap.json`` (or the folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / GAP_FILE
    doc = read_json_file(p, "devices gap file", error=WorkbenchError)
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or "model" not in doc:
        raise WorkbenchError(f"'{p}' is not a devices gap file (no model and rows); write it with "
                             "bench/devices_gap.py or the app's Export tab")
    return DevicesGap.from_dict(doc)


def _plan_record(model: str, plan: QuantPlan | None, bits: int | None) -> QuantPlan:
    if plan is not None:
        return plan
    if is_quantized_dir(model):
        return QuantPlan.load(Path(model) / "plan.json")
    if bits is None:
        raise PlanError("give a plan or bits (4 or 8) for a float model, or a quantized model directory")
    return QuantPlan.uniform(f"int{bits}")


def measure_devices_gap(model: str | Path, *, plan: QuantPlan | dict | str | Path | None = None,
                        bits: int | None = None, targets: Sequence[str] = TARGETS, soc: str = "8gen3",
                        max_tokens: int | None = None, windows: int = HTP_WINDOWS, prompt: int = PROMPT,
                        work: str | Path, log: Callable[[str], None] | None = None,
                        on_row: Callable[[DevicesGap], None] | None = None, backend=None) -> DevicesGap:
    """Measure ``targets`` for one plan of ``model`` (a float model with ``plan`` or ``bits``, or a quantized model
    directory), each in a child process, into ``work``; returns the rows (``DevicesGap``), also saved there as
    ``GAP_FILE`` after every target. ``on_row`` sees the result after every target (a progress display).
    ``backend`` (``workbench.model.sweep_backends``; default one after another here) runs the targets side by side:
    on worker processes, or on Ray nodes that see ``model`` and ``work`` at the same paths (a shared
    filesystem). Side by side, each row's time and peak memory are measured while others run."""
    say = log or (lambda m: None)
    model = str(model)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise PlanError(f"unknown device target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    if not targets:
        raise PlanError(f"choose at least one target of {', '.join(TARGETS)}")
    if max_tokens is not None and max_tokens < 2:
        raise PlanError(f"the token budget must be at least 2, got {max_tokens}")
    if windows < 1:
        raise PlanError(f"the HTP needs at least one 128-token window, got {windows}")
    if plan is not None and not isinstance(plan, QuantPlan):
        plan = QuantPlan.from_dict(plan) if isinstance(plan, dict) else QuantPlan.load(plan)
    if is_quantized_dir(model):
        if plan is not None or bits is not None:
            raise PlanError(f"'{model}' is a quantized model with its own plan; give no plan or bits with it")
    elif plan is None and bits is None:
        raise PlanError("give a plan or bits (4 or 8) for a float model, or a quantized model directory")
    if soc and "htp" in targets:
        soc = htp_soc(soc).device  # an unknown or non-Snapdragon device is refused before anything runs
    recorded = _plan_record(model, plan, bits)
    plan_doc = None if plan is None else plan.to_dict()
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    gap = DevicesGap(model, recorded.to_dict(), recorded.content_hash(), soc, max_tokens, windows,
                     work_dir=str(work.resolve()), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    t0 = time.perf_counter()
    ordered = [t for t in TARGETS if t in targets]
    found: dict[str, dict] = {}

    def done(target: str, row: dict) -> None:
        found[target] = row
        say(f"{target}: done")
        gap.rows = [found[t] for t in ordered if t in found]  # the table's order, whatever finished first
        gap.seconds = time.perf_counter() - t0
        gap.complete = len(found) == len(ordered)
        gap.save()
        if on_row is not None:
            on_row(gap)

    for target in ordered:
        why = missing_toolchain(target)
        if why:
            say(f"{target}: {why}")
            done(target, absent_row(target, why))
    # the HTP compiles ort-qdq's graphs and is judged against the simulation: it runs after both
    backend = backend or LocalBackend()
    for phase in ([t for t in ordered if t != "htp"], ["htp"]):
        todo = [t for t in phase if t in ordered and t not in found]
        if not todo:
            continue
        sim = found.get("simulation")
        common = (model, plan_doc, bits, str(work), max_tokens, soc, windows, prompt,
                  sim["prefill"]["kl"] if sim and sim.get("prefill") else None, found.get("ort-qdq"), gap.plan)
        if isinstance(backend, LocalBackend):  # one after another: say which one runs now
            for target in todo:
                say(f"{target}: running ({ordered.index(target) + 1}/{len(ordered)}) ...")
                done(target, _measure_target(common, target))
        else:
            say(f"{', '.join(todo)}: running side by side ({backend.name}) ...")
            backend.run(todo, _measure_target, done, state=common)
    return gap


def _measure_target(common: tuple, target: str) -> dict:
    """One target's row, on any sweep backend; a toolchain that fails is a row saying how, not a crash."""
    model, plan_doc, bits, work, max_tokens, soc, windows, prompt, sim_kl, qdq, recorded = common
    try:
        return _measure_one(target, model, plan_doc, bits, Path(work), max_tokens, soc, windows, prompt, sim_kl,
                            qdq, recorded)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return absent_row(target, f"failed: {type(e).__name__}: {msg}", error=True)


def _measure_one(target: str, model: str, plan: dict | None, bits: int | None, work: Path, max_tokens: int | None,
                 soc: str, windows: int, prompt: int, sim_kl: float | None, qdq: dict | None,
                 recorded: dict) -> dict:
    if target == "simulation":
        sim, s, peak = in_child(_run_simulation, model, plan, bits, max_tokens)
        return simulation_row(sim, s, peak)
    if target in CONVERT_RUNTIMES:
        rep, s, peak = in_child(_run_convert, model, target, plan, bits, str(work / target), max_tokens)
        row = convert_row(target, CONVERT_RUNTIMES[target], rep, s, peak)
        if row["gap"] and target == "ort-qdq":  # the graph runs in onnxruntime: compare it block by block
            try:
                row["layerwise"], _, _ = in_child(_run_layerwise, model, plan, bits, str(work / target),
                                                  str(work / "layerwise"))
                row["cause"] = row["layerwise"]["cause"]
            except Exception as e:  # the row keeps its measurements; the note says why there is no cause
                row["note"] = (row["note"] + "; " if row["note"] else "") + f"layer-wise comparison failed: {e}"
        return row
    if target == "htp":
        if qdq is None or qdq["prefill"] is None:  # the QDQ graphs of this run, not an older one's
            return absent_row(target, "needs ort-qdq's QDQ graphs of this run: choose ort-qdq too")
        m, s, peak = in_child(_run_htp, model, str(work / "ort-qdq"), str(work / "htp"), soc, windows, prompt,
                              recorded)
        return htp_row(m, sim_kl, s, peak)
    m, s, peak = in_child(_run_rknn, model, plan, bits, str(work / "rknn"))
    return rknn_row(m, s, peak)
