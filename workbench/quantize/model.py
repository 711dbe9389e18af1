"""Apply a plan to a model: which layers become which integers, with what group size, by RTN or AWQ.

    qm = quantize_model(lm, QuantPlan.uniform("int4"), method="rtn")
    qm.layers            # per layer: precision, group size, fallback note
    qm.apply_(model)     # write the dequantized weights into a float model (the simulation)
    qm.save("out/demo-int4")

When a layer's input size is not a multiple of the plan's group size, the layer falls back to the
largest multiple of 32 below the group size that divides the input size, else to the smallest one
above it that does, else to per-channel, and its report says so (``strict=True`` makes that an
error instead).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ..errors import PlanError, WorkspaceError
from ..numerics.memory import drop_file_pages
from .plan import QuantPlan, get_precision
from ..units import text_table
from .qtensor import SUPPORTED_BITS, QuantizedWeight, SubScales
from .rtn import quantize_weight
from .storage import save_quantized
from ..files.workspace import model_fingerprint
from .awq import (DEFAULT_GRID, default_search_tokens, fold_awq_scales, load_awq_search, save_awq_search,
                  scaled_importance, search_awq, SEARCH_VERSION)
from .gptq import default_gptq_tokens, search_gptq
from .layers import QuantEmbedding, QuantLinear

__all__ = ["LayerQuantReport", "QuantizedModel", "quantize_model", "resolve_group_size", "METHODS", "activation_importance",
           "CALIBRATED_METHODS", "bits_per_weight", "LayerQuantizer", "layer_quantizer", "release_layer_weight"]

METHODS = ("rtn", "awq", "gptq", "awq+gptq")
CALIBRATED_METHODS = ("awq", "gptq", "awq+gptq")  # they read calibration samples
FALLBACK_MULTIPLE = 32  # fallback group sizes stay multiples of 32, as kernels and NPUs expect


def resolve_group_size(in_features: int, group_size: int | None,
                       precision=None) -> tuple[int | None, str | None]:
    """The group size a layer with ``in_features`` inputs gets, and a note when it had to fall back.

    A ``precision`` with a fixed layout (``int3-k``: 16-weight groups in 256-weight super-blocks) has its
    own group size, and a layer it does not fit is refused: its blocks cannot fall back.
    """
    prec = get_precision(precision)
    if prec is not None and prec.group_size:
        why = prec.misfit(in_features)
        if why:
            raise PlanError(f"{why}; give the layer a precision with float16 group scales (int3, int6, ...)")
        return prec.group_size, None
    if group_size is None or in_features % group_size == 0:
        return group_size, None
    below = range(group_size - group_size % FALLBACK_MULTIPLE, 0, -FALLBACK_MULTIPLE)
    above = range(group_size - group_size % FALLBACK_MULTIPLE + FALLBACK_MULTIPLE, in_features, FALLBACK_MULTIPLE)
    for candidates, where in ((below, "below"), (above, "above")):
        for g in candidates:
            if in_features % g == 0:
                return g, (f"group size {group_size} does not divide {in_features} input features; using {g}, the "
                           f"nearest multiple of {FALLBACK_MULTIPLE} {where} it that does")
    return None, (f"group size {group_size} does not divide {in_features} input features and no multiple of "
                  f"{FALLBACK_MULTIPLE} below {in_features} does; using per-channel scales")


@dataclass(frozen=True)
class LayerQuantizer:
    """How one layer's weight is rounded: every argument ``quantize_weight`` gets for it.

    ``layer_quantizer`` is the one place these come from, so ``quantize_model``, the sensitivity
    sweep's ``LayerVariants``, the plan evaluator and the Fisher proxy round a layer alike.
    """

    bits: int
    group_size: int | None  # after the fallback (``resolve_group_size``)
    symmetric: bool
    scale_bits: "int | SubScales | None" = None  # two-level sub-scale layout; None: a float16 scale per group
    scale_search: bool = False
    fallback: str | None = None  # why ``group_size`` differs from the plan's
    full_range: bool = False  # the 16-level symmetric grid (float16 group scales only)
    minimums: bool = False  # a float16 minimum beside each float16 group scale (llama.cpp's Q4_1 / Q5_1)

    def quantize(self, w: torch.Tensor, *, clip_max: torch.Tensor | None = None,
                 importance: torch.Tensor | None = None) -> QuantizedWeight:
        """RTN of ``w`` (``[out, in]``); AWQ's ``clip_max`` replaces the scale search (its clips set the ranges).
        ``importance`` (``[in]``, mean squared input per column) weighs the scale search's error."""
        return quantize_weight(w.detach().to(torch.float32), self.bits, self.group_size, self.symmetric,
                               clip_max=clip_max, scale_search=self.scale_search and clip_max is None,
                               scale_bits=self.scale_bits, full_range=self.full_range,
                               importance=importance if self.scale_search and clip_max is None else None,
                               minimums=self.minimums)


def layer_quantizer(plan: QuantPlan, precision, shape: tuple[int, int], *, name: str | None = None,
                    strict: bool = False) -> LayerQuantizer | None:
    """The quantizer ``plan`` gives a layer of ``shape`` at ``precision`` (None for float precisions and None).

    Raises ``PlanError`` for an unsupported width, a two-level precision in an asymmetric plan, and
    (``strict``) a group size that does not divide the layer's input features.
    """
    prec = get_precision(precision)
    if prec is None or prec.is_float:
        return None
    where = f"layer '{name}': " if name else ""
    if prec.bits not in SUPPORTED_BITS:
        raise PlanError(f"{where}{prec.name} ({prec.bits}-bit) weights are not supported; "
                        f"weight quantization supports {', '.join(f'int{b}' for b in SUPPORTED_BITS)}")
    if prec.two_level and not plan.symmetric and not prec.minimums:
        raise PlanError(f"{where}{prec.name} has two-level scales, which are symmetric; plan "
                        "with symmetric=true (drop --asymmetric) or give the layer a precision with float16 "
                        "scales")
    try:
        gs, note = resolve_group_size(shape[1], plan.group_size, prec)
    except PlanError as e:  # a fixed block layout that does not fit the layer
        raise PlanError(f"{where}{e}") from None
    if note and strict:
        raise PlanError(f"{where}{note} (strict mode); choose a group size that divides "
                        f"{shape[1]} or drop --strict to allow the fallback")
    return LayerQuantizer(prec.bits, gs, plan.symmetric, prec.sub_scales, plan.scale_search, note,
                          plan.full_range and not prec.two_level and not prec.float_minimums, prec.float_minimums)


def bits_per_weight(layers, precisions: Mapping[str, str | None], group_size: int | None = None,
                    symmetric: bool = True) -> float:
    """The one bits-per-weight figure: stored bits of the quantizable layers' weights per weight.

    Integer layers count their packed codes, scales as stored (float16 per group, or two-level: integer
    sub-scales plus float16 per channel) and zero points (``Precision.weight_bytes``)
    at the group size each really gets (``resolve_group_size``), float layers their width, and layers
    left alone 16 bits; a tied weight counts once when both uses share a precision. Norms and biases
    are not weights here. Plans (``autoplan.plan_footprint``, from layer shapes) and quantized models
    (``QuantizedModel.bits_per_weight``) both report this, so the same plan shows the same figure.
    """
    counted: dict[tuple[str, str], tuple[int, int]] = {}
    for info in layers:
        prec = get_precision(precisions.get(info.name)) or get_precision("fp16")
        key = (info.tied_to or info.name, prec.name)
        if key in counted:
            continue
        out_features, in_features = info.shape
        gs = None if prec.is_float else resolve_group_size(in_features, group_size, prec)[0]
        counted[key] = (prec.weight_bytes(out_features, in_features, gs, symmetric), out_features * in_features)
    weights = sum(n for _, n in counted.values())
    return 8 * sum(b for b, _ in counted.values()) / weights if weights else 0.0


@dataclass
class LayerQuantReport:
    """What happened to one layer."""

    name: str
    kind: str
    shape: tuple[int, int]
    precision: str | None  # None = left as it was
    group_size: int | None = None  # the group size actually used (None = per-channel or float)
    fallback: str | None = None  # why the group size differs from the plan's
    tied_to: str | None = None
    untied: bool = False  # tied to the embedding in the source, stored separately here
    weight_error: float | None = None  # ||W - dequantized|| / ||W|| (in the stored, AWQ-scaled, coordinates)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass
class QuantizedModel:
    """A plan's result: integer weights per layer plus any float tensors the method changed."""

    plan: QuantPlan
    method: str
    weights: dict[str, QuantizedWeight]
    layers: list[LayerQuantReport]
    float_overrides: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # param name -> float32
    source: object = field(default=None, repr=False, compare=False)  # the LoadedModel it came from
    awq: dict | None = field(default=None, repr=False)
    gptq: dict | None = field(default=None, repr=False)  # settings and seconds of the GPTQ pass
    seconds: float = 0.0

    # -- lookup ----------------------------------------------------------------------------------
    def layer(self, name: str) -> LayerQuantReport:
        for r in self.layers:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def precisions(self) -> dict[str, str | None]:
        return {r.name: r.precision for r in self.layers}

    @property
    def fallbacks(self) -> dict[str, str]:
        return {r.name: r.fallback for r in self.layers if r.fallback}

    @property
    def unties_embeddings(self) -> bool:
        return any(r.untied for r in self.layers)

    # -- use -------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply_(self, model: nn.Module) -> nn.Module:
        """Write the dequantized weights (and changed float tensors) into ``model`` in place.

        fp16 layers are rounded to float16 values, so the float model computes what the saved
        and exported model computes. Tied embeddings are untied first when the plan gives
        ``lm_head`` and the embedding different precisions.
        """
        if self.unties_embeddings:
            untie_embeddings_(model)
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, t in self.float_overrides.items():
            if name not in params:
                raise PlanError(f"parameter '{name}' of the quantized model is missing from the model it is "
                                "applied to; apply it to the architecture it was made from")
            params[name].data.copy_(t.to(params[name].dtype))
        for r in self.layers:
            mod = model.get_submodule(r.name)
            if r.name in self.weights:
                mod.weight.data.copy_(self.weights[r.name].dequantize().to(mod.weight.dtype))
            elif r.precision is not None and get_precision(r.precision).bits == 16:
                mod.weight.data.copy_(mod.weight.data.to(torch.float16).to(mod.weight.dtype))
        return model

    @torch.no_grad()
    def build_model(self, model: nn.Module | None = None) -> nn.Module:
        """The quantized network as a module, without a second float copy of ``model`` (default: the source).

        A copy of the module tree that shares every tensor the plan leaves alone; integer layers
        become ``QuantLinear`` / ``QuantEmbedding`` (computing from the codes), fp16 layers are
        rounded to float16 values, and tensors AWQ changed are swapped in. ``model`` is unchanged.
        """
        import copy

        model = model if model is not None else getattr(self.source, "model", None)
        if model is None:
            raise PlanError("build_model needs the model this result was made from")
        memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        new = copy.deepcopy(model, memo)
        if self.unties_embeddings:
            for cfg in {id(c): c for c in (new.config, new.config.get_text_config())}.values():
                cfg.tie_word_embeddings = False
        params = dict(new.named_parameters(remove_duplicate=False))
        rounded_by_id: dict[int, nn.Parameter] = {}  # a tied weight is rounded once and stays tied
        for name, t in self.float_overrides.items():
            if name not in params:
                raise PlanError(f"parameter '{name}' of the quantized model is missing from the model it is "
                                "applied to; use the architecture it was made from")
            owner, _, leaf = name.rpartition(".")
            setattr(new.get_submodule(owner), leaf, nn.Parameter(t, requires_grad=False))
        for r in self.layers:
            owner, _, leaf = r.name.rpartition(".")
            parent = new.get_submodule(owner) if owner else new
            mod = getattr(parent, leaf)
            if r.name in self.weights:
                qw = self.weights[r.name]
                device = _device_of(mod, new)
                if isinstance(mod, nn.Embedding):
                    setattr(parent, leaf, QuantEmbedding(qw, mod.padding_idx).to(device))
                else:
                    setattr(parent, leaf, QuantLinear(qw, getattr(mod, "bias", None)).to(device))
            elif r.precision is not None and get_precision(r.precision).bits == 16:
                w = mod.weight
                if id(w) not in rounded_by_id:
                    rounded_by_id[id(w)] = w if _fp16_exact(w) else \
                        nn.Parameter(w.detach().to(torch.float16).to(w.dtype), requires_grad=False)
                mod.weight = rounded_by_id[id(w)]
        return new.eval()

    def save(self, directory: str | Path, *, report: dict | None = None) -> Path:
        """Save as a directory a float model loader and every exporter can read (see ``io``)."""
        return save_quantized(self, directory, report=report)

    def storage_bytes(self) -> int:
        """Bytes of all layer weights as stored (packed integers + scales + zeros, float layers), counted from the
        codes and shapes: the stored tensors (``layer_storage``) are not built, which at a 1.5 B model held a
        second copy of every weight at the end of `workbench quantize`."""
        if self.source is None:
            raise WorkspaceError("this QuantizedModel has no source model to take its float tensors from; "
                                 "create it with quantize_model or load_quantized")
        params = {**dict(self.source.model.named_parameters(remove_duplicate=False)), **self.float_overrides}
        total = 0
        for r in self.layers:
            if r.tied_to and not r.untied:
                continue  # stored once, under the embedding
            if r.name in self.weights:
                total += self.weights[r.name].storage_bytes()
                continue
            w = params[f"{r.name}.weight"]
            prec = get_precision(r.precision) if r.precision else None
            width = prec.bits // 8 if prec is not None and prec.bits in (16, 32) else \
                2 if w.dtype in (torch.float16, torch.bfloat16) or _fp16_exact(w) else 4
            total += w.numel() * width
        return total

    @property
    def parameters(self) -> int:
        return sum(r.shape[0] * r.shape[1] for r in self.layers if not (r.tied_to and not r.untied))

    @property
    def bits_per_weight(self) -> float:
        """Average stored bits per layer weight (``bits_per_weight``: the same figure as the plan's estimate)."""
        return bits_per_weight(self.layers, self.precisions, self.plan.group_size, self.plan.symmetric)

    def table(self) -> str:
        rows = [("layer", "shape", "precision", "group", "error", "note")]
        for r in self.layers:
            note = r.fallback or (f"untied from {r.tied_to}" if r.untied else (f"tied to {r.tied_to}" if r.tied_to
                                                                                  else ""))
            rows.append((r.name, "x".join(map(str, r.shape)), r.precision or "(unchanged)",
                         "-" if r.name not in self.weights else str(r.group_size or "channel"),
                         "" if r.weight_error is None else f"{r.weight_error:.4f}", note))
        return text_table(rows)

    def to_dict(self) -> dict:
        return {"method": self.method, "plan": self.plan.to_dict(), "seconds": self.seconds,
                "bits_per_weight": self.bits_per_weight, "layers": [r.to_dict() for r in self.layers]}


def _fp16_exact(w: torch.Tensor, rows: int = 8192) -> bool:
    """Whether float16 holds every value of ``w`` (checked a slice of rows at a time: no full-size copies)."""
    if w.dtype == torch.float16:
        return True
    w = w.detach()
    return all(torch.equal(w[i:i + rows].to(torch.float16).to(w.dtype), w[i:i + rows])
               for i in range(0, w.shape[0], rows))


def release_layer_weight(model: nn.Module, name: str) -> None:
    """Swap layer ``name``'s weight for a meta tensor of its shape and dtype (its memory goes back once nothing
    else holds it; a reference's pinned output layer keeps its own); a forward through it then fails instead of
    computing with freed memory."""
    mod = model.get_submodule(name)
    w = mod.weight
    mod.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
    if sys.getrefcount(w) <= 2:  # nothing else holds it (this frame and the call's argument)
        drop_file_pages(w)  # a weight read straight from its file: its pages would stay resident otherwise


def round_layer_weight_(model: nn.Module, name: str) -> None:
    """Give layer ``name`` its weight rounded to float16 values (in its own dtype), unless something besides the
    layer holds the weight (a reference's pinned output layer reads the float values): the float copy's file pages
    go back as the rounded one is made, so the quantized model's fp16 layers cost no second copy."""
    mod = model.get_submodule(name)
    w = mod.weight
    if sys.getrefcount(w) > 3 or _fp16_exact(w):  # held elsewhere, or already float16 values
        return
    mod.weight = nn.Parameter(w.detach().to(torch.float16).to(w.dtype), requires_grad=False)
    drop_file_pages(w)


def _device_of(mod: nn.Module, model: nn.Module) -> torch.device:
    """Where ``mod`` computes: its first parameter not released to the meta device, else the model's."""
    for t in [*mod.parameters(), *model.parameters()]:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def untie_embeddings_(model: nn.Module) -> nn.Module:
    """Give ``lm_head`` its own copy of the embedding matrix and mark the config untied."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and inp is not None and out.weight is inp.weight:
        out.weight = nn.Parameter(inp.weight.detach().clone(), requires_grad=inp.weight.requires_grad)
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        cfg.tie_word_embeddings = False
    return model


def _samples_and_stats(calibration, stats):
    """Accept a CalibrationSet, a (CalibrationSet, CalibrationStats) pair or a list of token tensors."""
    if isinstance(calibration, tuple) and len(calibration) == 2 and \
            (calibration[1] is None or hasattr(calibration[1], "layers")):
        calibration, stats = calibration[0], calibration[1] or stats
    samples = getattr(calibration, "samples", calibration)
    if not isinstance(samples, (list, tuple)) or not samples or \
            not all(isinstance(s, (torch.Tensor, dict)) for s in samples):
        raise PlanError("AWQ and GPTQ need calibration data: pass calibration=CalibrationSet (workbench.evaluation.data."
                        "load_calibration_set) or a list of 1-D token-id tensors")
    mean_abs = None
    if stats is not None:
        mean_abs = {name: st.mean_abs for name, st in stats.layers.items() if getattr(st, "mean_abs", None) is not None}
    return list(samples), mean_abs


def activation_importance(calibration, stats) -> dict[str, torch.Tensor]:
    """Per layer, each input column's mean squared activation over the calibration set (``rms^2`` from
    ``CalibrationStats``, given as ``stats`` or in a ``(set, stats)`` pair): what llama.cpp's importance
    matrix holds, and what the scale search weighs each column's rounding error by. Empty without stats."""
    if isinstance(calibration, tuple) and len(calibration) == 2 and hasattr(calibration[1], "layers"):
        stats = stats or calibration[1]
    if stats is None:
        return {}
    return {name: st.rms.float().square() for name, st in stats.layers.items()
            if getattr(st, "rms", None) is not None}


def _samples_key(samples) -> str:
    """A short hash of calibration token ids, for workspace keys."""
    import hashlib
    h = hashlib.sha256()
    for s in samples:
        if isinstance(s, dict):  # a picture's inputs: pixels and token ids
            for k in sorted(s):
                h.update(k.encode() + s[k].contiguous().numpy().tobytes() + b"|")
            continue
        h.update(s.reshape(-1).to(torch.int64).numpy().tobytes() + b"|")
    return h.hexdigest()[:16]


def _gptq_checkpoint(workspace, model, samples, spec, settings: dict, awq_search: dict | None):
    """Where a GPTQ run keeps its per-block progress: keyed by everything that decides its codes.

    None (no resume) without a workspace, or for AWQ+GPTQ on a search the workspace did not store.
    """
    if workspace is None or (awq_search is not None and not awq_search.get("workspace_key")):
        return None
    inputs = {"weights": model_fingerprint(model), "calibration": _samples_key(samples),
              "spec": {k: list(v) for k, v in sorted(spec.items())}, **settings,
              "awq": awq_search.get("workspace_key") if awq_search else None}
    return workspace.partial_path("gptq", workspace.key(inputs))


def _cached_awq_search(workspace, model, samples, mean_abs, spec, awq_tokens, progress, grids=None,
                       scale_search: bool = False) -> dict:
    """The AWQ search through the workspace: keyed by weights, calibration tokens, layer spec and settings."""
    import hashlib

    stats_key = None
    if mean_abs:
        hs = hashlib.sha256()
        for name in sorted(mean_abs):
            hs.update(name.encode() + mean_abs[name].to(torch.float32).numpy().tobytes())
        stats_key = hs.hexdigest()[:16]
    inputs = {"weights": model_fingerprint(model), "calibration": _samples_key(samples), "mean_abs": stats_key,
              "spec": {k: list(v) for k, v in sorted(spec.items())}, "grid": DEFAULT_GRID,
              "tokens": awq_tokens, "version": SEARCH_VERSION,
              **({"grids": {k: v for k, v in sorted(grids.items())}} if grids else {}),
              **({"scale_search": True} if scale_search else {})}

    def compute(partial):
        import shutil
        resume = partial / "resume"  # per-block progress; the partial directory is keyed by these inputs
        result = search_awq(model, samples, spec, mean_abs=mean_abs, progress=progress,
                            max_tokens=awq_tokens, checkpoint=resume, grids=grids, scale_search=scale_search)
        shutil.rmtree(resume, ignore_errors=True)
        save_awq_search(result, partial)
        return {"groups": len(result["groups"]), "tokens": result["tokens"], "seconds": result["seconds"]}

    art = workspace.get_or_compute("awq", inputs, compute)
    return {**load_awq_search(art.path), "workspace_key": art.key}  # conversions name it as their upstream


def quantize_model(lm, plan: QuantPlan, *, calibration=None, method: str | None = None, strict: bool = False,
                   progress: bool = True, stats=None, awq_search: dict | None = None,
                   awq_tokens: int | None = None, workspace=None, gptq_tokens: int | None = None,
                   act_order: bool = False, release_float: bool = False) -> QuantizedModel:
    """Quantize ``lm`` (a LoadedModel) by ``plan``; ``lm.model`` is not changed.

    ``method`` defaults to ``plan.method``. AWQ needs ``calibration`` (samples; statistics via
    ``stats`` or a ``(set, stats)`` pair supply mean |x| per channel); a cached ``awq_search``
    result skips the search, and a ``workspace`` stores and finds search results by their inputs.
    GPTQ needs ``calibration`` samples too (``gptq_tokens`` of them; ``act_order`` visits columns by
    decreasing input energy); layers outside the decoder blocks are rounded to nearest. ``awq+gptq``
    folds AWQ's searched scales into the float weights first, then runs GPTQ on them (without AWQ's clips).
    Two-level precisions (``int4-lpbq``) are rounded with two-level scales by every method (AWQ searches its
    scales and clips on the float16-scale grid of the same width, then rounds two-level).

    ``release_float``: a caller done with the float model (its reference outputs already captured, as `workbench
    quantize` does) lets each integer layer's float weight go once its codes exist (``release_layer_weight``), so
    float weights and codes are never both held whole: at a float32 1.5 B checkpoint, 7 GB + 1.3 GB of codes.
    ``lm.model`` then no longer computes; ``build_model`` and saving still work.
    """
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    method = (method or plan.method or "rtn").lower()
    if method not in METHODS:
        raise PlanError(f"unknown quantization method '{method}'; choose one of: {', '.join(METHODS)}")
    if hasattr(lm, "require_float"):
        lm.require_float("quantize")  # a quantized model is not re-quantized from its dequantized weights
    model = lm.model
    layers = list(lm.layers)
    names = [info.name for info in layers]
    plan.validate(names)
    reports, spec = [], {}
    quantizers: dict[str, LayerQuantizer] = {}
    precision_of = plan.resolve(names)
    for info in layers:
        pname = precision_of[info.name]
        r = LayerQuantReport(info.name, info.kind, info.shape, pname, tied_to=info.tied_to)
        if info.tied_to is not None and pname != precision_of[info.tied_to]:
            r.untied = True
        q = layer_quantizer(plan, pname, info.shape, name=info.name, strict=strict)
        if q is not None:
            r.group_size, r.fallback = q.group_size, q.fallback
            if not (info.tied_to and not r.untied):
                spec[info.name] = (q.bits, q.group_size, q.symmetric)
                quantizers[info.name] = q
        reports.append(r)
    # layers with two-level scales: their sub-scale width (GPTQ rounds them two-level too)
    scale_bits = {n: q.scale_bits for n, q in quantizers.items() if q.scale_bits is not None}
    minimums = frozenset(n for n, q in quantizers.items() if q.minimums)  # float16 minimums (Q4_1 / Q5_1)

    float_overrides: dict[str, torch.Tensor] = {}
    # the scale search weighs each input column's error by its mean square (after AWQ's scales, where folded)
    importance = activation_importance(calibration, stats) if method in ("rtn", "gptq", "awq") else {}
    clips: dict[str, torch.Tensor] = {}
    unfolded: dict[str, list[dict]] = {}  # AWQ search entries by block, not yet folded into float copies
    if method in ("awq", "awq+gptq") and spec:
        if awq_search is None:
            samples, mean_abs = _samples_and_stats(calibration, stats)
            awq_tokens = awq_tokens or default_search_tokens(model)
            # each alpha is scored on the grid the layer is rounded to (16 levels, float minimums)
            grids = {n: {"full_range": True} if q.full_range else {"minimums": True}
                     for n, q in quantizers.items() if n in spec and (q.full_range or q.minimums)}
            # a clip is kept where it beats the rounding the layer would otherwise get: the weighted scale search
            weighed = method == "awq" and plan.scale_search and bool(importance)
            if workspace is not None:
                awq_search = _cached_awq_search(workspace, model, samples, mean_abs, spec, awq_tokens, progress,
                                                grids, weighed)
            else:
                awq_search = search_awq(model, samples, spec, mean_abs=mean_abs, progress=progress,
                                        max_tokens=awq_tokens, grids=grids, scale_search=weighed)
        for entry in awq_search["groups"]:
            unfolded.setdefault(entry["group"]["block"], []).append(entry)
        clips = awq_search.get("clips", {}) if method == "awq" else {}  # GPTQ compensates its rounding itself

    gptq_weights: dict[str, QuantizedWeight] = {}
    gptq_result = None
    if method in ("gptq", "awq+gptq") and spec:
        samples, _ = _samples_and_stats(calibration, stats)

        def folded(block: str) -> dict[str, torch.Tensor]:  # AWQ's scales, folded as the block is reached
            return fold_awq_scales(model, {"groups": unfolded.get(block, [])}) if unfolded else {}
        settings = {"tokens": gptq_tokens or default_gptq_tokens(model), "act_order": act_order,
                    "checkpoint_version": 1,
                    "scale_search": plan.scale_search,
                    **({"full_range": True} if plan.full_range else {}),
                    "scale_bits": {n: list(astuple(v)) if v.top or v.super_block else v.bits
                                   for n, v in sorted(scale_bits.items())},
                    **({"minimums": sorted(minimums)} if minimums else {})}
        checkpoint = _gptq_checkpoint(workspace, model, samples, spec, settings,
                                      awq_search if method == "awq+gptq" else None)
        gptq_result = search_gptq(model, samples, spec, max_tokens=settings["tokens"], act_order=act_order,
                                  scale_search=plan.scale_search, progress=progress, block_params=folded,
                                  full_range=plan.full_range,
                                  scale_bits=scale_bits, checkpoint=checkpoint, minimums=minimums)
        if checkpoint is not None:
            import shutil
            shutil.rmtree(checkpoint, ignore_errors=True)
        gptq_weights = gptq_result.pop("weights")

    def fold_blocks(name: str | None = None) -> None:
        """Fold AWQ scales one block at a time (the block holding ``name``; all left when None), so only
        one block's float copies are alive beside the model while its layers are quantized."""
        for block in [b for b in unfolded if name is None or name.startswith(b + ".")]:
            float_overrides.update(fold_awq_scales(model, {"groups": unfolded.pop(block)}))

    params = dict(model.named_parameters(remove_duplicate=False))
    if method == "awq" and awq_search is not None:
        importance = scaled_importance(importance, awq_search)  # layers without a clip: the weighted search
    # a tied embedding is also the output layer, whose inputs weigh its columns (lookups use whole rows)
    for r in reports:
        if r.tied_to and not r.untied and r.name in importance and r.tied_to not in importance:
            importance[r.tied_to] = importance[r.name]
    weights: dict[str, QuantizedWeight] = {}
    for r in tqdm(reports, desc="quantize", unit="layer", disable=not progress, leave=False):
        if r.name not in spec:
            if r.tied_to and r.tied_to in weights and not r.untied:
                weights[r.name] = weights[r.tied_to]
                r.weight_error = reports[names.index(r.tied_to)].weight_error
            continue
        key = f"{r.name}.weight"
        fold_blocks(r.name)
        w = float_overrides.pop(key) if key in float_overrides else params[key].detach().float()
        qw = gptq_weights.pop(r.name, None)
        if qw is None:
            qw = quantizers[r.name].quantize(w, clip_max=clips[r.name].to(w.device) if r.name in clips else None,
                                             importance=importance.get(r.name))
        qw = qw.to(w.device)
        r.weight_error = float((w - qw.dequantize()).norm() / w.norm().clamp_min(1e-12))
        weights[r.name] = qw.to("cpu")  # codes are kept and saved on the CPU; build_model moves them back
        if release_float and not r.tied_to and not any(t.tied_to == r.name for t in reports):
            del w
            params.pop(key, None)
            release_layer_weight(model, r.name)
    fold_blocks()  # blocks whose layers all stay float still carry their scales
    if release_float:  # 16-bit layers rounded where they are, so build_model shares them instead of copying
        params.clear()
        for r in reports:
            prec = get_precision(r.precision) if r.precision else None
            if prec is not None and prec.is_float and prec.bits == 16 and not r.tied_to and \
                    not any(t.tied_to == r.name for t in reports):
                round_layer_weight_(model, r.name)
    return QuantizedModel(plan, method, weights, reports, float_overrides, source=lm, awq=awq_search, gptq=gptq_result,
                          seconds=time.perf_counter() - t0)
