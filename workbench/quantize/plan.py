"""Precisions and the quantization plan: which precision every layer gets.

A plan is ordered rules over PyTorch module names (FQNs from ``named_modules()``):
an exact name beats a pattern, and a pattern beats the default. Patterns are globs
(``*.q_proj``) or regular expressions (``re:.*layers\\.[0-3]\\..*``); among patterns the one
added last wins, so a bulk rule added later overrides an earlier one. A precision of ``None``
means "leave the layer as it is".

    plan = QuantPlan.uniform("int4").with_override("model.layers.0.self_attn.q_proj", "fp16")
    plan.save("plan.json"); QuantPlan.load("plan.json") == plan
"""
from __future__ import annotations

import difflib
import fnmatch
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping

from ..errors import PlanError
from ..units import text_table
from ..files.workspace import hash_inputs, atomic_write_text

__all__ = ["fitting_precisions", 
    "Precision", "PRECISIONS", "register_precision", "get_precision", "PlanRule", "QuantPlan",
    "PLAN_VERSION", "DEFAULT_GROUP_SIZE", "DEFAULT_SCALE_SEARCH", "DEFAULT_FULL_RANGE",
    "QUANTIZER_SETTINGS", "VisionRecipe", "vision_recipe", "vision_recipe_for", "VISION_RECIPE_TARGETS", "MMPROJ_TYPES",
]

PLAN_VERSION = 1
DEFAULT_GROUP_SIZE = 128  # what AWQ, GPTQ and practitioners use; smaller = more scales, bigger file
SCALE_BYTES = 2  # one fp16 scale per group (per output channel when per-channel)
# new plans search each group's range (measured to lower KL for RTN, AWQ and GPTQ on the demo model, all but GPTQ at
# asymmetric int4 g32: README, "Scale search"); a plan file without the field was saved before it existed, or with
# it off, and means off
DEFAULT_SCALE_SEARCH = True
# plans made from a width (`--bits`, the app) round to the symmetric 16-level grid: lowest KL at every width 2-8 on a
# trained model, at about 4.6x the search time (docs/quantize.md, 'The default rounding'); a plan file without
# the field means off
DEFAULT_FULL_RANGE = True
# the plan fields besides precision and method that decide how a layer is rounded: equal settings, equal codes
QUANTIZER_SETTINGS = ("group_size", "symmetric", "scale_search", "full_range")


@dataclass(frozen=True)
class Precision:
    """A storage precision for a layer's weights."""

    name: str
    bits: int
    is_float: bool
    description: str = ""
    # two-level scales (LPBQ-style): each group's scale is an unsigned ``scale_bits``-bit integer in
    # [1, scale_max] (default 2^scale_bits) times one float16 scale per output channel, or per
    # ``super_block`` columns; None: a float16 scale per group
    scale_bits: int | None = None
    scale_max: int | None = None
    super_block: int | None = None
    # a fixed layout's own group size (llama.cpp's k-quants: 16), which the plan's group size does not change
    group_size: int | None = None
    # minimums: unsigned codes and a minimum per group, the layout asymmetric whatever the plan says; with
    # two-level scales (llama.cpp's Q4_K / Q5_K) an integer beside each sub-scale under a second float16 scale
    # per super-block, else a float16 minimum beside each float16 group scale (Q4_1 / Q5_1)
    minimums: bool = False

    def __post_init__(self):
        if self.scale_bits is not None and (self.is_float or not 1 <= self.scale_bits <= 8):
            raise PlanError(f"precision '{self.name}': scale_bits must be 1..8 on an integer precision, "
                            f"got {self.scale_bits!r}")
        if self.scale_max is not None and not 1 <= self.scale_max <= (1 << (self.scale_bits or 0)):
            raise PlanError(f"precision '{self.name}': scale_max must be 1..2^scale_bits, got {self.scale_max!r}")
        if self.super_block is not None and (not self.group_size or self.super_block % self.group_size):
            raise PlanError(f"precision '{self.name}': a super-block needs a fixed group size that divides it")
        if self.minimums and (self.two_level and not self.super_block or self.is_float):
            raise PlanError(f"precision '{self.name}': minimums go on integer weights, two-level ones in "
                            "super-blocks")

    @property
    def two_level(self) -> bool:
        return self.scale_bits is not None

    @property
    def float_minimums(self) -> bool:
        """A float16 minimum beside each float16 group scale (llama.cpp's Q4_1 / Q5_1)."""
        return self.minimums and not self.two_level

    @property
    def sub_scales(self):
        """The two-level layout as the quantizer takes it (``SubScales``), or None."""
        from .qtensor import SubScales
        return None if self.scale_bits is None else SubScales(self.scale_bits, self.scale_max, self.super_block,
                                                              self.minimums)

    def layer_group_size(self, plan_group_size: int | None) -> int | None:
        """The group size a layer at this precision is quantized with: the layout's own, else the plan's."""
        return self.group_size or plan_group_size

    def misfit(self, in_features: int) -> str | None:
        """Why a layer of ``in_features`` inputs cannot take this precision's fixed layout (None: it can)."""
        unit = self.super_block or self.group_size
        if unit and in_features % unit:
            return (f"{self.name} stores {unit}-weight blocks, which do not divide the {in_features} inputs of "
                    f"this layer")
        return None

    def weight_bytes(self, out_features: int, in_features: int, group_size: int | None = DEFAULT_GROUP_SIZE,
                     symmetric: bool = True) -> int:
        """Bytes to store an out x in weight: packed integers plus scales (and zero points), as stored.

        Single-level: a float16 scale per group. Two-level: ``scale_bits`` per group, packed, plus a
        float16 scale per output channel (or super-block); with minimums as many again for them.
        """
        n = out_features * in_features
        if self.is_float:
            return n * self.bits // 8
        group_size = self.layer_group_size(group_size)
        groups_per_row = 1 if not group_size else -(-in_features // group_size)
        groups = out_features * groups_per_row
        zero_bytes = 0 if symmetric or self.two_level else -(-groups * self.bits // 8)
        if self.two_level:
            per_row = 1 if not self.super_block else -(-in_features // self.super_block)
            scale_bytes = (-(-groups * self.scale_bits // 8) + out_features * per_row * SCALE_BYTES) * \
                (2 if self.minimums else 1)
        else:
            scale_bytes = groups * SCALE_BYTES * (2 if self.minimums else 1)
            zero_bytes = 0 if self.minimums else zero_bytes
        return -(-n * self.bits // 8) + scale_bytes + zero_bytes


PRECISIONS: dict[str, Precision] = {}


def register_precision(p: Precision) -> Precision:
    """Add a precision to the registry, so plans, the UI and the CLI can name it."""
    PRECISIONS[p.name] = p
    return p


for _p in (
    Precision("fp32", 32, True, "float32: the unquantized reference"),
    Precision("fp16", 16, True, "float16: kept in floating point"),
    Precision("int8", 8, False, "8-bit integer weights, fp16 scales"),
    Precision("int6", 6, False, "6-bit integer weights, fp16 scales"),
    Precision("int5", 5, False, "5-bit integer weights, fp16 scales"),
    Precision("int4", 4, False, "4-bit integer weights, fp16 scales"),
    Precision("int3", 3, False, "3-bit integer weights, fp16 scales"),
    Precision("int2", 2, False, "2-bit integer weights, fp16 scales"),
    Precision("int8-lpbq", 8, False, "8-bit integer weights, 4-bit integer group scales under an fp16 scale per "
              "output channel", scale_bits=4),
    Precision("int4-lpbq", 4, False, "4-bit integer weights, 4-bit integer group scales under an fp16 scale per "
              "output channel (Qualcomm's low-power block quantization)", scale_bits=4),
    # llama.cpp's k-quant layouts, symmetric: 16-weight groups with integer scales under an fp16 scale per
    # 256 weights, stored exactly as its Q3_K / Q6_K blocks (3.4375 and 6.5625 bits per weight)
    Precision("int3-k", 3, False, "3-bit integer weights in 16-weight groups, 6-bit group scales under an fp16 "
              "scale per 256 weights (llama.cpp's Q3_K layout)", scale_bits=6, scale_max=31, super_block=256,
              group_size=16),
    Precision("int6-k", 6, False, "6-bit integer weights in 16-weight groups, 8-bit group scales under an fp16 "
              "scale per 256 weights (llama.cpp's Q6_K layout)", scale_bits=8, scale_max=127, super_block=256,
              group_size=16),
    # llama.cpp's k-quants with minimums: 32-weight groups, each a 6-bit scale and a 6-bit minimum under two
    # fp16 scales per 256 weights, w = d * sc * q - dmin * m, stored exactly as its Q4_K / Q5_K blocks (4.5, 5.5)
    Precision("int4-k", 4, False, "4-bit unsigned weights in 32-weight groups, 6-bit group scales and minimums "
              "under two fp16 scales per 256 weights (llama.cpp's Q4_K layout)", scale_bits=6, scale_max=63,
              super_block=256, group_size=32, minimums=True),
    Precision("int5-k", 5, False, "5-bit unsigned weights in 32-weight groups, 6-bit group scales and minimums "
              "under two fp16 scales per 256 weights (llama.cpp's Q5_K layout)", scale_bits=6, scale_max=63,
              super_block=256, group_size=32, minimums=True),
    # llama.cpp's Q4_1 / Q5_1: a float16 scale and a float16 minimum per 32 weights, w = d * q + m (5 and 6 bpw)
    Precision("int4-min", 4, False, "4-bit unsigned weights in 32-weight groups, an fp16 scale and an fp16 "
              "minimum per group (llama.cpp's Q4_1 layout)", group_size=32, minimums=True),
    Precision("int5-min", 5, False, "5-bit unsigned weights in 32-weight groups, an fp16 scale and an fp16 "
              "minimum per group (llama.cpp's Q5_1 layout)", group_size=32, minimums=True),
):
    register_precision(_p)


def get_precision(name: str | Precision | None) -> Precision | None:
    """Look a precision up by name; ``None`` stays ``None`` (leave the layer alone)."""
    if name is None or isinstance(name, Precision):
        return name
    key = str(name).lower()
    if key not in PRECISIONS:
        raise PlanError(f"unknown precision '{name}'; choose one of: {', '.join(PRECISIONS)}")
    return PRECISIONS[key]


def _is_pattern(text: str) -> bool:
    return text.startswith("re:") or any(c in text for c in "*?[")


@dataclass(frozen=True)
class PlanRule:
    """``pattern`` is an exact FQN, a glob, or ``re:`` + a regular expression."""

    pattern: str
    precision: str | None

    def __post_init__(self):
        get_precision(self.precision)
        if self.pattern.startswith("re:"):
            try:
                re.compile(self.pattern[3:])
            except re.error as e:
                raise PlanError(f"rule '{self.pattern}': invalid regular expression: {e}") from None

    @property
    def is_exact(self) -> bool:
        return not _is_pattern(self.pattern)

    def matches(self, name: str) -> bool:
        if self.pattern.startswith("re:"):
            return re.fullmatch(self.pattern[3:], name) is not None
        if self.is_exact:
            return name == self.pattern
        return fnmatch.fnmatchcase(name, self.pattern)


# JSON type of every plan field: a string "false" must not read as true, nor "one" as a version
_FIELD_TYPES = {
    "version": ((int,), "an integer"),
    "default": ((str, type(None)), "a precision name or null"),
    "group_size": ((int, type(None)), "an integer or null (per-channel)"),
    "symmetric": ((bool,), "true or false"),
    "scale_search": ((bool,), "true or false"),
    "full_range": ((bool,), "true or false"),
    "method": ((str,), "a method name such as \"rtn\" or \"awq\""),
    "rules": ((list,), "a list of {\"pattern\": ..., \"precision\": ...} objects"),
    "meta": ((Mapping,), "an object"),
}
_RULE_FIELD_TYPES = {
    "pattern": ((str,), "a string"),
    "precision": ((str, type(None)), "a precision name or null"),
}


def _has_type(value, types: tuple[type, ...]) -> bool:
    """JSON-faithful isinstance: true and false are not integers here."""
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _json_value(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class QuantPlan:
    """Ordered precision rules over layer names plus a default; immutable, JSON round-trips."""

    default: str | None = "int8"
    rules: tuple[PlanRule, ...] = ()
    group_size: int | None = DEFAULT_GROUP_SIZE  # None = per output channel
    symmetric: bool = True
    method: str = "rtn"
    version: int = PLAN_VERSION
    meta: Mapping[str, object] = field(default_factory=dict, compare=False)
    # each group's range searched for the least error instead of min/max (RTN, GPTQ, AWQ's unclipped layers)
    scale_search: bool = DEFAULT_SCALE_SEARCH
    # symmetric codes over all 2^b levels (16 at 4 bits), each group's scale its largest-magnitude weight over
    # -2^(b-1) with its sign, as llama.cpp's Q4_0 / Q5_0 (quantize/rtn.py); two-level precisions keep their grid
    full_range: bool = False

    def __post_init__(self):
        get_precision(self.default)
        if self.full_range and not self.symmetric:
            raise PlanError("full_range is the symmetric 16-level grid (llama.cpp's Q4_0); an asymmetric plan already "
                            "uses every level: set symmetric=true or full_range=false")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise PlanError(f"group_size must be a positive integer or null (per-channel), got {self.group_size!r}")
        if self.version > PLAN_VERSION:
            raise PlanError(f"plan version {self.version} is newer than this workbench understands ({PLAN_VERSION})")
        object.__setattr__(self, "rules", tuple(
            r if isinstance(r, PlanRule) else PlanRule(**r) for r in self.rules))

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def uniform(cls, precision: str, *, keep_embeddings: str | None = "fp16", **kw) -> "QuantPlan":
        """Every linear layer at ``precision``; embeddings and lm_head at ``keep_embeddings``."""
        rules = () if keep_embeddings is None else (
            PlanRule("*embed_tokens", keep_embeddings), PlanRule("lm_head", keep_embeddings))
        return cls(default=precision, rules=rules, **kw)

    @classmethod
    def default_for(cls, precision: str, **kw) -> "QuantPlan":
        """What `workbench quantize --bits` and the app start from: ``uniform`` with the rounding measured best
        at every width (the 16-level grid where symmetric; docs/quantize.md, 'The default rounding')."""
        kw.setdefault("full_range", DEFAULT_FULL_RANGE and kw.get("symmetric", True))
        return cls.uniform(precision, **kw)

    def with_override(self, pattern: str, precision: str | None) -> "QuantPlan":
        """A new plan where ``pattern`` (a name or a pattern) maps to ``precision``."""
        rules = [r for r in self.rules if r.pattern != pattern] + [PlanRule(pattern, precision)]
        return replace(self, rules=tuple(rules))

    def without_rule(self, pattern: str) -> "QuantPlan":
        return replace(self, rules=tuple(r for r in self.rules if r.pattern != pattern))

    @property
    def quantizer_settings(self) -> dict[str, object]:
        """``QUANTIZER_SETTINGS`` by name: what sweeps and evaluators key their cached codes by."""
        return {k: getattr(self, k) for k in QUANTIZER_SETTINGS}

    # -- lookup -------------------------------------------------------------------------------
    def precision_name_for(self, name: str) -> str | None:
        for r in self.rules:
            if r.is_exact and r.pattern == name:
                return r.precision
        for r in reversed(self.rules):
            if not r.is_exact and r.matches(name):
                return r.precision
        return self.default

    def precision_for(self, name: str) -> Precision | None:
        return get_precision(self.precision_name_for(name))

    def resolve(self, layer_names: Iterable[str]) -> dict[str, str | None]:
        """Map every layer name to its precision name (or None)."""
        return {n: self.precision_name_for(n) for n in layer_names}

    def validate(self, layer_names: Iterable[str]) -> None:
        """Raise ``PlanError`` for a rule that matches no layer, naming the closest real layers."""
        names = list(layer_names)
        for r in self.rules:
            if not any(r.matches(n) for n in names):
                close = difflib.get_close_matches(r.pattern.removeprefix("re:"), names, n=3, cutoff=0.4)
                hint = f"; closest layer names: {', '.join(close)}" if close else \
                    f"; layers look like: {', '.join(names[:3])}"
                source = getattr(self, "source_file", None)  # set by load(): not a field, never saved
                where = f"plan file '{source}': rule" if source else "plan rule"
                raise PlanError(f"{where} '{r.pattern}' matches no layer of this model{hint}")

    def content_hash(self) -> str:
        """Eight hex digits naming the plan's content (rules, default, group size, symmetry, method; not
        ``meta``): the same plan under two names hashes alike, so the app and the report count it once."""
        return hash_inputs({k: v for k, v in self.to_dict().items() if k != "meta"})[:8]

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready. ``scale_search`` is written only when on: files from before it existed lack it and
        mean off, so absent means off in every file (``from_dict``), and their hashes and cache keys stay."""
        return {"version": self.version, "default": self.default, "group_size": self.group_size,
                "symmetric": self.symmetric, "method": self.method,
                "rules": [{"pattern": r.pattern, "precision": r.precision} for r in self.rules],
                **({"scale_search": True} if self.scale_search else {}),
                **({"full_range": True} if self.full_range else {}),
                **({"meta": dict(self.meta)} if self.meta else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "QuantPlan":
        if not isinstance(d, Mapping):
            raise PlanError("a plan must be a JSON object with 'version', 'default' and 'rules'")
        known = {"version", "default", "group_size", "symmetric", "method", "rules", "meta", "scale_search",
                 "full_range"}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"unknown plan field(s) {sorted(unknown)}; allowed: {sorted(known)}")
        if "version" not in d:
            raise PlanError("plan has no 'version' field; is this a workbench plan file?")
        for name, (types, expected) in _FIELD_TYPES.items():
            if name in d and not _has_type(d[name], types):
                raise PlanError(f"plan field '{name}' must be {expected}, got {_json_value(d[name])}")
        rules = d.get("rules", [])
        for i, r in enumerate(rules):
            if not isinstance(r, Mapping) or set(r) != {"pattern", "precision"}:
                raise PlanError(f"plan 'rules' item {i} must be a {{\"pattern\": ..., \"precision\": ...}} object, "
                                f"got {_json_value(r)}")
            for name, (types, expected) in _RULE_FIELD_TYPES.items():
                if not _has_type(r[name], types):
                    raise PlanError(f"plan 'rules' item {i} field '{name}' must be {expected}, "
                                    f"got {_json_value(r[name])}")
        if d["version"] < 1:
            raise PlanError(f"plan field 'version' must be 1 or more, got {d['version']}")
        try:
            get_precision(d.get("default", "int8"))
        except PlanError as e:
            raise PlanError(f"plan field 'default': {e}") from None
        parsed = []
        for i, r in enumerate(rules):
            try:
                parsed.append(PlanRule(**r))
            except PlanError as e:
                raise PlanError(f"plan 'rules' item {i}: {e}") from None
        return cls(default=d.get("default", "int8"), rules=tuple(parsed),
                   group_size=d.get("group_size", DEFAULT_GROUP_SIZE), symmetric=d.get("symmetric", True),
                   method=d.get("method", "rtn"), version=d["version"], meta=d.get("meta", {}),
                   scale_search=d.get("scale_search", False), full_range=d.get("full_range", False))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "QuantPlan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(Path(path), self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "QuantPlan":
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"plan file '{p}' {'is a directory' if p.is_dir() else 'does not exist'}; pass a plan "
                            "JSON file (`workbench plan` writes one)")
        try:
            plan = cls.from_json(p.read_text(encoding="utf-8"))
            object.__setattr__(plan, "source_file", str(p))  # named when a rule matches no layer
            return plan
        except UnicodeDecodeError as e:
            raise PlanError(f"plan file '{p}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except PlanError as e:
            raise PlanError(f"{p}: {e}") from None

    @staticmethod
    def check_output_file(path: str | Path, option: str = "--out") -> Path:
        """Refuse to overwrite ``path`` unless it is absent or already a plan file (a user's other file is kept)."""
        p = Path(path)
        if p.is_dir():
            raise PlanError(f"{option} '{p}' is a directory; name the plan JSON file to write, e.g. {p / 'plan.json'}")
        if p.exists():
            try:
                QuantPlan.load(p)
            except PlanError:
                raise PlanError(f"{option} '{p}' exists and is not a workbench plan; name a new file, or move that "
                                "one away") from None
        return p

    # -- display ------------------------------------------------------------------------------
    def table(self, layers: Iterable) -> str:
        """A readable table: layer, shape, parameters, precision, bytes at that precision."""
        rows = [("layer", "shape", "params", "precision", "bytes")]
        total = 0
        for info in layers:
            pname = self.precision_name_for(info.name)
            nbytes = info.bytes_at(pname or "fp16", self.group_size, self.symmetric)
            total += nbytes
            rows.append((info.name, "x".join(map(str, info.shape)), f"{info.parameters:,}",
                         pname or "(unchanged)", f"{nbytes:,}"))
        rows.append(("total", "", "", "", f"{total:,}"))
        return text_table(rows, right={1, 2, 4})


def fitting_precisions(precisions, in_features: int) -> list[str]:
    """The precisions a layer of ``in_features`` inputs can take: a fixed block layout only where its blocks fit."""
    return [p for p in precisions if not get_precision(p).misfit(in_features)]


# ---------------------------------------------------------------- vision-language recipes per runtime

@dataclass(frozen=True)
class VisionRecipe:
    """How a runtime ships a vision-language model's vision encoder and projector (they are their own graph or file
    on every device stack), and the language model's weights where the recipe fixes them."""

    runtime: str
    vision: str  # the vision encoder's precision
    projector: str  # the projector's / merger's (Qwen's merger sits inside the vision graph)
    language: str | None  # the language model's, where the recipe fixes it; None: the plan's
    source: str

    def to_dict(self) -> dict:
        return {"runtime": self.runtime, "vision": self.vision, "projector": self.projector,
                "language": self.language, "source": self.source}


# deployment target -> the runtime whose VLM recipe it follows
VISION_RECIPE_TARGETS = {"qnn": "qualcomm", "htp": "qualcomm", "ort-qdq": "qualcomm", "mnn": "mnn", "mnn-llm": "mnn",
                         "llama.cpp": "llama.cpp"}
MNN_INT4_VISION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # llmexport's int4 block-128 visual.mnn; int8 otherwise
MMPROJ_TYPES = {"f16": "fp16", "q8_0": "int8"}  # llama.cpp's mmproj GGUF: f16 by default, Q8_0 by llama-quantize


def vision_recipe(target: str, model_type: str | None = None, *, mmproj: str = "f16") -> VisionRecipe:
    """The VLM recipe of ``target`` (``qnn``, ``htp``, ``ort-qdq``, ``mnn``, ``mnn-llm``, ``llama.cpp``) for a model of
    ``model_type`` (``qwen2_5_vl``, ``smolvlm``...). The runtimes' own choices, as their code writes them:

    * Qualcomm (qai-hub-models' Qwen2.5-VL / Qwen3-VL): the vision encoder its own graph at w8a16 (int8 weights per
      channel, 16-bit activations, min-max calibrated on ~100 images), the merger inside it; the language model w4a16.
    * MNN (llmexport's ``visual.mnn``, weight-only): int4 in blocks of 128 for Qwen2 / 2.5 / 3-VL, int8 for SmolVLM,
      InternVL, Gemma 3 and the rest.
    * llama.cpp: the vision encoder and projector in one ``mmproj`` GGUF, f16 by default, ``q8_0`` by llama-quantize.
    """
    family = VISION_RECIPE_TARGETS.get(target)
    if family is None:
        raise PlanError(f"no vision-language recipe for target '{target}'; targets with one: "
                        f"{', '.join(VISION_RECIPE_TARGETS)}")
    if mmproj not in MMPROJ_TYPES:
        raise PlanError(f"mmproj type must be one of {', '.join(MMPROJ_TYPES)}, got '{mmproj}'")
    if family == "qualcomm":
        return VisionRecipe("Qualcomm (qai-hub-models)", "int8", "int8", "int4",
                            "vision encoder w8a16 (int8 weights per channel), language model w4a16")
    if family == "mnn":
        bits = "int4" if model_type in MNN_INT4_VISION else "int8"
        return VisionRecipe("MNN (llmexport visual.mnn)", bits, bits, None,
                            f"visual part weight-only {bits}" + (" in blocks of 128" if bits == "int4" else "") +
                            f" for {model_type or 'this model type'}")
    return VisionRecipe("llama.cpp (mmproj GGUF)", MMPROJ_TYPES[mmproj], MMPROJ_TYPES[mmproj], None,
                        f"vision encoder and projector in one mmproj GGUF at {mmproj}")


def vision_recipe_for(targets, model_type: str | None = None, *, mmproj: str = "f16") -> VisionRecipe | None:
    """The one VLM recipe of ``targets`` (a name or several; those without a recipe are passed over): None when
    none has one, PlanError when two ship the vision encoder differently."""
    names = [targets] if isinstance(targets, str) else list(targets or ())
    found = {t: vision_recipe(t, model_type, mmproj=mmproj) for t in names if t in VISION_RECIPE_TARGETS}
    kinds = {(r.vision, r.projector) for r in found.values()}
    if len(kinds) > 1:
        raise PlanError("these targets ship the vision encoder differently (" + "; ".join(
            f"{t}: vision {r.vision}, projector {r.projector}" for t, r in found.items()) + "): plan for one of them")
    return next(iter(found.values()), None)
