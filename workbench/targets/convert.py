"""Convert a model (float + plan, or a saved quantized model) for a target, run the result, and compare it.

    report = convert("demo", "ort-int4", "out/int4", plan=QuantPlan.uniform("int4"))
    report.top1_agreement_vs_simulation, report.kl_divergence, report.simulation["kl_divergence"]

Every runnable output is evaluated by ``workbench.evaluation.evaluate`` on the same text and windows as the
workbench's own simulation of the plan: KL divergence and top-1 agreement against the
unquantized PyTorch model, and top-1 agreement against the simulation. A converted model that
drifts from the simulation (top-1 below ``GAP_TOP1``, or KL well above the simulation's) is
flagged: that is the "fine in simulation, gibberish on device" failure, caught on the desk.

Targets come from the one registry (``workbench.targets``): ``ort-int4`` (MatMulNBits with the
workbench's own integers), ``ort-genai`` (the same integers in one fused graph for onnxruntime-genai,
the CPU host's deployable artifact), ``ort-qdq`` (QDQ for onnxruntime's QNN execution provider, run on its
CPU), ``mnn`` (.mnn, run by MNN), and bundles for SDKs not installable here: ``qnn`` (its QDQ twin
is what gets measured), ``llama.cpp``, ``tensorrt``, ``rknn``. Each target's converter lives in its
module and gets a ``ConvertJob``: the prepared models, the output folder, the report to fill, and
the shared steps (static export, calibration inputs, evaluation against the simulation).

``conversion.json`` (written by ``convert``) records the report, the plan, and the quantized model
it came from: its directory and the SHA-256 of its ``manifest.json`` when it is a saved one, and
the workspace keys upstream of it (the AWQ search, when there was one).

Memory stays near the model's stored size: the float model keeps its stored dtype (float32
arithmetic a block at a time), the simulation shares its tensors and holds integer layers as codes
(``QuantizedModel.build_model``), graphs are built a tensor at a time, and evaluation keeps only
the reference's final hidden states, computing log-probabilities a window and a chunk at a time.
Big models are evaluated on a token budget by default (``default_eval_tokens``), said in the notes.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..assets import demo_text_path
from ..errors import ModelLoadError, PlanError
from ..evaluation.evaluate import DEFAULT_CTX, Window, strided_windows
from ..numerics.logits import final_hidden, head_logits
from ..numerics.memory import release_freed_memory
from ..onnx.export import ExportResult, export_onnx
from ..runtime.onnx_runner import OnnxCausalLM
from ..model.load import LoadedModel, is_quantized_dir, load_model, load_quantized
from ..quantize.plan import QuantPlan, vision_recipe_for
from ..evaluation.textio import read_tokens
from .processes import owned_tempdir
from .registry import check_precisions, check_signed_scales, get_target, registered_targets, target_names
from ..files.workspace import atomic_write_json
from ..evaluation.data import load_calibration_set
from ..model.calibrate import importance_statistics, reads_importance
from ..model.vision_quality import part_plan, recipe_part_plan

__all__ = ["CONVERT_TARGETS", "ConversionReport", "PreparedModels", "ConvertJob", "prepare_models", "convert",
           "GAP_TOP1", "calibration_feeds", "default_eval_tokens", "EVAL_PARAMETER_TOKENS", "MIN_EVAL_TOKENS",
           "quantized_model_provenance", "ignored_options", "DEFAULT_STATIC"]

CONVERT_TARGETS = target_names("convert")  # ort-int4, ort-genai, ort-qdq, qnn, mnn, llama.cpp, tensorrt, rknn, and any registered
GAP_TOP1 = 0.95  # below this top-1 agreement with the simulation, the converted model is not what was evaluated
GAP_KL_RATIO = 1.5  # ... or when its KL to the float model exceeds the simulation's by this factor (+ GAP_KL_FLOOR)
GAP_KL_FLOOR = 0.002
DEFAULT_STATIC = (128, 512)
# Default evaluation budget: the whole text while parameters x tokens stays under this (the demo model's
# 23 k held-out tokens), else this many parameter-tokens, never under MIN_EVAL_TOKENS: a conversion runs
# four models over the text (float, simulation, two accuracy levels), about 1.5 minutes for 0.5 B on 2 cores.
EVAL_PARAMETER_TOKENS = 5e11
MIN_EVAL_TOKENS = 1024
REF_ROWS = 256  # reference tokens whose logits are rebuilt together (156 MB for a 151,936-token vocabulary)
COMPARE_ELEMENTS = 2**22  # log-probabilities compared at once: 64 tokens of Qwen's vocabulary, 1,024 of the demo's
EVAL_BATCH = 4  # windows per PyTorch forward pass (their hidden states only: the output layer runs per window)
# Teacher-forced decode scoring: each window's first half is the prompt (prefill), every later token one decode
# step, each step scored; on the first windows that hold this many steps (a decode step costs a graph run).
DECODE_EVAL_STEPS = 512


@dataclass
class PreparedModels:
    """The unquantized reference, the simulation of the plan and the integer weights behind it.

    ``float_lm`` keeps its stored dtype (float32 arithmetic); ``sim_lm`` computes with the plan's
    dequantized weights and shares every other tensor with ``float_lm`` (no second float copy).
    """

    float_lm: LoadedModel
    sim_lm: LoadedModel
    qm: object  # workbench.quantize.QuantizedModel
    source: str


def vision_bits_plan(lm, plan: QuantPlan, target: str | None) -> QuantPlan:
    """A VLM's ``--bits`` plan with the vision encoder and projector as ``target`` ships them
    (``quantize.plan.vision_recipe``: Qualcomm w8a16, MNN int4 / int8, llama.cpp's f16 mmproj), or at int8 as
    `workbench quantize --bits` plans them where the target has no recipe."""
    recipe = vision_recipe_for(target, lm.config.model_type) if target else None
    if recipe is not None:
        return recipe_part_plan(lm, plan, recipe)
    return part_plan(lm, plan, vision="int8", projector="int8")


def prepare_models(model, *, plan: QuantPlan | str | Path | None = None, bits: int | None = None,
                   progress: bool = False, device: str = "cpu", importance: bool = True,
                   target: str | None = None) -> PreparedModels:
    """Resolve MODEL as a float model with a plan (or ``bits``), or a directory written by ``workbench quantize``.

    A float model is quantized as `workbench quantize` does by default: RTN's scale search weighs errors by the
    importance statistics (``calibrate.importance_statistics``) unless ``importance`` is False. The models (and
    quantization) run on ``device``; graphs and onnxruntime stay on the CPU. A VLM's encoder and projector follow
    ``target``'s recipe when the plan comes from ``bits`` (``vision_bits_plan``).
    """
    from ..quantize import quantize_model
    if is_quantized_dir(model):
        if plan is not None or bits is not None:
            raise PlanError(f"'{model}' is a quantized model with its own plan; drop --plan/--bits, or pass the float "
                            "model with a plan")
        sim_lm, qm = load_quantized(model, device=device)
        meta = json.loads((Path(str(model)) / "quantization.json").read_text(encoding="utf-8"))
        source = meta.get("source")
        if not source or not Path(source).exists():
            raise ModelLoadError(f"the float model '{source}' that '{model}' was quantized from is not there; the "
                                 "comparison needs it: restore it or quantize again from a present model")
        float_lm = load_model(source, device=device)
        return PreparedModels(float_lm, sim_lm, qm, str(model))
    float_lm = load_model(model, device=device)
    if plan is None:
        if bits is None:
            raise PlanError("give a plan (--plan PLAN.json) or --bits 4|8 for a float model")
        from ..quantize.plan import PRECISIONS
        if f"int{bits}" not in PRECISIONS:
            widths = ", ".join(str(p.bits) for p in PRECISIONS.values()
                               if not p.is_float and not p.two_level and not p.minimums)
            raise PlanError(f"--bits must be a registered integer width ({widths}), got {bits}")
        plan = QuantPlan.uniform(f"int{bits}")
        if getattr(float_lm, "is_vision", False):
            plan = vision_bits_plan(float_lm, plan, target)
    elif not isinstance(plan, QuantPlan):
        plan = QuantPlan.load(plan)
    try:
        plan.validate([info.name for info in float_lm.layers])
    except PlanError as e:
        raise PlanError(f"the plan does not fit model '{model}': {e}") from None
    calibration = None
    if importance and reads_importance(plan):
        calibration, how = importance_statistics(float_lm, progress=progress)
        if progress:
            print(how)
    qm = quantize_model(float_lm, plan, calibration=calibration, progress=progress)
    sim_lm = LoadedModel(qm.build_model(float_lm.model), float_lm.tokenizer, float_lm.path,
                         f"{float_lm.name} (simulated)", float_lm.layers)
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
    # the decode graph, teacher-forced (decode_scores): kl_divergence, top1_agreement, top1_agreement_vs_simulation,
    # perplexity, tokens, windows, prompt, measured_on, and prefill_kl_divergence on the same positions
    decode: dict = field(default_factory=dict)
    reference_perplexity: float | None = None
    gap: str | None = None
    eval_tokens: int = 0
    ctx: int = 0
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)  # the plan converted (QuantPlan.to_dict())
    quantized_model: dict = field(default_factory=dict)  # path, manifest_sha256, method, source_model
    upstream: dict = field(default_factory=dict)  # workspace keys the quantized model came from

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d

    def summary(self) -> str:
        if not self.runnable:
            return f"{self.target}: wrote {len(self.files)} files to {self.out_dir} (run commands there with the SDK)"
        d = self.decode
        return (f"{self.target}: KL {self.kl_divergence:.5f} (simulation {self.simulation.get('kl_divergence', 0):.5f}), "
                f"top-1 vs float {self.top1_agreement:.4f}, vs simulation {self.top1_agreement_vs_simulation:.4f}"
                + (f"; decode KL {d['kl_divergence']:.5f}, top-1 vs float {d['top1_agreement']:.4f}" if d else "")
                + (f"; GAP: {self.gap}" if self.gap else ""))


def calibration_feeds(lm: LoadedModel, *, samples: int = 16, seq_len: int = 128, text: str | Path | None = None,
                      runner: OnnxCausalLM | None = None) -> dict[str, list[dict]]:
    """Prefill (and, given a float ``runner``, decode) graph inputs from the calibration text.

    The decode samples' positions are spread evenly over every position the decode graph serves
    (1 .. its static past): with all of them at one position, the rotary angles are calibrated to
    that position's range and clip beyond it (teacher-forced decode past position 127 of the demo
    model: KL 2.0, top-1 0.17). Where the sample is shorter than the position, its whole text is
    the past and the position lies beyond it, which only the position-dependent ranges notice.
    """
    calib = load_calibration_set(text, tokenizer=lm.tokenizer, samples=samples, seq_len=seq_len)
    prefill, decode = [], []
    n_samples = len(calib.samples)
    for k, s in enumerate(calib.samples):
        toks = [int(t) for t in s]
        if runner is None:
            n = len(toks)
            prefill.append({"input_ids": np.array([toks], np.int64), "attention_mask": np.ones((1, n), np.int64),
                            "position_ids": np.arange(n, dtype=np.int64)[None]})
            continue
        seq = runner.static_seq or len(toks)
        prefill.append(runner.prefill_feed(toks[:seq]))
        if runner.decode is not None and len(toks) > 1:
            longest = runner.static_past or seq
            position = 1 + round(k * (longest - 1) / max(1, n_samples - 1))
            past = toks[:min(len(toks) - 1, seq, longest, position)]
            _, _, kv = runner.run_prefill(past)
            decode.append(runner.decode_feed(toks[len(past)], kv, position))
    return {"prefill": prefill, "decode": decode}


def _files(out: Path) -> list[dict]:
    return [{"path": str(p), "bytes": p.stat().st_size} for p in sorted(out.rglob("*"))
            if p.is_file() and "calibration" not in p.relative_to(out).parts]


def default_eval_tokens(parameters: int, n_tokens: int) -> int:
    """Tokens a conversion evaluates by default: all of them on small models, a budget on big ones."""
    if parameters * n_tokens <= EVAL_PARAMETER_TOKENS:
        return n_tokens
    return min(n_tokens, max(MIN_EVAL_TOKENS, int(EVAL_PARAMETER_TOKENS // parameters)))


@dataclass
class _Scores:
    """One model's agreement with the reference (and with the simulation) over the evaluated windows."""

    tokens: int = 0
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    reference_nll: float = 0.0
    vs_simulation: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(self.reference_nll / self.tokens)

    @property
    def kl_divergence(self) -> float:
        return self.kl / self.tokens

    @property
    def top1_agreement(self) -> float:
        return self.top1 / self.tokens

    @property
    def top1_agreement_vs_simulation(self) -> float:
        return self.vs_simulation / self.tokens


class _Evaluator:
    """The float model's outputs captured once; the simulation and each converted model scored against them.

    PyTorch models run their decoder on several windows at once and keep only the final hidden
    states at the scored positions (tokens x hidden); logits come from the output layer a window at
    a time, so tokens x vocabulary is never held beyond one window. Converted models run one after
    another (``score``): only one runtime is loaded at a time.
    """

    def __init__(self, prep: PreparedModels, text: str | Path | None, max_tokens: int | None, ctx: int | None,
                 progress: bool):
        lm = prep.float_lm
        text_path = text or demo_text_path("heldout")
        # read no further than the largest budget default_eval_tokens can give (all of a small text)
        cap = max_tokens or max(MIN_EVAL_TOKENS, int(EVAL_PARAMETER_TOKENS // max(lm.parameters, 1))) + 1
        ids, extent = read_tokens(lm.tokenizer, text_path, max_tokens=cap)
        self.text_tokens = len(ids)
        budget = max_tokens or default_eval_tokens(lm.parameters, len(ids))
        self.budget_note = None
        if max_tokens is None and budget < len(ids):
            self.budget_note = (f"evaluated on the first {budget:,} of {len(ids):,} tokens: the default budget for a "
                                f"{lm.parameters / 1e6:,.0f} M-parameter model (--max-tokens N to change)")
        read_note = extent.note(f"enough for the {budget:,}-token evaluation budget")
        if read_note:
            self.budget_note = f"{self.budget_note}; {read_note}" if self.budget_note else read_note
        self.ids = ids[:budget]
        max_pos = getattr(lm.model.config, "max_position_embeddings", None) or DEFAULT_CTX
        self.ctx = min(ctx or DEFAULT_CTX, max_pos, len(self.ids))
        self.windows = strided_windows(len(self.ids), self.ctx)
        self.progress = progress
        self.head = lm.model.get_output_embeddings()
        self.hidden = self._final_hidden(lm.model, "reference")
        self.sim_top1: list[torch.Tensor] | None = None
        sim = prep.sim_lm.model
        sim_hidden, sim_head = self._final_hidden(sim, "simulation"), sim.get_output_embeddings()
        self.sim_report = self._score(lambda k, w: head_logits(sim_head, sim_hidden[k]), "simulation", record=True)

    def _bar(self, desc: str, windows: int | None = None):
        from tqdm.auto import tqdm
        return tqdm(total=windows or len(self.windows), desc=desc, unit="window", disable=not self.progress,
                    leave=False)

    def _rows(self, w: Window) -> slice:
        """Positions of a window whose next-token predictions are scored."""
        return slice(w.score_from - w.begin - 1, w.end - w.begin - 1)

    def _final_hidden(self, model, desc: str) -> list[torch.Tensor]:
        """The output layer's inputs at the scored positions of each window; windows of equal length batched."""
        hidden: list[torch.Tensor] = []
        with self._bar(desc) as bar:
            k = 0
            while k < len(self.windows):
                n = self.windows[k].end - self.windows[k].begin
                batch = list(itertools.takewhile(lambda w: w.end - w.begin == n, self.windows[k:k + EVAL_BATCH]))
                ids = torch.stack([self.ids[w.begin:w.end] for w in batch])
                h = final_hidden(model, ids.to(next(model.parameters()).device))
                hidden += [h[b, self._rows(w)].clone() for b, w in enumerate(batch)]
                k += len(batch)
                bar.update(len(batch))
        return hidden

    @torch.inference_mode()
    def _score(self, window_logits: Callable[[int, Window], torch.Tensor | tuple[torch.Tensor, int]], desc: str, *,
               record: bool = False, windows: int | None = None) -> _Scores:
        """KL, top-1 agreement and perplexity from each window's float32 logits at its scored positions.

        ``window_logits`` returns the logits of every scored position, or ``(logits, skip)``: those of
        the scored positions after the first ``skip`` (decode after a prompt).
        """
        scores, argmax = _Scores(), []
        with self._bar(desc, windows) as bar:
            for k, w in enumerate(self.windows[:windows]):
                out = window_logits(k, w)
                logits, skip = out if isinstance(out, tuple) else (out, 0)
                if skip >= w.scored:
                    bar.update(1)
                    continue
                logits, picks = logits.to(self.hidden[k].device), []
                targets = self.ids[w.score_from + skip:w.end].to(logits.device)
                hidden = self.hidden[k][skip:]
                rows = max(1, COMPARE_ELEMENTS // logits.shape[-1])
                for r in range(0, w.scored - skip, REF_ROWS):
                    ref = head_logits(self.head, hidden[r:r + REF_ROWS])
                    for c in range(0, ref.shape[0], rows):
                        rlp = ref[c:c + rows]
                        rlp -= torch.logsumexp(rlp, dim=-1, keepdim=True)  # in place: log-probabilities
                        span = slice(r + c, r + c + rlp.shape[0])
                        lp, t = torch.log_softmax(logits[span], dim=-1), targets[span, None]
                        scores.nll -= lp.gather(1, t).sum().item()
                        scores.reference_nll -= rlp.gather(1, t).sum().item()
                        scores.kl += (rlp.exp() * (rlp - lp)).sum(-1).clamp_min(0).sum().item()
                        pick = lp.argmax(-1)
                        scores.top1 += int((rlp.argmax(-1) == pick).sum())
                        picks.append(pick)
                    del ref
                picks = torch.cat(picks)
                if self.sim_top1 is not None:
                    scores.vs_simulation += int((picks == self.sim_top1[k][skip:].to(picks.device)).sum())
                argmax.append(picks)
                scores.tokens += w.scored - skip
                del logits
                bar.update(1)
        if record:
            self.sim_top1 = argmax
            scores.vs_simulation = scores.tokens
        return scores

    def score(self, run_logits: Callable[[np.ndarray], np.ndarray], desc: str, windows: int | None = None) -> _Scores:
        """Score a runtime on the first ``windows`` windows (all by default).

        ``run_logits`` maps token ids ``[1, n]`` to logits ``[1, n, vocab]`` (onnxruntime, MNN).
        """
        def window_logits(_k: int, w: Window) -> torch.Tensor:
            out = np.ascontiguousarray(run_logits(self.ids[w.begin:w.end][None].numpy()), dtype=np.float32)
            return torch.from_numpy(out)[0, self._rows(w)]
        return self._score(window_logits, desc, windows=windows)

    def decode_windows(self, prompt: int, steps: int = DECODE_EVAL_STEPS) -> int:
        """How many leading windows hold ``steps`` decode steps after a ``prompt``-token prompt (all at most)."""
        total = 0
        for n, w in enumerate(self.windows, 1):
            total += max(0, w.end - w.begin - 1 - max(prompt, w.score_from - w.begin - 1))
            if total >= steps:
                return n
        return len(self.windows)

    def score_decode(self, runner, desc: str, *, prompt: int | None = None,
                     windows: int | None = None) -> tuple[_Scores, _Scores, dict]:
        """Teacher-forced decode: (decode scores, the prefill graph's on the same positions, what was run).

        Each window's first ``prompt`` tokens (default half the window) go through the prefill graph,
        then every later token is one decode step at its position, fed the cache the previous steps
        wrote, and every step's logits are scored. ``runner`` has ``logits``, ``run_prefill`` and
        ``run_decode`` (``OnnxCausalLM``); ``windows`` defaults to ``decode_windows``.
        """
        prompt = max(1, self.ctx // 2 if prompt is None else prompt)
        windows = windows or self.decode_windows(prompt)

        def start(w: Window) -> tuple[int, int]:
            first = w.score_from - w.begin - 1  # the window position of its first scored row
            return max(prompt, first), max(prompt, first) - first

        def decoded(_k: int, w: Window):
            ids, (at, skip) = self.ids[w.begin:w.end].tolist(), start(w)
            if at >= len(ids) - 1:
                return torch.zeros(0), w.scored
            _, _, kv = runner.run_prefill(ids[:at])
            steps = []
            for pos in range(at, len(ids) - 1):
                step, kv, _ = runner.run_decode(ids[pos], kv, pos)
                steps.append(np.asarray(step, dtype=np.float32))
            return torch.from_numpy(np.stack(steps)), skip

        def prefilled(_k: int, w: Window):
            out = np.ascontiguousarray(runner.logits(self.ids[w.begin:w.end][None].numpy()), dtype=np.float32)
            return torch.from_numpy(out)[0, self._rows(w)][start(w)[1]:], start(w)[1]
        dec = self._score(decoded, desc + " decode", windows=windows)
        pre = self._score(prefilled, desc + " prefill", windows=windows)
        return dec, pre, {"windows": windows, "prompt": prompt}

    def fill_decode(self, report: ConversionReport, scored: tuple[_Scores, _Scores, dict], measured_on: Path) -> None:
        """Record the decode graph's scores (``score_decode``) beside the prefill graph's; a gap is flagged too."""
        dec, pre, info = scored
        report.decode = {"measured_on": str(measured_on), "kl_divergence": dec.kl_divergence,
                         "top1_agreement": dec.top1_agreement,
                         "top1_agreement_vs_simulation": dec.top1_agreement_vs_simulation,
                         "perplexity": dec.perplexity, "tokens": dec.tokens, **info,
                         "prefill_kl_divergence": pre.kl_divergence, "prefill_top1_agreement": pre.top1_agreement}
        report.notes.append(f"decode scored teacher-forced: the first {info['windows']} window(s), each after a "
                            f"{info['prompt']}-token prompt, every step ({dec.tokens:,} steps); the prefill graph on "
                            f"the same positions: KL {pre.kl_divergence:.2e}")
        gap, _ = _judge(dec, self.sim_report)
        if gap and not report.gap:
            report.gap = f"decode graph: {gap}"

    def fill(self, report: ConversionReport, candidate: _Scores, measured_on: Path) -> None:
        s = self.sim_report
        vs_sim = candidate.top1_agreement_vs_simulation
        report.measured_on = str(measured_on)
        report.kl_divergence, report.top1_agreement = candidate.kl_divergence, candidate.top1_agreement
        report.perplexity = candidate.perplexity
        report.top1_agreement_vs_simulation = vs_sim
        report.simulation = {"kl_divergence": s.kl_divergence, "top1_agreement": s.top1_agreement,
                             "perplexity": s.perplexity}
        report.reference_perplexity = s.reference_perplexity
        report.eval_tokens, report.ctx = candidate.tokens, self.ctx
        report.details["evaluation"] = {"tokens_scored": candidate.tokens, "text_tokens": self.text_tokens,
                                        "windows": len(self.windows), "ctx": self.ctx}
        if self.budget_note and self.budget_note not in report.notes:
            report.notes.append(self.budget_note)
        report.gap, note = _judge(candidate, s)
        if note:
            report.notes.append(note)


def _judge(candidate: _Scores, sim: _Scores) -> tuple[str | None, str | None]:
    """(gap, note): whether the converted model computes something other than the simulation.

    A gap is KL well above the simulation's, or top-1 agreement with the simulation below
    ``GAP_TOP1`` with a worse KL and more top-1 changes than quantizing itself makes (on a model
    whose logits are nearly tied, as with random weights, any rounding flips many top-1 picks).
    """
    vs_sim, worse = candidate.top1_agreement_vs_simulation, candidate.kl_divergence > sim.kl_divergence
    own_changes = 1 - sim.top1_agreement  # how often quantizing alone changes the float model's top-1
    if candidate.kl_divergence > GAP_KL_RATIO * sim.kl_divergence + GAP_KL_FLOOR:
        return (f"KL to the float model is {candidate.kl_divergence:.4f} against the simulation's "
                f"{sim.kl_divergence:.4f}: the conversion adds error the simulation does not show"), None
    if vs_sim >= GAP_TOP1:
        return None, None
    if worse and 1 - vs_sim > own_changes:
        return (f"top-1 agreement with the simulation is {vs_sim:.3f} (< {GAP_TOP1}): the converted model does not "
                "compute what the workbench evaluated"), None
    if not worse:
        return None, (f"top-1 agreement with the simulation is {vs_sim:.3f}, but the converted model is closer to the "
                      "float model than the simulation is: it quantizes differently, not worse")
    return None, (f"top-1 agreement with the simulation is {vs_sim:.3f}, with KL within the simulation's and fewer "
                  f"top-1 changes than quantizing itself makes ({own_changes:.1%} of the float model's): near-tied "
                  "logits, not a different computation")


def quantized_model_provenance(prep: PreparedModels) -> tuple[dict, dict]:
    """(quantized model, upstream keys) of a conversion: the saved directory and its manifest's SHA-256 when
    ``prep.source`` is one (else the model quantized on the fly), and the AWQ search's workspace key."""
    qm, src = prep.qm, Path(prep.source)
    info = {"path": None, "manifest_sha256": None, "method": qm.method, "source_model": str(prep.float_lm.path)}
    awq_key = (qm.awq or {}).get("workspace_key")
    if is_quantized_dir(src) and (src / "manifest.json").is_file():
        info["path"] = str(src.resolve())
        info["manifest_sha256"] = hashlib.sha256((src / "manifest.json").read_bytes()).hexdigest()
        meta = json.loads((src / "quantization.json").read_text(encoding="utf-8"))
        awq_key = awq_key or (meta.get("awq") or {}).get("workspace_key")
    return info, ({"awq_search": awq_key} if awq_key else {})


def regrid_command(prep: PreparedModels, target: str) -> str | None:
    """For a saved quantized model on the 16-level grid: the one command that makes one ``target`` holds (the same
    plan, rounded on the target's grid) with the saved model's measured KL beside it; None when the model was not
    read from a `workbench quantize` folder (the caller's generic advice then stands)."""
    src = Path(prep.source)
    if not (is_quantized_dir(src) and (src / "plan.json").is_file()):
        return None
    import shlex
    report = {}
    if (src / "report.json").is_file():
        try:
            report = json.loads((src / "report.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            report = {}
    kl = report.get("kl_divergence") if isinstance(report, dict) else None
    measured = (f"{src.name} measured KL {kl:.4g} against its float model on {report.get('tokens', 0):,} tokens; "
                if isinstance(kl, (int, float)) and not isinstance(kl, bool) else "")
    out = src.with_name(f"{src.name}-{target}")
    cmd = " ".join(shlex.quote(str(a)) for a in ("workbench", "quantize", prep.float_lm.path, "--plan",
                                                   src / "plan.json", "--target", target, "--out", out))
    return (f"make one it holds with `{cmd}` (the same plan on the 15-level grid {target} holds; {measured}the new "
            "model's KL is measured when you run it)")


class ConvertJob:
    """One conversion as a target's converter sees it: models, output folder, report, options, shared steps."""

    def __init__(self, prep: PreparedModels, out: Path, report: ConversionReport, work: Path, *, text, max_tokens,
                 ctx, activation_bits, accuracy_level, static, calibration_samples, calibration_seq_len,
                 greedy_steps, evaluate_outputs, progress, say, owns_models, soc=None, split_limit_bytes=None):
        self.prep, self.out, self.report, self.work = prep, out, report, work
        self.text, self.max_tokens, self.ctx = text, max_tokens, ctx
        self.activation_bits, self.accuracy_level, self.greedy_steps = activation_bits, accuracy_level, greedy_steps
        self.calibration_samples, self.calibration_seq_len = calibration_samples, calibration_seq_len
        self.evaluate_outputs, self.progress, self.say, self.owns_models = evaluate_outputs, progress, say, owns_models
        self.default_ctx = DEFAULT_CTX
        self.soc = soc  # the device profile of the NPU the target compiles for (qnn: a Snapdragon), or None
        self.split_limit_bytes = split_limit_bytes  # each compiled context under this (default: the SoC's limit)
        max_pos = getattr(prep.float_lm.model.config, "max_position_embeddings", None)
        self.static = static
        self._static_note = None
        if max_pos and static[1] + 1 > max_pos:
            self.static = (min(static[0], max_pos - 1), max_pos - 1)
            self._static_note = f"static past shortened to {self.static[1]}: the model has {max_pos} positions"

    def export_static(self, where: Path) -> ExportResult:
        """The float model's graphs with fixed shapes (``static``), as NPU converters want them."""
        if self._static_note and self._static_note not in self.report.notes:
            self.report.notes.append(self._static_note)
        return export_onnx(self.prep.float_lm, where, static=self.static, check=False)

    def feeds(self, export: ExportResult) -> dict[str, list[dict]]:
        """Calibration inputs for the prefill and decode graphs of ``export`` (run by the float graphs)."""
        runner = OnnxCausalLM(export.prefill_path, export.decode_path)
        return calibration_feeds(self.prep.float_lm, samples=self.calibration_samples,
                                 seq_len=self.calibration_seq_len, runner=runner)

    def evaluator(self, eval_ctx: int | None = None) -> _Evaluator | None:
        """The float model's and the simulation's scores (None when outputs are not evaluated)."""
        if not self.evaluate_outputs:
            return None
        self.say("evaluating the float model and the simulation")
        return _Evaluator(self.prep, self.text, self.max_tokens, eval_ctx or self.ctx, self.progress)

    def measure(self, run_logits: Callable[[np.ndarray], np.ndarray], measured_on: Path, desc: str, *,
                eval_ctx: int | None = None) -> None:
        """Score a converted model beside the simulation and fill the report."""
        ev = self.evaluator(eval_ctx)
        if ev is not None:
            ev.fill(self.report, ev.score(run_logits, desc), measured_on)


def convert(model, target: str, out_dir: str | Path, *, plan: QuantPlan | str | Path | None = None,
            bits: int | None = None, prepared: PreparedModels | None = None, text: str | Path | None = None,
            max_tokens: int | None = None, ctx: int | None = None, activation_bits: int = 16,
            accuracy_level: int = 4, static: tuple[int, int] | None = None, calibration_samples: int = 16,
            calibration_seq_len: int = 128, greedy_steps: int = 32, evaluate_outputs: bool = True,
            progress: bool = False, log: Callable[[str], None] | None = None,
            device: str = "cpu", soc: str | None = None, split_limit_bytes: int | None = None) -> ConversionReport:
    """Convert for ``target`` (a registered target) into ``out_dir``; run and compare the result where it can run.

    ``max_tokens`` None evaluates on ``default_eval_tokens`` (the whole text for small models).
    ``device`` is where the PyTorch models run (``prepare_models``); ignored with ``prepared``.
    ``soc``: the device profile of the NPU to compile for and run on (``qnn``: a Snapdragon, e.g. ``8gen3``).
    ``split_limit_bytes``: each context binary compiled for ``soc`` under this many bytes instead of the SoC's own
    context limit (``qnn``: a graph over it is split into parts).
    ``static``: fixed (SEQ, PAST) shapes for the targets that read them (default ``DEFAULT_STATIC``); ``static`` or
    ``soc`` given to a target that does not read it is said in the report's notes.
    """
    say = log or (lambda m: None)
    if target not in CONVERT_TARGETS:
        raise PlanError(f"unknown conversion target '{target}'; choose one of: {', '.join(CONVERT_TARGETS)}")
    spec = get_target(target)
    if split_limit_bytes is not None and (split_limit_bytes <= 0 or not soc):
        raise PlanError("--split-limit-mib sizes the context binaries compiled for a SoC: give a positive limit and "
                        "--soc DEVICE")
    if max_tokens is not None and max_tokens < 2:
        raise PlanError(f"--max-tokens must be at least 2 (one token is predicted from another), got {max_tokens}")
    if spec.check_setup is not None:
        spec.check_setup()
    t0 = time.perf_counter()
    prep = prepared or prepare_models(model, plan=plan, bits=bits, progress=progress, device=device,
                                      target=target)
    check_precisions(spec, prep.qm.precisions)
    check_signed_scales(spec, prep.qm, regrid_command(prep, target))
    report_seconds = {"prepare": time.perf_counter() - t0}
    release_freed_memory()  # quantization's temporaries: hand their pages back before the graphs are built
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = ConversionReport(target, out, [], 0.0, runnable=spec.runnable)
    report.details["seconds"] = report_seconds  # per stage; targets add their own
    report.plan = prep.qm.plan.to_dict()
    report.quantized_model, report.upstream = quantized_model_provenance(prep)
    report.notes += ignored_options(spec, static=static, soc=soc)
    work = owned_tempdir(CONVERT_TEMP)  # <tmp>/workbench-convert-<pid>-*: a killed run's is removed here, by the next
    try:
        spec.convert(ConvertJob(prep, out, report, work, text=text, max_tokens=max_tokens, ctx=ctx,
                                activation_bits=activation_bits, accuracy_level=accuracy_level,
                                static=static or DEFAULT_STATIC,
                                calibration_samples=calibration_samples, calibration_seq_len=calibration_seq_len,
                                greedy_steps=greedy_steps, evaluate_outputs=evaluate_outputs, progress=progress,
                                say=say, owns_models=prepared is None, soc=soc,
                                split_limit_bytes=split_limit_bytes))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not report.runnable and "mtmd" not in report.details:  # llama.cpp's multimodal CLI ran: its own scores are there
        report.notes.append(f"{target} cannot run here: no KL/top-1 is reported for it")
    report.files = _files(out)
    report.seconds = time.perf_counter() - t0
    write_conversion_json(report)
    report.files = _files(out)
    return report


def ignored_options(spec, **given) -> list[str]:
    """One note per option given (not None) that ``spec`` (a Target) does not read, naming the targets that do."""
    notes = []
    for option, value in given.items():
        if value is None or option in spec.options:
            continue
        readers = [t.name for t in registered_targets() if option in t.options]
        notes.append(f"--{option.replace('_', '-')} is ignored by {spec.name}: it is read by "
                     f"{', '.join(readers) or 'no target'} only")
    return notes


CONVERT_TEMP = "workbench-convert"  # a conversion's scratch folder kind (targets.processes.owned_tempdir)


def write_conversion_json(report: ConversionReport, directory: str | Path | None = None) -> Path:
    """The report as ``conversion.json`` in ``directory`` (default ``report.out_dir``); a caller that stages
    the output elsewhere first rewrites it there with the final paths."""
    return atomic_write_json(Path(directory or report.out_dir) / "conversion.json",
                             json.loads(json.dumps(report.to_dict(), default=str)))
