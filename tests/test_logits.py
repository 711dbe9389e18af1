"""Logits through the output layer a slice at a time: the same numbers and gradients as the layer itself."""
import torch
from torch import nn

import workbench.numerics.logits as logits
from workbench.numerics.logits import chunked_sum, trainable_head_logits


def _head(dtype=torch.float32, bias=True):
    torch.manual_seed(0)
    return nn.Linear(16, 40, bias=bias).to(dtype)


def test_trainable_head_logits_match_the_layer_forward_and_backward(monkeypatch):
    monkeypatch.setattr(logits, "VOCAB_CHUNK", 7)  # several slices, the last one short
    head = _head()
    h = torch.randn(5, 16, requires_grad=True)
    mine, theirs = trainable_head_logits(head, h), head(h)
    assert torch.allclose(mine, theirs, atol=1e-6)
    g = torch.randn_like(mine)
    for a, b in zip(torch.autograd.grad(mine, [h, head.weight, head.bias], g),
                    torch.autograd.grad(theirs, [h, head.weight, head.bias], g)):
        assert torch.allclose(a, b, atol=1e-5)


def test_a_16_bit_head_computes_in_float32_and_its_gradient_keeps_its_dtype():
    head = _head(torch.bfloat16, bias=False)
    h = torch.randn(3, 16, requires_grad=True)
    out = trainable_head_logits(head, h)
    assert out.dtype == torch.float32
    assert torch.allclose(out, h.detach() @ head.weight.float().T, atol=1e-5)
    out.sum().backward()
    assert head.weight.grad.dtype == torch.bfloat16 and h.grad.dtype == torch.float32


def test_chunked_sum_gives_the_whole_batch_loss_and_gradients():
    head = _head()
    h = torch.randn(11, 16, requires_grad=True)
    y = torch.randint(0, 40, (11,))

    def nll(rows, targets):
        return (nn.functional.cross_entropy(trainable_head_logits(head, rows), targets, reduction="sum"),)
    (chunked,) = chunked_sum(nll, h, y, chunk=4)  # 4 + 4 + 3 rows, each recomputed in backward
    (whole,) = nll(h, y)
    assert torch.allclose(chunked, whole, atol=1e-5)
    for a, b in zip(torch.autograd.grad(chunked, [h, head.weight]), torch.autograd.grad(whole, [h, head.weight])):
        assert torch.allclose(a, b, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(chunked_sum(nll, h, y, chunk=4)[0], whole, atol=1e-5)
