"""AWQ (activation-aware weight quantization) in float32: a scale search, then a clip search.

For every decoder block, the block's inputs on calibration samples are captured. For each
scalable group (``input_layernorm -> q/k/v``, ``v_proj -> o_proj``, ``post_attention_layernorm
-> gate/up``, ``up_proj -> down_proj``) the search tries ``s = mean|x| ^ alpha`` for alpha on a
grid that includes 0 (the identity, i.e. plain round-to-nearest), quantizes ``W * s``, and keeps
the alpha with the smallest output error of the inspected module (attention, o_proj, MLP,
down_proj). ``1/s`` is folded into the op before, so the float model computes the same function.
A clip search (shrink ratio 1.0 first, i.e. no clipping) then picks per-group clipping of the
scaled weights. With GQA, ``v_proj -> o_proj`` scales are shared by the query heads of one
key/value head, so the fold stays exact.

Memory: only the block inputs for all calibration tokens are held; inside a block the
activations are captured a chunk of tokens at a time and each alpha's squared error is summed
over chunks (the same loss as over all tokens at once), and the clip search scores clipping
through one Gram matrix per weight group instead of the layer's outputs on every token.

Search and apply are separate: :func:`search_awq` returns a plain dict (tensors and numbers)
that can be cached; :func:`fold_awq_scales` turns it into new float tensors.

    result = search_awq(lm.model, samples, quant_spec)   # quant_spec: fqn -> (bits, group, symmetric)
    new_params = fold_awq_scales(lm.model, result)       # {param_name: tensor}; the model is unchanged
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import PlanError
from ..numerics.compute import widened
from ..numerics.memory import release_freed_memory
from .rtn import fake_quantize, quantize_weight
from ..files.workspace import atomic_write_json, swap_into_place

__all__ = ["ScaleGroup", "find_decoder_blocks", "scale_groups", "search_awq", "fold_awq_scales", "apply_awq_scales_", "scaled_importance",
           "save_awq_search", "load_awq_search", "DEFAULT_GRID", "DEFAULT_SEARCH_TOKENS", "DEFAULT_CHUNK_TOKENS", "default_search_tokens",
           "SEARCH_VERSION"]

log = logging.getLogger("workbench")

DEFAULT_GRID = 20  # alphas 0, 0.05, ..., 0.95 as in the AWQ paper's code; 0 is the identity
# calibration tokens whose block outputs drive the search: the AWQ paper finds 16 sequences of 512
# enough (it needs far less data than GPTQ); statistics for mean |x| may still cover the whole set
DEFAULT_SEARCH_TOKENS = 8192
SEARCH_BUDGET = 1e12  # parameter-tokens for models too big for the full default on a 2-core CPU


def default_search_tokens(model: nn.Module) -> int:
    """Search tokens by model size: 8,192 up to ~120 M parameters, then fewer (2,048 at 0.5 B), never under 1,024.

    The search runs the grid (20 alphas) over every group, about 20 forward passes' worth of work
    per token: at 0.5 B parameters 8,192 tokens would take most of an hour on 2 CPU cores.
    """
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    tokens = int(SEARCH_BUDGET // max(params, 1))
    return max(1024, min(DEFAULT_SEARCH_TOKENS, -(-tokens // 1024) * 1024))
# bump when the search changes, so cached results are recomputed (2: the layer's own grid; a clip kept only where
# it beats the weighted scale search)
SEARCH_VERSION = 2
CLIP_TOKENS = 512  # tokens used by the per-group clip search (as in the AWQ code)
CLIP_STEPS = 10  # shrink ratios 1.0, 0.95, ..., 0.55 (1.0 = no clipping)
# tokens whose activations inside a block are held at once; the loss is summed over chunks, so the
# result does not depend on it, only memory (smaller) and time (each chunk re-quantizes every alpha)
DEFAULT_CHUNK_TOKENS = 4096  # each chunk re-quantizes every alpha: fewer chunks, less of that repeated work


class _StopForward(Exception):
    pass


@dataclass(frozen=True)
class ScaleGroup:
    """Linears sharing one input whose channels are scaled by ``s``, and the op ``1/s`` is folded into.

    ``prev`` is a norm (its weight is divided by ``s``) or a linear (its output rows are).
    ``repeat`` > 1 means the layers' input has ``repeat`` copies of each ``prev`` head (GQA):
    ``head_dim`` channels per head.
    """

    block: str
    prev: str
    layers: tuple[str, ...]
    inspect: str
    repeat: int = 1
    head_dim: int = 0

    @property
    def key(self) -> str:
        return f"{self.prev}->{'+'.join(n.rsplit('.', 1)[-1] for n in self.layers)}"


def find_decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder blocks (``model.layers``) and its name."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.endswith("layers") and len(mod) and \
                hasattr(mod[0], "self_attn") and hasattr(mod[0], "mlp"):
            return name, mod
    raise PlanError("AWQ needs a model with Llama/Qwen-style decoder blocks (a 'layers' list of blocks with "
                    "self_attn and mlp); use method='rtn' for this model")


_REQUIRED = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def scale_groups(model: nn.Module) -> list[ScaleGroup]:
    """The scalable groups of every block, in block order."""
    prefix, blocks = find_decoder_blocks(model)
    cfg = getattr(model, "config", None)
    groups = []
    for i, blk in enumerate(blocks):
        b = f"{prefix}.{i}"
        for part in _REQUIRED:
            try:
                blk.get_submodule(part)
            except AttributeError:
                raise PlanError(f"AWQ: block '{b}' has no '{part}'; only Llama/Qwen-style blocks are supported, "
                                "use method='rtn' for this model") from None
        groups.append(ScaleGroup(b, f"{b}.input_layernorm", tuple(f"{b}.self_attn.{p}_proj" for p in "qkv"),
                                 f"{b}.self_attn"))
        v, o = blk.self_attn.v_proj, blk.self_attn.o_proj
        if v.out_features == o.in_features:
            groups.append(ScaleGroup(b, f"{b}.self_attn.v_proj", (f"{b}.self_attn.o_proj",), f"{b}.self_attn.o_proj"))
        else:
            head_dim = getattr(blk.self_attn, "head_dim", None) or getattr(cfg, "head_dim", None)
            if head_dim and o.in_features % v.out_features == 0 and v.out_features % head_dim == 0:
                groups.append(ScaleGroup(b, f"{b}.self_attn.v_proj", (f"{b}.self_attn.o_proj",),
                                         f"{b}.self_attn.o_proj", o.in_features // v.out_features, head_dim))
        groups.append(ScaleGroup(b, f"{b}.post_attention_layernorm", (f"{b}.mlp.gate_proj", f"{b}.mlp.up_proj"),
                                 f"{b}.mlp"))
        groups.append(ScaleGroup(b, f"{b}.mlp.up_proj", (f"{b}.mlp.down_proj",), f"{b}.mlp.down_proj"))
    return groups


def _expand(s: torch.Tensor, g: ScaleGroup) -> torch.Tensor:
    """Scale on the layers' input channels from the scale on ``prev``'s output (GQA repeat)."""
    if g.repeat == 1:
        return s
    kv = s.numel() // g.head_dim
    return s.view(kv, 1, g.head_dim).expand(kv, g.repeat, g.head_dim).reshape(-1)


def _reduce(x_mean: torch.Tensor, g: ScaleGroup) -> torch.Tensor:
    """Mean |x| on ``prev``'s output channels from the layers' input channels (GQA: mean over heads)."""
    if g.repeat == 1:
        return x_mean
    return x_mean.view(-1, g.repeat, g.head_dim).mean(1).reshape(-1)


def _check_norm_foldable(norm: nn.Module, name: str) -> None:
    """A norm can absorb ``1/s`` only when its output is linear in its weight (``w * x_hat``)."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise PlanError(f"AWQ: '{name}' has no per-channel weight to fold scales into; use method='rtn'")
    x = torch.randn(2, w.numel(), generator=torch.Generator().manual_seed(0))
    s = torch.linspace(0.5, 2.0, w.numel())
    n = copy.deepcopy(norm).float()  # checked in float32: a 16-bit norm rounds more than the tolerance
    with torch.no_grad():
        ref = n(x)
        n.weight.div_(s)
        if getattr(n, "bias", None) is not None:
            n.bias.div_(s)
        ok = torch.allclose(n(x) * s, ref, rtol=1e-4, atol=1e-5)
    if not ok:
        raise PlanError(f"AWQ: '{name}' does not scale linearly with its weight (e.g. a (1 + w) norm); "
                        "use method='rtn' for this model")


def fold_awq_scales(model: nn.Module, result: dict) -> dict[str, torch.Tensor]:
    """New float32 tensors ``{param_name: tensor}`` with every group's scale folded in; model unchanged.

    Layers' weight columns are multiplied by ``s``, ``prev``'s weight (norm) or output rows
    (linear, with its bias) divided by it, so the float model computes the same function.
    """
    return _fold(dict(model.named_parameters(remove_duplicate=False)), result)


def _fold(params: dict[str, torch.Tensor], result: dict) -> dict[str, torch.Tensor]:
    new: dict[str, torch.Tensor] = {}

    def get(name):
        if name not in new:
            if name not in params:
                raise PlanError(f"AWQ result names '{name}', which this model does not have; search again")
            new[name] = params[name].detach().to(torch.float32).clone()
        return new[name]

    for entry in result["groups"]:
        g = ScaleGroup(**entry["group"])
        prev = get(f"{g.prev}.weight")
        s = entry["scales"].to(prev.device, torch.float32)  # a cached search is read back on the CPU
        if prev.dim() == 1:
            prev.div_(s)
        else:
            prev.div_(s[:, None])
        if f"{g.prev}.bias" in params and params[f"{g.prev}.bias"] is not None:
            get(f"{g.prev}.bias").div_(s)
        s_in = _expand(s, g)
        for name in g.layers:
            get(f"{name}.weight").mul_(s_in[None, :])
    return new


def scaled_importance(importance: dict[str, torch.Tensor], result: dict) -> dict[str, torch.Tensor]:
    """Each layer's per-column importance (mean squared input) after AWQ's scales: a layer whose weight
    columns are multiplied by ``s`` sees its inputs divided by ``s``, so its squared input becomes ``x^2 / s^2``
    (what the scale search must weigh the scaled weight's rounding error by)."""
    out = dict(importance)
    for entry in result["groups"]:
        g = ScaleGroup(**entry["group"])
        s_in = _expand(entry["scales"].to(torch.float32), g)
        for name in g.layers:
            if name in out:
                out[name] = out[name].to(torch.float32) / s_in.to(out[name].device).square()
    return out


@torch.no_grad()
def apply_awq_scales_(model: nn.Module, result: dict) -> nn.Module:
    """Fold the scales into ``model`` in place (float; no rounding): the function is unchanged."""
    new = fold_awq_scales(model, result)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in new.items():
        params[name].data.copy_(t.to(params[name].dtype))
    return model


# ---------------------------------------------------------------------------------------------
# search
def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, samples: list[torch.Tensor],
                         max_tokens: int, batch_size: int = 1):
    """Run the model up to the first block on calibration samples; keep (hidden, kwargs) per batch.

    A sample is a 1-D tensor of token ids, or a vision-language model's inputs for one picture (a dict with
    ``input_ids`` and pixels, from ``workbench.model.calibrate.ImageCalibrationSet``): those run whole, one at a
    time, so the blocks see the picture's tokens as the model places them."""
    chosen, total = [], 0
    pictures = []
    for s in samples:
        if isinstance(s, dict):
            n = int(s["input_ids"].shape[-1])
            if n >= 2 and total < max_tokens:  # a picture's tokens are not cut: its pixels must match them
                pictures.append(s)
                total += n
            continue
        s = s.reshape(-1).long()
        if s.numel() < 2:
            continue
        if total >= max_tokens:
            break
        chosen.append(s[: max_tokens - total] if total + s.numel() > max_tokens else s)
        total += chosen[-1].numel()
    if not chosen and not pictures:
        raise PlanError("AWQ needs calibration samples with at least 2 tokens; none were given")
    by_len: dict[int, list[torch.Tensor]] = {}
    for s in chosen:
        by_len.setdefault(s.numel(), []).append(s)
    units = []

    shared: dict[tuple, list[torch.Tensor]] = {}

    def dedupe(t):
        """One copy of equal side inputs (rotary cos/sin, masks, positions) shared by every unit."""
        if isinstance(t, tuple):
            return tuple(dedupe(x) for x in t)
        if not isinstance(t, torch.Tensor):
            return t
        seen = shared.setdefault((t.shape, t.dtype), [])
        for u in seen:
            if torch.equal(u, t):
                return u
        seen.append(t)
        return t

    def grab(_mod, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kw = {k: dedupe(v) for k, v in kwargs.items() if k != "hidden_states"}
        units.append([hidden.detach().to(torch.float32), kw])
        raise _StopForward

    handle = blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        for _length, group in sorted(by_len.items()):
            for i in range(0, len(group), batch_size):
                try:
                    model(input_ids=torch.stack(group[i:i + batch_size]).to(device), use_cache=False)
                except _StopForward:
                    pass
        for feats in pictures:
            try:
                model(**{k: v.to(device) for k, v in feats.items()}, use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return units, total


def token_chunks(units, chunk_tokens: int) -> list[list[int]]:
    """Consecutive unit indices, at most ``chunk_tokens`` tokens a chunk (at least one unit each)."""
    chunks, cur, n = [], [], 0
    for i, (hidden, _kw) in enumerate(units):
        t = hidden.shape[0] * hidden.shape[1]
        if cur and n + t > chunk_tokens:
            chunks.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += t
    if cur:
        chunks.append(cur)
    return chunks


def run_block(blk: nn.Module, units, idx: list[int], watch: dict[str, nn.Module]):
    """Run ``blk`` on the units ``idx``; record what each watched module receives and the block outputs."""
    seen = {k: [] for k in watch}
    handles = []
    for key, mod in watch.items():
        def hook(_m, args, kwargs, key=key):
            seen[key].append((args, kwargs))
        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    outs = []
    try:
        for i in idx:
            hidden, kw = units[i]
            out = blk(hidden, **kw)
            outs.append(out[0] if isinstance(out, tuple) else out)
    finally:
        for h in handles:
            h.remove()
    return seen, outs


def _first_tensor(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))


def _output(mod: nn.Module, calls) -> list[torch.Tensor]:
    outs = []
    for args, kwargs in calls:
        out = mod(*args, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def _sse(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    return sum(float(torch.nn.functional.mse_loss(a, b, reduction="sum")) for a, b in zip(outs, refs))


class _ScaleSearch:
    """One group's alpha grid search, fed chunk by chunk: squared output errors are summed per alpha.

    Streaming keeps only one chunk of activations alive; the loss is the same sum as over all
    tokens at once. alpha = 0 (the identity, plain round-to-nearest) comes first and wins ties.
    """

    def __init__(self, g: ScaleGroup, blk: nn.Module, block_name: str, x_mean: torch.Tensor, spec: dict,
                 n_grid: int, grids: dict[str, dict] | None = None):
        rel = lambda fqn: fqn[len(block_name) + 1:]  # noqa: E731
        self.g, self.spec, self.grids = g, spec, grids or {}
        self.inspect = blk.get_submodule(rel(g.inspect))
        self.linears = [(name, blk.get_submodule(rel(name))) for name in g.layers]
        x_prev = _reduce(x_mean.to(torch.float32), g)
        self.scales = []
        for i in range(n_grid):
            s = x_prev.pow(i / n_grid).clamp_min(1e-4)
            self.scales.append(s / (s.max() * s.min()).sqrt())
        self.alphas = [i / n_grid for i in range(n_grid)]
        self.sse = [0.0] * n_grid
        self.numel = 0

    def add(self, calls) -> None:
        """Score every alpha on one chunk of the inspected module's calls."""
        refs = _output(self.inspect, calls)
        self.numel += sum(r.numel() for r in refs)
        originals = [lin.weight.data for _, lin in self.linears]  # swapped, never written: restored below
        try:
            for i, s in enumerate(self.scales):
                s_in = _expand(s, self.g)
                for (name, lin), w in zip(self.linears, originals):
                    if name in self.spec:
                        bits, gs, sym = self.spec[name]
                        lin.weight.data = (fake_quantize(w * s_in[None, :], bits, gs, sym, **self.grids.get(name, {}))
                                           / s_in[None, :]).to(w.dtype)
                self.sse[i] += _sse(_output(self.inspect, calls), refs)
        finally:
            for (_, lin), w in zip(self.linears, originals):
                lin.weight.data = w

    def result(self) -> dict:
        losses = [e / max(self.numel, 1) for e in self.sse]
        best = min(range(len(losses)), key=lambda i: (losses[i], i))
        return {"group": self.g.__dict__ | {"layers": list(self.g.layers)}, "alpha": self.alphas[best],
                "loss": losses[best], "identity_loss": losses[0], "losses": losses, "scales": self.scales[best].clone()}


def _search_clip(w: torch.Tensor, gram: torch.Tensor, bits: int, gs: int | None, sym: bool,
                 grid: dict | None = None) -> tuple[torch.Tensor, float, float]:
    """Per-(row, group) clip maximum minimising the group's output error; ratio 1.0 (no clip) first.

    The error of a group's output over the tokens, mean_t (x_t . dw)^2, is the quadratic form
    dw^T (X^T X / T) dw: one [g, g] Gram matrix per group (``gram``, from ``_group_gram``) replaces the
    [out, tokens, groups] outputs.
    """
    out = w.shape[0]
    org_max = w.view(out, gram.shape[0], -1).abs().amax(-1)
    best_max, best_err, first = org_max.clone(), None, None
    for i in range(CLIP_STEPS):
        cur = org_max * (1 - i / DEFAULT_GRID)
        err = _group_error(w, fake_quantize(w, bits, gs, sym, clip_max=cur, **(grid or {})), gram)
        if best_err is None:
            best_err, first = err, err.sum().item()
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, cur, best_max)
    return best_max, first, best_err.sum().item()


def _group_gram(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[groups, g, g]``: each weight group's input Gram matrix over the tokens ``x`` (``[t, in]``)."""
    xg = x.view(x.shape[0], -1, g).transpose(0, 1)  # [ng, t, g]
    return xg.transpose(1, 2) @ xg / xg.shape[1]


def _group_error(w: torch.Tensor, wq: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``[out, groups]``: each (row, group)'s output error mean_t (x_t . dw)^2, through its Gram matrix."""
    out, ng = w.shape[0], gram.shape[0]
    d = (wq - w).view(out, ng, -1).transpose(0, 1)  # [ng, out, g]
    return ((d @ gram) * d).sum(-1).transpose(0, 1)


def _input_mean_abs(blk: nn.Module, units, names: list[str], block_name: str) -> dict[str, torch.Tensor]:
    """Per-channel mean |x| of the named layers' inputs over all units (when statistics do not supply it)."""
    sums: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(names, 0)
    handles = []
    for name in names:
        def hook(_m, args, kwargs, name=name):
            x = _first_tensor(args, kwargs)
            x = x.reshape(-1, x.shape[-1]).abs()
            sums[name] = sums.get(name, 0) + x.sum(0)
            counts[name] += x.shape[0]
        handles.append(blk.get_submodule(name[len(block_name) + 1:]).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        for hidden, kw in units:
            blk(hidden, **kw)
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] / counts[n] for n in names}


@torch.no_grad()
def search_awq(model: nn.Module, samples: list[torch.Tensor], spec: dict[str, tuple[int, int | None, bool]], *,
               mean_abs: dict[str, torch.Tensor] | None = None, n_grid: int = DEFAULT_GRID,
               max_tokens: int = DEFAULT_SEARCH_TOKENS, clip: bool = True, progress: bool = True,
               chunk_tokens: int = DEFAULT_CHUNK_TOKENS, checkpoint=None, grids: dict[str, dict] | None = None,
               scale_search: bool = False) -> dict:
    """Search AWQ scales and clips; returns a plain, cacheable dict (the model is not changed).

    ``spec`` maps each integer-quantized layer to ``(bits, group_size, symmetric)`` (group sizes
    already resolved per layer). ``mean_abs`` maps a layer to the per-channel mean |input| from
    calibration statistics; missing layers use the captured calibration inputs. Only the block
    inputs and outputs are held for all ``max_tokens``; the activations inside a block are
    captured ``chunk_tokens`` at a time, so memory stays near the model's own size. ``grids`` gives a layer's
    grid beyond ``spec`` (``{"full_range": True}``: 16 levels at 4 bits; ``{"minimums": True}``: a float
    minimum per group), so the search scores each alpha on the grid the layer is finally rounded to: a
    checkpoint whose weights already sit on that grid keeps alpha = 0 where the grid fits them exactly.
    With ``scale_search`` (the layer is otherwise rounded by the scale search weighted with its inputs' mean
    square), a layer's clip is kept only where its output error is below that rounding's, on the same tokens.

    With ``checkpoint`` (a directory keyed by these inputs) the result so far is saved after
    every block; a run that finds one left by a killed run replays the finished blocks' float
    forward (cheap beside their search) and goes on from the next block, to the same result.
    """
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    prefix, blocks = find_decoder_blocks(model)
    all_groups = scale_groups(model)
    for g in all_groups:
        if not isinstance(model.get_submodule(g.prev), nn.Linear):
            _check_norm_foldable(model.get_submodule(g.prev), g.prev)
    units, tokens = capture_block_inputs(model, blocks, samples, max_tokens)
    chunks = token_chunks(units, chunk_tokens)
    clip_step = max(1, tokens // CLIP_TOKENS)  # evenly spaced tokens for the clip search, as over all at once
    result = {"version": 1, "method": "awq", "grid": [i / n_grid for i in range(n_grid)], "tokens": tokens,
              "groups": [], "clips": {}, "clip_stats": {}}
    done = _load_search_checkpoint(checkpoint, result, len(blocks)) if checkpoint is not None else 0
    if done:
        log.info(f"AWQ search resumed after block {done} of {len(blocks)} (checkpoint {checkpoint})")
    for i in tqdm(range(len(blocks)), desc="awq", unit="block", disable=not progress, leave=False):
        with widened(blocks[i]):  # the search runs in float32 one block at a time, whatever the stored dtype
            if i < done:  # searched before the kill: only its outputs are needed, as the next block's inputs
                for idx in chunks:
                    _, outs = run_block(blocks[i], units, idx, {})
                    for j, out in zip(idx, outs):
                        units[j][0].copy_(out)
                continue
            _search_block(i, prefix, blocks, all_groups, spec, units, chunks, clip, clip_step, mean_abs, n_grid,
                          result, grids or {}, scale_search)
        if checkpoint is not None and i + 1 < len(blocks):
            _save_search_checkpoint(checkpoint, result, i + 1, len(blocks))
    result["seconds"] = time.perf_counter() - t0
    result["resumed_after_block"] = done
    return result


def _save_search_checkpoint(directory, result: dict, blocks_done: int, blocks: int) -> None:
    """The result after ``blocks_done`` blocks, staged and swapped in whole (a kill mid-write keeps the last)."""
    import shutil
    from pathlib import Path

    d = Path(directory)
    staged = d.with_name(d.name + ".writing")
    shutil.rmtree(staged, ignore_errors=True)
    save_awq_search(result, staged)
    atomic_write_json(staged / "progress.json", {"blocks_done": blocks_done, "blocks": blocks,
                                                 "tokens": result["tokens"]})
    swap_into_place(staged, d)


def _load_search_checkpoint(directory, result: dict, blocks: int) -> int:
    """Fill ``result`` from a killed run's checkpoint; the blocks it covers (0 when there is none usable)."""
    import json
    from pathlib import Path
    d = Path(directory)
    if not (d / "progress.json").is_file():
        return 0
    try:
        progress = json.loads((d / "progress.json").read_text(encoding="utf-8"))
        saved = load_awq_search(d)
        if progress["blocks"] != blocks or progress["tokens"] != result["tokens"] or saved["grid"] != result["grid"]:
            return 0
        result.update(groups=saved["groups"], clips=saved["clips"], clip_stats=saved["clip_stats"])
        return int(progress["blocks_done"])
    except Exception:  # noqa: BLE001 - a damaged checkpoint only costs the blocks it held: start over
        return 0


def _search_block(i, prefix, blocks, all_groups, spec, units, chunks, clip, clip_step, mean_abs, n_grid,
                  result, grids: dict[str, dict], scale_search: bool) -> None:
    """Scale and clip search of block ``i``; its inputs in ``units`` are replaced by its outputs."""
    bname = f"{prefix}.{i}"
    groups = [g for g in all_groups if g.block == bname and any(n in spec for n in g.layers)]
    blk_orig = blocks[i]
    sub = lambda fqn: blk_orig.get_submodule(fqn[len(bname) + 1:])  # noqa: E731
    clip_layers = [n for n in spec if n.startswith(bname + ".") and not n.endswith(("q_proj", "k_proj"))] \
        if clip and groups else []  # q/k feed a softmax: clipping by output error misleads (as in AWQ)
    x_means = {g.layers[0]: (mean_abs or {}).get(g.layers[0]) for g in groups}
    missing = [n for n, m in x_means.items() if m is None]
    if missing:  # statistics did not cover these inputs: one extra pass over the block measures them
        x_means.update(_input_mean_abs(blk_orig, units, missing, bname))
    # the search swaps quantized weights into this block's linears and always swaps the originals back
    searches = [_ScaleSearch(g, blk_orig, bname, x_means[g.layers[0]], spec, n_grid, grids) for g in groups]
    watch = {g.inspect: sub(g.inspect) for g in groups}
    watch.update({n: sub(n) for n in clip_layers})
    clip_rows: dict[str, list[torch.Tensor]] = {n: [] for n in clip_layers}
    for idx in chunks:
        seen, outs = run_block(blk_orig, units, idx, watch)
        for search in searches:
            search.add(seen[search.g.inspect])
        for n in clip_layers:
            for a, k in seen[n]:
                x = _first_tensor(a, k)
                clip_rows[n].append(x.reshape(-1, x.shape[-1])[::clip_step].clone())
        del seen
        for j, out in zip(idx, outs):  # this chunk's inputs are done with: its outputs feed the next block
            units[j][0].copy_(out)  # in place: long-lived buffers stay where they were, the heap stays compact
        del outs
        release_freed_memory()
    block_groups = [s.result() for s in searches]
    result["groups"] += block_groups
    if clip_layers:
        folded = _fold({f"{bname}.{n}": p for n, p in blk_orig.named_parameters()}, {"groups": block_groups})
        s_in = {n: _expand(e["scales"], ScaleGroup(**e["group"])) for e in block_groups for n in e["group"]["layers"]}
        for name in clip_layers:
            bits, gs, sym = spec[name]
            w = folded.get(f"{name}.weight", sub(name).weight.float())
            x = torch.cat(clip_rows.pop(name))[:CLIP_TOKENS]
            if name in s_in:
                x = x / s_in[name][None, :]
            gram = _group_gram(x, gs or w.shape[1])  # one per layer: the clip search and the comparison share it
            clip_max, err0, err1 = _search_clip(w, gram, bits, gs, sym, grids.get(name))
            result["clip_stats"][name] = {"error_unclipped": err0, "error_clipped": err1}
            if scale_search:  # the rounding the layer gets without a clip: kept where it does better
                searched = quantize_weight(w, bits, gs, sym, scale_search=True, importance=x.square().mean(0),
                                           **grids.get(name, {})).dequantize()
                err_s = _group_error(w, searched, gram).sum().item()
                result["clip_stats"][name]["error_scale_search"] = err_s
                if err_s <= err1:
                    continue
            result["clips"][name] = clip_max


# ---------------------------------------------------------------------------------------------
# caching: the search result as files (tensors in safetensors, the rest in JSON)
def save_awq_search(result: dict, directory) -> None:
    """Write a search result to ``directory``: ``awq_scales.safetensors`` + ``awq_search.json``."""
    from pathlib import Path

    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {f"scales.{i}": e["scales"].cpu().contiguous() for i, e in enumerate(result["groups"])}
    tensors.update({f"clip.{name}": t.cpu().contiguous() for name, t in result.get("clips", {}).items()})
    save_file(tensors, d / "awq_scales.safetensors")
    meta = {k: v for k, v in result.items() if k not in ("groups", "clips")}
    meta["groups"] = [{k: v for k, v in e.items() if k != "scales"} for e in result["groups"]]
    meta["clipped"] = sorted(result.get("clips", {}))
    atomic_write_json(d / "awq_search.json", meta)


def load_awq_search(directory) -> dict:
    """Read a search result written by :func:`save_awq_search`."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    d = Path(directory)
    meta = json.loads((d / "awq_search.json").read_text(encoding="utf-8"))
    tensors = load_file(d / "awq_scales.safetensors")
    result = {k: v for k, v in meta.items() if k not in ("groups", "clipped")}
    result["groups"] = [{**e, "scales": tensors[f"scales.{i}"]} for i, e in enumerate(meta["groups"])]
    result["clips"] = {name: tensors[f"clip.{name}"] for name in meta["clipped"]}
    return result
