"""Project a model and a plan onto a device before flashing it: memory, decode and prefill bounds.

    p = project("assets/model_shapes.json:qwen2.5-1.5b", "8gen3", QuantPlan.uniform("int8", keep_embeddings="int8"))
    p.decode_bound_tps, p.projected_decode_tps, p.fits_ram, p.unsupported_layers
    check_claim(p, decode_tps=40)            # above the bandwidth bound: impossible, with the arithmetic

Decode is memory-bound: each token reads every weight it uses once (the embedding only its one row)
plus the KV cache, so tokens/s <= bandwidth / those bytes. Prefill is bounded by compute (2 FLOPs per
weight per token plus attention, at the accelerator's TOPS for the plan's precision) and by reading
the weights once. Weight bytes come from the project's one accounting (``LoadedModel.layer_bytes``,
``quantize.bits_per_weight``); a model is taken as a LoadedModel, a config.json, a model directory,
a config dict or a name in ``assets/model_shapes.json``: shapes alone are enough, so a 7B is projected
on the meta device without reading its weights.

Real runtimes reach a fraction of the bound. ``fit_efficiency`` fits that fraction per device class to
the published measurements in ``assets/field_measurements.json`` (from shared/docs/FIELD.md), reports
each fit's error, and sets aside any published figure above its bound as impossible.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ..assets import ASSETS_DIR
from .runtimes import get_runtime, runtime_for_device
from .profiles import Device, get_device, load_devices
from ..errors import WorkbenchError
from ..quantize.plan import QuantPlan, get_precision
from ..quantize.model import bits_per_weight
from ..model.shapes import (KV_BYTES, SHAPES_FILE, PlanBytes, attention_dims, load_shape_config, model_shape,  # noqa: F401
                     plan_bytes)
from .vendor_fit import vendor_projection

if TYPE_CHECKING:
    from .vendor_fit import VendorProjection

__all__ = ["Projection", "PlanBytes", "plan_bytes", "AUTO", "ClassFit", "EfficiencyFit", "Claim", "model_shape",
           "load_shape_config", "project", "project_plans", "fit_efficiency", "check_claim", "check_memory_claim", "published_measurements",
           "plan_from_spec",
           "SHAPES_FILE", "MEASUREMENTS_FILE", "DEFAULT_CONTEXT", "DEFAULT_PROMPT"]

MEASUREMENTS_FILE = ASSETS_DIR / "field_measurements.json"
DEFAULT_CONTEXT = 1024  # tokens in the KV cache when decoding
DEFAULT_PROMPT = 128  # prompt tokens for prefill (the field's `--input_dim input_ids 1,128`)
AUTO = "auto"  # project(runtime=AUTO): the device class's own LLM runtime
GIB = 2 ** 30


# -- projection -----------------------------------------------------------------------------------------
@dataclass
class Projection:
    """What a plan of a model needs on a device and how fast the device's memory and compute allow it to run."""

    model: str
    device: str
    device_class: str
    parameters: int
    bits_per_weight: float
    weight_bytes: int  # resident weights (tied once, norms at fp16)
    bytes_per_token: int  # weights one decode step reads (the embedding: one row)
    context: int
    kv_bytes_per_token: int
    kv_bytes: int  # KV cache at ``context`` tokens
    buffer_bytes: int  # logits + the largest prefill activations at fp16: what the graph itself needs
    total_bytes: int
    ram_bytes: int | None
    fits_ram: bool | None
    npu_limit_bytes: int | None
    fits_npu: bool | None
    bandwidth_gbps: float | None
    decode_bound_tps: float | None
    efficiency: float | None
    efficiency_error: float | None  # generic: the fit's largest relative error; vendor fit: its median held-out error
    efficiency_basis: str
    projected_decode_tps: float | None
    prompt: int
    prefill_flops: float
    compute_tops: float | None
    compute_precision: str | None
    prefill_compute_ms: float | None
    prefill_memory_ms: float | None
    prefill_bound_ms: float | None
    unsupported_layers: list[tuple[str, str]] = field(default_factory=list)  # (layer, precision)
    notes: list[str] = field(default_factory=list)
    runtime: str | None = None  # the device LLM runtime projected with (device_runtimes); None: generic
    vendor: "VendorProjection | None" = None  # fitted to the vendor's measurements of that runtime
    ram_why: str | None = None  # why ``ram_bytes`` is unknown (a SoC's RAM is set by the phone or board built on it)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["unsupported_layers"] = [list(x) for x in self.unsupported_layers]
        return d


def project(model, device: str | Device, plan: QuantPlan | None = None, *, context: int = DEFAULT_CONTEXT,
            prompt: int = DEFAULT_PROMPT, fit: "EfficiencyFit | None" = None,
            ram_gb: float | None = None, runtime: str | None = AUTO) -> Projection:
    """Bounds and projections for ``model`` under ``plan`` on ``device``; ``ram_gb`` gives the RAM of a particular
    phone or board where the profile (a SoC's) leaves it unknown or differs.

    ``runtime``: the device's LLM runtime (``device_runtimes``; ``"auto"``: its class's own, Genie on a Snapdragon,
    RKLLM on a Rockchip board; None: none, the bandwidth bound times the practitioners' efficiency). With a runtime,
    the KV cache has its element size, the plan defaults to its recipe, and speed and memory are fitted to the
    vendor's measurements (``vendor``), each with its held-out error."""
    if context < 0 or prompt < 1:
        raise WorkbenchError(f"context must be >= 0 and prompt >= 1 tokens (got {context}, {prompt})")
    lm = model_shape(model)
    dev = device if isinstance(device, Device) else get_device(device)
    rt = runtime_for_device(dev, None if runtime == AUTO else runtime) if runtime else None
    plan = plan or (rt.plan() if rt else QuantPlan.uniform("fp16"))
    names = [info.name for info in lm.layers]
    assignments = plan.resolve(names)
    cfg = lm.config
    layers, heads, kv_heads, head_dim = attention_dims(cfg)
    notes: list[str] = []

    b = plan_bytes(lm, plan, context=context, prompt=prompt, kv_bytes=rt.kv_bytes if rt else KV_BYTES)
    weight_bytes, per_token, kv_per_token, kv_bytes, buffers = (b.weight_bytes, b.per_token, b.kv_per_token,
                                                                b.kv_bytes, b.buffers)
    total = weight_bytes + kv_bytes + buffers
    notes.append("memory counts weights, KV cache and the graph's own buffers, not the runtime's code or the OS")
    positions = getattr(cfg, "max_position_embeddings", None)
    if positions and context > positions:
        notes.append(f"a {context:,}-token context is past the {positions:,} positions the model's config allows "
                     "(max_position_embeddings): the model cannot use it as trained")

    if prompt > context:
        notes.append(f"the {prompt:,}-token prompt is longer than the {context:,}-token context the KV cache is counted "
                     f"at: memory is projected for {context:,} tokens, prefill for {prompt:,}; give a context of at "
                     f"least {prompt:,}")

    if ram_gb is not None and ram_gb <= 0:
        raise WorkbenchError(f"RAM must be positive, got {ram_gb} GB")
    ram_gb = ram_gb if ram_gb is not None else dev.ram_gb
    ram = None if ram_gb is None else int(ram_gb * 1e9)
    npu_limit = None if dev.npu_memory_limit_gb is None else int(dev.npu_memory_limit_gb * GIB)
    fits_ram = None if ram is None else total <= ram
    fits_npu = None if npu_limit is None else weight_bytes + kv_bytes <= npu_limit
    if ram is None:
        notes.append(f"RAM unknown for {dev.name}: {dev.source('ram_gb')}")

    # layers the accelerator cannot compute at the plan's precision
    unsupported = []
    if dev.weight_precisions is not None:
        for info in lm.layers:
            p = assignments.get(info.name) or "fp16"
            if p not in dev.weight_precisions:
                unsupported.append((info.name, p))
        if unsupported:
            kinds = sorted({p for _, p in unsupported})
            notes.append(f"{len(unsupported)} layer(s) at {', '.join(kinds)}, which {dev.name} does not compute with "
                         f"({', '.join(dev.weight_precisions)}; {dev.source('weight_precisions')}): they fall back to "
                         "another unit or precision, or the converter refuses them")

    bandwidth = dev.memory_bandwidth_gbps
    decode_bytes = per_token + kv_bytes
    bound = None if bandwidth is None else bandwidth * 1e9 / decode_bytes
    if bandwidth is None:
        notes.append(f"no decode bound: bandwidth unknown ({dev.source('memory_bandwidth_gbps')})")
    fit = fit if fit is not None else fit_efficiency()
    eff, err, basis = fit.factor_for(dev.device_class)
    projected = None if bound is None or eff is None else bound * eff
    vendor = None
    if rt is not None:
        vendor = vendor_projection(lm, plan, dev, rt, context=context, prompt=prompt, counted=b)
        if vendor is None:
            notes.append(f"no vendor measurement of {rt.title} is reachable: decode is the bandwidth bound times the "
                         "practitioners' efficiency")
        elif vendor.decode_tps is not None:
            projected = vendor.decode_tps
            if bound is not None and projected > bound:  # the fit knows the model's size, not this context's reads
                notes.append(f"the vendor fit's {projected:.1f} tok/s is above the bandwidth bound at a {context:,}-token "
                             f"context ({bound:.3g} tok/s, the KV cache read each token): projected at the bound")
                projected = bound
            eff = None if bound is None else projected / bound
            err, basis = vendor.decode_error, vendor.basis
        else:
            notes.append(vendor.basis)

    # prefill: compute at the plan's precision, and one read of the weights
    flops = b.flops
    integer = any(not get_precision(p).is_float for p in assignments.values() if p)
    order = (("int8", dev.npu_int8_tops), ("fp16", dev.npu_fp16_tops))
    order = order if integer else order[::-1]
    compute_precision, tops = next(((n, t) for n, t in order if t is not None), (None, None))
    if tops is not None and compute_precision != order[0][0]:
        notes.append(f"no {order[0][0]} throughput for {dev.name}; prefill bound at its {compute_precision} figure")
    compute_ms = None if tops is None else flops / (tops * 1e12) * 1e3
    memory_ms = None if bandwidth is None else weight_bytes / (bandwidth * 1e9) * 1e3
    known = [x for x in (compute_ms, memory_ms) if x is not None]
    return Projection(
        model=lm.name, device=dev.name, device_class=dev.device_class, parameters=lm.parameters,
        bits_per_weight=bits_per_weight(lm.layers, assignments, plan.group_size, plan.symmetric),
        weight_bytes=weight_bytes, bytes_per_token=int(per_token), context=context, kv_bytes_per_token=kv_per_token,
        kv_bytes=kv_bytes, buffer_bytes=int(buffers), total_bytes=int(total), ram_bytes=ram, fits_ram=fits_ram,
        npu_limit_bytes=npu_limit, fits_npu=fits_npu, bandwidth_gbps=bandwidth, decode_bound_tps=bound,
        efficiency=eff, efficiency_error=err, efficiency_basis=basis, projected_decode_tps=projected, prompt=prompt,
        prefill_flops=flops, compute_tops=tops, compute_precision=compute_precision, prefill_compute_ms=compute_ms,
        prefill_memory_ms=memory_ms, prefill_bound_ms=max(known) if known else None,
        unsupported_layers=unsupported, notes=notes, runtime=rt.name if rt else None, vendor=vendor,
        ram_why=None if ram is not None else dev.source("ram_gb").removeprefix("unknown: "))


def project_plans(model, devices, plans: Mapping[str, QuantPlan], *, context: int = DEFAULT_CONTEXT,
                  prompt: int = DEFAULT_PROMPT, ram_gb: float | None = None,
                  runtime: str | None = AUTO) -> dict[str, list[Projection]]:
    """Every plan (by label) on every device: ``{label: [Projection per device, in the order given]}``.

    The model's shapes are read once, so the app, the notebook and the run report compare candidate plans
    on one footing. ``runtime`` as in :func:`project`; a named runtime applies to the devices it runs on, the
    others are projected with their own (and a note says so)."""
    lm = model_shape(model)
    registry = load_devices()
    devs = [d if isinstance(d, Device) else get_device(d, registry) for d in devices]
    if not devs:
        raise WorkbenchError("choose at least one device (`workbench devices` lists them)")
    def runtime_on(d: Device) -> str | None:
        if runtime in (None, AUTO) or get_runtime(runtime).runs_on(d):
            return runtime
        return AUTO

    out = {}
    for label, plan in plans.items():
        out[label] = []
        for d in devs:
            on = runtime_on(d)
            p = project(lm, d, plan, context=context, prompt=prompt, ram_gb=ram_gb, runtime=on)
            if on != runtime:
                where = d.name if d.device_class in get_runtime(runtime).device_classes else f"{d.device_class} devices"
                p.notes.append(f"{runtime} does not run on {where}: projected with {p.runtime or 'no runtime'}")
            out[label].append(p)
    return out


# -- claims -------------------------------------------------------------------------------------------
@dataclass
class Claim:
    """A published figure held against physics: possible or not, and the arithmetic that says so."""

    what: str
    claimed: float
    bound: float | None
    possible: bool | None  # None: the bound is unknown
    arithmetic: str


def check_claim(p: Projection, *, decode_tps: float | None = None, peak_gb: float | None = None,
                ttft_ms: float | None = None) -> list[Claim]:
    """Hold claimed decode speed, peak memory and time to first token against a projection's bounds."""
    out = []
    if decode_tps is not None:
        if p.decode_bound_tps is None:
            out.append(Claim("decode", decode_tps, None, None, "bandwidth unknown: no bound"))
        else:
            need = decode_tps * (p.bytes_per_token + p.kv_bytes) / 1e9
            ok = decode_tps <= p.decode_bound_tps
            out.append(Claim("decode", decode_tps, p.decode_bound_tps, ok,
                             f"{decode_tps:g} tok/s x {(p.bytes_per_token + p.kv_bytes) / 1e9:.3f} GB read per token = "
                             f"{need:.1f} GB/s {'<=' if ok else '>'} {p.bandwidth_gbps:g} GB/s of bandwidth"
                             f" (bound {p.decode_bound_tps:.1f} tok/s)"))
    if peak_gb is not None:
        out.append(check_memory_claim(p.weight_bytes, peak_gb, what=f"{p.bits_per_weight:.2f} bits/weight"))
    if ttft_ms is not None and p.compute_tops is not None:
        per_token = p.prefill_flops / p.prompt  # FLOPs per prompt token at this prompt length
        longest = ttft_ms / 1e3 * p.compute_tops * 1e12 / per_token
        out.append(Claim("ttft", ttft_ms, p.prefill_bound_ms, None,
                         f"{ttft_ms:g} ms at {p.compute_tops:g} {p.compute_precision} TOPS covers at most "
                         f"~{longest:,.0f} prompt tokens ({per_token / 1e9:.2f} GFLOP per token); the prompt length "
                         f"is not published, so the claim cannot be ruled in or out (bound at {p.prompt} tokens: "
                         f"{p.prefill_bound_ms:.0f} ms)"))
    return out


def check_memory_claim(weight_bytes_or_parameters: int, peak_gb: float, *, bits: float | None = None,
                       what: str = "") -> Claim:
    """A peak-memory claim against the bytes the weights alone take (``bits`` given: a parameter count at
    that many bits per weight). A model's weights are read every token, so they must be resident."""
    weight_bytes = weight_bytes_or_parameters * bits / 8 if bits is not None else weight_bytes_or_parameters
    ok = peak_gb * 1e9 >= weight_bytes
    detail = f"{weight_bytes_or_parameters / 1e9:.3f} B parameters x {bits:g} bits / 8" if bits is not None else what
    implied = (f"; {peak_gb:g} GB holds {peak_gb * 8e9 / weight_bytes_or_parameters:.4f} bits per weight"
               if bits is not None else "")
    return Claim("peak memory", peak_gb, weight_bytes / 1e9, ok,
                 f"weights alone: {detail} = {weight_bytes / 1e9:.3f} GB {'<=' if ok else '>'} the claimed "
                 f"{peak_gb:g} GB{implied}")


# -- efficiency fitted to published measurements -----------------------------------------------------------
def plan_from_spec(spec: Mapping) -> QuantPlan:
    """A measurement's plan: ``{"precision": "int8", "keep_embeddings": "int8"}`` -> QuantPlan.uniform(...)."""
    return QuantPlan.uniform(spec["precision"], keep_embeddings=spec.get("keep_embeddings", "fp16"))


def published_measurements(path: str | os.PathLike = MEASUREMENTS_FILE) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8"))["measurements"]


@dataclass
class ClassFit:
    """Measured / bound for one device class: the factor (geometric mean), its points and errors."""

    device_class: str
    factor: float | None
    points: list[dict]  # label, measured, bound, ratio, error (projected / measured - 1), loo_error
    impossible: list[dict]  # measurements above their bound, left out of the fit

    @property
    def max_error(self) -> float | None:
        errs = [abs(p["error"]) for p in self.points]
        return max(errs) if errs else None

    @property
    def max_loo_error(self) -> float | None:
        errs = [abs(p["loo_error"]) for p in self.points if p.get("loo_error") is not None]
        return max(errs) if errs else None


@dataclass
class EfficiencyFit:
    """Per device class, the fraction of the decode bound published runs reach; all classes pooled for the rest."""

    classes: dict[str, ClassFit]
    pooled: ClassFit

    def factor_for(self, device_class: str) -> tuple[float | None, float | None, str]:
        c = self.classes.get(device_class)
        if c is not None and c.factor is not None:
            return c.factor, c.max_error, f"fitted to {len(c.points)} published {device_class} measurement(s)"
        if self.pooled.factor is None:
            return None, None, "no published measurement to fit"
        return (self.pooled.factor, self.pooled.max_error,
                f"no possible published {device_class} measurement: all classes pooled ({len(self.pooled.points)})")


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _class_fit(name: str, rows: list[dict]) -> ClassFit:
    ok = [r for r in rows if r["ratio"] <= 1.0]
    factor = _geomean([r["ratio"] for r in ok])
    points = []
    for r in ok:
        others = _geomean([o["ratio"] for o in ok if o is not r])
        points.append({**r, "error": factor * r["bound"] / r["measured"] - 1,
                       "loo_error": None if others is None else others * r["bound"] / r["measured"] - 1})
    return ClassFit(name, factor, points, [r for r in rows if r["ratio"] > 1.0])


def fit_efficiency(measurements: list[dict] | None = None, devices: dict[str, Device] | None = None) -> EfficiencyFit:
    """Fit measured decode / bandwidth bound per device class; a measurement above its bound is impossible
    and set aside (listed in ``impossible``), never fitted."""
    if measurements is None and devices is None:
        return _default_fit()
    measurements = published_measurements() if measurements is None else measurements
    devices = load_devices() if devices is None else devices
    rows: dict[str, list[dict]] = {}
    none = EfficiencyFit({}, ClassFit("all", None, [], []))
    for m in measurements:
        dev = get_device(m["device"], devices)
        p = project(m["shape"], dev, plan_from_spec(m["plan"]), context=m.get("context", DEFAULT_CONTEXT), fit=none,
                    runtime=None)
        if p.decode_bound_tps is None:
            continue
        rows.setdefault(dev.device_class, []).append(
            {"label": m["label"], "device": dev.name, "measured": m["decode_tps"], "bound": p.decode_bound_tps,
             "ratio": m["decode_tps"] / p.decode_bound_tps})
    classes = {c: _class_fit(c, r) for c, r in rows.items()}
    return EfficiencyFit(classes, _class_fit("all", [r for rs in rows.values() for r in rs]))


@lru_cache(maxsize=1)
def _default_fit() -> EfficiencyFit:
    return fit_efficiency(published_measurements(), load_devices())
