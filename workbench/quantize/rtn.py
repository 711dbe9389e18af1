"""Round-to-nearest quantization of one weight matrix, symmetric or asymmetric, group-wise or per-channel.

    qw = quantize_weight(w, bits=4, group_size=128, symmetric=True)
    (w - qw.dequantize()).abs().max() <= qw.scales.max() / 2

Symmetric: ``scale = max|w| / (2^(b-1) - 1)``, codes signed. Asymmetric: ``scale = (max - min) /
(2^b - 1)`` over a range stretched to include 0, ``zero = round(-min / scale)``, codes unsigned. ``clip_max`` (from AWQ's clip
search) clamps each group to ``[-clip_max, clip_max]`` before the range is taken.

``scale_search`` shrinks each group's range by the ratio in ``SEARCH_RATIOS`` (1.0, 0.95, ..., 0.5)
that gives the smallest squared error, weighted per input column by ``importance`` when given
(GPTQ passes the diagonal of ``X^T X``, so columns that see large activations count more): the
rounding error of the bulk shrinks more than the clipping error of the few largest weights grows,
as llama.cpp's k-quant search and GPTQModel's MSE option find. Ratio 1.0 is in the grid, so the
chosen range never does worse than min/max on that objective.

Full range (``full_range``, symmetric): the codes use every level of ``[-2^(b-1), 2^(b-1)-1]`` (16 at
4 bits, where max/min gives 15): each group's scale is its largest-magnitude weight over ``-2^(b-1)``,
keeping that weight's sign, so it lands on the extra code exactly, as llama.cpp's Q4_0 / Q5_0
reference rounding does (``floor(w / scale + 1/2)``, in float32, the scale rounded to float16 only for
storage: the codes are Q4_0's own, bit for bit). On a trained model this beats the 15-level grid:
one more level per group for the same bits. With ``scale_search`` each shrunk range, and nine stretched
ones (the largest weight at 7.1 ... 7.9 steps instead of 8, at 4 bits; llama.cpp's search reaches them
too), also tries its least-squares scale for the codes it gave (``sum(i w q) / sum(i q^2)``, ``i`` the importance), as
llama.cpp's imatrix rounding does; at 8 bits also Q8_0's own rule, ``max / 127`` (a weight shipped as Q8_0 is
found again exactly); ratio 1.0 stays a candidate, so the search is never worse than Q4_0's (Q8_0's) rounding
on the (weighted) error it minimises.

Importance weighting (``importance``, each input column's mean squared activation): ``quantize_weight``
weighs each weight's squared error by ``importance * sqrt(sigma2 + w^2)`` (``search_weights``; ``sigma2`` the
row's mean squared weight), the weighting llama.cpp's importance-matrix quantizers use: the activations'
importance, tempered toward the row's larger weights. Measured on the real-model bench (docs/results.md):
RTN at Q4_0's layout, Qwen2.5-Coder-0.5B KL 0.0761 -> 0.0737, SmolLM2-135M 0.1377 -> 0.1363 (the activation
importance alone over-fits the calibration text's columns). GPTQ keeps its own weights (``diag(H)``).

Two-level scales (``scale_bits``, symmetric; an int width or a ``SubScales`` layout): each row (or
super-block of a row) gets one float16 scale ``c`` (its largest group scale over the largest
sub-scale, rounded up to float16) and each group the integer sub-scale ``ceil(s / c)`` in
``[1, top]`` for its own scale ``s``, so every group's range stays covered. With ``scale_search`` each group picks its sub-scale among ``ceil(s * ratio / c)`` for the
ratios above, by the same (weighted) error.

Two-level minimums (``SubScales(mins=True)``, llama.cpp's Q4_K / Q5_K): each group is fitted as ``w ~= s q -
m`` with unsigned codes, ``m >= 0`` (the range holds 0). Without search ``s`` and ``m`` come from the group's
min/max; with ``scale_search`` each group tries codes from 21 range scalings (``(2^b - 1 + t) / (max - min)``,
``t`` from -1 to 1, as llama.cpp's ``make_qkx`` does) and for each the (weighted) least-squares ``s`` and
``m`` of those codes, keeping the least error (min/max stays a candidate). The super-block's two float16
scales are its largest ``s`` and ``m`` over 63 (rounded up), the groups' 6-bit integers the nearest
multiples, and the codes are rounded again at the stored ``s`` and ``m``.

Float minimums (``minimums=True`` with float16 group scales, llama.cpp's Q4_1 / Q5_1): the same fit of ``s``
and ``m`` per group, both then stored as float16 and the codes rounded again at the stored values.
"""
from __future__ import annotations

import torch

from ..errors import PlanError
from .qtensor import QuantizedWeight, SubScales, code_range, group_channel_scales

__all__ = ["quantize_weight", "fake_quantize", "two_level_groups", "channel_scales_for", "round_codes",
           "dequantize_codes", "full_range_scales", "least_squares_scales", "check_full_range", "min_groups",
           "fit_min_groups", "round_min_codes", "min_sub_values", "float_min_groups", "search_weights"]

_TINY = 2.0 ** -24  # smallest float16 step: an all-zero group gets this scale, never a division by zero
SEARCH_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))
# values per row block of the scale search (2 MB of float32): small enough to stay in cache, large enough that
# torch's per-call cost does not count
SEARCH_BLOCK_VALUES = 1 << 19


def _fp16_ceil(x: torch.Tensor) -> torch.Tensor:
    """Round up to a float16 value (scales are stored as float16; rounding up keeps the range covered)."""
    h = x.clamp_min(_TINY).half()
    low = h.float() < x
    if low.any():
        h = torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.float()


def group_weights(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``w [out, in]`` as ``[out, in / group_size, group_size]`` (one group per row when ``group_size`` is None)."""
    out, inp = w.shape
    g = group_size or inp
    if inp % g:
        raise PlanError(f"group size {g} does not divide the {inp} input features of this weight; choose a "
                        "divisor (quantize_model falls back automatically) or per-channel (group_size=None)")
    return w.reshape(out, inp // g, g)


def _clipped(wg: torch.Tensor, clip_max: torch.Tensor | None) -> torch.Tensor:
    if clip_max is None:
        return wg
    cm = clip_max.to(wg.dtype)[..., None]
    return torch.maximum(torch.minimum(wg, cm), -cm)


def channel_scales_for(wg: torch.Tensor, bits: int, scale_bits: "int | SubScales") -> torch.Tensor:
    """Two-level: the float16 scale per row ``[out]`` (or per super-block ``[out, n_super]``) of grouped
    weights ``[out, n_groups, g]``."""
    layout = SubScales.of(scale_bits)
    hi = code_range(bits, True)[1]
    group_max = wg.abs().amax(-1)
    if layout.super_block:
        out, n_groups, g = wg.shape
        if layout.super_block % g or n_groups % (layout.super_block // g):
            raise PlanError(f"{layout.super_block}-column super-blocks need {g}-column groups that divide them and "
                            f"rows of a multiple of {layout.super_block} columns (this one has {n_groups * g})")
        return _fp16_ceil(group_max.view(out, -1, layout.super_block // g).amax(-1) / hi / layout.max)
    return _fp16_ceil(group_max.amax(-1) / hi / layout.max)


def two_level_groups(wg: torch.Tensor, bits: int, scale_bits: "int | SubScales", *, scale_search: bool = False,
                     importance: torch.Tensor | None = None, channel_scales: torch.Tensor | None = None):
    """Codes (float, integral), sub-scales (float, integral) and channel scales of grouped weights.

    ``channel_scales`` given (``[out]``, or ``[out, n_super]`` with super-blocks): kept (GPTQ fixes
    them from the original weights first); a group whose range then needs more than the largest
    sub-scale's steps takes the largest sub-scale.
    """
    layout = SubScales.of(scale_bits)
    lo, hi = code_range(bits, True)
    top = layout.max
    if channel_scales is None:
        channel_scales = channel_scales_for(wg, bits, layout)
    ch = group_channel_scales(channel_scales, wg.shape[1]).to(wg.dtype)
    want = wg.abs().amax(-1) / hi
    best = best_err = None
    for ratio in (SEARCH_RATIOS if scale_search else (1.0,)):
        sub = torch.ceil(want * ratio / ch).clamp_(1, top)
        q = round_codes(wg, (sub * ch)[..., None], None, lo, hi)
        if not scale_search:
            return q, sub, channel_scales
        err = (wg - dequantize_codes(q, (sub * ch)[..., None], None)).square_()
        err = (err if importance is None else err * importance).sum(-1)
        if best is None:
            best, best_err = [q, sub], err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best[0] = torch.where(better[..., None], q, best[0])
        best[1] = torch.where(better, sub, best[1])
    return best[0], best[1], channel_scales


MIN_SEARCH_STEPS = tuple(-1.0 + 0.1 * i for i in range(21))  # range scalings tried per group (two-level minimums)


def _weighted_sums(wt: torch.Tensor, *terms: torch.Tensor) -> list[torch.Tensor]:
    return [(wt * t).sum(-1) for t in terms]


def fit_min_groups(wg: torch.Tensor, bits: int, *, scale_search: bool = False,
                   importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's float scale ``s >= 0`` and minimum ``m >= 0`` for ``w ~= s q - m`` (``q`` unsigned ``bits``-bit
    codes), ``[out, n_groups]`` each; the least (importance-weighted) error over the searched codes when
    ``scale_search``, else the group's min/max range."""
    nmax = float((1 << bits) - 1)
    wmin, wmax = wg.amin(-1).clamp_max(0), wg.amax(-1)
    span = (wmax - wmin).clamp_min(_TINY)
    best_s, best_m = span / nmax, -wmin
    if not scale_search:
        return best_s, best_m
    wt = torch.ones_like(wg) if importance is None else importance.expand_as(wg)
    def error(sc, mn, q):
        return (wt * (sc[..., None] * q - mn[..., None] - wg).square()).sum(-1)
    q0 = torch.round((wg - wmin[..., None]) / best_s[..., None]).clamp_(0, nmax)
    best_err = error(best_s, best_m, q0)
    sw = wt.sum(-1)
    sx, = _weighted_sums(wt, wg)
    for t in MIN_SEARCH_STEPS:
        q = torch.round((wg - wmin[..., None]) * ((nmax + t) / span)[..., None]).clamp_(0, nmax)
        sl, sll, slx = _weighted_sums(wt, q, q * q, q * wg)
        det = sw * sll - sl * sl
        ok = det > 0
        a = torch.where(ok, (sw * slx - sl * sx) / det.clamp_min(1e-30), best_s)
        b = torch.where(ok, (sll * sx - sl * slx) / det.clamp_min(1e-30), -best_m)
        pos = b > 0  # the offset must stay a minimum (<= 0): refit the scale alone
        a = torch.where(pos, slx / sll.clamp_min(1e-30), a).clamp_min(0)
        b = torch.where(pos, torch.zeros_like(b), b)
        err = error(a, -b, q)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_m = torch.where(better, a, best_s), torch.where(better, -b, best_m)
    return best_s, best_m


def round_min_codes(w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (as floats) of ``w`` at ``w ~= scale * q - minimum`` (shapes broadcast against ``w``)."""
    return torch.round((w + minimum) / scale).clamp_(0, (1 << bits) - 1)


def float_min_groups(wg: torch.Tensor, bits: int, *, scale_search: bool = False,
                     importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (float, integral), float16 scales and float16 minimums of grouped weights ``[out, n_groups, g]`` at
    ``w ~= s q - m`` (llama.cpp's Q4_1 / Q5_1 store ``d = s`` and ``m`` as ``-m``)."""
    s, m = fit_min_groups(wg, bits, scale_search=scale_search, importance=importance)
    s, m = s.clamp_min(_TINY).half().float(), m.half().float()
    return round_min_codes(wg, s[..., None], m[..., None], bits), s, m


def min_groups(wg: torch.Tensor, bits: int, layout: SubScales, *, scale_search: bool = False,
               importance: torch.Tensor | None = None, channel: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Codes, sub-scales, super-block scales, sub-minimums and minimum scales of grouped weights ``[out, n_groups,
    g]`` in a two-level-minimums layout (llama.cpp's Q4_K / Q5_K). ``channel`` given (``(d, dmin)``, each
    ``[out, n_super]``): kept (GPTQ fixes them from the original weights first)."""
    out, n_groups, g = wg.shape
    if not layout.super_block or layout.super_block % g or n_groups % (layout.super_block // g):
        raise PlanError(f"two-level minimums need {layout.super_block}-column super-blocks of whole {g}-column "
                        f"groups, and rows of a multiple of them (this one has {n_groups * g} columns)")
    s, m = fit_min_groups(wg, bits, scale_search=scale_search, importance=importance)
    top = layout.max
    if channel is None:
        per = layout.super_block // g
        channel = (_fp16_ceil(s.view(out, -1, per).amax(-1) / top), _fp16_ceil(m.view(out, -1, per).amax(-1) / top))
    d, dmin = (group_channel_scales(c, n_groups).to(wg.dtype) for c in channel)
    sub, sub_min = min_sub_values(s, m, d, dmin, layout)
    q = round_min_codes(wg, (sub * d)[..., None], (sub_min * dmin)[..., None], bits)
    return q, sub, channel[0], sub_min, channel[1]


def min_sub_values(s: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor,
                   layout: SubScales) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer sub-scales (``[1, top]``) and sub-minimums (``[0, top]``) nearest to the float scales ``s`` and
    minimums ``m`` under each group's float16 super-block scales ``d`` and ``dmin``."""
    return torch.round(s / d).clamp_(1, layout.max), torch.round(m / dmin).clamp_(0, layout.max)


def quantize_groups(wg: torch.Tensor, bits: int, symmetric: bool, clip_max: torch.Tensor | None, *,
                    scale_search: bool = False, importance: torch.Tensor | None = None, full_range: bool = False):
    """Codes (float, integral), scales and zeros for grouped weights ``[out, n_groups, g]``.

    ``importance`` (``[n_groups, g]`` per input column, or ``[out, n_groups, g]`` per weight: ``search_weights``)
    weighs the error the scale search minimises.
    ``full_range`` (symmetric only): the 16-level grid of llama.cpp's Q4_0 (module docstring).
    """
    check_full_range(full_range, symmetric)
    wg = _clipped(wg, clip_max)
    if not scale_search:
        return _round_groups(wg, bits, symmetric, 1.0, full_range)
    grids = search_grids(bits, full_range)
    rows = max(1, SEARCH_BLOCK_VALUES // max(1, wg.shape[1] * wg.shape[2]))
    parts = []
    for r in range(0, wg.shape[0], rows):  # row blocks: each stays in cache through its ~40 candidates
        imp = importance if importance is None or importance.dim() < 3 else importance[r:r + rows]
        parts.append(_searched_block(wg[r:r + rows], bits, symmetric, grids, imp, full_range))
    if len(parts) == 1:
        return tuple(parts[0])
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))


def search_grids(bits: int, full_range: bool) -> list[tuple[float, bool]]:
    """The (range ratio, 16-level grid) pairs the scale search tries, ratio 1.0 first."""
    grids = [(ratio, full_range) for ratio in SEARCH_RATIOS]
    if full_range:  # ranges stretched too: the largest weight at 7.1 ... 7.9 steps (4 bits), as llama.cpp's search
        top = float(-code_range(bits, True)[0])
        grids += [(top / (top - 0.1 * i), True) for i in range(1, 10)]
    if full_range and bits == 8:  # Q8_0's own rule, max / 127, too: a weight shipped as Q8_0 keeps its grid
        grids.append((1.0, False))
    return grids


def _searched_block(wg: torch.Tensor, bits: int, symmetric: bool, grids, importance: torch.Tensor | None,
                    full_range: bool) -> list:
    """The least (weighted) error codes, scales and zeros of a block of rows over ``grids``."""
    best, best_err = None, None
    for ratio, sixteen in grids:
        q, scales, zeros = _round_groups(wg, bits, symmetric, ratio, sixteen)
        candidates = [(q, scales)]
        if full_range:
            candidates.append((q, least_squares_scales(wg, q, importance)))
        for q, scales in candidates:
            err = _dequantize_groups(q, scales, zeros)
            torch.sub(wg, err, out=err)  # in place: the same arithmetic as (wg - dq)^2 * importance, fewer buffers
            err.square_()
            if importance is not None:
                err.mul_(importance)
            err = err.sum(-1)
            if best is None:
                best, best_err = [q, scales, zeros], err
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best[0] = torch.where(better[..., None], q, best[0])
            best[1] = torch.where(better, scales, best[1])
            if zeros is not None:
                best[2] = torch.where(better, zeros, best[2])
    return best


def search_weights(wg: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """Each weight's error weight ``[out, n_groups, g]`` for grouped weights ``wg`` and per-column ``importance``
    ``[n_groups, g]``: ``importance * sqrt(sigma2 + w^2)``, ``sigma2`` each row's mean squared weight."""
    sigma2 = wg.square().mean(dim=(-1, -2), keepdim=True)
    return importance * (sigma2 + wg.square()).sqrt()


def least_squares_scales(wg: torch.Tensor, q: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Each group's float16 scale that minimises ``sum(i (w - s q)^2)`` for its codes ``q``: ``sum(i w q) /
    sum(i q^2)`` (``i`` the per-column importance, 1 when None); a group of all-zero codes keeps scale 0."""
    iq = q if importance is None else q * importance
    num, den = (iq * wg).sum(-1), (iq * q).sum(-1)
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num)).half().float()


def full_range_scales(wg: torch.Tensor, bits: int, ratio: float = 1.0) -> torch.Tensor:
    """Each group's largest-magnitude weight (sign kept, shrunk by ``ratio``) over ``-2^(b-1)``, in float32:
    the scale llama.cpp's Q4_0 / Q5_0 rounding divides by (stored rounded to float16)."""
    top = wg.abs().argmax(-1, keepdim=True)
    return (wg.gather(-1, top)[..., 0] * ratio) / float(code_range(bits, True)[0])


def check_full_range(full_range: bool, symmetric: bool) -> None:
    if full_range and not symmetric:
        raise PlanError("full_range is the symmetric 16-level grid (llama.cpp's Q4_0); an asymmetric plan already "
                        "uses every level: drop full_range or plan with symmetric=true")


def _round_groups(wg: torch.Tensor, bits: int, symmetric: bool, ratio: float, full_range: bool = False):
    """Round-to-nearest with each group's range shrunk by ``ratio`` (1.0: the min/max range)."""
    lo, hi = code_range(bits, symmetric)
    if full_range:  # llama.cpp's reference: codes from the float32 scale, trunc(w / d + 2^(b-1) + 1/2), float32
        d = full_range_scales(wg, bits, ratio)
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)[..., None]
        q = torch.floor(wg * inv + (float(-lo) + 0.5)).clamp_(0, hi - lo) + lo
        return q, d.half().float(), None
    if symmetric:
        scales = _fp16_ceil(wg.abs().amax(-1) * ratio / hi)
        return round_codes(wg, scales[..., None], None, lo, hi), scales, None
    # the range always holds 0, so the zero point is a valid code and 0 is exact (as torch observers do)
    wmin, wmax = wg.amin(-1).clamp_max(0) * ratio, wg.amax(-1).clamp_min(0) * ratio
    scales = _fp16_ceil((wmax - wmin) / hi)
    zeros = torch.round(-wmin / scales).clamp_(lo, hi)
    return round_codes(wg, scales[..., None], zeros[..., None], lo, hi), scales, zeros


def round_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """The integer codes (as floats) of ``w`` at ``scale`` and ``zero`` (shapes broadcast against ``w``)."""
    q = torch.round(w / scale)
    return (q if zero is None else q + zero).clamp_(lo, hi)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``round_codes``' inverse: the float values the codes stand for."""
    return (q if zero is None else q - zero) * scale


def _dequantize_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    return dequantize_codes(q, scales[..., None], None if zeros is None else zeros[..., None])


def check_two_level(scale_bits: "int | SubScales | None", symmetric: bool) -> None:
    """Two-level scales without minimums are symmetric (a layout with minimums is asymmetric by itself)."""
    if scale_bits is not None and not symmetric and not SubScales.of(scale_bits).mins:
        raise PlanError("two-level scales (int4-lpbq, int8-lpbq) are symmetric and have no zero points; plan with "
                        "symmetric=true, or use a precision with float16 scales for an asymmetric plan")


def quantize_weight(w: torch.Tensor, bits: int, group_size: int | None = 128, symmetric: bool = True, *,
                    clip_max: torch.Tensor | None = None, scale_search: bool = False,
                    scale_bits: "int | SubScales | None" = None, full_range: bool = False,
                    importance: torch.Tensor | None = None, minimums: bool = False) -> QuantizedWeight:
    """Round-to-nearest quantization of a 2-D weight ``[out, in]`` (computed in float32).

    ``scale_bits``: two-level scales with integer sub-scales of that width, or that ``SubScales``
    layout (symmetric only). ``full_range``: the 16-level grid (symmetric, float16 group scales).
    ``minimums``: a float16 minimum beside each float16 group scale (unsigned codes, whatever ``symmetric``).
    ``importance``: ``[in]`` weights of each input column's squared error in the scale search (the
    mean squared activation of that input over a calibration set, as llama.cpp's imatrix).
    """
    if w.dim() != 2:
        raise PlanError(f"only 2-D weights can be quantized, got shape {tuple(w.shape)}")
    if group_size is not None and (not isinstance(group_size, int) or group_size <= 0):
        raise PlanError(f"group_size must be a positive integer or None (per-channel), got {group_size!r}")
    check_two_level(scale_bits, symmetric)
    w = w.detach().to(torch.float32)
    out, inp = w.shape
    wg = group_weights(w, group_size)
    if importance is not None:
        if importance.shape != (inp,):
            raise PlanError(f"importance must hold one weight per input column ({inp}), got shape "
                            f"{tuple(importance.shape)}")
        importance = search_weights(wg, importance.detach().to(torch.float32).to(w.device).reshape(wg.shape[1:]))
    if minimums:
        if scale_bits is not None:
            raise PlanError("float minimums go with float16 group scales; two-level layouts with minimums "
                            "(int4-k, int5-k) have their own")
        q, scales, mins = float_min_groups(_clipped(wg, clip_max), bits, scale_search=scale_search,
                                           importance=importance)
        return QuantizedWeight(q.reshape(out, inp).to(torch.uint8), scales.contiguous(), None, bits, group_size,
                               mins=mins.contiguous())
    if scale_bits is not None and SubScales.of(scale_bits).mins:
        layout = SubScales.of(scale_bits)
        q, sub, ch, sub_min, ch_min = min_groups(_clipped(wg, clip_max), bits, layout, scale_search=scale_search,
                                                 importance=importance)
        return QuantizedWeight.two_level_weight(q.reshape(out, inp).to(torch.uint8), sub.to(torch.uint8), ch, bits,
                                                group_size, layout, sub_mins=sub_min.to(torch.uint8),
                                                channel_mins=ch_min)
    if scale_bits is not None:
        if full_range:
            raise PlanError("full_range applies to float16 group scales; two-level precisions keep their own grid")
        q, sub, ch = two_level_groups(_clipped(wg, clip_max), bits, scale_bits, scale_search=scale_search,
                                      importance=importance)
        return QuantizedWeight.two_level_weight(q.reshape(out, inp).to(torch.int8), sub.to(torch.uint8), ch, bits,
                                                group_size, SubScales.of(scale_bits))
    q, scales, zeros = quantize_groups(wg, bits, symmetric, clip_max, scale_search=scale_search,
                                       importance=importance, full_range=full_range)
    qdtype = torch.int8 if symmetric else torch.uint8
    return QuantizedWeight(q.reshape(out, inp).to(qdtype), scales.contiguous(),
                           None if zeros is None else zeros.to(torch.uint8), bits, group_size)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
                  clip_max: torch.Tensor | None = None, scale_bits: "int | SubScales | None" = None,
                  full_range: bool = False, minimums: bool = False) -> torch.Tensor:
    """``quantize_weight(...).dequantize()`` without building the container (used inside searches)."""
    wg = group_weights(w.to(torch.float32), group_size)
    if minimums or scale_bits is not None and SubScales.of(scale_bits).mins:
        return quantize_weight(w, bits, group_size, symmetric, clip_max=clip_max, scale_bits=scale_bits,
                               minimums=minimums).dequantize()
    if scale_bits is not None:
        check_two_level(scale_bits, symmetric)
        q, sub, ch = two_level_groups(_clipped(wg, clip_max), bits, scale_bits)
        return dequantize_codes(q, (sub * group_channel_scales(ch, sub.shape[1]))[..., None], None).reshape(w.shape)
    return _dequantize_groups(*quantize_groups(wg, bits, symmetric, clip_max, full_range=full_range)).reshape(w.shape)
