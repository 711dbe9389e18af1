"""The one representation of a quantized weight that evaluation, saving and every exporter read.

A weight ``W[out, in]`` is split along ``in`` into groups of ``group_size`` columns (or one group
per row when ``group_size`` is None: per-channel). Each group has one scale (and, when asymmetric,
one zero point); ``W ~= (q - zero) * scale``. Scales are kept at float16 precision (they are
stored as float16), so the weights evaluated are bit-for-bit the weights saved.

Two-level scales (LPBQ-style, symmetric only): each group's scale is an integer sub-scale in
``[1, scale_max]`` (``scale_max`` defaults to ``2^scale_bits``) times one float16 scale per output
channel, or per ``super_block`` columns of it (llama.cpp's k-quant super-blocks of 256), and only
those two are stored; ``scales`` still holds their products (exact in float32: at most 11 + 8
significant bits), so every reader of ``scales`` computes the same weights.

Two-level minimums (llama.cpp's Q4_K / Q5_K, ``SubScales(mins=True)``): unsigned codes in ``[0, 2^b-1]``
and, beside each group's integer sub-scale, an integer sub-minimum in ``[0, scale_max]`` under a second
float16 scale per super-block; ``W ~= q * scale - min`` with ``scale = sub * channel`` and ``min =
sub_min * channel_min``, both exact float32 products (``mins`` holds the latter, group by group).

Float minimums (llama.cpp's Q4_1 / Q5_1): unsigned codes, and beside each group's float16 scale a float16
minimum (``mins``, no integers under it), ``W ~= q * scale - min``; ``sub_mins`` and ``channel_mins`` stay None.

    qw = QuantizedWeight(qweight, scales, zeros, bits=4, group_size=128)
    w_hat = qw.dequantize()             # float32 [out, in]
    packed = pack_int4(qw.storage_codes())   # two 4-bit codes per byte, for files
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PlanError

__all__ = ["QuantizedWeight", "SubScales", "group_channel_scales", "SUPPORTED_BITS", "code_range", "pack_int4", "unpack_int4", "pack_bits", "unpack_bits"]

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Smallest and largest integer code: signed ``[-2^(b-1), 2^(b-1)-1]`` or unsigned ``[0, 2^b-1]``."""
    if bits not in SUPPORTED_BITS:
        raise PlanError(f"{bits}-bit weights are not supported; choose one of {list(SUPPORTED_BITS)} bits")
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1)


@dataclass(frozen=True)
class SubScales:
    """The layout of two-level scales: ``bits``-bit integer sub-scales in ``[1, top]`` (stored minus one)
    under one float16 scale per ``super_block`` columns of a row (None: one per row).

    ``SubScales(4)`` is Qualcomm's LPBQ (sub-scales 1..16 per group, a float scale per channel);
    ``SubScales(6, 31, 256)`` is llama.cpp's Q3_K (6-bit signed scales, used positive);
    ``SubScales(6, 63, 256, mins=True)`` its Q4_K / Q5_K (6-bit scales and 6-bit minimums, unsigned codes).
    """

    bits: int
    top: int | None = None
    super_block: int | None = None
    mins: bool = False  # each group also has an integer minimum (``bits`` wide, 0..top) under a float16 scale

    @property
    def max(self) -> int:
        return self.top or (1 << self.bits)

    @classmethod
    def of(cls, value: "int | SubScales | None") -> "SubScales | None":
        """``None``, a sub-scale width (LPBQ layout) or a layout, as a layout."""
        return value if value is None or isinstance(value, SubScales) else cls(int(value))

    def scales_per_row(self, in_features: int) -> int:
        """Float16 scales per row: one per super-block (or one)."""
        return 1 if not self.super_block else -(-in_features // self.super_block)


@dataclass
class QuantizedWeight:
    """Integer codes plus per-group scales (and zero points) of one layer's weight.

    ``qweight``: int8 ``[out, in]`` codes when symmetric; uint8 ``[out, in]`` codes (with ``zeros``)
    when asymmetric, since unsigned 8-bit codes do not fit int8. ``scales``: float32
    ``[out, n_groups]`` holding float16-representable values. ``zeros``: uint8 ``[out, n_groups]``
    or None (symmetric). ``group_size``: columns per group, None for per-channel.
    Two-level scales: ``sub_scales`` uint8 ``[out, n_groups]`` in ``[1, scale_max]``,
    ``channel_scales`` float32 ``[out]`` (float16 values; ``[out, in / super_block]`` with
    super-blocks), and ``scales`` their products group by group. Two-level minimums (Q4_K / Q5_K):
    uint8 codes, ``sub_mins`` uint8 ``[out, n_groups]`` in ``[0, scale_max]``, ``channel_mins`` like
    ``channel_scales``, and ``mins`` their products.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int | None
    sub_scales: torch.Tensor | None = None
    channel_scales: torch.Tensor | None = None
    scale_bits: int | None = None
    scale_max: int | None = None  # largest sub-scale (None: 2^scale_bits)
    super_block: int | None = None  # columns under one float16 scale (None: the whole row)
    sub_mins: torch.Tensor | None = None  # two-level minimums only (llama.cpp's Q4_K / Q5_K)
    channel_mins: torch.Tensor | None = None
    mins: torch.Tensor | None = None  # float32 [out, n_groups]: sub_mins x channel_mins, or float16 values

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
        parts = (self.sub_scales is None, self.channel_scales is None, self.scale_bits is None)
        if len(set(parts)) > 1:
            raise ValueError("two-level scales need sub_scales, channel_scales and scale_bits together")
        if self.sub_mins is not None and self.mins is None or (self.sub_mins is None) != (self.channel_mins is None):
            raise ValueError("two-level minimums need sub_mins, channel_mins and mins together")
        if self.mins is not None and (self.two_level != (self.sub_mins is not None) or self.zeros is not None):
            raise ValueError("minimums come without zero points: integers under a float16 scale with two-level "
                             "scales, float16 values with float16 group scales")
        if self.mins is not None and (tuple(self.mins.shape) != tuple(self.scales.shape) or self.two_level and
                                      tuple(self.channel_mins.shape) != tuple(self.channel_scales.shape)):
            raise ValueError("mins must match scales, and channel_mins channel_scales, in shape")
        if self.two_level:
            if self.zeros is not None:
                raise ValueError("two-level scales are symmetric or have minimums: they have no zero points")
            want = (out,) if not self.super_block else (out, self.sub_layout.scales_per_row(inp))
            if self.super_block and (self.super_block % g or inp % self.super_block):
                raise ValueError(f"super-blocks of {self.super_block} columns need groups that divide them and "
                                 f"rows ({inp}) they divide")
            if tuple(self.sub_scales.shape) != tuple(self.scales.shape) or \
                    tuple(self.channel_scales.shape) != want:
                raise ValueError(f"sub_scales must be {tuple(self.scales.shape)} and channel_scales {want}")

    @classmethod
    def two_level_weight(cls, qweight: torch.Tensor, sub_scales: torch.Tensor, channel_scales: torch.Tensor,
                         bits: int, group_size: int | None, scale_bits: "int | SubScales", *,
                         sub_mins: torch.Tensor | None = None,
                         channel_mins: torch.Tensor | None = None) -> "QuantizedWeight":
        """A two-level weight from its stored parts; ``scales`` (and ``mins``) are their exact float32 products.

        A layout with minimums (``SubScales(mins=True)``) needs ``sub_mins`` and ``channel_mins`` and
        unsigned codes."""
        layout = SubScales.of(scale_bits)
        if sub_scales.numel() and (int(sub_scales.min()) < 1 or int(sub_scales.max()) > layout.max):
            raise ValueError(f"sub-scales must lie in [1, {layout.max}] for {layout.bits}-bit sub-scales")
        if layout.mins != (sub_mins is not None) or (sub_mins is None) != (channel_mins is None):
            raise ValueError("a layout with minimums takes sub_mins and channel_mins, and only it does")
        sub = sub_scales.to(torch.uint8)
        ch = channel_scales.to(torch.float32)
        per_group = group_channel_scales(ch, sub.shape[1])
        mins = sm = chm = None
        if layout.mins:
            if sub_mins.numel() and (int(sub_mins.min()) < 0 or int(sub_mins.max()) > layout.max):
                raise ValueError(f"sub-minimums must lie in [0, {layout.max}]")
            sm, chm = sub_mins.to(torch.uint8), channel_mins.to(torch.float32)
            mins = sm.to(torch.float32) * group_channel_scales(chm, sm.shape[1])
            qweight = qweight.to(torch.uint8)
        return cls(qweight, sub.to(torch.float32) * per_group, None, bits, group_size, sub, ch, layout.bits,
                   layout.top, layout.super_block, sm, chm, mins)

    @property
    def two_level(self) -> bool:
        return self.scale_bits is not None

    @property
    def sub_layout(self) -> SubScales | None:
        """The two-level layout (sub-scale width, largest sub-scale, super-block, minimums), or None."""
        return None if self.scale_bits is None else SubScales(self.scale_bits, self.scale_max, self.super_block,
                                                              self.mins is not None)

    @property
    def float_minimums(self) -> bool:
        """A float16 minimum per group beside its float16 scale (llama.cpp's Q4_1 / Q5_1)."""
        return self.mins is not None and not self.two_level

    @property
    def symmetric(self) -> bool:
        """Signed codes around 0: no zero points and no minimums."""
        return self.zeros is None and self.mins is None

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
        w = q * self.scales.to(torch.float32)[..., None]
        if self.mins is not None:  # llama.cpp's order: d * q - m, one rounding
            w = w - self.mins.to(torch.float32)[..., None]
        return w.view(out, inp)

    def to(self, device) -> "QuantizedWeight":
        """The same weight with its tensors on ``device`` (itself when they are there already)."""
        if self.qweight.device == torch.device(device):
            return self
        return self._map(lambda t: t.to(device))

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The weight of the rows ``index`` (output channels), scales and all (embedding lookups)."""
        return self._map(lambda t: t[index])

    def _map(self, f) -> "QuantizedWeight":
        """The same layout with ``f`` applied to every tensor (all are indexed by output row first)."""
        g = (lambda t: None if t is None else f(t))
        return QuantizedWeight(f(self.qweight), f(self.scales), g(self.zeros), self.bits, self.group_size,
                               g(self.sub_scales), g(self.channel_scales), self.scale_bits, self.scale_max,
                               self.super_block, g(self.sub_mins), g(self.channel_mins), g(self.mins))

    def storage_codes(self) -> torch.Tensor:
        """uint8 codes as stored: symmetric codes offset by ``2^(b-1)`` so every code is >= 0."""
        if self.symmetric:
            return (self.qweight.to(torch.int16) + (1 << (self.bits - 1))).to(torch.uint8)
        return self.qweight.to(torch.uint8)

    @classmethod
    def from_storage_codes(cls, codes: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None,
                           bits: int, group_size: int | None, *, sub_scales: torch.Tensor | None = None,
                           channel_scales: torch.Tensor | None = None,
                           scale_bits: "int | SubScales | None" = None, sub_mins: torch.Tensor | None = None,
                           channel_mins: torch.Tensor | None = None,
                           mins: torch.Tensor | None = None) -> "QuantizedWeight":
        """A weight from its stored codes; two-level weights pass their sub-scales and channel scales for ``scales``
        (and their sub-minimums and minimum scales with a layout that has minimums: unsigned codes); float
        minimums (Q4_1 / Q5_1) pass ``mins`` beside ``scales``."""
        if zeros is None and sub_mins is None and mins is None:
            q = (codes.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
        else:
            q = codes.to(torch.uint8)
        if scale_bits is not None:
            return cls.two_level_weight(q, sub_scales, channel_scales, bits, group_size, scale_bits,
                                        sub_mins=sub_mins, channel_mins=channel_mins)
        return cls(q, scales.to(torch.float32), None if zeros is None else zeros.to(torch.uint8), bits, group_size,
                   mins=None if mins is None else mins.to(torch.float32))

    def storage_bytes(self) -> int:
        """Bytes this weight takes in a file: packed codes, scales as stored, packed zero points.

        Single-level: a float16 scale per group. Two-level: the sub-scales packed at ``scale_bits``
        each, plus a float16 scale per output channel or super-block (``Precision.weight_bytes`` counts
        the same).
        """
        n = self.qweight.numel()
        zeros = 0 if self.zeros is None else -(-self.zeros.numel() * self.bits // 8)
        if self.two_level:
            scales = -(-self.sub_scales.numel() * self.scale_bits // 8) + 2 * self.channel_scales.numel()
            if self.mins is not None:
                scales *= 2  # as many sub-minimums and minimum scales as sub-scales and scales
        else:
            scales = 2 * self.scales.numel() * (2 if self.mins is not None else 1)  # float16 minimums beside them
        return -(-n * self.bits // 8) + scales + zeros


def group_channel_scales(channel_scales: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Each group's float16 scale ``[out, n_groups]`` from the per-row ``[out]`` or per-super-block
    ``[out, n_super]`` scales (super-blocks hold whole groups)."""
    if channel_scales.dim() == 1:
        return channel_scales[:, None].expand(-1, n_groups)
    return channel_scales.repeat_interleave(n_groups // channel_scales.shape[1], dim=1)


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


_BIT_CHUNK = 1 << 22  # codes packed at once (a multiple of 8, so every chunk starts on a byte)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (< 2^bits), flattened, as one little-endian bitstream: ``ceil(n * bits / 8)`` bytes.

    Code ``i`` occupies bits ``[i * bits, (i + 1) * bits)``, the lowest bit first: for 2, 4 and 8
    bits this is the same byte order as :func:`pack_int4` (two codes a byte, the first low).
    """
    flat = codes.reshape(-1).to(torch.uint8)
    shifts = torch.arange(bits, dtype=torch.uint8)
    weights = (1 << torch.arange(8, dtype=torch.int32))
    out = []
    for a in range(0, flat.numel(), _BIT_CHUNK):
        chunk = flat[a:a + _BIT_CHUNK]
        stream = ((chunk[:, None] >> shifts) & 1).reshape(-1)
        stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8))
        out.append((stream.view(-1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` uint8 codes (flat)."""
    raw = packed.reshape(-1).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    weights = (1 << torch.arange(bits, dtype=torch.int32))
    out = []
    step = _BIT_CHUNK * bits // 8  # bytes per chunk of codes
    for a in range(0, raw.numel(), step):
        stream = ((raw[a:a + step, None] >> shifts) & 1).reshape(-1)
        n = min(_BIT_CHUNK, count - len(out) * _BIT_CHUNK)
        out.append((stream[:n * bits].view(n, bits).to(torch.int32) * weights).sum(-1).to(torch.uint8))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8)
