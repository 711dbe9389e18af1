"""Round-to-nearest quantization of one weight matrix, symmetric or asymmetric, group-wise or per-channel.

    qw = quantize_weight(w, bits=4, group_size=128, symmetric=True)
    (w - qw.dequantize()).abs().max() <= qw.scales.max() / 2

Symmetric: ``scale = max|w| / (2^(b-1) - 1)``, codes signed. Asymmetric: ``scale = (max - min) /
(2^b - 1)`` over a range stretched to include 0, ``zero = round(-min / scale)``, codes unsigned. ``clip_max`` (from AWQ's clip
search) clamps each group to ``[-clip_max, clip_max]`` before the range is taken.
"""
from __future__ import annotations

import torch

from ..errors import PlanError
from .qtensor import QuantizedWeight, code_range

__all__ = ["quantize_weight", "fake_quantize"]

_TINY = 2.0 ** -24  # smallest float16 step: an all-zero group gets this scale, never a division by zero


def _fp16_ceil(x: torch.Tensor) -> torch.Tensor:
    """Round up to a float16 value (scales are stored as float16; rounding up keeps the range covered)."""
    h = x.clamp_min(_TINY).half()
    low = h.float() < x
    if low.any():
        h = torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.float()


def _grouped(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    out, inp = w.shape
    g = group_size or inp
    if inp % g:
        raise PlanError(f"group size {g} does not divide the {inp} input features of this weight; choose a "
                        "divisor (quantize_model falls back automatically) or per-channel (group_size=None)")
    return w.reshape(out, inp // g, g)


def _quantize_groups(wg: torch.Tensor, bits: int, symmetric: bool, clip_max: torch.Tensor | None):
    """Codes (float, integral), scales and zeros for grouped weights ``[out, n_groups, g]``."""
    lo, hi = code_range(bits, symmetric)
    if clip_max is not None:
        cm = clip_max.to(wg.dtype)[..., None]
        wg = torch.maximum(torch.minimum(wg, cm), -cm)
    if symmetric:
        scales = _fp16_ceil(wg.abs().amax(-1) / hi)
        q = torch.round(wg / scales[..., None]).clamp_(lo, hi)
        return q, scales, None
    # the range always holds 0, so the zero point is a valid code and 0 is exact (as torch observers do)
    wmin, wmax = wg.amin(-1).clamp_max(0), wg.amax(-1).clamp_min(0)
    scales = _fp16_ceil((wmax - wmin) / hi)
    zeros = torch.round(-wmin / scales).clamp_(lo, hi)
    q = (torch.round(wg / scales[..., None]) + zeros[..., None]).clamp_(lo, hi)
    return q, scales, zeros


def quantize_weight(w: torch.Tensor, bits: int, group_size: int | None = 128, symmetric: bool = True, *,
                    clip_max: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a 2-D weight ``[out, in]`` (computed in float32)."""
    if w.dim() != 2:
        raise PlanError(f"only 2-D weights can be quantized, got shape {tuple(w.shape)}")
    if group_size is not None and (not isinstance(group_size, int) or group_size <= 0):
        raise PlanError(f"group_size must be a positive integer or None (per-channel), got {group_size!r}")
    w = w.detach().to(torch.float32)
    q, scales, zeros = _quantize_groups(_grouped(w, group_size), bits, symmetric, clip_max)
    out, inp = w.shape
    qdtype = torch.int8 if symmetric else torch.uint8
    return QuantizedWeight(q.reshape(out, inp).to(qdtype), scales.contiguous(),
                           None if zeros is None else zeros.to(torch.uint8), bits, group_size)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
                  clip_max: torch.Tensor | None = None) -> torch.Tensor:
    """``quantize_weight(...).dequantize()`` without building the container (used inside searches)."""
    wg = _grouped(w.to(torch.float32), group_size)
    q, scales, zeros = _quantize_groups(wg, bits, symmetric, clip_max)
    if zeros is not None:
        q = q - zeros[..., None]
    return (q * scales[..., None]).reshape(w.shape)
