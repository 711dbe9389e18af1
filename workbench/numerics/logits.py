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

__all__ = ["final_hidden", "head_input", "head_logits", "head_vocab", "trainable_head_logits", "chunked_sum",
           "loss_chunk_rows", "VOCAB_CHUNK", "LOSS_CHUNK_ELEMENTS"]

VOCAB_CHUNK = 16384  # output-layer rows widened to float32 at a time (58 MB at hidden size 896)
LOSS_CHUNK_ELEMENTS = 1 << 24  # tokens x vocabulary float32 per tensor of a training loss: 64 MB


class _Stop(Exception):
    pass


@torch.inference_mode()
def final_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The output layer's input (float32 ``[batch, seq, hidden]``) for token ids ``[batch, seq]``."""
    return head_input(model, ids)


def head_input(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``final_hidden`` under the caller's autograd mode: differentiable when gradients are on (training)."""
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


def head_vocab(head: nn.Module) -> int | None:
    """Rows of an output layer (float or a QuantLinear's codes); None for a module with neither."""
    qw = getattr(head, "quantized", None)
    if qw is not None:
        return qw.shape[0]
    weight = getattr(head, "weight", None)
    return None if weight is None else weight.shape[0]


@torch.inference_mode()
def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 ``hidden @ W.T (+ b)`` for hidden ``[tokens, hidden]``, W widened or dequantized in row slices."""
    qw = getattr(head, "quantized", None)  # a QuantLinear: its codes, never dequantized whole
    weight = None if qw is not None else head.weight.detach()
    vocab = head_vocab(head)
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


class _SlicedHead(torch.autograd.Function):
    """``hidden @ W.T (+ b)`` in float32, W widened ``VOCAB_CHUNK`` rows at a time forward and backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        ctx.save_for_backward(hidden, weight)  # the weight as stored (16-bit), never a float32 copy of it
        ctx.has_bias = bias is not None
        h = hidden.to(torch.float32)
        out = torch.empty((h.shape[0], weight.shape[0]), dtype=torch.float32, device=h.device)
        for v in range(0, weight.shape[0], VOCAB_CHUNK):
            torch.matmul(h, weight[v:v + VOCAB_CHUNK].to(torch.float32).T, out=out[:, v:v + VOCAB_CHUNK])
        if bias is not None:
            out += bias.to(torch.float32)
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad_h = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=grad.device)
            for v in range(0, weight.shape[0], VOCAB_CHUNK):
                grad_h += grad[:, v:v + VOCAB_CHUNK] @ weight[v:v + VOCAB_CHUNK].to(torch.float32)
            grad_h = grad_h.to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad.T @ hidden.to(torch.float32)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_h, grad_w, grad_b


def trainable_head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``head_logits`` with gradients (to the hidden rows and a trainable head), for training losses.

    A plain linear output layer only (its ``weight``, parametrized or not, and ``bias``); the
    float32 copy of a 16-bit head is made ``VOCAB_CHUNK`` rows at a time, not whole (545 MB for a
    Qwen vocabulary at hidden size 896, per call).
    """
    return _SlicedHead.apply(hidden, head.weight, getattr(head, "bias", None))


def loss_chunk_rows(vocab: int) -> int:
    """Token rows per chunk of a loss over the output layer: 110 for a Qwen vocabulary, 4,096 for the demo's."""
    return max(1, LOSS_CHUNK_ELEMENTS // vocab)


def chunked_sum(fn, *rows: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """``fn(*row_chunks)`` (a tuple of scalar sums) over ``chunk`` rows at a time, added up; differentiable.

    What ``fn`` builds from a chunk (its logits, tokens x vocabulary) is not kept for backward:
    each chunk is recomputed when backward reaches it (activation checkpointing), so autograd holds
    the rows (tokens x hidden) and one chunk's logits at a time instead of the whole batch's.
    """
    from torch.utils.checkpoint import checkpoint
    n = rows[0].shape[0]
    total = None
    for a in range(0, n, chunk):
        part = tuple(r[a:a + chunk] for r in rows)
        if n <= chunk or not torch.is_grad_enabled():
            out = fn(*part)
        else:
            out = checkpoint(fn, *part, use_reentrant=False)
        total = out if total is None else tuple(x + y for x, y in zip(total, out))
    return total
