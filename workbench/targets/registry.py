"""The one registry of deployment targets: each target module registers a ``Target`` here.

    register_target(Target("toy", "Toy runtime", rules=Path("toy.json"), convert=convert_toy, runnable=True))
    get_target("qnn").convert(job); target_names("convert")   # what `workbench convert --target` offers

A target is one module under ``workbench/targets/`` (or anywhere: it only has to call
``register_target`` when imported) plus its operator rule table (``assets/targets/<rules>.json``,
or a path). It names its rule table, its converter (``convert(job)``, given a
``workbench.targets.convert.ConvertJob``), whether the converted model runs here (``runnable``), its
runner and the files its output holds (``runner(folder, *, threads)``, ``files``: what
``workbench.run.locate.open_runner`` opens a folder with, so ``generate``, ``profile`` and the app run
every runnable target's output without knowing its files), and its override-file format (``OverrideFormat``: writer and reader of per-layer precisions). ``inspect``,
``convert``, ``overrides`` and the app list and dispatch through ``target_names`` and ``get_target``.

Precisions: a target says which weight precisions it can carry, by kind and bit width
(``int_bits``, ``float_bits``) and which two-level scales (``two_level``: (code bits, sub-scale
bits) pairs), with ``precision_note`` saying why the rest are not, so a precision added with
``register_precision`` either works through it or is refused, naming the layers (``check_precisions``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from ..assets import ASSETS_DIR
from ..errors import PlanError, WorkbenchError
from ..quantize.plan import Precision, get_precision

__all__ = ["Target", "OverrideFormat", "register_target", "get_target", "target_names", "override_format",
           "check_precisions", "plan_reach", "quantized_reach", "check_signed_scales", "grid_reach",
           "signed_scale_holders", "signed_layers", "registered_targets", "TargetNames", "RULES_DIR", "rules_path"]

RULES_DIR = ASSETS_DIR / "targets"


@dataclass(frozen=True)
class OverrideFormat:
    """A converter's per-layer precision file: ``write(path, lm, plan, quantized, export, calibration)`` returns an
    ``OverrideFile``; ``read(path, lm, export)`` maps it back to ``{layer: precision}``."""

    name: str  # `workbench overrides --format NAME`
    write: Callable
    read: Callable
    needs_quantized: bool = False  # the writer reads the quantized weights (scales), not only the plan
    needs_graph: bool = False  # the writer names tensors of the exported ONNX graph


@dataclass(frozen=True)
class Target:
    """One deployment target: rules, converter, runner and override format, all from its module."""

    name: str
    title: str
    rules: str | Path | None = None  # rule table: a name in assets/targets, a JSON path, or None (no ONNX graph)
    convert: Callable | None = None  # convert(job: ConvertJob) -> None; fills job.report
    runnable: bool = False  # the converted model runs here, so conversions measure KL and top-1
    # runner(folder, *, threads) -> what ``workbench.runtime.stream.stream_tokens`` drives (``run_prefill`` /
    # ``run_decode``, or ``steps()``), naming its ``runtime``; ``workbench.run.locate.open_runner`` calls it
    runner: Callable | None = None
    files: tuple[str, ...] = ()  # what its output folder holds, all of it; the first is what the runner opens
    # layout(folder) -> the files its output holds in that folder when they vary (an HTP graph split into parts),
    # or None: ``files``
    layout: Callable | None = None
    overrides: OverrideFormat | None = None
    int_bits: tuple[int, ...] = (4, 8)  # integer weight widths it carries
    float_bits: tuple[int, ...] = (16, 32)  # float weight widths it carries
    module: str = field(default="", compare=False)
    two_level: tuple[tuple[int, int], ...] = ()  # (code bits, sub-scale bits) of two-level scales it carries exactly
    layouts: tuple[str, ...] = ()  # precisions with a fixed block layout (``int3-k``) it stores as they are
    # missing() -> None when its converter can run on this machine, else one sentence saying what is not here (a
    # toolchain in its own environment): the app greys the target with it instead of failing after a click
    missing: Callable[[], str | None] | None = None
    precision_note: str = ""  # why it carries no other precisions, said when it refuses one
    signed_scales: bool = False  # group scales may be negative (the 16-level grid's, as GGUF's Q4_0 and MatMulNBits)
    # conversion options it reads beyond the plan: "static" (fixed SEQ,PAST shapes), "soc" (the NPU compiled for);
    # ``convert`` notes one given to a target that does not read it
    options: tuple[str, ...] = ()
    # check_setup() raises one line when the target's own setup is broken (a toolkit variable naming no program),
    # before any work; a toolkit that is simply absent is ``missing``'s to say
    check_setup: Callable[[], None] | None = None

    def carries(self, precision: Precision) -> bool:
        """Whether this target carries ``precision`` as the plan stores it (bit width, and scales)."""
        if precision.is_float:
            return precision.bits in self.float_bits
        if precision.super_block or precision.group_size:
            return precision.name in self.layouts
        if precision.two_level:
            return (precision.bits, precision.scale_bits) in self.two_level
        return precision.bits in self.int_bits


_TARGETS: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    """Add (or replace) a target; ``inspect``, ``convert``, ``overrides`` and the app then offer it."""
    if not target.name or any(c.isspace() for c in target.name):
        raise WorkbenchError(f"target names are single words, got {target.name!r}")
    _TARGETS[target.name] = target
    return target


def get_target(name: str) -> Target:
    """The registered target ``name``; an unknown name lists the known ones."""
    try:
        return _TARGETS[name]
    except KeyError:
        raise PlanError(f"unknown target '{name}'; choose one of: {', '.join(_TARGETS)}") from None


def registered_targets() -> list[Target]:
    """Every registered target, in the order they were registered (the built-in ones by module name)."""
    return list(_TARGETS.values())


class TargetNames(Sequence):
    """The registered targets' names that have ``what`` (``"convert"``, ``"rules"``, ``"overrides"``),
    read when used, so a target registered later is offered too (argparse choices, dropdowns)."""

    def __init__(self, what: str):
        self.what = what

    def _names(self) -> list[str]:
        if self.what == "overrides":
            return [t.overrides.name for t in _TARGETS.values() if t.overrides is not None]
        names = [n for n, t in _TARGETS.items() if getattr(t, self.what) is not None]
        if self.what == "rules":  # a rule table's own name also names it (`inspect --target ort`)
            names += [p.stem for p in sorted(RULES_DIR.glob("*.json")) if p.stem not in names]
        return names

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return repr(tuple(self._names()))


def target_names(what: str = "convert") -> TargetNames:
    """Names of targets with a converter (``convert``), a rule table (``rules``) or an override format."""
    if what not in ("convert", "rules", "overrides"):
        raise ValueError(f"what must be convert, rules or overrides, got {what!r}")
    return TargetNames(what)


def override_format(name: str) -> tuple[Target, OverrideFormat]:
    """The target whose override format is ``name`` (``qnn``, ``ort``, ``llamacpp``, ``mnn``, ...)."""
    for t in _TARGETS.values():
        if t.overrides is not None and t.overrides.name == name:
            return t, t.overrides
    raise PlanError(f"unknown override format '{name}'; choose one of: {', '.join(target_names('overrides'))}")


def rules_path(name: str) -> Path:
    """The rule table of a target (by target name, or by the table's own name in ``assets/targets``)."""
    t = _TARGETS.get(name)
    if t is not None and t.rules is not None:
        rules = t.rules
        return rules if isinstance(rules, Path) else RULES_DIR / f"{rules}.json"
    path = RULES_DIR / f"{name}.json"
    if not path.is_file():
        raise WorkbenchError(f"unknown target '{name}'; choose one of: {', '.join(target_names('rules'))}")
    return path


def _describe(p: Precision) -> str:
    if p.two_level:
        return f"{p.bits}-bit integer, {p.scale_bits}-bit sub-scales"
    return f"{p.bits}-bit {'float' if p.is_float else 'integer'}"


def _layers_text(layers: list[str]) -> str:
    return ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")


def signed_layers(qm) -> list[str]:
    """Layers of ``qm`` whose group scales carry a sign (the 16-level grid's, llama.cpp's Q4_0 layout)."""
    if not qm.plan.full_range:
        return []
    return [n for n, w in qm.weights.items() if w.sub_scales is None and bool((w.scales < 0).any())]


def signed_scale_holders() -> list[str]:
    """The conversion targets that hold signed group scales (the 16-level grid)."""
    return [t.name for t in _TARGETS.values() if t.signed_scales and t.convert is not None]


def grid_reach(targets: Iterable[str]) -> list[str]:
    """Of ``targets``, those that cannot hold the 16-level grid: a plan going to any of them is rounded on the
    15-level grid (``full_range`` off), what `workbench quantize --target` does."""
    return [n for n in targets if not get_target(n).signed_scales]


def _signed_reason(target: Target, signed: list[str]) -> str:
    return (f"{len(signed)} layer(s) (e.g. {signed[0]}) were rounded on the 16-level grid, whose group scales carry "
            f"a sign (llama.cpp's Q4_0 layout), which {target.name} cannot hold")


def check_signed_scales(target: Target, qm, fix: str | None = None) -> None:
    """The 16-level grid (``full_range``, `workbench quantize --bits`'s default) signs each group's scale, as
    llama.cpp's Q4_0 does; a target without ``signed_scales`` cannot hold that. Refuse before any graph is built,
    naming the fix (``fix``: the command that makes a model this target holds, when the caller knows it)."""
    if target.signed_scales:
        return
    signed = signed_layers(qm)
    if signed:
        holders = " / ".join(signed_scale_holders())
        fix = fix or (f"quantize again with `workbench quantize ... --target {target.name}` (or --no-full-range, or "
                      "\"full_range\": false in the plan)")
        raise PlanError(f"{_signed_reason(target, signed)}: {fix}; or convert this model with --target {holders}")


def quantized_reach(qm, targets: Iterable[str] | None = None) -> dict[str, str | None]:
    """Per conversion target (default every one with a converter): None when it can take the quantized model ``qm``
    as it is (every precision, and the grid its scales are on), else why not in one sentence; what `workbench
    quantize` reports, so a user learns where the model can go before converting it."""
    names = list(targets if targets is not None else target_names("convert"))
    out = plan_reach(qm.precisions, names)
    signed = signed_layers(qm)
    for name in names:
        t = get_target(name)
        if out[name] is None and signed and not t.signed_scales:
            out[name] = _signed_reason(t, signed)
    return out


def plan_reach(precisions: Mapping[str, str | None] | Iterable[str | None],
               targets: Iterable[str] | None = None) -> dict[str, str | None]:
    """Per conversion target (``targets``, default every one with a converter): None when it carries every precision
    of a plan (``{layer: precision}`` or the precisions alone), else why not in one sentence: what the app offers,
    so a target the plan cannot go to is greyed with its reason rather than refused after a click."""
    values = list(precisions.values() if isinstance(precisions, Mapping) else precisions)
    out = {}
    for name in (targets if targets is not None else target_names("convert")):
        t = get_target(name)
        bad = sorted({v for v in values if (pr := get_precision(v)) is not None and not t.carries(pr)})
        out[name] = None if not bad else (
            f"{t.title} cannot carry {', '.join(bad)} (it takes "
            + ", ".join([f"int{b}" for b in t.int_bits] + [f"{b}-bit float" for b in t.float_bits]) + ")")
    return out


def check_precisions(target: Target, precisions: Mapping[str, str | None] | Iterable[str | None],
                     what: str = "") -> None:
    """Refuse every precision ``target`` cannot carry, naming it and (given ``{layer: precision}``) its layers."""
    items = precisions.items() if isinstance(precisions, Mapping) else ((None, p) for p in precisions)
    bad: dict[str, tuple[Precision, list[str]]] = {}
    for layer, name in items:
        p = get_precision(name)
        if p is None or target.carries(p):
            continue
        entry = bad.setdefault(p.name, (p, []))
        if layer is not None:
            entry[1].append(layer)
    if bad:
        takes = [f"int{b}" for b in target.int_bits] + [f"{b}-bit float" for b in target.float_bits] + \
            [f"int{b} with {k}-bit sub-scales" for b, k in target.two_level if k == 4] + list(target.layouts)
        names = "; ".join(f"'{n}' ({_describe(p)})" + (f" for layer(s) {_layers_text(layers)}" if layers else "")
                          for n, (p, layers) in bad.items())
        note = f" ({target.precision_note})" if target.precision_note else ""
        raise PlanError(f"{what or target.title} cannot carry precision {names}: it takes {', '.join(takes)}{note}; "
                        "give those layers another precision in the plan, or make one that fits with `workbench plan "
                        f"MODEL --bits-per-weight B --target {target.name} --out PLAN.json` (in the app: choose one of "
                        "those precisions for them in the Precisions tab)")
