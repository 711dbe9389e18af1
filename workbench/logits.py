"""Logits of a PyTorch causal LM without a float32 copy of its output layer.

    hidden = final_hidden(model, ids)          # [batch, seq, hidden] float32: the decoder, stopped at the head
    logits = head_logits(model.get_output_embeddings(), hidden[0])

A Qwen output layer is 151,936 rows: 545 MB in float32 for Qwen2.5-0.5B, 1.6 GB for Qwen3-4B.
``head_logits`` widens (or dequantizes) ``VOCAB_CHUNK`` rows at a time instead, and callers keep
hidden states (tokens x hidden) rather than logits (tokens x vocabulary) between uses. Valid for
models whose logits are exactly ``lm_head(final hidden state)`` (Llama, Qwen2, Qwen3: no scaling
or soft-capping), which is what the ONNX export builds.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["final_hidden", "head_logits", "VOCAB_CHUNK"]

VOCAB_CHUNK = 16384  # output-layer rows widened to float32 at a time (58 MB at hidden size 896)


class _Stop(Exception):
    pass


@torch.inference_mode()
def final_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The output layer's input (float32 ``[batch, seq, hidden]``) for token ids ``[batch, seq]``."""
    got: list[torch.Tensor] = []

    def grab(_module, args):
        got.append(args[0])
        raise _Stop
    handle = model.get_output_embeddings().register_forward_pre_hook(grab, prepend=True)
    try:
        model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not got:
        raise RuntimeError("the model never called its output layer; its logits cannot be rebuilt")
    return got[0].to(torch.float32)


@torch.inference_mode()
def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 ``hidden @ W.T (+ b)`` for hidden ``[tokens, hidden]``, W widened or dequantized in row slices."""
    qw = getattr(head, "quantized", None)  # a QuantLinear: its codes, never dequantized whole
    weight = None if qw is not None else head.weight.detach()
    vocab = qw.shape[0] if qw is not None else weight.shape[0]
    device = qw.qweight.device if qw is not None else weight.device
    hidden = hidden.to(device, torch.float32)
    logits = torch.empty((hidden.shape[0], vocab), dtype=torch.float32, device=device)
    for v in range(0, vocab, VOCAB_CHUNK):
        rows = slice(v, v + VOCAB_CHUNK)
        if qw is not None:
            w = qw.rows(rows).dequantize()
        else:
            w = weight[rows].to(torch.float32)
        torch.matmul(hidden, w.T, out=logits[:, rows])
    bias = getattr(head, "bias", None)
    if bias is not None:
        logits += bias.detach().to(torch.float32)
    return logits
