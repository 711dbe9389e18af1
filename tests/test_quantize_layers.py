"""quantize.layers: QuantLinear and QuantEmbedding compute from the codes exactly as the dequantized weight does."""
import torch
from torch.nn import functional as F

from workbench.quantize.layers import QuantEmbedding, QuantLinear
from workbench.quantize.rtn import quantize_weight

G = torch.Generator().manual_seed(0)


def test_quant_linear_is_the_linear_layer_of_its_dequantized_weight():
    qw = quantize_weight(torch.randn(16, 32, generator=G), 4, 8, symmetric=False)
    bias = torch.randn(16, generator=G)
    layer = QuantLinear(qw, bias)
    x = torch.randn(3, 5, 32, generator=G)
    assert torch.equal(layer(x), F.linear(x, qw.dequantize(), bias))
    assert torch.equal(layer.weight, qw.dequantize()) and not layer.bias.requires_grad
    assert (layer.in_features, layer.out_features) == (32, 16)
    half = layer(x.to(torch.bfloat16))
    assert half.dtype == torch.float32  # 16-bit inputs compute in float32
    torch.testing.assert_close(half, F.linear(x.to(torch.bfloat16).float(), qw.dequantize(), bias))
    assert "bits=4" in repr(layer) and "group_size=8" in repr(layer)
    assert QuantLinear(qw)(x).shape == (3, 5, 16)


def test_quant_embedding_looks_up_the_rows_it_is_asked_for():
    qw = quantize_weight(torch.randn(50, 12, generator=G), 8, None)
    emb = QuantEmbedding(qw, padding_idx=0)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(emb(ids), F.embedding(ids, qw.dequantize()))
    assert (emb.num_embeddings, emb.embedding_dim, emb.padding_idx) == (50, 12, 0)
    assert "bits=8" in repr(emb)
