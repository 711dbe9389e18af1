"""Modules that compute with a ``QuantizedWeight`` directly: the quantized model without a float copy.

``QuantizedModel.build_model(model)`` swaps these in for the integer layers of a model that shares
every other tensor with the source, so evaluating a quantized 0.5 B model costs its integer codes
(one byte a weight) instead of a second float network. The weight is dequantized to float32 for
each forward pass: the arithmetic is exactly ``quantize -> dequantize -> float32 matmul``, the
same as the saved model and every exporter describe.

    lin = QuantLinear(qw, bias=None)        # qw: QuantizedWeight
    y = lin(x)                              # == F.linear(x, qw.dequantize())
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .qtensor import QuantizedWeight

__all__ = ["QuantLinear", "QuantEmbedding"]


class _Dequantizing(nn.Module):
    """Holds one QuantizedWeight as buffers (codes, scales, zeros) so ``.to(device)`` moves them."""

    def __init__(self, qw: QuantizedWeight):
        super().__init__()
        self.bits, self.group_size, self.scale_bits = qw.bits, qw.group_size, qw.scale_bits
        self.scale_max, self.super_block = qw.scale_max, qw.super_block
        self.register_buffer("qweight", qw.qweight, persistent=False)
        self.register_buffer("scales", qw.scales, persistent=False)
        self.register_buffer("zeros", qw.zeros, persistent=False)
        self.register_buffer("sub_scales", qw.sub_scales, persistent=False)  # two-level scales only
        self.register_buffer("channel_scales", qw.channel_scales, persistent=False)
        self.register_buffer("sub_mins", qw.sub_mins, persistent=False)  # two-level minimums only (Q4_K / Q5_K)
        self.register_buffer("channel_mins", qw.channel_mins, persistent=False)
        self.register_buffer("mins", qw.mins, persistent=False)

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.sub_scales,
                               self.channel_scales, self.scale_bits, self.scale_max, self.super_block, self.sub_mins,
                               self.channel_mins, self.mins)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer computes with."""
        return self.quantized.dequantize()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32), for code that reads ``module.weight``."""
        return self.dequantized_weight()


class QuantLinear(_Dequantizing):
    """``nn.Linear`` whose weight is a QuantizedWeight; computes in float32 (or the input's wider dtype)."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__(qw)
        self.out_features, self.in_features = qw.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, " \
               f"group_size={self.group_size or 'channel'}" + \
               (f", two-level scales ({self.scale_bits}-bit)" if self.scale_bits else "")


class QuantEmbedding(_Dequantizing):
    """``nn.Embedding`` whose table is a QuantizedWeight: only the looked-up rows are dequantized."""

    def __init__(self, qw: QuantizedWeight, padding_idx: int | None = None):
        super().__init__(qw)
        self.num_embeddings, self.embedding_dim = qw.shape
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.quantized.rows(ids.reshape(-1))
        return rows.dequantize().view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}"
