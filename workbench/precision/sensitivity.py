"""Per-layer sensitivity: how much each layer alone hurts the model at each lower precision.

For every quantizable layer and every registered integer precision (int8, int6, int5, int4, int3, int2
and the two-level int8-lpbq / int4-lpbq; ``sweep_precisions``) the sweep quantizes that layer alone,
swaps it into the float model (as integer codes, ``LayerVariants``), measures KL divergence to the
unquantized model (primary) and the perplexity change (secondary) on a fixed token budget, and
puts the layer back. The reference model runs once (``capture_reference``), and the blocks before
the quantized layer, unchanged in that trial, are replayed from a recording of the baseline run
(``BlockReplay``), so a trial costs at most one forward pass and usually less.

That is still a forward pass per trial: seconds each on a 0.5 B model with a 151,936-token
vocabulary, about 340 of them. Above ``AUTO_KL_MAX_WORK`` (trials x tokens x parameters) the
sweep estimates instead (``score="proxy"``, ``workbench.precision.proxy``): every trial's KL from one
forward and one backward pass, as the Fisher-weighted quantization error. The report says which
score it holds (``report.score``) and why.

    report = run_sensitivity(load_model("demo"), workspace=Workspace())   # cached, resumable
    report.damage("model.layers.0.mlp.down_proj", "int4")                 # KL, nats per token
    report.ranking("int4")[:5]                                             # most sensitive first

A measured sweep writes ``progress.json`` (atomically) after every trial into the workspace's
partial directory; a killed sweep continues from the trials already done on the next call.

A vision-language model is swept on pictures unless text is given (``workbench.precision.pictures``): every
trial, vision encoder, projector and language layers alike, is the answer tokens' KL given the image on the
same held-out questions (``images``, ``questions``), so the auto plan weighs all three parts on one scale.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..assets import demo_text_path
from ..errors import DataError, PlanError, WorkspaceError
from ..evaluation.evaluate import DEFAULT_CTX, EvalReport, ReferenceOutputs, capture_reference, evaluate
from ..model.load import LoadedModel, stored_bytes
from .proxy import PROXY_VERSION, decoder_blocks, proxy_scores, proxy_supported
from ..quantize.plan import DEFAULT_GROUP_SIZE, DEFAULT_SCALE_SEARCH, PRECISIONS, QUANTIZER_SETTINGS, QuantPlan, fitting_precisions, get_precision
from ..evaluation.textio import text_token_ids
from ..files.workspace import Workspace, atomic_write_json, model_fingerprint, read_json_file
from ..model.sweep_backends import LocalBackend
from ..model.vision_quality import VisionEvalSet, vision_eval_set
from .pictures import DEFAULT_SWEEP_QUESTIONS, VisionPlanEvaluator
from ..quantize import layer_quantizer
from ..quantize.layers import QuantEmbedding, QuantLinear

__all__ = ["LayerVariants", "BlockReplay", "PlanEvaluator", "LayerSensitivity", "SensitivityReport", "run_sensitivity",
           "choose_score", "evaluation_tokens", "sweep_precisions", "fitting", "DEFAULT_SWEEP_TOKENS",
           "SENSITIVITY_STEP", "SCORES", "AUTO_KL_MAX_WORK", "VisionPlanEvaluator", "DEFAULT_SWEEP_QUESTIONS"]

# the reference's log-probabilities kept across an evaluator's evaluations (one output layer per trial, not two):
# a default 1,024-token sweep of a Qwen vocabulary holds 622 MB; a longer text rebuilds them each time
KEPT_REFERENCE_BYTES = 768 << 20
DEFAULT_SWEEP_TOKENS = 1024  # 2 windows of 512 on the demo model: enough to rank layers, ~0.5 s a trial
SCORES = ("kl", "proxy")
# trials x tokens x parameters above which `auto` estimates instead of measuring: the demo model's sweep is
# 2.6e11 (measured, seconds); Qwen2.5-0.5B's is 1.7e14 (measured, about an hour on 2 cores: estimated instead)
AUTO_KL_MAX_WORK = 1e13
METRICS = {"kl": "kl: nats/token vs the unquantized model, measured with each layer quantized alone",
           "proxy": "kl: nats/token vs the unquantized model, estimated as 1/2 sum F (W - Q(W))^2 with F the "
                    "diagonal Fisher information (one forward and backward pass; workbench.precision.proxy)"}
SENSITIVITY_STEP = "sensitivity"
PROGRESS_FILE = "progress.json"
REPORT_FILE = "sensitivity.json"



def sweep_precisions(symmetric: bool = True, layers: Iterable | None = None) -> tuple[str, ...]:
    """Every registered integer precision, read when called (two-level ones only for symmetric plans, but for
    layouts with their own minimums, ``int4-k``, which are asymmetric in either).

    Given a model's ``layers``, a fixed block layout (``int3-k``'s 256-weight blocks) is left out when
    some layer's inputs are not a multiple of its blocks (Qwen2.5-0.5B's 896): a sweep measures every
    layer at every precision it offers, so the auto plan can give any layer any of them.
    """
    layers = list(layers or ())
    return tuple(p.name for p in PRECISIONS.values() if not p.is_float and (symmetric or not p.two_level or p.minimums)
                 and not any(p.misfit(info.shape[1]) for info in layers))


def evaluation_tokens(lm: LoadedModel, text_path: str | Path | None = None, tokens: int | None = None) -> torch.Tensor:
    """The first ``tokens`` token ids of a text (default: the bundled held-out text): a fixed budget."""
    path = Path(text_path) if text_path else demo_text_path("heldout")
    if tokens is not None and tokens < 2:
        raise DataError(f"the evaluation budget must be at least 2 tokens, got {tokens}")
    return text_token_ids(lm.tokenizer, path, tokens)  # read no further than the budget


def _module(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise PlanError(f"the model has no layer '{name}'") from None


class LayerVariants:
    """Each layer at each precision, quantized on demand and swapped into the model as integer codes.

    ``quantized(name, "int4")`` is the ``QuantizedWeight`` (the same RTN that ``quantize_model``
    uses: ``quantize.layer_quantizer`` of the same settings, with its group-size fallback and the
    scale search when on). ``swapped(assignments)`` puts the chosen variants into the
    model the way ``QuantizedModel.build_model`` builds a quantized one: an integer layer becomes a
    ``QuantLinear`` / ``QuantEmbedding`` computing from the codes (dequantized to float32 one layer at
    a time, during its forward pass), an fp16 layer gets its weight rounded to float16 values, and
    everything is restored on exit. No float copy of a variant is kept: only codes (one byte a
    weight), least recently used first out once they pass ``cache_bytes`` (default: the model's own
    size as stored; 0 keeps nothing, as a sweep that uses each variant once does).
    """

    def __init__(self, lm: LoadedModel, *, group_size: int | None = DEFAULT_GROUP_SIZE, symmetric: bool = True,
                 scale_search: bool = DEFAULT_SCALE_SEARCH, weights: Mapping[str, Mapping[str, object]] | None = None,
                 cache_bytes: int | None = None, full_range: bool = False):
        self.lm = lm
        # a plan holding only the rounding settings: what ``layer_quantizer`` reads
        self.settings = QuantPlan(default=None, group_size=group_size, symmetric=symmetric, scale_search=scale_search,
                                  full_range=full_range)
        self.cache_bytes = stored_bytes(lm.model) if cache_bytes is None else int(cache_bytes)
        self._names = [info.name for info in lm.layers]
        self._given: dict[tuple[str, str], object] = {}  # weights of an earlier quantize step, reused as they are
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        for precision, by_layer in (weights or {}).items():
            for name, qw in by_layer.items():
                self._given[(self._canonical(name), precision)] = qw

    @property
    def group_size(self) -> int | None:
        return self.settings.group_size

    @property
    def symmetric(self) -> bool:
        return self.settings.symmetric

    @property
    def scale_search(self) -> bool:
        return self.settings.scale_search

    @property
    def full_range(self) -> bool:
        return self.settings.full_range

    @classmethod
    def for_plan(cls, lm: LoadedModel, plan: QuantPlan) -> "LayerVariants":
        return cls(lm, **plan.quantizer_settings)

    def matches(self, plan: QuantPlan) -> bool:
        """Whether ``plan`` rounds layers as these variants do (same group size, symmetry, scale search)."""
        return plan.quantizer_settings == self.settings.quantizer_settings

    def describe(self) -> str:
        return _settings_text(self.settings)

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
            if qm.plan.quantizer_settings != first.quantizer_settings:
                raise PlanError("the quantized models use different group sizes, symmetry or scale search; pass ones "
                                "made alike")
            for r in qm.layers:
                if r.name in qm.weights and not (r.tied_to and not r.untied):
                    weights.setdefault(r.precision, {})[r.name] = qm.weights[r.name]
        return cls(lm, **first.quantizer_settings, weights=weights)

    def original(self, name: str) -> torch.Tensor:
        return _module(self.lm.model, name).weight.detach()

    def quantizer(self, name: str, precision: str):
        """The ``LayerQuantizer`` ``quantize_model`` uses for ``name`` at ``precision`` under these settings."""
        return layer_quantizer(self.settings, precision, tuple(self.original(name).shape), name=name)

    def _canonical(self, name: str) -> str:
        try:
            return self.lm.layer(name).tied_to or name
        except KeyError:
            return name

    @property
    def cached_bytes(self) -> int:
        return sum(_code_bytes(qw) for qw in self._cache.values())

    def quantized(self, name: str, precision: str):
        """The ``QuantizedWeight`` of ``name`` at an integer precision (kept while the cache has room)."""
        p = get_precision(precision)
        if p is None or p.is_float:
            raise PlanError(f"'{precision}' is not an integer precision; only integer layers have quantized weights")
        key = (self._canonical(name), p.name)  # a tied lm_head shares the embedding's codes
        if key in self._given:
            return self._given[key]
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        qw = self.quantizer(name, p.name).quantize(self.original(name))
        size = _code_bytes(qw)
        if size <= self.cache_bytes:
            while self._cache and self.cached_bytes + size > self.cache_bytes:
                self._cache.popitem(last=False)
            self._cache[key] = qw
        return qw

    def weight(self, name: str, precision: str | None) -> torch.Tensor:
        """The weight ``name`` computes with at ``precision``: float32 for integer precisions, made on demand."""
        p = get_precision(precision)
        orig = self.original(name)
        if p is None or (p.is_float and p.bits >= 32):
            return orig
        if p.is_float:
            return orig.to(torch.float16).to(orig.dtype)
        return self.quantized(name, p.name).dequantize()

    def assignments(self, plan: QuantPlan) -> dict[str, str | None]:
        return plan.resolve(self._names)

    @contextlib.contextmanager
    def swapped(self, assignments: Mapping[str, str | None]) -> Iterator[nn.Module]:
        """The model with ``assignments`` (layer -> precision) swapped in; restored on exit, even on error.

        Integer layers are replaced by modules computing from their codes, so a tied lm_head can
        differ from the embedding during the trial; the original modules and parameters (and the
        tie) are put back afterwards.
        """
        model = self.lm.model
        saved: list[tuple[nn.Module, str, object]] = []  # (owner, attribute, original value)
        rounded: dict[int, nn.Parameter] = {}  # a tied weight rounded to fp16 once
        try:
            for name, precision in assignments.items():
                p = get_precision(precision)
                if p is None or (p.is_float and p.bits >= 32):
                    continue
                mod = _module(model, name)
                if p.is_float:
                    w = mod.weight
                    if id(w) not in rounded:
                        rounded[id(w)] = nn.Parameter(self.weight(name, p.name), requires_grad=False)
                    saved.append((mod, "weight", w))
                    mod.weight = rounded[id(w)]
                    continue
                owner, _, leaf = name.rpartition(".")
                parent = _module(model, owner) if owner else model
                qw = self.quantized(name, p.name)
                swap = QuantEmbedding(qw, mod.padding_idx) if isinstance(mod, nn.Embedding) else \
                    QuantLinear(qw, getattr(mod, "bias", None))
                saved.append((parent, leaf, mod))
                setattr(parent, leaf, swap)
            yield model
        finally:
            for owner, attr, value in reversed(saved):
                setattr(owner, attr, value)

    def clear(self) -> None:
        self._cache.clear()


def _settings_text(plan: QuantPlan) -> str:
    """``group_size=128, symmetric=True, scale_search=True``: a plan's rounding settings, for messages."""
    return ", ".join(f"{k}={v}" for k, v in plan.quantizer_settings.items())


def _code_bytes(qw) -> int:
    """Memory a QuantizedWeight holds: codes, scales and zero points."""
    return sum(t.numel() * t.element_size() for t in (qw.qweight, qw.scales, qw.zeros) if t is not None)


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
        self.blocks = decoder_blocks(model)
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
    """Measure plans fast on a fixed token budget: reference outputs captured once, integer codes cached.

    ``evaluate(plan)`` returns an ``EvalReport`` (perplexity, KL, top-1 against the float model)
    after swapping the plan's layers in: no second reference run, and no re-quantization of the
    layers whose codes are still cached. ``progress`` shows bars for the reference and baseline runs.
    """

    def __init__(self, lm: LoadedModel, ids: torch.Tensor, *, variants: LayerVariants | None = None,
                 ctx: int | None = None, batch_size: int = 4, reference: ReferenceOutputs | None = None,
                 progress: bool = False):
        self.lm = lm
        self.progress = progress
        self.ids = ids
        max_pos = getattr(lm.config, "max_position_embeddings", None) or DEFAULT_CTX
        self.ctx = min(ctx or DEFAULT_CTX, max_pos, len(ids))
        self.batch_size = batch_size
        self.variants = variants or LayerVariants(lm)
        self._reference = reference
        if reference is not None and not reference.keep_bytes:  # a reference passed in is compared many times here too
            reference.keep_log_probs(KEPT_REFERENCE_BYTES)
        self.baseline: EvalReport | None = None
        self.replay = BlockReplay(lm.model)  # recorded on the float model: for single-layer trials
        self._plan_replay = BlockReplay(lm.model)  # recorded on the last plan evaluated: for small edits
        self._last_plan: dict[str, str | None] | None = None

    @property
    def reference(self) -> ReferenceOutputs:
        if self._reference is None:
            self._reference = capture_reference(self.lm.model, self.ids, ctx=self.ctx, batch_size=self.batch_size,
                                                progress=self.progress)
            self._reference.keep_log_probs(KEPT_REFERENCE_BYTES)
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
                                         batch_size=self.batch_size, progress=self.progress, desc="float model")
            if self.replay.outputs is not None:
                with self.replay.skipping(self.replay.depth):
                    check = evaluate(self.lm.model, self.ids, reference=ref, ctx=self.ctx,
                                     batch_size=self.batch_size, progress=False)
                if abs(check.nll - self.baseline.nll) > 1e-6 * max(1.0, abs(self.baseline.nll)):
                    self.replay.enabled = False
        return self.baseline

    def evaluate_model(self, model: nn.Module, *, progress: bool = False, desc: str = "evaluate") -> EvalReport:
        """``model`` (a quantized one built from the float model) on these tokens, against the reference."""
        return evaluate(model, self.ids, reference=self.reference, ctx=self.ctx, batch_size=self.batch_size,
                        progress=progress, desc=desc)

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
        if not self.variants.matches(plan):
            raise PlanError(f"this evaluator caches weights made with {self.variants.describe()}; the plan asks for "
                            f"{_settings_text(plan)}: make a new evaluator for it (LayerVariants.for_plan)")
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
    trials_run: int = 0  # trials measured (or layers x precisions scored) by this call; 0 when cached
    score: str = "kl"  # "kl": measured per trial; "proxy": estimated in one pass (workbench.precision.proxy)
    score_reason: str = ""
    scale_search: bool = False  # layers rounded with the scale search; reports from before it existed: off
    full_range: bool = False  # layers rounded on the 16-level symmetric grid; reports from before it existed: off
    # "": text tokens; else what a VLM's trials answered (tokens: answer tokens; reference_perplexity: exp of
    # the float model's mean answer-token NLL)
    measured_on: str = ""

    @property
    def quantizer_settings(self) -> dict[str, object]:
        """The rounding settings the sweep measured: plans made from it (``autoplan``) carry them."""
        return {k: getattr(self, k) for k in QUANTIZER_SETTINGS}

    @property
    def score_label(self) -> str:
        """How the damages were obtained, for tables and chart titles."""
        return "measured KL" if self.score == "kl" else "estimated KL (Fisher proxy)"

    def layer(self, name: str) -> LayerSensitivity:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise PlanError(f"layer '{name}' is not in this sensitivity report ({len(self.layers)} layers)")

    def damage(self, name: str, precision: str, metric: str = "kl") -> float:
        """Damage of ``name`` alone at ``precision`` (measured or estimated: ``score``); 0 for float precisions."""
        p = get_precision(precision)
        if p is None or p.is_float:
            return 0.0
        d = self.layer(name).damage.get(p.name)
        if d is None:
            raise PlanError(f"no {p.name} measurement for '{name}'; sweep precisions were {list(self.precisions)}")
        return float(d[metric])

    def ranking(self, precision: str = "int4", metric: str = "kl") -> list[tuple[str, float]]:
        """Layers from most to least sensitive at ``precision`` (those it was measured on: a layout fits some)."""
        name = get_precision(precision).name
        return sorted(((layer.name, self.damage(layer.name, precision, metric)) for layer in self.layers
                       if name in layer.damage), key=lambda kv: -kv[1])

    def to_dict(self) -> dict:
        return {"model": self.model, "precisions": list(self.precisions), "tokens": self.tokens, "ctx": self.ctx,
                "group_size": self.group_size, "symmetric": self.symmetric, "scale_search": self.scale_search,
                "reference_perplexity": self.reference_perplexity, "seconds": self.seconds,
                "trials_run": self.trials_run, "score": self.score, "score_reason": self.score_reason,
                "metric": METRICS[self.score], "layers": [layer.to_dict() for layer in self.layers],
                **({"full_range": True} if self.full_range else {}),
                **({"measured_on": self.measured_on} if self.measured_on else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SensitivityReport":
        try:
            return cls(d["model"], tuple(d["precisions"]), int(d["tokens"]), int(d["ctx"]), d["group_size"],
                       bool(d["symmetric"]), float(d["reference_perplexity"]),
                       [LayerSensitivity.from_dict(x) for x in d["layers"]], float(d.get("seconds", 0.0)),
                       int(d.get("trials_run", 0)), str(d.get("score", "kl")), str(d.get("score_reason", "")),
                       bool(d.get("scale_search", False)), bool(d.get("full_range", False)),
                       str(d.get("measured_on", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise WorkspaceError(f"sensitivity report is malformed (field {e}); delete it and sweep again") from None

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "SensitivityReport":
        return cls.from_dict(read_json_file(path, "sensitivity report", error=WorkspaceError,
                                            hint="; run `workbench sensitivity MODEL` first"))


def fitting(info, precisions: Sequence[str]) -> list[str]:
    """The precisions a layer can take: a fixed block layout only where its blocks divide the layer's inputs."""
    return fitting_precisions(precisions, info.shape[1])


def _trial_key(name: str, precision: str) -> str:
    return f"{name}|{precision}"


def _trial(state: tuple, task: tuple[str, str]) -> dict:
    """One layer alone at one precision, measured against the baseline: a sweep's task on any backend."""
    evaluator, base = state
    name, p = task
    t0 = time.perf_counter()
    report = evaluator.evaluate_assignments({name: p}, desc=f"{name} {p}")
    return {"kl": report.kl_divergence, "ppl": report.perplexity, "ppl_delta": report.perplexity - base.perplexity,
            "nll_delta": report.nll - base.nll, "top1": report.top1_agreement,
            "seconds": time.perf_counter() - t0}


def _worker_state(payload: tuple) -> tuple:
    """A worker's own evaluator (the same tokens, context and rounding) and its baseline, built once."""
    lm, ids, ctx, batch_size, settings = payload
    evaluator = PlanEvaluator(lm, ids, ctx=ctx, batch_size=batch_size,
                              variants=LayerVariants(lm, **settings, cache_bytes=0))
    return evaluator, evaluator.evaluate_baseline()


def _sweep(evaluator: PlanEvaluator, layers: Sequence, precisions: Sequence[str], progress_path: Path | None,
           progress: bool, on_trial: Callable[[str, str, dict], None] | None,
           backend=None) -> tuple[dict, float, int, float]:
    """Run every missing trial on ``backend`` (default: this process), saving progress after each result.

    Returns (trials, reference perplexity, trials run now, seconds spent on trials in all runs).
    """
    from tqdm.auto import tqdm
    backend = backend or LocalBackend()
    state = {"trials": {}, "seconds": 0.0}
    if progress_path is not None and progress_path.is_file():
        try:
            state = json.loads(progress_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:  # a progress file is only ever replaced atomically; be safe anyway
            state = {"trials": {}, "seconds": 0.0}
    trials: dict[str, dict] = state["trials"]
    pairs = [(info, p) for info in layers for p in fitting(info, precisions)]
    todo = [(info.name, p) for info, p in pairs if _trial_key(info.name, p) not in trials]
    total = len(pairs)
    if todo and len(todo) < total:  # said, so a quick finish is not mistaken for a fast sweep
        import logging
        logging.getLogger("workbench").info(f"resuming the sensitivity sweep from {progress_path}: "
                                            f"{total - len(todo)} of {total} trials were measured by an earlier run")
    base = evaluator.evaluate_baseline()
    ran = 0
    with tqdm(total=total, initial=total - len(todo),
              desc="sensitivity", unit="trial", disable=not progress) as bar:
        def done(task: tuple[str, str], result: dict) -> None:
            nonlocal ran
            result = dict(result)
            seconds = result.pop("seconds")
            trials[_trial_key(*task)] = result
            state["seconds"] = float(state.get("seconds", 0.0)) + seconds
            ran += 1
            if progress_path is not None:
                atomic_write_json(progress_path, state)
            if on_trial is not None:
                on_trial(*task, result)
            bar.update(1)

        v = evaluator.variants
        backend.run(todo, _trial, done, state=(evaluator, base), setup=_worker_state,
                    payload=(evaluator.lm, evaluator.ids, evaluator.ctx, evaluator.batch_size,
                             dict(v.settings.quantizer_settings)))
    return trials, base.perplexity, ran, float(state.get("seconds", 0.0))


def choose_score(lm: LoadedModel, trials: int, tokens: int, score: str = "auto") -> tuple[str, str]:
    """``"kl"`` or ``"proxy"`` for a sweep of ``trials`` trials on ``tokens`` tokens, and why.

    ``auto`` measures KL while trials x tokens x parameters stays under ``AUTO_KL_MAX_WORK`` (a
    few minutes of a 2-core CPU) and uses the one-pass proxy above it, where the proxy can follow
    the model's blocks.
    """
    if score not in ("auto", *SCORES):
        raise PlanError(f"score must be one of auto, {', '.join(SCORES)}; got '{score}'")
    if score != "auto":
        return score, f"{score} asked for"
    work = trials * tokens * lm.parameters
    size = f"{trials} trials x {tokens:,} tokens x {lm.parameters / 1e6:,.1f} M parameters"
    if work <= AUTO_KL_MAX_WORK:
        return "kl", f"auto: {size} is within the {AUTO_KL_MAX_WORK:.0e} limit for measured KL"
    if not proxy_supported(lm.model):
        return "kl", f"auto: {size} is above the {AUTO_KL_MAX_WORK:.0e} limit, but the proxy cannot follow " \
                     "this architecture's blocks"
    return "proxy", f"auto: {size} is above the {AUTO_KL_MAX_WORK:.0e} limit for measured KL"


def _proxy_trials(evaluator: PlanEvaluator, layers: Sequence, precisions: Sequence[str], progress: bool,
                  on_trial: Callable[[str, str, dict], None] | None) -> tuple[dict, float, int, float]:
    """Every layer x precision scored in one pass; the same shape of result as a sweep of measured trials.

    The NLL change is taken equal to the estimated KL (what it is in expectation over text drawn
    from the model itself).
    """
    v = evaluator.variants
    scores = proxy_scores(evaluator.lm, evaluator.ids, precisions, **v.settings.quantizer_settings,
                          ctx=evaluator.ctx, progress=progress)
    ref = scores.reference_perplexity
    trials = {}
    for info in layers:
        for p in fitting(info, precisions):
            kl = scores.damage[info.name][p]
            trials[_trial_key(info.name, p)] = result = {"kl": kl, "nll_delta": kl, "ppl": ref * math.exp(kl),
                                                         "ppl_delta": ref * math.expm1(kl)}
            if on_trial is not None:
                on_trial(info.name, p, result)
    return trials, ref, len(trials), scores.seconds


def run_sensitivity(lm: LoadedModel, *, ids: torch.Tensor | None = None, text_path: str | Path | None = None,
                    tokens: int = DEFAULT_SWEEP_TOKENS, precisions: Sequence[str] | None = None,
                    group_size: int | None = DEFAULT_GROUP_SIZE, symmetric: bool = True,
                    scale_search: bool = DEFAULT_SCALE_SEARCH, ctx: int | None = None, layers: Iterable[str] | None = None, evaluator: PlanEvaluator | None = None,
                    full_range: bool = False,
                    score: str = "auto", workspace: Workspace | None = None, force: bool = False,
                    progress: bool = True, on_trial: Callable[[str, str, dict], None] | None = None,
                    backend=None, images: VisionEvalSet | str | Path | None = None,
                    questions: int = DEFAULT_SWEEP_QUESTIONS) -> SensitivityReport:
    """Sweep every quantizable layer x precision; cached and resumable when a ``workspace`` is given.

    ``ids`` (or ``text_path``, default the held-out text) is cut to ``tokens`` tokens. Pass an
    ``evaluator`` to share its cached weights and reference outputs (the override panel does); its
    variants' settings then replace ``group_size``, ``symmetric`` and ``scale_search``.
    ``precisions`` None sweeps every registered integer precision (``sweep_precisions``).
    ``score``: ``kl`` measures each trial, ``proxy`` estimates every trial in one pass
    (``workbench.precision.proxy``), ``auto`` picks by the sweep's size (``choose_score``); the report says
    which, and why. ``on_trial(name, precision, result)`` is called after each trial. ``backend``
    (``workbench.model.sweep_backends``) runs measured trials elsewhere, on Ray; default: this process. The
    result does not depend on it, so neither does the workspace key.

    A vision-language model without ``ids`` or ``text_path`` is measured on pictures: the answer tokens' KL
    given the image over the first ``questions`` questions of ``images`` (an image set, default the bundled
    demo-vl held-out set), every trial measured (the proxy follows text only), in this process.
    """
    lm.require_float("sensitivity")  # a quantized model's layers are already integers: sweep its float source
    vision = getattr(lm, "is_vision", False)
    if images is not None and not vision:
        raise DataError(f"'{lm.path}' is a text model (no vision encoder): sweep it on text, drop --images")
    pictures = isinstance(evaluator, VisionPlanEvaluator) or (
        evaluator is None and vision and ids is None and text_path is None)
    if images is not None and not pictures:
        raise DataError("give text (--data) or pictures (--images) to sweep on, not both")
    if pictures:
        if score == "proxy":
            raise PlanError("the Fisher proxy estimates KL on text; a sweep on pictures measures every trial: use "
                            "--score kl or auto")
        if backend is not None and not isinstance(backend, LocalBackend):
            raise PlanError("a sweep on pictures runs in this process: drop --workers / --ray")
    if precisions is None:
        precisions = sweep_precisions(evaluator.variants.symmetric if evaluator is not None else symmetric, lm.layers)
    for p in precisions:
        prec = get_precision(p)
        if prec is None or prec.is_float:
            raise PlanError(f"sensitivity sweeps integer precisions ({', '.join(sweep_precisions())}), not '{p}'")
    precisions = tuple(get_precision(p).name for p in precisions)
    if evaluator is None and pictures:  # a sweep uses each layer's codes once: keep none of them
        evaluator = VisionPlanEvaluator(
            lm, LayerVariants(lm, group_size=group_size, symmetric=symmetric, scale_search=scale_search,
                              cache_bytes=0, full_range=full_range),
            images if isinstance(images, VisionEvalSet) else vision_eval_set(images), questions=questions,
            progress=progress)
    if evaluator is None:
        if ids is None:
            ids = evaluation_tokens(lm, text_path, tokens)
        else:
            ids = ids.reshape(-1)[:tokens]
        # a sweep uses each layer's codes once: keep none of them
        evaluator = PlanEvaluator(lm, ids, ctx=ctx, progress=progress,
                                  variants=LayerVariants(lm, group_size=group_size, symmetric=symmetric,
                                                         scale_search=scale_search, cache_bytes=0,
                                                         full_range=full_range))
    variants = evaluator.variants
    names = list(layers) if layers is not None else [info.name for info in lm.layers]
    unknown = [n for n in names if n not in {info.name for info in lm.layers}]
    if unknown:
        raise PlanError(f"layer(s) {unknown[:3]} are not quantizable layers of this model")
    infos = [lm.layer(n) for n in names]
    for p in precisions:  # a fixed block layout is measured on the layers it fits, and refused only if none
        if all(get_precision(p).misfit(info.shape[1]) for info in infos):
            raise PlanError(f"cannot sweep {p} on these layers: {get_precision(p).misfit(infos[0].shape[1])}; "
                            "leave it out (the default sweep does)")
    if pictures:
        score, reason = "kl", f"measured on {evaluator.describe()}"
        measured = {"pictures": evaluator.fingerprint, "questions": len(evaluator.questions)}
    else:
        score, reason = choose_score(lm, len(infos) * len(precisions), len(evaluator.ids), score)
        measured = {"tokens": hashlib.sha256(evaluator.ids.numpy().tobytes()).hexdigest()[:16],
                    "n_tokens": int(len(evaluator.ids)), "ctx": evaluator.ctx}
    inputs = {"model": model_fingerprint(lm.model), **measured, "precisions": list(precisions),
              "group_size": variants.group_size, "symmetric": variants.symmetric, "layers": names, "method": "rtn"}
    if score == "proxy":  # measured sweeps keep the inputs (and cache keys) they always had
        inputs.update(score="proxy", proxy=PROXY_VERSION)
    if variants.scale_search:  # sweeps without it keep their keys; one with it never reads one made without
        inputs["scale_search"] = True
    if variants.full_range:
        inputs["full_range"] = True

    def measure(progress_path: Path | None) -> tuple[dict, float, int, float]:
        if score == "proxy":
            return _proxy_trials(evaluator, infos, precisions, progress, on_trial)
        return _sweep(evaluator, infos, precisions, progress_path, progress, on_trial, backend)

    def build(trials: dict, ref_ppl: float, ran: int, seconds: float) -> SensitivityReport:
        out = []
        for info in infos:
            out.append(LayerSensitivity(info.name, info.block, info.role, tuple(info.shape), info.parameters,
                                        info.tied_to, {p: trials[_trial_key(info.name, p)]
                                                       for p in fitting(info, precisions)}))
        n = evaluator.evaluate_baseline().tokens if pictures else int(len(evaluator.ids))
        return SensitivityReport(str(lm.name), precisions, n, evaluator.ctx, variants.group_size,
                                 variants.symmetric, ref_ppl, out, seconds, ran, score, reason, variants.scale_search,
                                 variants.full_range, reason.removeprefix("measured on ") if pictures else "")

    if workspace is None:
        return build(*measure(None))

    ran_here = {"n": 0}

    def compute(partial: Path) -> dict:
        trials, ref_ppl, ran, seconds = measure(partial / PROGRESS_FILE)
        ran_here["n"] = ran
        report = build(trials, ref_ppl, ran, seconds)
        report.save(partial / REPORT_FILE)
        return {"layers": len(infos), "precisions": list(precisions), "tokens": report.tokens, "score": score,
                "seconds": round(seconds, 3), "reference_perplexity": ref_ppl}

    artifact = workspace.get_or_compute(SENSITIVITY_STEP, inputs, compute, force=force)
    report = SensitivityReport.load(artifact.file(REPORT_FILE))
    report.trials_run = ran_here["n"]
    if ran_here["n"] == 0:
        report.score_reason = f"{reason}; read from the workspace"
    return report
