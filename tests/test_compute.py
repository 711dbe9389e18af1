"""Float32 compute on 16-bit weights: same figures as a float32 model, weights never changed or held twice."""
import pytest
import torch

from workbench.numerics.compute import (disable_float32_compute, enable_float32_compute, float32_compute_enabled,
                               narrow_saved_weights, stored_dtype, widened)
from workbench.model.load import load_model


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """The tiny model stored in bfloat16, and a float32 model holding exactly the same values."""
    half = load_model(tiny_model_dir, dtype="bfloat16")
    full = load_model(tiny_model_dir, dtype="float32")
    with torch.no_grad():
        for p32, p16 in zip(full.model.parameters(), half.model.parameters()):
            p32.copy_(p16.float())
    return half, full


def test_load_keeps_the_stored_dtype_and_computes_in_float32(pair):
    half, full = pair
    assert stored_dtype(half.model) == torch.bfloat16 and float32_compute_enabled(half.model)
    ids = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = half.model(input_ids=ids).logits
        b = full.model(input_ids=ids).logits
    assert a.dtype == torch.float32
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert all(p.dtype == torch.bfloat16 for p in half.model.parameters())


def test_without_the_hooks_a_16_bit_model_computes_in_16_bit(pair):
    half, _ = pair
    ids = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(1))
    disable_float32_compute(half.model)
    try:
        with torch.no_grad():
            assert half.model(input_ids=ids).logits.dtype == torch.bfloat16
    finally:
        enable_float32_compute(half.model)
    assert float32_compute_enabled(half.model)


def test_parameters_are_restored_when_the_forward_raises(pair):
    half, _ = pair
    before = {n: p.data.data_ptr() for n, p in half.model.named_parameters()}

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop
    h = half.model.model.layers[1].mlp.register_forward_pre_hook(stop)
    try:
        with pytest.raises(Stop), torch.no_grad():
            half.model(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        h.remove()
    after = {n: p.data.data_ptr() for n, p in half.model.named_parameters()}
    assert before == after  # the very same 16-bit tensors, not float32 copies left behind


def test_widened_is_float32_inside_and_the_same_tensors_after(pair):
    half, _ = pair
    block = half.model.model.layers[0]
    ptrs = [p.data_ptr() for p in block.parameters()]
    with widened(block):
        assert all(p.dtype == torch.float32 for p in block.parameters())
    assert [p.data_ptr() for p in block.parameters()] == ptrs
    assert all(p.dtype == torch.bfloat16 for p in block.parameters())


def test_backward_reads_the_16_bit_weight_not_a_float32_copy_kept_from_the_forward():
    """Under narrow_saved_weights a weight changed between forward and backward changes the gradient (what is
    saved is the parameter, widened again when read); without it the forward's float32 copy is what backward uses."""
    def grad_after_doubling(ctx):
        torch.manual_seed(0)
        layer = enable_float32_compute(torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False)).to(torch.bfloat16))
        layer.requires_grad_(False)
        x = torch.randn(3, 8, requires_grad=True)
        with ctx(layer):
            y = layer(x)
        assert y.dtype == torch.float32 and layer[0].weight.dtype == torch.bfloat16
        w = layer[0].weight.float().clone()
        layer[0].weight.data.mul_(2)  # behind autograd's version counter: what backward reads is the point
        y.sum().backward()
        return x.grad, w
    import contextlib
    narrowed, w = grad_after_doubling(narrow_saved_weights)
    copied, _ = grad_after_doubling(lambda m: contextlib.nullcontext())
    ones = torch.ones(3, 4)
    assert torch.allclose(copied, ones @ w) and torch.allclose(narrowed, ones @ (2 * w))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantize_and_evaluate_on_cuda_give_the_cpu_figures(tiny_model_dir):
    from workbench.evaluation.evaluate import capture_reference, evaluate
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import quantize_model
    ids = torch.randint(0, 4096, (200,), generator=torch.Generator().manual_seed(0))
    figures = []
    for device in ("cpu", "cuda"):
        lm = load_model(tiny_model_dir, device=device)
        qm = quantize_model(lm, QuantPlan.uniform("int4"), progress=False)
        ref = capture_reference(lm.model, ids, ctx=64, progress=False)
        rep = evaluate(qm.build_model(), ids, reference=ref, ctx=64, progress=False)
        figures.append((rep.perplexity, rep.kl_divergence))
    assert figures[0] == pytest.approx(figures[1], rel=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sensitivity_scores_on_cuda_give_the_cpu_figures(tiny_model_dir):
    from workbench.precision.proxy import proxy_scores
    from workbench.precision.sensitivity import run_sensitivity
    ids = torch.randint(0, 4096, (300,), generator=torch.Generator().manual_seed(0))
    figures = []
    for device in ("cpu", "cuda"):
        lm = load_model(tiny_model_dir, device=device)
        proxy = proxy_scores(lm, ids, ctx=128, progress=False).damage
        kl = run_sensitivity(lm, ids=ids, ctx=128, score="kl", workspace=None, progress=False)
        figures.append((proxy, {layer.name: layer.damage for layer in kl.layers}))
    for cpu, cuda in zip(*figures):
        for name in cpu:
            for prec in cpu[name]:
                assert _as_kl(cpu[name][prec]) == pytest.approx(_as_kl(cuda[name][prec]), rel=5e-2, abs=1e-6)


def _as_kl(value):
    return value["kl"] if isinstance(value, dict) else value


@pytest.mark.parametrize("command", ["info", "eval", "calibrate", "quantize", "sensitivity", "plan", "export", "convert"])
def test_device_option_says_what_to_do_without_a_gpu(command, capsys):
    from workbench.cli import main
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        main([command, "demo", "--device", "cuda"])
    assert "sees no CUDA GPU; leave --device out" in capsys.readouterr().err
