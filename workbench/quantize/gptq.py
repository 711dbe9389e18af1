"""GPTQ: round each weight column in turn and push its rounding error onto the columns not yet rounded.

For one linear layer with inputs ``X`` the output error ``||X W^T - X Q^T||^2`` is a quadratic form
in ``H = X^T X``. GPTQ (Frantar et al., 2022) quantizes the columns of ``W`` left to right; after
column ``j`` is rounded, the remaining columns are corrected by ``-err_j * Hinv[j, j:] / Hinv[j, j]``
(the optimal update for that quadratic), using the upper Cholesky factor of ``H^-1`` so the whole
pass costs one factorisation and ``rows x cols^2`` multiply-adds, done ``block_columns`` at a time.

Options as in the reference code: ``damp`` (a fraction of the mean diagonal added to ``H``, so
dead or collinear inputs do not blow up the inverse) and ``act_order`` (columns visited in order
of decreasing ``H[j, j]``, the most-used inputs first). Group scales are taken from the
partially corrected weights when the pass reaches a group's first column; with ``act_order``
they are fixed beforehand from the original weights ("static groups"), so every column keeps its
natural group and the stored layout stays the plain group-wise one every target reads.
Two-level scales (``scale_bits``): each row's float16 scale is fixed from the original weights
before any column is rounded; each group's integer sub-scale is then chosen as the pass reaches
the group (or beforehand with ``act_order``), by the same rule as RTN. A layout with minimums
(``int4-k`` / ``int5-k``, llama.cpp's Q4_K / Q5_K) fixes both super-block scales (of the scales and of
the minimums) from RTN of the original weights, and fits each group's scale and minimum as it is reached;
float minimums (``int4-min`` / ``int5-min``, Q4_1 / Q5_1) fit each group's float16 scale and minimum likewise.

The model runs block by block as in AWQ: the block inputs of all calibration tokens are held,
``H`` of every integer layer in the block is summed over them, the layers are quantized, and the
block's outputs with the quantized weights become the next block's inputs, so later blocks
compensate for the error the earlier ones make. The model itself is never changed. With a
``checkpoint`` directory the codes of the finished blocks are saved after every block, and a run
killed part way goes on from the next block (the finished blocks only run forward, with their saved
codes, to give the next block its inputs), to the same result.

    weights = search_gptq(lm.model, samples, spec)   # spec: fqn -> (bits, group_size, symmetric)
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch
from torch import nn

from ..numerics.compute import widened
from ..errors import PlanError
from ..numerics.memory import release_freed_memory
from .awq import capture_block_inputs, run_block, token_chunks, find_decoder_blocks
from .qtensor import QuantizedWeight, SubScales, code_range, group_channel_scales
from .rtn import (group_weights, quantize_groups, channel_scales_for, check_full_range, check_two_level, dequantize_codes,
                  fit_min_groups, float_min_groups, min_groups, min_sub_values, round_codes, round_min_codes,
                  search_weights, two_level_groups)
from ..files.workspace import atomic_write_json

__all__ = ["gptq_quantize_weight", "search_gptq", "DEFAULT_DAMP", "DEFAULT_BLOCK_COLUMNS", "default_gptq_tokens"]

log = logging.getLogger("workbench")

DEFAULT_DAMP = 0.01  # of the mean of diag(H), as in the GPTQ paper's code
DEFAULT_BLOCK_COLUMNS = 128  # columns corrected together before the lazy update of the rest
DEFAULT_GPTQ_TOKENS = 8192
GPTQ_BUDGET = 1e12  # parameter-tokens: one forward pass per token and block plus the H sums


def default_gptq_tokens(model: nn.Module) -> int:
    """Calibration tokens by size: 8,192 up to ~120 M parameters, fewer above (2,048 at 0.5 B), never under 1,024."""
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return max(1024, min(DEFAULT_GPTQ_TOKENS, -(-int(GPTQ_BUDGET // max(params, 1)) // 1024) * 1024))


def _group_params(w: torch.Tensor, bits: int, symmetric: bool, scale_search: bool, importance: torch.Tensor,
                  channel: torch.Tensor | None = None, scale_bits: SubScales | None = None, full_range: bool = False,
                  channel_min: torch.Tensor | None = None, minimums: bool = False):
    """Scales, zeros (or None), sub-scales (two-level, else None) and minimums (a layout with minimums: integer
    sub-minimums, or float16 minimums with ``minimums``; else None) of the columns ``w`` ``[out, g]`` taken as one
    group, by the RTN rule (and search); two-level under the fixed row scales ``channel`` (and ``channel_min``)."""
    if minimums:
        _q, s, m = float_min_groups(w[:, None, :], bits, scale_search=scale_search, importance=importance[None, :])
        return s[:, 0], None, None, m[:, 0]
    if scale_bits is not None and scale_bits.mins:
        s, m = fit_min_groups(w[:, None, :], bits, scale_search=scale_search, importance=importance[None, :])
        sub, sub_min = min_sub_values(s[:, 0], m[:, 0], channel, channel_min, scale_bits)
        return sub * channel, None, sub, sub_min
    if scale_bits is not None:
        _q, sub, _ = two_level_groups(w[:, None, :], bits, scale_bits, scale_search=scale_search,
                                      importance=importance[None, :], channel_scales=channel)
        return sub[:, 0] * channel, None, sub[:, 0], None
    _q, scales, zeros = quantize_groups(w[:, None, :], bits, symmetric, None, scale_search=scale_search,
                                        importance=importance[None, :], full_range=full_range)
    return scales[:, 0], None if zeros is None else zeros[:, 0], None, None


def _column(t: torch.Tensor | None, k: int) -> torch.Tensor | None:
    return None if t is None else t[:, k]


def _inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, with more damping if ``H`` is singular."""
    n = h.shape[0]
    eye = torch.eye(n, dtype=h.dtype, device=h.device)
    mean_diag = float(torch.diag(h).mean()) or 1.0
    for extra in (1.0, 10.0, 100.0):
        lower, info = torch.linalg.cholesky_ex(h + (damp * extra * mean_diag) * eye)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
    raise PlanError("GPTQ: this layer's input covariance is not positive definite even with 100x damping; "
                    "use more calibration tokens or method='rtn'")


def gptq_quantize_weight(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None = 128,
                         symmetric: bool = True, *, damp: float = DEFAULT_DAMP, act_order: bool = False,
                         block_columns: int = DEFAULT_BLOCK_COLUMNS, scale_search: bool = False,
                         scale_bits: int | None = None, full_range: bool = False,
                         minimums: bool = False) -> QuantizedWeight:
    """Quantize ``w`` ``[out, in]`` minimising ``tr((W - Q) H (W - Q)^T)`` column by column (``H`` = ``X^T X``).

    ``scale_search``: each group's range from the RTN scale search, its error weighted by ``diag(H)``.
    ``scale_bits``: two-level scales (symmetric), as ``quantize_weight``. ``full_range``: the 16-level grid
    (llama.cpp's Q4_0 scale rule, as ``quantize_weight``); columns are rounded at the stored float16 scale.
    ``minimums``: a float16 minimum beside each float16 group scale (Q4_1 / Q5_1), unsigned codes.
    """
    if w.dim() != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise PlanError(f"GPTQ needs a 2-D weight and its [in, in] input covariance, got {tuple(w.shape)} and "
                        f"{tuple(h.shape)}")
    out, cols = w.shape
    group_weights(w, group_size)  # the same divisibility error as RTN
    check_two_level(scale_bits, symmetric)
    check_full_range(full_range, symmetric)
    if full_range and scale_bits is not None:
        raise PlanError("full_range applies to float16 group scales; two-level precisions keep their own grid")
    if minimums and (scale_bits is not None or full_range):
        raise PlanError("float minimums go with float16 group scales, without full_range's symmetric grid")
    g = group_size or cols
    lo, hi = code_range(bits, symmetric)
    w = w.detach().to(torch.float32).clone()
    h = h.detach().to(torch.float32).clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    n_groups = cols // g
    energy = torch.diag(h).clone()  # per input column, in the original order: the scale search's weights
    scales = torch.empty(out, n_groups)
    scale_bits = SubScales.of(scale_bits)
    two_level_mins = scale_bits is not None and scale_bits.mins
    if minimums or two_level_mins:  # unsigned codes beside a minimum, no zero point
        lo, hi = 0, (1 << bits) - 1
    zeros = None if symmetric or minimums or two_level_mins else torch.empty(out, n_groups)
    float_mins = torch.empty(out, n_groups) if minimums else None
    channel = group_ch = sub_scales = channel_min = group_chm = sub_mins = None
    if two_level_mins:  # both super-block scales from RTN of the original weights, before any correction
        wg = group_weights(w, group_size)  # the same scales RTN of these weights with importance diag(H) gives
        _q, _s, channel, _m, channel_min = min_groups(wg, bits, scale_bits, scale_search=scale_search,
                                                      importance=search_weights(wg, energy.view(n_groups, g)))
        group_chm = group_channel_scales(channel_min, n_groups)
        sub_mins = torch.empty(out, n_groups)
    elif scale_bits is not None:  # the row (super-block) scales from the original weights, before any correction
        channel = channel_scales_for(group_weights(w, group_size), bits, scale_bits)
    if scale_bits is not None:
        group_ch = group_channel_scales(channel, n_groups)
        sub_scales = torch.empty(out, n_groups)

    def set_group(k: int, cols: torch.Tensor, start: int) -> None:
        s, z, sub, sub_min = _group_params(cols, bits, symmetric, scale_search, energy[start:start + g],
                                           _column(group_ch, k), scale_bits, full_range, _column(group_chm, k),
                                           minimums)
        scales[:, k] = s
        if zeros is not None:
            zeros[:, k] = z
        if sub is not None:
            sub_scales[:, k] = sub
        if sub_min is not None:
            (float_mins if minimums else sub_mins)[:, k] = sub_min

    if act_order:  # static groups: every group's range from the original weights, before any correction
        for k in range(n_groups):
            set_group(k, w[:, k * g:(k + 1) * g], k * g)
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    else:
        perm = None
    hinv = _inverse_factor(h, damp)
    codes = torch.empty(out, cols)
    for a in range(0, cols, block_columns):
        b = min(a + block_columns, cols)
        w1, err1 = w[:, a:b].clone(), torch.empty(out, b - a)
        hinv1 = hinv[a:b, a:b]
        for i in range(b - a):
            j = a + i
            col = int(perm[j]) if perm is not None else j
            k = col // g
            if perm is None and col % g == 0:  # a group starts: its range from the corrected weights
                set_group(k, torch.cat([w1[:, i:], w[:, b:]], dim=1)[:, :g], col)
            s, z = scales[:, k], None if zeros is None else zeros[:, k]
            if minimums or two_level_mins:
                mn = float_mins[:, k] if minimums else sub_mins[:, k] * group_chm[:, k]
                c = round_min_codes(w1[:, i], s, mn, bits)
                deq = c * s - mn
            else:
                c = round_codes(w1[:, i], s, z, lo, hi)
                deq = dequantize_codes(c, s, z)
            codes[:, j] = c
            e = (w1[:, i] - deq) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, b:] -= err1 @ hinv[a:b, b:]
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    if minimums:
        return QuantizedWeight(codes.to(torch.uint8), scales.contiguous(), None, bits, group_size,
                               mins=float_mins.contiguous())
    if two_level_mins:
        return QuantizedWeight.two_level_weight(codes.to(torch.uint8), sub_scales.to(torch.uint8), channel, bits,
                                                group_size, scale_bits, sub_mins=sub_mins.to(torch.uint8),
                                                channel_mins=channel_min)
    if scale_bits is not None:
        return QuantizedWeight.two_level_weight(codes.to(torch.int8), sub_scales.to(torch.uint8), channel, bits,
                                                group_size, scale_bits)
    qdtype = torch.int8 if symmetric else torch.uint8
    return QuantizedWeight(codes.to(qdtype), scales.contiguous(), None if zeros is None else zeros.to(torch.uint8),
                           bits, group_size)


@contextlib.contextmanager
def _swapped(params: dict[str, torch.Tensor], new: dict[str, torch.Tensor]):
    """The parameters hold ``new`` values for the duration; the very tensors they held come back after."""
    saved = {n: params[n].data for n in new}
    try:
        for n, t in new.items():
            params[n].data = t.to(saved[n].dtype).to(saved[n].device)
        yield
    finally:
        for n, data in saved.items():
            params[n].data = data


def _covariance_hook(h: torch.Tensor, count: list[int]):
    def hook(_m, args, kwargs):
        x = (args[0] if args else kwargs["input"]).detach().reshape(-1, h.shape[0]).to(torch.float32)
        h.addmm_(x.T, x)
        count[0] += x.shape[0]
    return hook


@torch.no_grad()
def search_gptq(model: nn.Module, samples: list[torch.Tensor], spec: dict[str, tuple[int, int | None, bool]], *,
                max_tokens: int = DEFAULT_GPTQ_TOKENS, damp: float = DEFAULT_DAMP, act_order: bool = False,
                chunk_tokens: int = 4096, scale_search: bool = False, progress: bool = True, full_range: bool = False,
                block_params: Callable[[str], dict[str, torch.Tensor]] | None = None,
                scale_bits: dict[str, int] | None = None, checkpoint=None,
                minimums: frozenset[str] = frozenset()) -> dict:
    """GPTQ of every layer in ``spec`` that sits in a decoder block; ``{"weights": {fqn: QuantizedWeight}, ...}``.

    ``scale_bits`` maps the layers with two-level scales to their sub-scale width; ``minimums`` names the
    layers with float16 minimums (Q4_1 / Q5_1).

    Layers outside the blocks (the embedding, an untied output layer) are left to the caller (RTN).
    ``block_params(block_name)`` gives new values for some of a block's parameters (AWQ's folded
    scales), used while that block runs and as the weights GPTQ rounds. ``checkpoint``: a directory
    keyed by all of these inputs (the caller's job), for resuming.
    """
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    prefix, blocks = find_decoder_blocks(model)
    units, tokens = capture_block_inputs(model, blocks, samples, max_tokens)
    chunks = token_chunks(units, chunk_tokens)
    weights: dict[str, QuantizedWeight] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    done = _load_checkpoint(checkpoint, weights, len(blocks), tokens) if checkpoint is not None else 0
    if done:
        log.info(f"GPTQ resumed after block {done} of {len(blocks)} (checkpoint {checkpoint})")
    for i in tqdm(range(len(blocks)), desc="gptq", unit="block", disable=not progress, leave=False):
        bname = f"{prefix}.{i}"
        blk = blocks[i]
        names = [n for n in spec if n.startswith(bname + ".")]
        if i < done:  # rounded before the kill: its saved codes give the next block its inputs
            with widened(blk), _swapped(params, {f"{n}.weight": weights[n].dequantize() for n in names}):
                _forward_block(blk, units, chunks)
            continue
        with widened(blk), _swapped(params, block_params(bname) if block_params else {}):
            mods = {n: blk.get_submodule(n[len(bname) + 1:]) for n in names}
            for n, m in mods.items():
                if not isinstance(m, nn.Linear):
                    raise PlanError(f"GPTQ quantizes linear layers; '{n}' is a {type(m).__name__}; use method='rtn'")
            covs = {n: torch.zeros(m.in_features, m.in_features, device=m.weight.device) for n, m in mods.items()}
            counts = {n: [0] for n in mods}
            handles = [m.register_forward_pre_hook(_covariance_hook(covs[n], counts[n]), with_kwargs=True)
                       for n, m in mods.items()]
            try:
                for idx in chunks:
                    run_block(blk, units, idx, {})
            finally:
                for hd in handles:
                    hd.remove()
            deq = {}
            for n, m in mods.items():
                bits, gs, sym = spec[n]
                qw = gptq_quantize_weight(m.weight.detach().float().cpu(), covs.pop(n).cpu() / max(counts[n][0], 1),
                                          bits, gs, sym, damp=damp, act_order=act_order, scale_search=scale_search,
                                          full_range=(full_range and not (scale_bits or {}).get(n)
                                                      and n not in minimums),
                                          scale_bits=(scale_bits or {}).get(n), minimums=n in minimums)
                weights[n] = qw
                deq[f"{n}.weight"] = qw.dequantize()
            with _swapped(params, deq):  # the next block sees what the quantized block computes
                _forward_block(blk, units, chunks)
            del deq
        if checkpoint is not None and i + 1 < len(blocks):
            _save_checkpoint(checkpoint, weights, names, i + 1, len(blocks), tokens)
        release_freed_memory()
    return {"method": "gptq", "weights": weights, "tokens": tokens, "damp": damp, "act_order": act_order,
            "scale_search": scale_search, "full_range": full_range, "seconds": time.perf_counter() - t0, "resumed_after_block": done}


def _forward_block(blk: nn.Module, units, chunks) -> None:
    """Replace each unit's block inputs by the block's outputs."""
    for idx in chunks:
        _seen, outs = run_block(blk, units, idx, {})
        for j, out in zip(idx, outs):
            units[j][0].copy_(out)
        del outs


_PARTS = ("qweight", "scales", "zeros", "sub_scales", "channel_scales", "sub_mins", "channel_mins", "mins")


def _save_checkpoint(directory, weights: dict[str, QuantizedWeight], names: list[str], blocks_done: int,
                     blocks: int, tokens: int) -> None:
    """Block ``blocks_done - 1``'s codes (``names``) in a file of their own, then the progress that counts it.

    Each block is written once (not everything so far again), with its layers' widths in the file's own
    metadata, each file atomically and the progress file last, so a kill at any point leaves the blocks
    it names whole on disk.
    """
    import json
    import os
    from pathlib import Path

    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors, layers = {}, {}
    for name in names:
        qw = weights[name]
        for part in _PARTS:
            t = getattr(qw, part)
            if t is not None:
                tensors[f"{name}/{part}"] = t.contiguous().cpu()
        layers[name] = {"bits": qw.bits, "group_size": qw.group_size, "scale_bits": qw.scale_bits,
                        "scale_max": qw.scale_max, "super_block": qw.super_block}
    block = d / f"block-{blocks_done - 1}.safetensors"
    save_file(tensors, str(block) + ".writing", metadata={"layers": json.dumps(layers)})
    os.replace(str(block) + ".writing", block)
    atomic_write_json(d / "progress.json", {"blocks_done": blocks_done, "blocks": blocks, "tokens": tokens})


def _load_checkpoint(directory, weights: dict[str, QuantizedWeight], blocks: int, tokens: int) -> int:
    """Fill ``weights`` from a killed run's checkpoint; the blocks it covers (0 when there is none usable)."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    d = Path(directory)
    if not (d / "progress.json").is_file():
        return 0
    try:
        progress = json.loads((d / "progress.json").read_text(encoding="utf-8"))
        if progress["blocks"] != blocks or progress["tokens"] != tokens:
            return 0
        for i in range(int(progress["blocks_done"])):
            with safe_open(str(d / f"block-{i}.safetensors"), framework="pt") as f:
                stored = set(f.keys())
                for name, meta in json.loads(f.metadata()["layers"]).items():
                    parts = {part: f.get_tensor(f"{name}/{part}") if f"{name}/{part}" in stored else None
                             for part in _PARTS}
                    weights[name] = QuantizedWeight(**parts, bits=meta["bits"], group_size=meta["group_size"],
                                                    scale_bits=meta["scale_bits"], scale_max=meta.get("scale_max"),
                                                    super_block=meta.get("super_block"))
        return int(progress["blocks_done"])
    except Exception:  # noqa: BLE001 - a damaged checkpoint only costs the blocks it held: start over
        weights.clear()
        return 0
