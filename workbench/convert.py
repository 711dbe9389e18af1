"""Convert a model (float + plan, or a saved quantized model) for a target, run the result, and compare it.

    report = convert("demo", "ort-int4", "out/int4", plan=QuantPlan.uniform("int4"))
    report.top1_agreement_vs_simulation, report.kl_divergence, report.simulation["kl_divergence"]

Every runnable output is evaluated by ``workbench.evaluate`` on the same text and windows as the
workbench's own simulation of the plan: KL divergence and top-1 agreement against the
unquantized PyTorch model, and top-1 agreement against the simulation. A converted model that
drifts from the simulation (top-1 below ``GAP_TOP1``, or KL well above the simulation's) is
flagged: that is the "fine in simulation, gibberish on device" failure, caught on the desk.

Targets: ``ort-int4`` (MatMulNBits with the workbench's own integers), ``ort-qdq`` (QDQ for
onnxruntime's QNN execution provider, run on its CPU), ``mnn`` (.mnn, run by MNN), and bundles for
SDKs not installable here: ``qnn`` (its QDQ twin is what gets measured), ``tensorrt``, ``rknn``.
"""
from __future__ import annotations

import copy
import json
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .errors import ModelLoadError, PlanError
from .evaluate import DEFAULT_CTX, encode_text, evaluate, read_text, strided_windows
from .graph import LogitsModule, OnnxCausalLM, export_onnx, greedy_tokens_torch
from .models import LoadedModel, demo_text_path, load_model
from .plan import QuantPlan, get_precision
from .workspace import atomic_write_json

__all__ = ["CONVERT_TARGETS", "ConversionReport", "PreparedModels", "prepare_models", "convert", "GAP_TOP1",
           "calibration_feeds"]

CONVERT_TARGETS = ("ort-int4", "ort-qdq", "mnn", "qnn", "tensorrt", "rknn")
GAP_TOP1 = 0.95  # below this top-1 agreement with the simulation, the converted model is not what was evaluated
GAP_KL_RATIO = 1.5  # ... or when its KL to the float model exceeds the simulation's by this factor (+ GAP_KL_FLOOR)
GAP_KL_FLOOR = 0.002
DEFAULT_STATIC = (128, 512)


@dataclass
class PreparedModels:
    """The unquantized reference, the simulation (dequantized weights) and the integer weights behind it."""

    float_lm: LoadedModel
    sim_lm: LoadedModel
    qm: object  # workbench.quantize.QuantizedModel
    source: str


def _is_quantized_dir(model) -> bool:
    return Path(str(model)).is_dir() and (Path(str(model)) / "quantization.json").is_file()


def prepare_models(model, *, plan: QuantPlan | str | Path | None = None, bits: int | None = None,
                   progress: bool = False) -> PreparedModels:
    """Resolve MODEL as a float model with a plan (or ``bits``), or a directory written by ``workbench quantize``."""
    from .quantize import load_quantized, quantize_model
    if _is_quantized_dir(model):
        if plan is not None or bits is not None:
            raise PlanError(f"'{model}' is a quantized model with its own plan; drop --plan/--bits, or pass the float "
                            "model with a plan")
        sim_lm, qm = load_quantized(model)
        meta = json.loads((Path(str(model)) / "quantization.json").read_text(encoding="utf-8"))
        source = meta.get("source")
        if not source or not Path(source).exists():
            raise ModelLoadError(f"the float model '{source}' that '{model}' was quantized from is not there; the "
                                 "comparison needs it: restore it or quantize again from a present model")
        float_lm = load_model(source)
        return PreparedModels(float_lm, sim_lm, qm, str(model))
    float_lm = load_model(model)
    if plan is None:
        if bits is None:
            raise PlanError("give a plan (--plan PLAN.json) or --bits 4|8 for a float model")
        if bits not in (4, 8):
            raise PlanError(f"--bits must be 4 or 8, got {bits}")
        plan = QuantPlan.uniform(f"int{bits}")
    elif not isinstance(plan, QuantPlan):
        plan = QuantPlan.load(plan)
    try:
        plan.validate([info.name for info in float_lm.layers])
    except PlanError as e:
        raise PlanError(f"the plan does not fit model '{model}': {e}") from None
    qm = quantize_model(float_lm, plan, progress=progress)
    sim_lm = LoadedModel(copy.deepcopy(float_lm.model), float_lm.tokenizer, float_lm.path, f"{float_lm.name} (simulated)",
                         float_lm.layers)
    qm.apply_(sim_lm.model)
    return PreparedModels(float_lm, sim_lm, qm, str(model))


@dataclass
class ConversionReport:
    """What a conversion wrote, and how its outputs compare with the float model and the simulation."""

    target: str
    out_dir: Path
    files: list[dict]
    seconds: float
    runnable: bool
    measured_on: str | None = None  # the file the metrics come from
    kl_divergence: float | None = None
    top1_agreement: float | None = None
    perplexity: float | None = None
    top1_agreement_vs_simulation: float | None = None
    simulation: dict = field(default_factory=dict)  # kl_divergence, top1_agreement, perplexity of the simulation
    reference_perplexity: float | None = None
    gap: str | None = None
    eval_tokens: int = 0
    ctx: int = 0
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d

    def summary(self) -> str:
        if not self.runnable:
            return f"{self.target}: wrote {len(self.files)} files to {self.out_dir} (run commands there with the SDK)"
        return (f"{self.target}: KL {self.kl_divergence:.5f} (simulation {self.simulation.get('kl_divergence', 0):.5f}), "
                f"top-1 vs float {self.top1_agreement:.4f}, vs simulation {self.top1_agreement_vs_simulation:.4f}"
                + (f"; GAP: {self.gap}" if self.gap else ""))


def calibration_feeds(lm: LoadedModel, *, samples: int = 16, seq_len: int = 128, text: str | Path | None = None,
                      runner: OnnxCausalLM | None = None) -> dict[str, list[dict]]:
    """Prefill (and, given a float ``runner``, decode) graph inputs from the calibration text."""
    from .data import load_calibration_set
    calib = load_calibration_set(text, tokenizer=lm.tokenizer, samples=samples, seq_len=seq_len)
    prefill, decode = [], []
    for s in calib.samples:
        toks = [int(t) for t in s]
        if runner is None:
            n = len(toks)
            prefill.append({"input_ids": np.array([toks], np.int64), "attention_mask": np.ones((1, n), np.int64),
                            "position_ids": np.arange(n, dtype=np.int64)[None]})
            continue
        seq = runner.static_seq or len(toks)
        prefill.append(runner.prefill_feed(toks[:seq]))
        if runner.decode is not None and len(toks) > 1:
            past = toks[:min(len(toks) - 1, seq, runner.static_past or seq)]
            _, _, kv = runner.run_prefill(past)
            decode.append(runner.decode_feed(toks[len(past)], kv, len(past)))
    return {"prefill": prefill, "decode": decode}


def _files(out: Path) -> list[dict]:
    return [{"path": str(p), "bytes": p.stat().st_size} for p in sorted(out.rglob("*"))
            if p.is_file() and "calibration" not in p.relative_to(out).parts]


class _Evaluator:
    """Reference and simulation outputs computed once; candidates scored against both."""

    def __init__(self, prepared: PreparedModels, text: str | Path | None, max_tokens: int | None, ctx: int | None,
                 progress: bool):
        from .evaluate import capture_reference
        lm = prepared.float_lm
        text_path = text or demo_text_path("heldout")
        ids = encode_text(lm.tokenizer, read_text(text_path), source=str(text_path))
        if max_tokens:
            ids = ids[:max_tokens]
        max_pos = getattr(lm.model.config, "max_position_embeddings", None) or DEFAULT_CTX
        self.ctx = min(ctx or DEFAULT_CTX, max_pos, len(ids))
        self.ids = ids
        self.progress = progress
        self.reference = capture_reference(lm.model, ids, ctx=self.ctx, progress=progress)
        sim = prepared.sim_lm.model
        sim_module = LogitsModule(lambda x: sim(input_ids=torch.from_numpy(x)).logits.numpy(),
                                  record_argmax=True)
        self.sim_report = evaluate(sim_module, ids, reference=self.reference, ctx=self.ctx, progress=progress,
                                   desc="simulation")
        self.sim_top1 = self._scored(sim_module.argmax_rows)

    def _scored(self, rows: list[np.ndarray]) -> np.ndarray:
        windows = strided_windows(len(self.ids), self.ctx)
        if len(rows) != len(windows):
            raise RuntimeError(f"recorded {len(rows)} rows for {len(windows)} windows")
        return np.concatenate([r[w.score_from - w.begin - 1:w.end - w.begin - 1] for r, w in zip(rows, windows)])

    def score(self, run_logits: Callable[[np.ndarray], np.ndarray], desc: str) -> tuple[object, float]:
        module = LogitsModule(run_logits, record_argmax=True)
        report = evaluate(module, self.ids, reference=self.reference, ctx=self.ctx, progress=self.progress, desc=desc)
        vs_sim = float((self._scored(module.argmax_rows) == self.sim_top1).mean())
        return report, vs_sim

    def fill(self, report: ConversionReport, candidate, vs_sim: float, measured_on: Path) -> None:
        s = self.sim_report
        report.measured_on = str(measured_on)
        report.kl_divergence, report.top1_agreement = candidate.kl_divergence, candidate.top1_agreement
        report.perplexity = candidate.perplexity
        report.top1_agreement_vs_simulation = vs_sim
        report.simulation = {"kl_divergence": s.kl_divergence, "top1_agreement": s.top1_agreement,
                             "perplexity": s.perplexity}
        report.reference_perplexity = s.reference_perplexity
        report.eval_tokens, report.ctx = candidate.tokens, self.ctx
        worse = candidate.kl_divergence > s.kl_divergence
        if candidate.kl_divergence > GAP_KL_RATIO * s.kl_divergence + GAP_KL_FLOOR:
            report.gap = (f"KL to the float model is {candidate.kl_divergence:.4f} against the simulation's "
                          f"{s.kl_divergence:.4f}: the conversion adds error the simulation does not show")
        elif vs_sim < GAP_TOP1 and worse:
            report.gap = (f"top-1 agreement with the simulation is {vs_sim:.3f} (< {GAP_TOP1}): the converted model does "
                          "not compute what the workbench evaluated")
        elif vs_sim < GAP_TOP1:
            report.notes.append(f"top-1 agreement with the simulation is {vs_sim:.3f}, but the converted model is closer "
                                "to the float model than the simulation is: it quantizes differently, not worse")


def _plan_bits_for_qdq(prepared: PreparedModels, weight_names: dict) -> tuple[dict, list[str]]:
    """Weight bit widths per ONNX initializer for QDQ: 8 for integer layers, 16 for layers the plan keeps float."""
    bits, notes = {}, []
    for r in prepared.qm.layers:
        init = weight_names.get(r.name)
        if init is None:
            continue
        prec = get_precision(r.precision) if r.precision else None
        bits[init] = 16 if (prec is None or prec.is_float) else 8
    if any(get_precision(r.precision).bits == 4 for r in prepared.qm.layers if r.precision):
        notes.append("int4 layers of the plan get 8-bit weights in the QDQ model (onnxruntime's QNN configuration "
                     "re-quantizes per channel; for the plan's own INT4 integers use --target ort-int4)")
    notes.append("layers the plan keeps in float get 16-bit weights (A16W16 MatMul) instead of staying float, "
                 "which HTP would reject as a float x fixed-point MatMul")
    return bits, notes


def _mnn_weight_args(prepared: PreparedModels) -> tuple[int | None, int | None, list[str]]:
    qws = list(prepared.qm.weights.values())
    if not qws:
        return None, None, ["the plan quantizes no layer: MNN stores float weights"]
    kinds = {(q.bits, q.effective_group_size if q.group_size else None) for q in qws}
    if len(kinds) > 1:
        return None, None, ["the plan mixes bit widths or group sizes, which one MNN --weightQuantBits setting cannot "
                            "express: MNN stores the simulated weights in float (the simulation's values, not a "
                            "smaller file)"]
    bits, group = next(iter(kinds))
    floats = [r.name for r in prepared.qm.layers if r.name not in prepared.qm.weights and r.kind == "linear"]
    notes = [f"MNN re-quantizes the simulated weights with --weightQuantBits {bits} --weightQuantBlock {group or -1} "
             "--weightQuantAsymmetric: its min/max grid over values already on the workbench's grid reproduces them "
             "(its symmetric mode does not: it rescales and moves every code)"]
    if floats:
        notes.append(f"layers the plan keeps in float ({', '.join(floats[:4])}) get a [1, K, N] weight so MNN leaves "
                     "them unquantized")
    return bits, group, notes


def convert(model, target: str, out_dir: str | Path, *, plan: QuantPlan | str | Path | None = None,
            bits: int | None = None, prepared: PreparedModels | None = None, text: str | Path | None = None,
            max_tokens: int | None = None, ctx: int | None = None, activation_bits: int = 16,
            accuracy_level: int = 4, static: tuple[int, int] = DEFAULT_STATIC, calibration_samples: int = 16,
            calibration_seq_len: int = 128, greedy_steps: int = 32, evaluate_outputs: bool = True,
            progress: bool = False, log: Callable[[str], None] | None = None) -> ConversionReport:
    """Convert for ``target`` into ``out_dir``; run and compare the result where it can run here."""
    from .targets import inspect_graph
    say = log or (lambda m: None)
    if target not in CONVERT_TARGETS:
        raise PlanError(f"unknown conversion target '{target}'; choose one of: {', '.join(CONVERT_TARGETS)}")
    t0 = time.perf_counter()
    prep = prepared or prepare_models(model, plan=plan, bits=bits, progress=progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = ConversionReport(target, out, [], 0.0, runnable=target in ("ort-int4", "ort-qdq", "mnn", "qnn"))
    max_pos = getattr(prep.float_lm.model.config, "max_position_embeddings", None)
    if max_pos and static[1] + 1 > max_pos:
        static = (min(static[0], max_pos - 1), max_pos - 1)
        if target in ("ort-qdq", "qnn", "rknn"):
            report.notes.append(f"static past shortened to {static[1]}: the model has {max_pos} positions")
    evaluator = None
    work = Path(tempfile.mkdtemp(prefix="workbench-convert-"))
    try:
        if target == "ort-int4":
            from .targets.ort import ACCURACY_LEVELS, build_matmulnbits_onnx
            say("exporting the simulation to ONNX")
            ex = export_onnx(prep.sim_lm, work / "sim", check=False)
            built = {}
            for level in sorted({accuracy_level, 0}):
                sub = out if level == accuracy_level else work / f"level{level}"
                built[level] = [build_matmulnbits_onnx(p, sub / p.name, prep.qm, ex.weight_names, ex.weight_layouts,
                                                       accuracy_level=level) for p in ex.files]
            main = built[accuracy_level][0]
            report.details.update(accuracy_level=accuracy_level, accuracy_level_meaning=ACCURACY_LEVELS[accuracy_level],
                                  replaced_layers=len(main.replaced), kept_float=main.kept_float)
            report.notes += [f"{k}: {v}" for k, v in main.kept_float.items()]
            runner = OnnxCausalLM(out / ex.prefill_path.name, out / ex.decode_path.name)
            tokens = prep.float_lm.tokenizer("The workbench measures what each choice costs.",
                                             add_special_tokens=False)["input_ids"]
            onnx_tokens = runner.generate_greedy(tokens, greedy_steps)
            sim_tokens = greedy_tokens_torch(prep.sim_lm.model, tokens, greedy_steps)
            report.details["greedy_match_steps_vs_simulation"] = next(
                (i for i, (a, b) in enumerate(zip(onnx_tokens, sim_tokens)) if a != b), greedy_steps)
            report.details["decode_tokens_per_second"] = {}
            for level, builds in built.items():
                r = OnnxCausalLM(builds[0].path, builds[1].path, threads=1)
                report.details["decode_tokens_per_second"][level] = _decode_speed(r, tokens)
            if evaluate_outputs:
                evaluator = _Evaluator(prep, text, max_tokens, ctx, progress)
                levels = {}
                for level, builds in built.items():
                    cand, vs_sim = evaluator.score(OnnxCausalLM(builds[0].path).logits, f"int4 level {level}")
                    levels[level] = {"kl_divergence": cand.kl_divergence, "top1_agreement": cand.top1_agreement,
                                     "top1_agreement_vs_simulation": vs_sim}
                    if level == accuracy_level:
                        evaluator.fill(report, cand, vs_sim, main.path)
                report.details["accuracy_levels"] = levels
        elif target in ("ort-qdq", "qnn"):
            from .targets.ort import quantize_qdq
            say(f"exporting the float model to ONNX with static shapes {static}")
            sx = export_onnx(prep.float_lm, out if target == "qnn" else work / "static", static=static, check=False)
            srunner = OnnxCausalLM(sx.prefill_path, sx.decode_path)
            feeds = calibration_feeds(prep.float_lm, samples=calibration_samples, seq_len=calibration_seq_len,
                                      runner=srunner)
            wbits, notes = _plan_bits_for_qdq(prep, sx.weight_names)
            report.notes += notes
            qdq_dir = out if target == "ort-qdq" else out / "ort-qdq-twin"
            say(f"quantizing to QDQ (A{activation_bits}W8)")
            infos = {}
            for name, path in (("prefill", sx.prefill_path), ("decode", sx.decode_path)):
                infos[name] = _quiet_quantize(quantize_qdq, path, qdq_dir / f"{name}.qdq.onnx", feeds[name],
                                              activation_bits=activation_bits, weight_bits_by_initializer=wbits)
            report.details["qdq"] = {"activation_bits": activation_bits, "weight_bits": 8, "static": list(static),
                                     "mask_tensors": len(infos["prefill"]["mask_tensors"]),
                                     "mask_range": infos["prefill"]["mask_range"]}
            for g in ("prefill", "decode"):
                report.details[f"inspection_qdq_{g}"] = inspect_graph(qdq_dir / f"{g}.qdq.onnx", "qnn").summary()
            if target == "qnn":
                from .targets.qnn import write_qnn_bundle
                info = write_qnn_bundle(out, {"prefill": sx.prefill_path, "decode": sx.decode_path}, prep.qm,
                                        sx.weight_names, feeds, activation_bits=activation_bits)
                report.notes += info["notes"]
                report.notes.append("QNN itself cannot run here: the metrics come from the QDQ twin of the same static "
                                    "graphs (same bit widths, same mask fix) in onnxruntime CPU")
                for g in ("prefill", "decode"):
                    report.details[f"inspection_{g}"] = inspect_graph(out / f"{g}.onnx", "qnn").summary()
            if evaluate_outputs:
                eval_ctx = min(ctx or static[0], static[0])
                if eval_ctx != (ctx or DEFAULT_CTX):
                    report.notes.append(f"evaluated with {eval_ctx}-token windows, the static graph's sequence length "
                                        "(the simulation is scored on the same windows)")
                evaluator = _Evaluator(prep, text, max_tokens, eval_ctx, progress)
                cand, vs_sim = evaluator.score(OnnxCausalLM(qdq_dir / "prefill.qdq.onnx").logits, "qdq")
                evaluator.fill(report, cand, vs_sim, qdq_dir / "prefill.qdq.onnx")
        elif target == "mnn":
            from .targets.mnn import MnnCausalLM, convert_to_mnn, keep_matmul_weights_float
            say("exporting the simulation to ONNX")
            ex = export_onnx(prep.sim_lm, work / "sim", check=False)
            wb, block, notes = _mnn_weight_args(prep)
            report.notes += notes
            float_inits = [ex.weight_names[r.name] for r in prep.qm.layers if r.name in ex.weight_names
                           and r.name not in prep.qm.weights and ex.weight_layouts.get(r.name) == "in_out"]
            say("converting to MNN")
            kept: list[str] = []
            for p in ex.files:
                src = p
                if wb and float_inits:
                    src = work / f"float-kept-{p.name}"
                    kept = keep_matmul_weights_float(p, src, float_inits)
                convert_to_mnn(src, out / p.with_suffix(".mnn").name, weight_bits=wb, block_size=block, asymmetric=True)
            report.details["mnn"] = {"weight_bits": wb, "block": block, "asymmetric": True, "kept_float": kept}
            if evaluate_outputs:
                evaluator = _Evaluator(prep, text, max_tokens, ctx, progress)
                runner = MnnCausalLM(out / "prefill.mnn", threads=2)
                cand, vs_sim = evaluator.score(runner.logits, "mnn")
                evaluator.fill(report, cand, vs_sim, out / "prefill.mnn")
        elif target == "tensorrt":
            from .targets.tensorrt import write_tensorrt_bundle
            ex = export_onnx(prep.sim_lm, out, check=False)
            insp = inspect_graph(ex.prefill_path, "tensorrt")
            fp32 = [n for f in insp.findings if f.rule in ("fp16-overflow",) for n in f.nodes]
            info = write_tensorrt_bundle(out, {"prefill": ex.prefill_path, "decode": ex.decode_path}, fp32_layers=fp32)
            report.notes += info["notes"] + ["the graphs carry the simulated (dequantized) weights of the plan"]
            report.details["inspection"] = insp.summary()
        elif target == "rknn":
            from .targets.rknn import write_rknn_bundle
            sx = export_onnx(prep.float_lm, out, static=static, check=False)
            srunner = OnnxCausalLM(sx.prefill_path, sx.decode_path)
            sfeeds = calibration_feeds(prep.float_lm, samples=calibration_samples, seq_len=calibration_seq_len,
                                       runner=srunner)
            info = write_rknn_bundle(out, {"prefill": sx.prefill_path, "decode": sx.decode_path}, sfeeds)
            report.notes += info["notes"]
            report.details["inspection"] = inspect_graph(sx.prefill_path, "rknn").summary()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not report.runnable:
        report.notes.append(f"{target} cannot run here: no KL/top-1 is reported for it")
    report.files = _files(out)
    report.seconds = time.perf_counter() - t0
    atomic_write_json(out / "conversion.json", json.loads(json.dumps(report.to_dict(), default=str)))
    report.files = _files(out)
    return report


def _quiet_quantize(fn, *args, **kw):
    """onnxruntime's quantizer logs advice to the root logger; keep CLI and notebook output clean."""
    import logging
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        return fn(*args, **kw)
    finally:
        root.setLevel(level)


def _decode_speed(runner: OnnxCausalLM, prompt: list[int], steps: int = 32) -> float:
    """Decode tokens per second after one warm-up run (prefill excluded)."""
    _, _, kv = runner.run_prefill(prompt)
    runner.run_decode(1, kv, len(prompt))  # warm-up
    t = time.perf_counter()
    pos = len(prompt)
    for i in range(steps):
        _, kv, _ = runner.run_decode(1 + i % 7, kv, pos)
        pos += 1
    dt = time.perf_counter() - t
    return steps / dt if dt > 0 else math.inf
