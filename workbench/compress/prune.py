"""Structured pruning: remove whole attention heads and MLP channels, so the tensors really shrink.

    imp = head_and_channel_importance(lm, workspace=Workspace())   # Taylor scores, and KL per masked head
    plan = PrunePlan(heads=0.25, mlp=0.2)                          # of the model's heads / channels; ends whole
    result = prune_model(lm, plan, imp)                            # a smaller model, in memory
    save_pruned(result, lm, "out/pruned")                          # a Hugging Face directory

Units. Attention is grouped-query: every KV head serves ``heads / kv_heads`` query heads. With
``head_unit="group"`` (the default) a KV head and the query heads that share it are one unit and
leave together (q_proj and o_proj lose the query heads' rows and columns, k_proj and v_proj the KV
head's rows). With ``head_unit="query"`` every KV head stays and each group of a layer loses the
same number of query heads. An MLP channel is one row of gate_proj and up_proj and one column of
down_proj. ``q_norm`` / ``k_norm`` (Qwen3) act per ``head_dim`` and are untouched; ``head_dim`` is
written into the pruned config explicitly, since it no longer equals ``hidden_size / num_attention_heads``.

Per-layer counts. By default the first and last layers stay whole and a ratio is of the whole
model's heads (channels), removed as whole units from the middle layers where they score lowest
(``spread="global"``), so layers keep different counts. Qwen2, Qwen3 and Llama configs hold one head
count and one MLP width for every layer, so such a model's config.json gets the largest counts in
the standard fields and every layer's in ``layer_shapes`` (``workbench.model.load.LAYER_SHAPES``); the
workbench's loader builds each layer at its own counts (transformers' attention reshapes with
``-1`` heads and repeats KV heads ``num_key_value_groups`` times, which is set per layer). Plain
transformers ignores that field and would fail on the weights' shapes. A plan whose layers keep the
same counts (``spread="layer"`` without the first/last rule, or explicit lists) writes a plain config.
The slicing rules are written here rather than taken from torch-pruning, which is not a dependency
and whose dependency graph would have to be constrained back to these same grouped-query rules.

Importance (``head_and_channel_importance``), from calibration windows with the language-model loss:
``taylor`` is the first-order Taylor estimate of the loss change when a unit's output is zeroed,
``|sum over tokens and the unit's dimensions of activation x gradient|`` (on o_proj's input per
head, on down_proj's input per channel); ``activation`` is the unit's activation norm times the norm
of the weights that read it (o_proj / down_proj columns). For heads it also measures the KL to the
unpruned model with each KV group (and each query head) masked alone, on the sensitivity sweep's
evaluator (reference captured once, earlier blocks replayed), cached in the workspace.
"""
from __future__ import annotations

import copy
import hashlib
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..numerics.compute import narrow_saved_weights, enable_float32_compute
from ..errors import PlanError
from ..evaluation.evaluate import evaluate, capture_reference, paired_difference, reference_report
from ..numerics.logits import chunked_sum, head_input, loss_chunk_rows, trainable_head_logits
from ..model.load import LoadedModel, LAYER_SHAPES, load_model, model_from_config
from ..precision.proxy import decoder_blocks
from ..files.workspace import (Workspace, atomic_write_json, read_json_file, model_fingerprint, staged_output,
                               write_output_manifest)
from ..assets import demo_text_path
from ..devices.projection import model_shape
from ..precision.sensitivity import evaluation_tokens, PlanEvaluator
from .finetune import save_model_directory

__all__ = ["PrunePlan", "PruneImportance", "PruneResult", "Geometry", "head_and_channel_importance",
           "prune_model", "save_pruned", "prune", "predict_parameters", "predicted_size", "geometry", "PRUNE_FORMAT",
           "SCORES",
           "HEAD_UNITS", "SPREADS", "PRUNE_PLAN_VERSION", "measure_point", "head_mapping", "kept_query_heads"]

PRUNE_FORMAT = "workbench-prune"  # the kind named in the manifest of a pruned --out
PRUNE_PLAN_VERSION = 2
PRUNE_REPORT = "prune.json"
IMPORTANCE_FILE = "importance.json"
IMPORTANCE_STEP = "prune-importance"
IMPORTANCE_VERSION = 1
SCORES = ("taylor", "activation", "kl")  # kl: heads by measured KL (MLP channels then use taylor)
HEAD_UNITS = ("group", "query")
DEFAULT_IMPORTANCE_TOKENS = 2048
DEFAULT_KL_TOKENS = 1024


# -- shapes -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """The prunable shape of a Llama/Qwen decoder."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    hidden: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


def geometry(model: nn.Module) -> Geometry:
    """The model's heads, KV heads, head_dim and MLP width, checked to be a decoder the slicing rules cover."""
    cfg = model.config
    blocks = decoder_blocks(model)
    arch = ", ".join(getattr(cfg, "architectures", None) or [type(model).__name__])
    if blocks is None:
        raise PlanError(f"structured pruning supports Llama-style decoders (Llama, Qwen2/2.5, Qwen3); {arch} has no "
                        "model.layers")
    for block in blocks:
        a, m = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        if not all(isinstance(getattr(a, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                not all(isinstance(getattr(m, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
            raise PlanError(f"structured pruning needs float q/k/v/o and gate/up/down linear layers in every block; "
                            f"{arch} has others (a quantized model? prune its float source)")
    if getattr(cfg, LAYER_SHAPES, None) is not None:
        raise PlanError(f"this model was already pruned to per-layer shapes ('{LAYER_SHAPES}' in its config); prune "
                        "the original model with a plan that removes more")
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(blocks[0].self_attn, "head_dim", None) or cfg.hidden_size // heads
    return Geometry(len(blocks), heads, kv, head_dim, cfg.intermediate_size, cfg.hidden_size)


# -- the plan ---------------------------------------------------------------------------------------

def _ratio(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise PlanError(f"{what} must be a fraction removed in [0, 1), got {value!r}"
                        + ("; 1 would remove every unit" if value == 1 else ""))
    return float(value)


SPREADS = ("global", "layer")


@dataclass(frozen=True)
class PrunePlan:
    """What each layer keeps: fractions removed, per-layer ratios or explicit kept lists, the ends kept whole.

    ``heads`` / ``mlp``: fraction of the model's heads / MLP channels removed. With ``spread="global"``
    (the default) the fraction is of all the model's heads (channels), taken as whole units from the
    prunable layers wherever they score lowest, so layers end up with different counts; with
    ``spread="layer"`` every prunable layer loses that fraction of its own units. ``keep_first_last``
    (default on; a model of one or two layers has no middle layers and prunes them all) leaves the
    first and last layers whole. ``layers`` overrides one layer by its index: ``{"2": {"heads": 0.5}}``
    (a fraction of that layer removed) or ``{"2": {"heads_keep": [0], "mlp_keep": [0, 5, ...]}}``
    (the units kept). ``mlp_multiple`` keeps every layer's MLP width a multiple of it (32: group-wise
    quantization at group 32 still divides; 1 keeps the exact fraction). ``score`` ranks units
    (``taylor``, ``activation``, or ``kl`` for heads). Version 1 plans (one count for every layer) read
    as ``spread="layer"`` without the first/last rule, as they were written.
    """

    heads: float = 0.0
    mlp: float = 0.0
    head_unit: str = "group"
    score: str = "taylor"
    mlp_multiple: int = 32
    keep_first_last: bool = True
    spread: str = "global"
    layers: Mapping[str, Mapping] = field(default_factory=dict)
    version: int = PRUNE_PLAN_VERSION

    def __post_init__(self):
        _ratio(self.heads, "heads")
        _ratio(self.mlp, "mlp")
        if self.head_unit not in HEAD_UNITS:
            raise PlanError(f"head_unit must be one of {', '.join(HEAD_UNITS)}, got {self.head_unit!r}")
        if self.score not in SCORES:
            raise PlanError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.spread not in SPREADS:
            raise PlanError(f"spread must be one of {', '.join(SPREADS)}, got {self.spread!r}")
        if not isinstance(self.keep_first_last, bool):
            raise PlanError(f"keep_first_last must be true or false, got {self.keep_first_last!r}")
        if isinstance(self.mlp_multiple, bool) or not isinstance(self.mlp_multiple, int) or self.mlp_multiple < 1:
            raise PlanError(f"mlp_multiple must be a positive integer, got {self.mlp_multiple!r}")
        if self.version != PRUNE_PLAN_VERSION:
            raise PlanError(f"pruning plan version {self.version} is not supported (this workbench reads versions "
                            f"1 and {PRUNE_PLAN_VERSION})")
        for key, entry in self.layers.items():
            if not isinstance(entry, Mapping):
                raise PlanError(f"pruning plan layer {key!r}: give an object like {{\"heads\": 0.5}}")
            unknown = set(entry) - {"heads", "mlp", "heads_keep", "mlp_keep"}
            if unknown:
                raise PlanError(f"pruning plan layer {key!r}: unknown field(s) {sorted(unknown)}; use heads, mlp "
                                "(fractions removed) or heads_keep, mlp_keep (lists of kept indices)")
            for kind in ("heads", "mlp"):
                if kind in entry and f"{kind}_keep" in entry:
                    raise PlanError(f"pruning plan layer {key!r}: give {kind} or {kind}_keep, not both")
                if kind in entry:
                    _ratio(entry[kind], f"layer {key} {kind}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = {str(k): dict(v) for k, v in self.layers.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "pruning plan") -> "PrunePlan":
        if not isinstance(d, Mapping):
            raise PlanError(f"{where}: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {sorted(unknown)}; a pruning plan has {sorted(known)}")
        d = dict(d)
        if d.get("version") == 1:  # written when every layer kept the same counts: read as it meant then
            if set(d) & {"keep_first_last", "spread"}:
                raise PlanError(f"{where}: keep_first_last and spread are version 2 fields; set version to 2")
            d.update(version=PRUNE_PLAN_VERSION, keep_first_last=False, spread="layer",
                     mlp_multiple=d.get("mlp_multiple", 1))
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "PrunePlan":
        d = read_json_file(path, "pruning plan", error=PlanError,
                           hint="write one with PrunePlan(...).save(path) or pass --heads / --mlp")
        return cls.from_dict(d, where=f"pruning plan '{path}'")

    # -- resolution to kept indices ---------------------------------------------------------------

    def whole_layers(self, geo: Geometry) -> set[int]:
        """Layers a ratio leaves whole: the first and last, when the model has layers between them."""
        return {0, geo.layers - 1} if self.keep_first_last and geo.layers > 2 else set()

    def keep(self, geo: Geometry, importance: "PruneImportance | None" = None) -> dict:
        """Kept units per layer: ``{"heads": [[...] per layer], "mlp": [[...] per layer]}``, checked.

        Head units are KV groups (``head_unit="group"``) or, per layer, query heads listed by their
        global index (``head_unit="query"``, every group of a layer keeping the same number). Ratios
        take the most important units by ``importance`` (required unless every layer gives lists).
        """
        return self._resolve(geo, importance)

    def layer_counts(self, geo: Geometry, importance: "PruneImportance | None" = None) -> list[tuple[int, int, int]]:
        """(query heads, KV heads, MLP width) per layer: which layers lose units needs ``importance`` under
        ``spread="global"``, the totals (and so the parameters) do not; without it the units removed are
        spread evenly over the prunable layers."""
        kept = self._resolve(geo, importance if importance is not None else _IndexOrder(geo))
        out = []
        for units, ch in zip(kept["heads"], kept["mlp"]):
            q, kv = _query_and_kv_heads(units, geo, self.head_unit)
            out.append((len(q), len(kv), len(ch)))
        return out

    def _resolve(self, geo: Geometry, importance) -> dict:
        for key in self.layers:
            if not str(key).isdigit() or int(key) >= geo.layers:
                raise PlanError(f"the pruning plan names layer {key!r}; the model has layers 0-{geo.layers - 1}")
        per_layer = {int(k): v for k, v in self.layers.items()}
        whole = self.whole_layers(geo)
        kept: dict[str, list] = {"heads": [None] * geo.layers, "mlp": [None] * geo.layers}
        for kind, ratio, of in (("heads", self.heads, self._heads_of), ("mlp", self.mlp, self._mlp_of)):
            pool = []
            for i in range(geo.layers):
                entry = per_layer.get(i, {})
                if kind in entry or f"{kind}_keep" in entry:
                    kept[kind][i] = of(i, entry, geo, importance)
                elif i in whole or ratio == 0:
                    kept[kind][i] = of(i, {kind: 0.0}, geo, importance)
                elif self.spread == "layer":
                    kept[kind][i] = of(i, {kind: ratio}, geo, importance)
                else:
                    pool.append(i)
            if pool:
                for i, k in self._global(kind, ratio, pool, geo, importance).items():
                    kept[kind][i] = k
        return kept

    def _global(self, kind: str, ratio: float, pool: list[int], geo: Geometry, importance) -> dict[int, list[int]]:
        """``ratio`` of the model's heads (channels) removed from the ``pool`` layers, lowest-scoring blocks first.

        A block is the least a layer can lose and stay well formed: one KV group with its query
        heads, one query head from every KV group, or the MLP channels down to the next multiple of
        ``mlp_multiple``. Blocks are taken by their mean score, across layers, while taking one
        brings the total removed nearer the target.
        """
        import heapq
        query = kind == "heads" and self.head_unit == "query"
        blocks: dict[int, list[tuple[list[int], float]]] = {}  # layer -> blocks in removal order
        for i in pool:
            if kind == "heads" and not query:
                scores = self._scores(importance, "heads", i, geo.kv_heads)
                blocks[i] = [([k], scores[k]) for k in sorted(range(geo.kv_heads), key=lambda k: scores[k])][:-1]
            elif query:  # per group its heads ascending; block j = every group's j-th least important head
                scores = self._scores(importance, "heads", i, geo.heads)
                per_group = [sorted(range(g * geo.group, (g + 1) * geo.group), key=lambda h: scores[h])
                             for g in range(geo.kv_heads)]
                blocks[i] = [([grp[j] for grp in per_group], sum(scores[grp[j]] for grp in per_group) / geo.kv_heads)
                             for j in range(geo.group - 1)]
            else:
                score = "taylor" if self.score == "kl" else self.score
                scores = PrunePlan(score=score)._scores(importance, "mlp", i, geo.intermediate)
                order = sorted(range(geo.intermediate), key=lambda c: scores[c])
                widths, w, m = [], geo.intermediate, self.mlp_multiple
                while (w - 1) // m * m >= m:
                    widths.append((w - 1) // m * m)
                    w = widths[-1]
                done, blocks[i] = 0, []
                for w in widths:
                    units = order[done:geo.intermediate - w]
                    blocks[i].append((units, sum(scores[c] for c in units) / len(units)))
                    done = geo.intermediate - w
        per_unit = geo.heads if kind == "heads" else geo.intermediate
        target = ratio * geo.layers * per_unit  # query heads / channels of the whole model
        group_blocks = kind == "heads" and not query
        size = (lambda b: len(b) * geo.group) if group_blocks else len
        step = geo.group if group_blocks else geo.kv_heads if query else self.mlp_multiple
        removed, taken = 0, {i: 0 for i in pool}
        heap = [(b[0][1], i) for i, b in blocks.items() if b]
        heapq.heapify(heap)
        while heap:
            i = heap[0][1]
            n = size(blocks[i][taken[i]][0])
            if abs(removed + n - target) > abs(removed - target) + 1e-9:  # a tie takes it: half rounds up
                break
            heapq.heappop(heap)
            removed += n
            taken[i] += 1
            if taken[i] < len(blocks[i]):
                heapq.heappush(heap, (blocks[i][taken[i]][1], i))
        if not heap and target - removed >= step / 2 - 1e-9:
            what = "heads" if kind == "heads" else "MLP channels"
            keep = "one head per KV group" if query else "one KV group" if kind == "heads" else \
                f"{self.mlp_multiple} channels"
            most = f"at most {removed / (geo.layers * per_unit):.0%}"
            if len(pool) == geo.layers:
                raise PlanError(f"removing {ratio:.0%} of the model's {what} leaves none in a layer (each keeps at "
                                f"least {keep}); lower {kind} ({most})")
            raise PlanError(f"removing {ratio:.0%} of the model's {what} from layer(s) {', '.join(map(str, pool))} "
                            f"alone leaves none in a layer (each keeps at least {keep}); lower {kind} ({most}), or "
                            "set keep_first_last false (--prune-first-last) to prune every layer")
        out = {}
        n_units = geo.kv_heads if kind == "heads" and not query else geo.heads if query else geo.intermediate
        for i in pool:
            gone = {u for b, _ in blocks[i][:taken[i]] for u in b}
            out[i] = [u for u in range(n_units) if u not in gone]
        return out

    def _scores(self, importance, kind: str, layer: int, n: int) -> list[float]:
        if importance is None:
            raise PlanError(f"layer {layer}: a {kind} ratio needs importance scores; compute them "
                            "(head_and_channel_importance) or list the kept units")
        scores = importance.scores(kind, layer, self.score, self.head_unit)
        if len(scores) != n:
            raise PlanError(f"the importance scores have {len(scores)} {kind} units in layer {layer}, the model "
                            f"{n}: they were computed for another model")
        return list(scores)

    def _ranked(self, importance, kind: str, layer: int, n: int) -> list[int]:
        scores = self._scores(importance, kind, layer, n)
        return sorted(range(n), key=lambda j: -scores[j])

    def _heads_of(self, i: int, entry: Mapping, geo: Geometry, importance) -> list[int]:
        group = self.head_unit == "group"
        n = geo.kv_heads if group else geo.heads
        if "heads_keep" in entry:
            kept = _checked_list(entry["heads_keep"], n, f"layer {i} heads_keep", "KV groups" if group else
                                 "query heads")
        else:
            ratio = entry.get("heads", self.heads)
            if ratio == 0:
                return list(range(n))
            ranked = self._ranked(importance, "heads", i, n)
            if group:
                keep_n = n - _removed(ratio, n)
                if keep_n < 1:
                    raise PlanError(f"layer {i}: removing {ratio:.0%} of {n} KV groups leaves none; lower heads")
                kept = sorted(ranked[:keep_n])
            else:  # the same number of query heads from every group, each group's most important ones
                per = geo.group - _removed(ratio, geo.group)
                if per < 1:
                    raise PlanError(f"layer {i}: removing {ratio:.0%} of the {geo.group} query heads of each KV "
                                    "group leaves a group with none; lower heads, or prune whole groups "
                                    "(head_unit 'group')")
                kept = sorted(j for g in range(geo.kv_heads)
                              for j in [h for h in ranked if h // geo.group == g][:per])
        if not kept:
            raise PlanError(f"layer {i}: the plan keeps no heads; keep at least one")
        if not group:
            per_group = [sum(1 for h in kept if h // geo.group == g) for g in range(geo.kv_heads)]
            if min(per_group) == 0:
                g = per_group.index(0)
                raise PlanError(f"layer {i} keeps no query head of KV group {g}; keep at least one per group, or "
                                "prune whole groups (head_unit 'group')")
            if len(set(per_group)) > 1:
                raise PlanError(f"layer {i} keeps {per_group} query heads per KV group; grouped-query attention "
                                "needs the same number in every group")
        return kept

    def _mlp_of(self, i: int, entry: Mapping, geo: Geometry, importance) -> list[int]:
        n = geo.intermediate
        if "mlp_keep" in entry:
            return _checked_list(entry["mlp_keep"], n, f"layer {i} mlp_keep", "MLP channels")
        ratio = entry.get("mlp", self.mlp)
        if ratio == 0:
            return list(range(n))
        keep_n = n - _removed(ratio, n)
        keep_n -= keep_n % self.mlp_multiple
        if keep_n < 1:
            raise PlanError(f"layer {i}: removing {ratio:.0%} of {n} MLP channels (kept width a multiple of "
                            f"{self.mlp_multiple}) leaves none; lower mlp or mlp_multiple")
        score = "taylor" if self.score == "kl" else self.score
        ranked = PrunePlan(score=score)._ranked(importance, "mlp", i, n)
        return sorted(ranked[:keep_n])


class _IndexOrder:
    """Stand-in scores that rank units by index (earlier = keep): counts without importance."""

    def __init__(self, geo: Geometry):
        self.geo = geo

    def scores(self, kind: str, layer: int, score: str, head_unit: str = "group") -> list[float]:
        n = self.geo.intermediate if kind == "mlp" else self.geo.kv_heads if head_unit == "group" else self.geo.heads
        return [float(n - j) for j in range(n)]


def _removed(ratio: float, n: int) -> int:
    """Units removed for a fraction: the nearest whole number (half rounds up)."""
    return int(math.floor(ratio * n + 0.5))


def _checked_list(value, n: int, what: str, units: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise PlanError(f"{what} must be a list of integer indices")
    bad = [v for v in value if not 0 <= v < n]
    if bad:
        raise PlanError(f"{what} names {units} {bad[:3]}; the model has {n} (0-{n - 1})")
    if len(set(value)) != len(value):
        raise PlanError(f"{what} lists an index twice")
    if not value:
        raise PlanError(f"{what} is empty: a layer must keep at least one of its {units}")
    return sorted(value)


# -- importance ---------------------------------------------------------------------------------------

@dataclass
class PruneImportance:
    """Scores per layer: per query head, per KV group, per MLP channel; and measured KL per masked head."""

    model: str
    tokens: int
    geometry: dict
    taylor_heads: list[list[float]]
    taylor_mlp: list[list[float]]
    activation_heads: list[list[float]]
    activation_mlp: list[list[float]]
    kl_groups: list[list[float]] | None = None  # KL (nats/token) with each KV group masked alone
    kl_heads: list[list[float]] | None = None  # KL with each query head masked alone
    kl_tokens: int = 0
    seconds: float = 0.0

    @property
    def group(self) -> int:
        return self.geometry["heads"] // self.geometry["kv_heads"]

    def scores(self, kind: str, layer: int, score: str, head_unit: str = "group") -> list[float]:
        """One layer's scores for ``kind`` (heads: per KV group or per query head), higher = keep."""
        if kind == "mlp":
            return (self.activation_mlp if score == "activation" else self.taylor_mlp)[layer]
        if score == "kl":
            table = self.kl_groups if head_unit == "group" else self.kl_heads
            if table is None:
                raise PlanError("the plan ranks heads by measured KL, but the importance was computed without it; "
                                "compute it with measure_kl=True or choose score 'taylor'")
            return table[layer]
        per_head = (self.activation_heads if score == "activation" else self.taylor_heads)[layer]
        if head_unit == "query":
            return per_head
        g = self.group
        return [sum(per_head[k * g:(k + 1) * g]) for k in range(len(per_head) // g)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "PruneImportance":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "PruneImportance":
        return cls.from_dict(read_json_file(path, "pruning importance"))


def _o_and_down(model: nn.Module) -> list[tuple[nn.Linear, nn.Linear]]:
    return [(b.self_attn.o_proj, b.mlp.down_proj) for b in decoder_blocks(model)]


def _gradient_scores(lm: LoadedModel, ids: torch.Tensor, geo: Geometry, seq_len: int, batch_size: int,
                     progress: bool) -> tuple[list, list, list, list]:
    """Taylor and activation-norm scores from the language-model loss on ``ids`` cut into windows."""
    from tqdm.auto import tqdm
    model = lm.model
    n = ids.numel() // seq_len
    if n < 1:
        raise PlanError(f"importance needs at least one window of {seq_len} tokens; the text has {ids.numel()}")
    windows = ids[: n * seq_len].view(n, seq_len)
    pairs = _o_and_down(model)
    taylor_h = torch.zeros(geo.layers, geo.heads, dtype=torch.float64)
    taylor_m = torch.zeros(geo.layers, geo.intermediate, dtype=torch.float64)
    sq_h = torch.zeros_like(taylor_h)
    sq_m = torch.zeros_like(taylor_m)
    handles = []

    def hook(i: int, kind: str):
        def pre(module, args):
            x = args[0]
            if not x.requires_grad:
                return
            flat = x.detach().float().reshape(-1, x.shape[-1])
            if kind == "heads":
                sq_h[i] += flat.view(-1, geo.heads, geo.head_dim).square().sum((0, 2)).double()
            else:
                sq_m[i] += flat.square().sum(0).double()

            def grad_hook(g):
                prod = (x.detach().float() * g.float()).reshape(x.shape[0], -1, x.shape[-1]).sum(1)  # per window
                if kind == "heads":
                    taylor_h[i] += prod.view(-1, geo.heads, geo.head_dim).sum(-1).abs().sum(0).double()
                else:
                    taylor_m[i] += prod.abs().sum(0).double()
            x.register_hook(grad_hook)
        return pre

    for i, (o, down) in enumerate(pairs):
        handles.append(o.register_forward_pre_hook(hook(i, "heads")))
        handles.append(down.register_forward_pre_hook(hook(i, "mlp")))
    embed = model.get_input_embeddings()
    handles.append(embed.register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    head = model.get_output_embeddings()
    chunk = loss_chunk_rows(head.weight.shape[0])

    def nll(h, y):  # the language-model loss of a chunk of rows, summed: its logits never outlive the chunk
        return (torch.nn.functional.cross_entropy(trainable_head_logits(head, h), y, reduction="sum"),)
    try:
        for p in model.parameters():
            p.requires_grad_(False)  # gradients of the activations only
        model.eval()
        device = next(model.parameters()).device
        for s in tqdm(range(0, n, batch_size), desc="importance", unit="batch", disable=not progress, leave=False):
            batch = windows[s:s + batch_size].to(device)
            # the batch's mean next-token loss, as model(labels=...) gives it, one window at a time (windows do
            # not interact, so each window's activation gradients are the batch's), without tokens x vocabulary
            # and without the blocks' float32 weight copies kept for backward
            scored = batch.shape[0] * (batch.shape[1] - 1)
            for window in batch:
                with torch.enable_grad(), narrow_saved_weights(model):
                    hidden = head_input(model, window[None])[0, :-1]
                    targets = window[1:].clone()  # a plain tensor (the text's ids may be inference tensors)
                    (total,) = chunked_sum(nll, hidden, targets, chunk=chunk)
                    (total / scored).backward()
    finally:
        for h in handles:
            h.remove()
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)
    # activation norm x the norm of the weights that read the unit (Wanda's |W| ||X|| at unit level)
    act_h, act_m = [], []
    for i, (o, down) in enumerate(pairs):
        w_o = o.weight.detach().float().view(o.weight.shape[0], geo.heads, geo.head_dim).square().sum((0, 2)).sqrt()
        w_d = down.weight.detach().float().square().sum(0).sqrt()
        act_h.append((sq_h[i].sqrt().float() * w_o).tolist())
        act_m.append((sq_m[i].sqrt().float() * w_d).tolist())
    return taylor_h.tolist(), taylor_m.tolist(), act_h, act_m


def _masked_kl(lm: LoadedModel, ids: torch.Tensor, geo: Geometry, progress: bool) -> tuple[list, list]:
    """KL to the unpruned model with each KV group, then each query head, masked alone (o_proj input zeroed)."""
    from tqdm.auto import tqdm
    evaluator = PlanEvaluator(lm, ids, progress=progress)
    evaluator.evaluate_baseline()  # records block outputs: a trial in block k replays blocks 0..k-1
    blocks = decoder_blocks(lm.model)

    def trial(layer: int, heads: Sequence[int]) -> float:
        cols = torch.cat([torch.arange(h * geo.head_dim, (h + 1) * geo.head_dim) for h in heads])

        def mask(module, args):
            x = args[0].clone()
            x[..., cols.to(x.device)] = 0
            return (x, *args[1:])
        handle = blocks[layer].self_attn.o_proj.register_forward_pre_hook(mask)
        try:
            with evaluator.replay.skipping(layer):
                return float(evaluate(lm.model, evaluator.ids, reference=evaluator.reference, ctx=evaluator.ctx,
                                      batch_size=evaluator.batch_size, progress=False).kl_divergence)
        finally:
            handle.remove()

    groups, heads = [], []
    g = geo.group
    bar = tqdm(total=geo.layers * (geo.kv_heads + (geo.heads if g > 1 else 0)), desc="head KL", unit="trial",
               disable=not progress, leave=False)
    for layer in range(geo.layers):
        row = []
        for k in range(geo.kv_heads):
            row.append(trial(layer, range(k * g, (k + 1) * g)))
            bar.update()
        groups.append(row)
        if g > 1:
            hrow = []
            for h in range(geo.heads):
                hrow.append(trial(layer, [h]))
                bar.update()
            heads.append(hrow)
        else:
            heads.append(list(row))  # one query head per KV head: the group is the head
    bar.close()
    return groups, heads


def head_and_channel_importance(lm: LoadedModel, *, ids: torch.Tensor | None = None, text_path=None,
                                tokens: int = DEFAULT_IMPORTANCE_TOKENS, seq_len: int = 256, batch_size: int = 4,
                                measure_kl: bool = True, kl_tokens: int = DEFAULT_KL_TOKENS,
                                workspace: Workspace | None = None, force: bool = False,
                                progress: bool = True) -> PruneImportance:
    """Importance of every head and MLP channel (Taylor, activation norm, and measured KL per masked head).

    ``ids`` (default: the model's calibration text, ``text_path``) gives the gradient windows; KL is
    measured on the first ``kl_tokens`` of the held-out text like the sensitivity sweep. Cached in
    ``workspace`` under ``prune-importance/`` by the weights, tokens and settings.
    """
    lm.require_float("prune")
    geo = geometry(lm.model)
    if ids is None:
        ids = evaluation_tokens(lm, text_path or demo_text_path("calibration"))
    ids = ids.reshape(-1)[:tokens].long()
    max_pos = getattr(lm.config, "max_position_embeddings", None) or seq_len
    seq_len = min(seq_len, max_pos, ids.numel())
    kl_ids = evaluation_tokens(lm, None, kl_tokens) if measure_kl else None

    def compute_now() -> PruneImportance:
        t0 = time.perf_counter()
        th, tm, ah, am = _gradient_scores(lm, ids, geo, seq_len, batch_size, progress)
        kg = kh = None
        if measure_kl:
            kg, kh = _masked_kl(lm, kl_ids, geo, progress)
        return PruneImportance(str(lm.name), int(ids.numel()), asdict(geo), th, tm, ah, am, kg, kh,
                               int(kl_ids.numel()) if kl_ids is not None else 0, time.perf_counter() - t0)

    if workspace is None:
        return compute_now()
    inputs = {"model": model_fingerprint(lm.model), "version": IMPORTANCE_VERSION,
              "tokens": hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16], "seq_len": seq_len,
              "kl_tokens": hashlib.sha256(kl_ids.numpy().tobytes()).hexdigest()[:16] if kl_ids is not None else None}

    def compute(partial: Path) -> dict:
        imp = compute_now()
        imp.save(partial / IMPORTANCE_FILE)
        return {"tokens": imp.tokens, "kl_tokens": imp.kl_tokens, "seconds": round(imp.seconds, 3)}

    artifact = workspace.get_or_compute(IMPORTANCE_STEP, inputs, compute, force=force)
    return PruneImportance.load(artifact.file(IMPORTANCE_FILE))


# -- slicing ------------------------------------------------------------------------------------------

def _head_rows(heads: Sequence[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def _query_and_kv_heads(kept: Sequence[int], geo: Geometry, unit: str) -> tuple[list[int], list[int]]:
    """(kept query heads, kept KV heads) for a layer's kept units."""
    if unit == "group":
        return [k * geo.group + j for k in kept for j in range(geo.group)], list(kept)
    return list(kept), list(range(geo.kv_heads))


def _shapes(geo: Geometry, shapes, n_kv=None, intermediate=None) -> list[tuple[int, int, int]]:
    """Per-layer (heads, KV heads, MLP width): a list as given, or one count for every layer (the older call)."""
    if isinstance(shapes, int):
        return [(shapes, n_kv, intermediate)] * geo.layers
    return [tuple(int(v) for v in s) for s in shapes]


def pruned_config(config, geo: Geometry, shapes, n_kv: int | None = None, intermediate: int | None = None):
    """A copy of ``config`` with fewer heads / a narrower MLP; ``head_dim`` always explicit.

    ``shapes``: per-layer ``(heads, KV heads, MLP width)`` (or, as before, the three counts of every
    layer). Layers with different counts get the largest in the standard fields and theirs in
    ``layer_shapes`` (``workbench.model.load.LAYER_SHAPES``), which only the workbench's loader reads.
    """
    shapes = _shapes(geo, shapes, n_kv, intermediate)
    cfg = copy.deepcopy(config)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = (max(s[k] for s in shapes)
                                                                               for k in range(3))
    cfg.head_dim = geo.head_dim
    if len(set(shapes)) > 1:
        setattr(cfg, LAYER_SHAPES, {k: [s[j] for s in shapes] for j, k in
                                    enumerate(("num_attention_heads", "num_key_value_heads", "intermediate_size"))})
    elif hasattr(cfg, LAYER_SHAPES):
        delattr(cfg, LAYER_SHAPES)
    return cfg


def predict_parameters(config, geo: Geometry, shapes, n_kv: int | None = None, intermediate: int | None = None) -> int:
    """Parameters of the pruned model, from shapes alone (built on the meta device, each layer at its counts)."""
    with torch.device("meta"):
        model = model_from_config(pruned_config(config, geo, shapes, n_kv, intermediate))
    return _count(model)


def predicted_size(lm: LoadedModel, plan: PrunePlan, quant_plan=None,
                   importance: "PruneImportance | None" = None) -> dict:
    """Parameters and weight bytes (fp16, and under ``quant_plan``) of the model ``plan`` would leave.

    From shapes alone (a meta-device model of the pruned config), with the same byte accounting as
    every plan and quantized model (``LoadedModel.size_bytes``). ``heads`` / ``kv_heads`` /
    ``intermediate`` are the largest counts of any layer, ``layers`` every layer's; which layers lose
    units under a global ratio follows ``importance`` (the totals do not depend on it).
    """
    geo = geometry(lm.model)
    shapes = plan.layer_counts(geo, importance)
    heads, kv, inter = (max(s[k] for s in shapes) for k in range(3))
    shape = model_shape(pruned_config(lm.model.config, geo, shapes).to_dict(), name=f"{lm.name} pruned")
    params = _count(shape.model)
    out = {"heads": heads, "kv_heads": kv, "intermediate": inter, "parameters": params,
           "fp16_bytes": shape.size_bytes(precision="fp16"),
           "layers": [{"heads": h, "kv_heads": k, "intermediate": m} for h, k, m in shapes],
           **_removed_fractions(geo, shapes)}
    if quant_plan is not None:
        out["quantized_bytes"] = shape.size_bytes(quant_plan)
    return out


def _removed_fractions(geo: Geometry, shapes) -> dict:
    """The fractions of the model's query heads, KV heads and MLP channels a plan removes (all layers together)."""
    return {"heads_removed": 1 - sum(s[0] for s in shapes) / (geo.layers * geo.heads),
            "kv_heads_removed": 1 - sum(s[1] for s in shapes) / (geo.layers * geo.kv_heads),
            "mlp_removed": 1 - sum(s[2] for s in shapes) / (geo.layers * geo.intermediate)}


def kept_query_heads(kept_units: Sequence[Sequence[int]], geo: Geometry | Mapping, head_unit: str) -> list[list[int]]:
    """Per layer, the source's query-head index of each head the pruned layer keeps, in order."""
    g = geo if isinstance(geo, Geometry) else Geometry(**{f.name: geo[f.name] for f in fields(Geometry)})
    return [_query_and_kv_heads(units, g, head_unit)[0] for units in kept_units]


def head_mapping(directory: str | Path) -> list[list[int]] | None:
    """Per layer, which source query head each head of a pruned directory is (from its ``prune.json``); None when
    the directory is not a pruned model or says nothing about it."""
    path = Path(directory) / PRUNE_REPORT
    if not path.is_file():
        return None
    try:
        report = read_json_file(path, "pruning report")
        if "kept_query_heads" in report:
            return [list(map(int, layer)) for layer in report["kept_query_heads"]]
        return kept_query_heads(report["kept"]["heads"], report["geometry_before"],
                                report["plan"].get("head_unit", "group"))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


@dataclass
class PruneResult:
    """The pruned model, what it kept, and the parameter counts before, predicted and after."""

    model: nn.Module
    plan: PrunePlan
    kept: dict
    geometry_before: dict
    geometry_after: dict
    parameters_before: int
    parameters_predicted: int
    parameters_after: int

    @property
    def uniform(self) -> bool:
        """Whether every layer keeps the same counts (a plain config every tool reads)."""
        per = self.geometry_after["per_layer"]
        return all(len(set(v)) == 1 for v in per.values())

    def report(self) -> dict:
        b, per = self.geometry_before, self.geometry_after["per_layer"]
        geo = Geometry(**{f.name: b[f.name] for f in fields(Geometry)})
        shapes = list(zip(per["heads"], per["kv_heads"], per["intermediate"]))
        return {"plan": self.plan.to_dict(), "kept": self.kept,
                "kept_query_heads": kept_query_heads(self.kept["heads"], geo, self.plan.head_unit),
                "geometry_before": self.geometry_before,
                "geometry_after": self.geometry_after, "parameters_before": self.parameters_before,
                "parameters_predicted": self.parameters_predicted, "parameters_after": self.parameters_after,
                **_removed_fractions(geo, shapes)}

    def summary(self) -> str:
        b, a = self.geometry_before, self.geometry_after
        params = (f"parameters {self.parameters_before:,} -> {self.parameters_after:,} "
                  f"({self.parameters_after / self.parameters_before - 1:+.1%})")
        if self.uniform:
            return (f"heads {b['heads']} -> {a['heads']} (KV {b['kv_heads']} -> {a['kv_heads']}), MLP "
                    f"{b['intermediate']} -> {a['intermediate']} per layer; {params}")
        per, n = a["per_layer"], b["layers"]
        return (f"heads {n * b['heads']} -> {sum(per['heads'])} (KV {n * b['kv_heads']} -> {sum(per['kv_heads'])}), "
                f"MLP {n * b['intermediate']} -> {sum(per['intermediate'])} in all layers "
                f"({1 - sum(per['heads']) / (n * b['heads']):.1%} of heads, "
                f"{1 - sum(per['intermediate']) / (n * b['intermediate']):.1%} of MLP channels removed; per layer "
                f"heads {per['heads']}, KV {per['kv_heads']}, MLP {per['intermediate']}); {params}")


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@torch.no_grad()
def prune_model(lm: LoadedModel, plan: PrunePlan, importance: PruneImportance | None = None) -> PruneResult:
    """A new, smaller model: each layer's kept heads and channels sliced out of ``lm``'s weights."""
    lm.require_float("prune")
    geo = geometry(lm.model)
    kept = plan.keep(geo, importance)
    state = lm.model.state_dict()
    new_state = dict(state)
    shapes = []
    for i in range(geo.layers):
        q_heads, kv_heads = _query_and_kv_heads(kept["heads"][i], geo, plan.head_unit)
        if len(q_heads) % len(kv_heads):
            raise PlanError(f"layer {i}: {len(q_heads)} query heads over {len(kv_heads)} KV heads is not "
                            "grouped-query attention; keep the same number per group")
        shapes.append((len(q_heads), len(kv_heads), len(kept["mlp"][i])))
        qr, kvr = _head_rows(q_heads, geo.head_dim), _head_rows(kv_heads, geo.head_dim)
        ch = torch.tensor(kept["mlp"][i])
        p = f"model.layers.{i}."
        for name, rows, dim in (("self_attn.q_proj", qr, 0), ("self_attn.k_proj", kvr, 0),
                                ("self_attn.v_proj", kvr, 0), ("self_attn.o_proj", qr, 1),
                                ("mlp.gate_proj", ch, 0), ("mlp.up_proj", ch, 0), ("mlp.down_proj", ch, 1)):
            w = state[p + name + ".weight"]
            new_state[p + name + ".weight"] = w.index_select(dim, rows.to(w.device)).clone()
            if dim == 0 and p + name + ".bias" in state:  # Qwen2's q/k/v biases follow their rows
                b = state[p + name + ".bias"]
                new_state[p + name + ".bias"] = b.index_select(0, rows.to(b.device)).clone()
    cfg = pruned_config(lm.model.config, geo, shapes)
    dtype = next(lm.model.parameters()).dtype
    from transformers.initialization import no_init_weights
    with no_init_weights():  # every weight is overwritten below: a random initialisation would be wasted time
        model = model_from_config(cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict(new_state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise PlanError(f"pruned weights do not cover the pruned model (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}); this architecture is not one the slicing rules know")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    if dtype in (torch.float16, torch.bfloat16):
        enable_float32_compute(model)  # as load_model does: float32 arithmetic on 16-bit storage
    after = {"layers": geo.layers, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
             "head_dim": geo.head_dim, "intermediate": cfg.intermediate_size, "hidden": geo.hidden,
             "per_layer": {k: [s[j] for s in shapes] for j, k in enumerate(("heads", "kv_heads", "intermediate"))}}
    return PruneResult(model, plan, kept, asdict(geo), after, _count(lm.model),
                       predict_parameters(lm.model.config, geo, shapes), _count(model))


def save_pruned(result: PruneResult, lm: LoadedModel, out_dir: str | Path, *,
                importance: PruneImportance | None = None, extra: Mapping | None = None) -> Path:
    """Write the pruned model (source dtype, tokenizer, ``prune.json``) as a Hugging Face directory: a plain one when
    every layer keeps the same counts, else with ``layer_shapes`` in config.json (the workbench loader reads it)."""
    with staged_output(out_dir, PRUNE_FORMAT) as tmp:
        save_model_directory(result.model, lm, tmp)
        atomic_write_json(tmp / PRUNE_REPORT, {"source": str(lm.path), **result.report(), **(extra or {})})
        if importance is not None:
            importance.save(tmp / IMPORTANCE_FILE)
        write_output_manifest(tmp, PRUNE_FORMAT, {"source": str(lm.path)})
    return Path(out_dir)


def prune(model, plan: PrunePlan, out_dir: str | Path, *, workspace: Workspace | None = None,
          importance: PruneImportance | None = None, measure_kl: bool | None = None,
          evaluate_tokens: int | None = 4096, progress: bool = True,
          on_status: Callable[[str], None] | None = None, importance_tokens: int = DEFAULT_IMPORTANCE_TOKENS) -> dict:
    """Importance (cached), slicing, saving and a before/after measurement: what ``workbench prune`` does.

    ``importance`` already computed for this model is used as given (else scored on ``importance_tokens``
    calibration tokens). Returns the report written to
    ``prune.json`` (with held-out perplexity and KL of the pruned model against the original on the
    first ``evaluate_tokens`` tokens; None skips the measurement).
    """
    say = on_status or (lambda s: None)
    t0 = time.perf_counter()
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    needs = plan.heads > 0 or plan.mlp > 0 or any(("heads" in v or "mlp" in v) for v in plan.layers.values())
    if needs and importance is None:
        say("scoring heads and channels...")
        importance = head_and_channel_importance(
            lm, tokens=importance_tokens, workspace=workspace, progress=progress,
            measure_kl=plan.score == "kl" if measure_kl is None else measure_kl)
    say("slicing...")
    result = prune_model(lm, plan, importance)
    extra: dict = {}
    if evaluate_tokens:
        say("measuring...")
        ids = evaluation_tokens(lm, None, evaluate_tokens)
        ctx = min(512, getattr(lm.config, "max_position_embeddings", 512) or 512, ids.numel())
        reference = capture_reference(lm.model, ids, ctx=ctx, progress=False)  # the original runs once
        before = reference_report(reference, ids)
        after = evaluate(result.model, ids, reference=reference, ctx=ctx, progress=False)
        del reference
        d = paired_difference(after, before)
        extra["evaluation"] = {"tokens": after.tokens, "perplexity_before": before.perplexity,
                               "perplexity_after": after.perplexity, "perplexity_after_stderr": after.perplexity_stderr,
                               "nll_change": d["mean"], "nll_change_stderr": d["stderr"],
                               "kl": after.kl_divergence, "kl_stderr": after.kl_stderr,
                               "top1": after.top1_agreement}
    extra["seconds"] = time.perf_counter() - t0
    save_pruned(result, lm, out_dir, importance=importance, extra=extra)
    return {"out_dir": str(out_dir), "summary": result.summary(), **result.report(), **extra}


def measure_point(label: str, model: nn.Module, ids: torch.Tensor, reference, *, size_bytes: int,
                  bits_per_weight: float | None = None, ctx: int = 512, parameters: int | None = None) -> dict:
    """One row of the compression table / one point of the Pareto chart: size, perplexity and KL with errors.

    ``reference`` is the original model or its ``capture_reference`` outputs; ``report`` keeps the
    per-window figures for paired differences between rows. ``parameters`` defaults to the model's
    float parameters: pass the source's count for a quantized model (its codes are not parameters).
    """
    report = evaluate(model, ids, reference=reference, ctx=ctx, progress=False)
    return {"label": label, "size_bytes": int(size_bytes), "bits_per_weight": bits_per_weight,
            "parameters": parameters if parameters is not None else _count(model),
            "perplexity": report.perplexity, "perplexity_stderr": report.perplexity_stderr,
            "kl_divergence": report.kl_divergence, "kl_stderr": report.kl_stderr,
            "top1_agreement": report.top1_agreement, "tokens": report.tokens, "report": report}
