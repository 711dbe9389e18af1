"""The one representation of a quantized weight that evaluation, saving and every exporter read.

A weight ``W[out, in]`` is split along ``in`` into groups of ``group_size`` columns (or one group
per row when ``group_size`` is None: per-channel). Each group has one scale (and, when asymmetric,
one zero point); ``W ~= (q - zero) * scale``. Scales are kept at float16 precision (they are
stored as float16), so the weights evaluated are bit-for-bit the weights saved.

    qw = QuantizedWeight(qweight, scales, zeros, bits=4, group_size=128)
    w_hat = qw.dequantize()             # float32 [out, in]
    packed = pack_int4(qw.storage_codes())   # two 4-bit codes per byte, for files
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PlanError

__all__ = ["QuantizedWeight", "SUPPORTED_BITS", "code_range", "pack_int4", "unpack_int4"]

SUPPORTED_BITS = (4, 8)


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Smallest and largest integer code: signed ``[-2^(b-1), 2^(b-1)-1]`` or unsigned ``[0, 2^b-1]``."""
    if bits not in SUPPORTED_BITS:
        raise PlanError(f"{bits}-bit weights are not supported; choose one of {list(SUPPORTED_BITS)} bits")
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1)


@dataclass
class QuantizedWeight:
    """Integer codes plus per-group scales (and zero points) of one layer's weight.

    ``qweight``: int8 ``[out, in]`` codes when symmetric; uint8 ``[out, in]`` codes (with ``zeros``)
    when asymmetric, since unsigned 8-bit codes do not fit int8. ``scales``: float32
    ``[out, n_groups]`` holding float16-representable values. ``zeros``: uint8 ``[out, n_groups]``
    or None (symmetric). ``group_size``: columns per group, None for per-channel.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int | None

    def __post_init__(self):
        out, inp = self.qweight.shape
        g = self.group_size or inp
        if inp % g:
            raise ValueError(f"group size {g} does not divide {inp} input features")
        if tuple(self.scales.shape) != (out, inp // g):
            raise ValueError(f"scales shape {tuple(self.scales.shape)} does not match {(out, inp // g)}")
        if self.zeros is not None and tuple(self.zeros.shape) != tuple(self.scales.shape):
            raise ValueError("zeros must have the same shape as scales")
        code_range(self.bits, self.symmetric)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def effective_group_size(self) -> int:
        return self.group_size or self.qweight.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]``: ``(q - zero) * scale`` per group."""
        out, inp = self.qweight.shape
        g = self.effective_group_size
        q = self.qweight.to(torch.float32).view(out, inp // g, g)
        if self.zeros is not None:
            q = q - self.zeros.to(torch.float32)[..., None]
        return (q * self.scales.to(torch.float32)[..., None]).view(out, inp)

    def to(self, device) -> "QuantizedWeight":
        """The same weight with its tensors on ``device`` (itself when they are there already)."""
        if self.qweight.device == torch.device(device):
            return self
        return QuantizedWeight(self.qweight.to(device), self.scales.to(device),
                               None if self.zeros is None else self.zeros.to(device), self.bits, self.group_size)

    def storage_codes(self) -> torch.Tensor:
        """uint8 codes as stored: symmetric codes offset by ``2^(b-1)`` so every code is >= 0."""
        if self.symmetric:
            return (self.qweight.to(torch.int16) + (1 << (self.bits - 1))).to(torch.uint8)
        return self.qweight.to(torch.uint8)

    @classmethod
    def from_storage_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                           group_size: int | None) -> "QuantizedWeight":
        if zeros is None:
            q = (codes.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
        else:
            q = codes.to(torch.uint8)
        return cls(q, scales.to(torch.float32), None if zeros is None else zeros.to(torch.uint8), bits, group_size)

    def storage_bytes(self) -> int:
        """Bytes this weight takes in a file: packed codes, float16 scales, packed zero points."""
        n = self.qweight.numel()
        zeros = 0 if self.zeros is None else -(-self.zeros.numel() * self.bits // 8)
        return -(-n * self.bits // 8) + 2 * self.scales.numel() + zeros


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in ``[0, 15]`` two per byte along the last axis (low nibble first)."""
    codes = codes.to(torch.uint8)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 codes, the last axis cut to ``length``."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)[..., :length]
