"""Per-layer sensitivity: how much each layer alone hurts the model at each lower precision.

For every quantizable layer and every precision (int8, int4) the sweep quantizes that layer alone,
swaps its weight into the float model, measures KL divergence to the unquantized model (primary)
and the perplexity change (secondary) on a fixed token budget, and puts the weight back. Each
layer is quantized once per precision (``LayerVariants`` caches the dequantized tensors), the
reference model runs once (``capture_reference``), and the blocks before the quantized layer,
unchanged in that trial, are replayed from a recording of the baseline run (``BlockReplay``), so
a trial costs at most one forward pass and usually less.

    report = run_sensitivity(load_model("demo"), workspace=Workspace())   # cached, resumable
    report.damage("model.layers.0.mlp.down_proj", "int4")                 # KL, nats per token
    report.ranking("int4")[:5]                                             # most sensitive first

The sweep writes ``progress.json`` (atomically) after every trial into the workspace's partial
directory; a killed sweep continues from the trials already done on the next call.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .errors import DataError, PlanError, WorkspaceError
from .evaluate import DEFAULT_CTX, EvalReport, ReferenceOutputs, capture_reference, encode_text, evaluate, read_text
from .models import LoadedModel, demo_text_path
from .plan import DEFAULT_GROUP_SIZE, QuantPlan, get_precision
from .workspace import Workspace, atomic_write_json, read_json_file

__all__ = ["LayerVariants", "BlockReplay", "PlanEvaluator", "LayerSensitivity", "SensitivityReport", "run_sensitivity",
           "evaluation_tokens", "model_fingerprint", "SWEEP_PRECISIONS", "DEFAULT_SWEEP_TOKENS", "SENSITIVITY_STEP"]

SWEEP_PRECISIONS = ("int8", "int4")
DEFAULT_SWEEP_TOKENS = 1024  # 2 windows of 512 on the demo model: enough to rank layers, ~0.5 s a trial
SENSITIVITY_STEP = "sensitivity"
PROGRESS_FILE = "progress.json"
REPORT_FILE = "sensitivity.json"


def model_fingerprint(lm: LoadedModel) -> str:
    """A hash of the weights as they are in memory: a sweep cached for one model is never reused for another."""
    from .calibrate import model_fingerprint as weights_fingerprint
    return weights_fingerprint(lm.model)


def evaluation_tokens(lm: LoadedModel, text_path: str | Path | None = None, tokens: int | None = None) -> torch.Tensor:
    """The first ``tokens`` token ids of a text (default: the bundled held-out text): a fixed budget."""
    path = Path(text_path) if text_path else demo_text_path("heldout")
    ids = encode_text(lm.tokenizer, read_text(path), source=str(path))
    if tokens is not None:
        if tokens < 2:
            raise DataError(f"the evaluation budget must be at least 2 tokens, got {tokens}")
        ids = ids[:tokens]
    return ids


def _module(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise PlanError(f"the model has no layer '{name}'") from None


class LayerVariants:
    """Each layer's weight at each precision, quantized once and kept as a float tensor to swap in.

    ``quantized(name, "int4")`` is the ``QuantizedWeight`` (the same RTN that ``quantize_model``
    uses, with its group-size fallback); ``weight(name, p)`` is what the simulation evaluates:
    the dequantized weight, the weight rounded to float16 for ``fp16``, the original otherwise.
    ``swapped(assignments)`` puts chosen variants into the model and always restores it.
    """

    def __init__(self, lm: LoadedModel, *, group_size: int | None = DEFAULT_GROUP_SIZE, symmetric: bool = True,
                 weights: Mapping[str, Mapping[str, object]] | None = None):
        self.lm = lm
        self.group_size = group_size
        self.symmetric = symmetric
        self._names = [info.name for info in lm.layers]
        self._quantized: dict[tuple[str, str], object] = {}
        self._float: dict[tuple[str, str], torch.Tensor] = {}
        for precision, by_layer in (weights or {}).items():  # weights of an earlier quantize step, reused
            for name, qw in by_layer.items():
                self._quantized[(name, precision)] = qw

    @classmethod
    def for_plan(cls, lm: LoadedModel, plan: QuantPlan) -> "LayerVariants":
        return cls(lm, group_size=plan.group_size, symmetric=plan.symmetric)

    @classmethod
    def from_quantized(cls, lm: LoadedModel, *quantized) -> "LayerVariants":
        """Start from the weights ``quantize_model`` already made (e.g. uniform INT8 and INT4 results).

        Only RTN results qualify: AWQ also rescales the preceding norms, so its weights cannot be
        swapped in one layer at a time.
        """
        if not quantized:
            raise PlanError("give at least one QuantizedModel to take weights from")
        first = quantized[0].plan
        weights: dict[str, dict[str, object]] = {}
        for qm in quantized:
            if qm.method != "rtn" or qm.float_overrides:
                raise PlanError(f"a {qm.method} result changes more than each layer's weight; sweep with RTN "
                                "weights (quantize_model(..., method='rtn'))")
            if (qm.plan.group_size, qm.plan.symmetric) != (first.group_size, first.symmetric):
                raise PlanError("the quantized models use different group sizes or symmetry; pass ones made alike")
            for r in qm.layers:
                if r.name in qm.weights and not (r.tied_to and not r.untied):
                    weights.setdefault(r.precision, {})[r.name] = qm.weights[r.name]
        return cls(lm, group_size=first.group_size, symmetric=first.symmetric, weights=weights)

    def original(self, name: str) -> torch.Tensor:
        return _module(self.lm.model, name).weight.detach()

    def group_size_for(self, name: str) -> int | None:
        """The group size ``quantize_model`` uses for this layer (its fallback when the plan's does not divide)."""
        from .quantize import resolve_group_size
        return resolve_group_size(self.original(name).shape[1], self.group_size)[0]

    def quantized(self, name: str, precision: str):
        """The ``QuantizedWeight`` of ``name`` at an integer precision (computed once)."""
        from .quantize import quantize_weight
        p = get_precision(precision)
        if p is None or p.is_float:
            raise PlanError(f"'{precision}' is not an integer precision; only int8/int4 layers have quantized weights")
        key = (name, p.name)
        if key not in self._quantized:
            self._quantized[key] = quantize_weight(self.original(name), p.bits, self.group_size_for(name),
                                                   self.symmetric)
        return self._quantized[key]

    def weight(self, name: str, precision: str | None) -> torch.Tensor:
        """The float tensor the simulation uses for ``name`` at ``precision``."""
        p = get_precision(precision)
        orig = self.original(name)
        if p is None or (p.is_float and p.bits >= 32):
            return orig
        key = (name, p.name)
        if key not in self._float:
            if p.is_float:
                w = orig.to(torch.float16).to(orig.dtype)
            else:
                w = self.quantized(name, p.name).dequantize().to(orig.dtype)
            self._float[key] = w.to(orig.device)
        return self._float[key]

    def assignments(self, plan: QuantPlan) -> dict[str, str | None]:
        return plan.resolve(self._names)

    @contextlib.contextmanager
    def swapped(self, assignments: Mapping[str, str | None]) -> Iterator[nn.Module]:
        """The model with ``assignments`` (layer -> precision) swapped in; restored on exit, even on error.

        Each module gets its own parameter, so a tied lm_head can differ from the embedding
        during the trial; the shared parameter object is put back afterwards.
        """
        model = self.lm.model
        saved: list[tuple[nn.Module, nn.Parameter]] = []
        try:
            for name, precision in assignments.items():
                if get_precision(precision) is None:
                    continue
                mod = _module(model, name)
                saved.append((mod, mod.weight))
                mod.weight = nn.Parameter(self.weight(name, precision), requires_grad=False)
            yield model
        finally:
            for mod, param in reversed(saved):
                mod.weight = param

    def clear(self) -> None:
        self._quantized.clear()
        self._float.clear()


MAX_REPLAY_BYTES = 1 << 30  # recorded block outputs kept for replay; above this every trial runs in full
_BLOCK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _Replay(nn.Module):
    """Stands in for a decoder block: passes its input through, or returns the block's recorded output."""

    def __init__(self, outputs: list[torch.Tensor] | None = None):
        super().__init__()
        self.outputs = outputs
        self.calls = 0

    def forward(self, hidden_states, *args, **kwargs):
        if self.outputs is None:
            return hidden_states
        out = self.outputs[self.calls]
        self.calls += 1
        if out.shape != hidden_states.shape:
            raise RuntimeError("a replayed block output does not match the batch; evaluate the same tokens")
        return out


class BlockReplay:
    """Skip the blocks before the first changed layer: their outputs are recorded once and replayed.

    A trial that quantizes a layer of block ``k`` leaves blocks ``0..k-1`` unchanged, so their
    outputs on the fixed tokens are those of the float model. ``record()`` keeps them during the
    baseline evaluation; ``skipping(k)`` replaces those blocks by a replay of the recording for the
    duration of a trial. Checked once against a full run; any mismatch turns it off.
    """

    def __init__(self, model: nn.Module):
        inner = getattr(model, "model", None)
        blocks = getattr(inner, "layers", None)
        n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        self.blocks = blocks if isinstance(blocks, nn.ModuleList) and len(blocks) == n else None
        self.outputs: list[list[torch.Tensor]] | None = None
        self.enabled = self.blocks is not None

    @property
    def depth(self) -> int:
        return len(self.blocks) if self.blocks is not None else 0

    def block_of(self, name: str) -> int:
        """Index of the first block a layer's change affects: its own block, 0 for embeddings, all for the head."""
        m = _BLOCK_RE.search(name)
        if m:
            return int(m.group(1))
        return self.depth if name.endswith("lm_head") else 0

    @contextlib.contextmanager
    def record(self, n_tokens: int, hidden: int) -> Iterator[None]:
        if not self.enabled or self.depth * n_tokens * hidden * 4 > MAX_REPLAY_BYTES:
            self.enabled = False
            yield
            return
        previous = self.outputs
        outputs: list[list[torch.Tensor]] = [[] for _ in range(self.depth)]

        def hook(i):
            def keep(module, args, output):
                if not isinstance(output, torch.Tensor):
                    self.enabled = False  # an architecture whose blocks return tuples: no replay
                    return
                outputs[i].append(output.detach().clone())
            return keep
        handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(self.blocks)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if previous is not None:  # blocks replayed during this run kept their earlier outputs
            outputs = [new if new else old for new, old in zip(outputs, previous)]
        self.outputs = outputs if self.enabled and all(outputs) else None

    @contextlib.contextmanager
    def skipping(self, start: int) -> Iterator[None]:
        if start <= 0 or not self.enabled or self.outputs is None:
            yield
            return
        originals = [self.blocks[j] for j in range(start)]
        try:
            for j in range(start - 1):
                self.blocks[j] = _Replay()
            self.blocks[start - 1] = _Replay(self.outputs[start - 1])
            yield
        finally:
            for j, block in enumerate(originals):
                self.blocks[j] = block


class PlanEvaluator:
    """Measure plans fast on a fixed token budget: reference log-probs captured once, weights cached.

    ``evaluate(plan)`` returns an ``EvalReport`` (perplexity, KL, top-1 against the float model)
    after swapping the plan's cached weights in: no re-quantization, no second reference run.
    """

    def __init__(self, lm: LoadedModel, ids: torch.Tensor, *, variants: LayerVariants | None = None,
                 ctx: int | None = None, batch_size: int = 4, reference: ReferenceOutputs | None = None):
        self.lm = lm
        self.ids = ids
        max_pos = getattr(lm.config, "max_position_embeddings", None) or DEFAULT_CTX
        self.ctx = min(ctx or DEFAULT_CTX, max_pos, len(ids))
        self.batch_size = batch_size
        self.variants = variants or LayerVariants(lm)
        self._reference = reference
        self.baseline: EvalReport | None = None
        self.replay = BlockReplay(lm.model)  # recorded on the float model: for single-layer trials
        self._plan_replay = BlockReplay(lm.model)  # recorded on the last plan evaluated: for small edits
        self._last_plan: dict[str, str | None] | None = None

    @property
    def reference(self) -> ReferenceOutputs:
        if self._reference is None:
            self._reference = capture_reference(self.lm.model, self.ids, ctx=self.ctx, batch_size=self.batch_size,
                                                progress=False)
        return self._reference

    def evaluate_baseline(self) -> EvalReport:
        """The unquantized model itself (KL 0): the anchor every damage is relative to.

        Its block outputs are recorded for replay, then the replay is checked: the head alone on
        the recorded last block must reproduce the baseline, or replay is turned off.
        """
        if self.baseline is None:
            ref = self.reference
            hidden = int(getattr(self.lm.config, "hidden_size", 0) or 0)
            with self.replay.record(len(self.ids), hidden):
                self.baseline = evaluate(self.lm.model, self.ids, reference=ref, ctx=self.ctx,
                                         batch_size=self.batch_size, progress=False)
            if self.replay.outputs is not None:
                with self.replay.skipping(self.replay.depth):
                    check = evaluate(self.lm.model, self.ids, reference=ref, ctx=self.ctx,
                                     batch_size=self.batch_size, progress=False)
                if abs(check.nll - self.baseline.nll) > 1e-6 * max(1.0, abs(self.baseline.nll)):
                    self.replay.enabled = False
        return self.baseline

    def evaluate_assignments(self, assignments: Mapping[str, str | None], *, desc: str = "evaluate") -> EvalReport:
        """Evaluate with ``assignments`` swapped in; blocks before the first changed one are replayed."""
        ref = self.reference
        changed = [n for n, p in assignments.items() if get_precision(p) is not None]
        start = min((self.replay.block_of(n) for n in changed), default=0)
        with self.variants.swapped(assignments) as model, self.replay.skipping(start):
            return evaluate(model, self.ids, reference=ref, ctx=self.ctx, batch_size=self.batch_size,
                            progress=False, desc=desc)

    def evaluate(self, plan: QuantPlan) -> EvalReport:
        """Evaluate a whole plan. Blocks before the first layer that differs from the last plan
        evaluated here are replayed from that evaluation, so changing one layer re-runs only the
        blocks from that layer on."""
        if (plan.group_size, plan.symmetric) != (self.variants.group_size, self.variants.symmetric):
            raise PlanError(f"this evaluator caches weights at group size {self.variants.group_size}, symmetric="
                            f"{self.variants.symmetric}; the plan asks for group size {plan.group_size}, "
                            f"symmetric={plan.symmetric}: make a new evaluator for it")
        assignments = self.variants.assignments(plan)
        replay = self._plan_replay
        start = 0
        if self._last_plan is not None and replay.outputs is not None:
            changed = [n for n in assignments if _effective(assignments[n]) != _effective(self._last_plan.get(n))]
            start = min((replay.block_of(n) for n in changed), default=replay.depth)
        ref = self.reference
        hidden = int(getattr(self.lm.config, "hidden_size", 0) or 0)
        self._last_plan = None  # if this run fails, the recording no longer matches a known plan
        with self.variants.swapped(assignments) as model, replay.record(len(self.ids), hidden), \
                replay.skipping(start):
            report = evaluate(model, self.ids, reference=ref, ctx=self.ctx, batch_size=self.batch_size,
                              progress=False)
        self._last_plan = dict(assignments)
        return report


def _effective(precision: str | None) -> str | None:
    """Precisions that put the same tensor in the model compare equal (None and fp32 leave it as loaded)."""
    p = get_precision(precision)
    return None if p is None or (p.is_float and p.bits >= 32) else p.name


@dataclass
class LayerSensitivity:
    """One layer's damage when it alone is quantized: ``damage[precision] = {"kl", "ppl_delta", ...}``."""

    name: str
    block: str
    role: str
    shape: tuple[int, int]
    parameters: int
    tied_to: str | None = None
    damage: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "LayerSensitivity":
        return cls(d["name"], d["block"], d["role"], tuple(d["shape"]), int(d["parameters"]), d.get("tied_to"),
                   {p: dict(v) for p, v in d.get("damage", {}).items()})


@dataclass
class SensitivityReport:
    """The sweep's result: per layer and precision, KL divergence (nats/token) and perplexity change."""

    model: str
    precisions: tuple[str, ...]
    tokens: int
    ctx: int
    group_size: int | None
    symmetric: bool
    reference_perplexity: float
    layers: list[LayerSensitivity]
    seconds: float = 0.0
    trials_run: int = 0  # trials measured by this call (0 when everything came from the cache)

    def layer(self, name: str) -> LayerSensitivity:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise PlanError(f"layer '{name}' is not in this sensitivity report ({len(self.layers)} layers)")

    def damage(self, name: str, precision: str, metric: str = "kl") -> float:
        """Measured damage of ``name`` alone at ``precision``; 0 for float precisions."""
        p = get_precision(precision)
        if p is None or p.is_float:
            return 0.0
        d = self.layer(name).damage.get(p.name)
        if d is None:
            raise PlanError(f"no {p.name} measurement for '{name}'; sweep precisions were {list(self.precisions)}")
        return float(d[metric])

    def ranking(self, precision: str = "int4", metric: str = "kl") -> list[tuple[str, float]]:
        """Layers from most to least sensitive at ``precision``."""
        return sorted(((layer.name, self.damage(layer.name, precision, metric)) for layer in self.layers),
                      key=lambda kv: -kv[1])

    def to_dict(self) -> dict:
        return {"model": self.model, "precisions": list(self.precisions), "tokens": self.tokens, "ctx": self.ctx,
                "group_size": self.group_size, "symmetric": self.symmetric,
                "reference_perplexity": self.reference_perplexity, "seconds": self.seconds,
                "trials_run": self.trials_run, "metric": "kl (nats/token, vs the unquantized model)",
                "layers": [layer.to_dict() for layer in self.layers]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SensitivityReport":
        try:
            return cls(d["model"], tuple(d["precisions"]), int(d["tokens"]), int(d["ctx"]), d["group_size"],
                       bool(d["symmetric"]), float(d["reference_perplexity"]),
                       [LayerSensitivity.from_dict(x) for x in d["layers"]], float(d.get("seconds", 0.0)),
                       int(d.get("trials_run", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise WorkspaceError(f"sensitivity report is malformed (field {e}); delete it and sweep again") from None

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "SensitivityReport":
        return cls.from_dict(read_json_file(path, "sensitivity report", error=WorkspaceError,
                                            hint="; run `workbench sensitivity MODEL` first"))


def _trial_key(name: str, precision: str) -> str:
    return f"{name}|{precision}"


def _sweep(evaluator: PlanEvaluator, layers: Sequence, precisions: Sequence[str], progress_path: Path | None,
           progress: bool, on_trial: Callable[[str, str, dict], None] | None) -> tuple[dict, float, int, float]:
    """Run every missing trial, saving progress after each.

    Returns (trials, reference perplexity, trials run now, seconds spent on trials in all runs).
    """
    from tqdm.auto import tqdm
    state = {"trials": {}, "seconds": 0.0}
    if progress_path is not None and progress_path.is_file():
        try:
            state = json.loads(progress_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:  # a progress file is only ever replaced atomically; be safe anyway
            state = {"trials": {}, "seconds": 0.0}
    trials: dict[str, dict] = state["trials"]
    todo = [(info, p) for info in layers for p in precisions if _trial_key(info.name, p) not in trials]
    base = evaluator.evaluate_baseline()
    ran = 0
    with tqdm(total=len(layers) * len(precisions), initial=len(layers) * len(precisions) - len(todo),
              desc="sensitivity", unit="trial", disable=not progress) as bar:
        for info, p in todo:
            t0 = time.perf_counter()
            report = evaluator.evaluate_assignments({info.name: p}, desc=f"{info.name} {p}")
            result = {"kl": report.kl_divergence, "ppl": report.perplexity,
                      "ppl_delta": report.perplexity - base.perplexity,
                      "nll_delta": report.nll - base.nll, "top1": report.top1_agreement}
            trials[_trial_key(info.name, p)] = result
            state["seconds"] = float(state.get("seconds", 0.0)) + time.perf_counter() - t0
            ran += 1
            if progress_path is not None:
                atomic_write_json(progress_path, state)
            if on_trial is not None:
                on_trial(info.name, p, result)
            bar.update(1)
    return trials, base.perplexity, ran, float(state.get("seconds", 0.0))


def run_sensitivity(lm: LoadedModel, *, ids: torch.Tensor | None = None, text_path: str | Path | None = None,
                    tokens: int = DEFAULT_SWEEP_TOKENS, precisions: Sequence[str] = SWEEP_PRECISIONS,
                    group_size: int | None = DEFAULT_GROUP_SIZE, symmetric: bool = True, ctx: int | None = None,
                    layers: Iterable[str] | None = None, evaluator: PlanEvaluator | None = None,
                    workspace: Workspace | None = None, force: bool = False, progress: bool = True,
                    on_trial: Callable[[str, str, dict], None] | None = None) -> SensitivityReport:
    """Sweep every quantizable layer x precision; cached and resumable when a ``workspace`` is given.

    ``ids`` (or ``text_path``, default the held-out text) is cut to ``tokens`` tokens. Pass an
    ``evaluator`` to share its cached weights and reference outputs (the override panel does).
    ``on_trial(name, precision, result)`` is called after each measured trial.
    """
    for p in precisions:
        prec = get_precision(p)
        if prec is None or prec.is_float:
            raise PlanError(f"sensitivity sweeps integer precisions (int8, int4), not '{p}'")
    precisions = tuple(get_precision(p).name for p in precisions)
    if evaluator is None:
        if ids is None:
            ids = evaluation_tokens(lm, text_path, tokens)
        else:
            ids = ids.reshape(-1)[:tokens]
        evaluator = PlanEvaluator(lm, ids, ctx=ctx,
                                  variants=LayerVariants(lm, group_size=group_size, symmetric=symmetric))
    variants = evaluator.variants
    names = list(layers) if layers is not None else [info.name for info in lm.layers]
    unknown = [n for n in names if n not in {info.name for info in lm.layers}]
    if unknown:
        raise PlanError(f"layer(s) {unknown[:3]} are not quantizable layers of this model")
    infos = [lm.layer(n) for n in names]
    inputs = {"model": model_fingerprint(lm), "tokens": hashlib.sha256(evaluator.ids.numpy().tobytes()).hexdigest()[:16],
              "n_tokens": int(len(evaluator.ids)), "ctx": evaluator.ctx, "precisions": list(precisions),
              "group_size": variants.group_size, "symmetric": variants.symmetric, "layers": names, "method": "rtn"}

    def build(trials: dict, ref_ppl: float, ran: int, seconds: float) -> SensitivityReport:
        out = []
        for info in infos:
            out.append(LayerSensitivity(info.name, info.block, info.role, tuple(info.shape), info.parameters,
                                        info.tied_to, {p: trials[_trial_key(info.name, p)] for p in precisions}))
        return SensitivityReport(str(lm.name), precisions, int(len(evaluator.ids)), evaluator.ctx, variants.group_size,
                                 variants.symmetric, ref_ppl, out, seconds, ran)

    if workspace is None:
        trials, ref_ppl, ran, seconds = _sweep(evaluator, infos, precisions, None, progress, on_trial)
        return build(trials, ref_ppl, ran, seconds)

    ran_here = {"n": 0}

    def compute(partial: Path) -> dict:
        trials, ref_ppl, ran, seconds = _sweep(evaluator, infos, precisions, partial / PROGRESS_FILE, progress,
                                               on_trial)
        ran_here["n"] = ran
        report = build(trials, ref_ppl, ran, seconds)
        report.save(partial / REPORT_FILE)
        return {"layers": len(infos), "precisions": list(precisions), "tokens": report.tokens,
                "seconds": round(seconds, 3), "reference_perplexity": ref_ppl}

    artifact = workspace.get_or_compute(SENSITIVITY_STEP, inputs, compute, force=force)
    report = SensitivityReport.load(artifact.file(REPORT_FILE))
    report.trials_run = ran_here["n"]
    return report
