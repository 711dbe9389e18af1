"""GPTQ: the column-by-column error compensation, against a direct solve, RTN and the model-level figures."""
from __future__ import annotations

import pytest
import torch

from workbench.errors import PlanError
from workbench.quantize.plan import QuantPlan
from workbench.quantize import gptq_quantize_weight, quantize_model, quantize_weight
from workbench.quantize.rtn import quantize_groups


def _layer(rows=24, cols=64, tokens=512, seed=0, rank=8):
    """A weight and inputs near a low-rank subspace (as real activations are), their covariance H = X^T X / n."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    x = torch.randn(tokens, rank, generator=g) @ torch.randn(rank, cols, generator=g) \
        + 0.3 * torch.randn(tokens, cols, generator=g)
    return w, x, x.T @ x / tokens


def _output_error(w, x, qw) -> float:
    return float((x @ (w - qw.dequantize()).T).square().sum())


def _direct_gptq(w, h, bits, symmetric, damp):
    """The same greedy rule written out plainly: after rounding column j, the columns not yet rounded
    move by the optimal correction from the inverse of H restricted to them (no Cholesky tricks).
    Per-channel scales (one group) fixed from the original weights."""
    w = w.clone().double()
    h = h.double() + damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    _, scales, zeros = quantize_groups(w.float()[:, None, :], bits, symmetric, None)
    s, z = scales[:, 0].double(), None if zeros is None else zeros[:, 0].double()
    lo, hi = (-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
    codes = torch.empty_like(w)
    for j in range(w.shape[1]):
        rest = list(range(j, w.shape[1]))
        hinv = torch.linalg.inv(h[rest][:, rest])
        c = torch.round(w[:, j] / s) if z is None else torch.round(w[:, j] / s) + z
        c = c.clamp(lo, hi)
        codes[:, j] = c
        q = c * s if z is None else (c - z) * s
        err = (w[:, j] - q) / hinv[0, 0]
        w[:, rest] -= err[:, None] * hinv[0][None, :]
    return codes


@pytest.mark.parametrize("symmetric", [True, False])
def test_codes_match_a_direct_solve_of_the_same_rule(symmetric):
    w, _x, h = _layer(rows=6, cols=16)
    qw = gptq_quantize_weight(w, h, 4, None, symmetric, damp=0.01, block_columns=5)  # blocks that split unevenly
    direct = _direct_gptq(w, h, 4, symmetric, 0.01)
    assert torch.equal(qw.qweight.double(), direct)


def test_identity_covariance_is_round_to_nearest():
    w, _x, _h = _layer()
    rtn = quantize_weight(w, 4, 32, True)
    qw = gptq_quantize_weight(w, torch.eye(w.shape[1]), 4, 32, True, damp=0.0)
    assert torch.equal(qw.qweight, rtn.qweight) and torch.equal(qw.scales, rtn.scales)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size,symmetric", [(32, True), (16, False), (None, True)])
def test_output_error_is_well_below_round_to_nearest(group_size, symmetric, act_order):
    w, x, h = _layer()
    rtn = quantize_weight(w, 4, group_size, symmetric)
    qw = gptq_quantize_weight(w, h, 4, group_size, symmetric, act_order=act_order)
    assert qw.shape == rtn.shape and qw.scales.shape == rtn.scales.shape and qw.group_size == group_size
    assert _output_error(w, x, qw) < 0.2 * _output_error(w, x, rtn)  # 0.04-0.06 measured


def test_dead_inputs_and_bad_shapes():
    w, x, h = _layer(cols=32)
    h[3, :] = h[:, 3] = 0.0  # an input that was always zero
    qw = gptq_quantize_weight(w, h, 4, 16, True)
    assert int(qw.qweight[:, 3].abs().max()) == 0  # its weights cannot matter: stored as zero
    with pytest.raises(PlanError, match="does not divide"):
        gptq_quantize_weight(w, h, 4, 12, True)
    with pytest.raises(PlanError, match="input covariance"):
        gptq_quantize_weight(w, h[:16, :16], 4, 16, True)


@pytest.mark.slow
def test_gptq_model_beats_rtn_and_leaves_the_model_unchanged(lm):
    from workbench.quantize import measure_cost, measure_reference
    before = {n: p.clone() for n, p in lm.model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, lm.model.config.vocab_size, (128,), generator=gen) for _ in range(8)]
    ids = torch.randint(0, lm.model.config.vocab_size, (600,), generator=gen)
    base = measure_reference(lm.model, ids, ctx=128, progress=False)
    plan = QuantPlan.uniform("int4", group_size=32)
    kl = {}
    for method in ("rtn", "gptq", "awq+gptq"):
        qm = quantize_model(lm, plan, method=method, calibration=samples, progress=False)
        kl[method] = measure_cost(qm, base, progress=False).kl_divergence
        assert all(torch.equal(p, before[n]) for n, p in lm.model.named_parameters())
    assert qm.method == "awq+gptq" and qm.gptq["tokens"] == 8 * 128 and not qm.gptq["act_order"]
    assert qm.awq["groups"] and qm.float_overrides  # the folded norms travel with the quantized model
    assert kl["gptq"] < kl["rtn"] and kl["awq+gptq"] < kl["rtn"]
    assert all(torch.equal(p, before[n]) for n, p in lm.model.named_parameters())
    with pytest.raises(PlanError, match="calibration"):
        quantize_model(lm, plan, method="gptq", progress=False)


def test_scale_search_weighs_groups_by_input_energy():
    w, x, h = _layer()
    plain = gptq_quantize_weight(w, h, 4, 32, True)
    searched = gptq_quantize_weight(w, h, 4, 32, True, scale_search=True)
    assert not torch.equal(plain.scales, searched.scales)
    assert _output_error(w, x, searched) < _output_error(w, x, plain)


def test_plan_scale_search_reaches_every_rounded_layer(lm):
    plain = quantize_model(lm, QuantPlan.uniform("int4", group_size=32, scale_search=False), progress=False)
    searched = quantize_model(lm, QuantPlan.uniform("int4", group_size=32, scale_search=True), progress=False)
    for r in plain.layers:
        if r.name in plain.weights:
            assert searched.layer(r.name).weight_error <= r.weight_error + 1e-6, r.name
    assert sum(s.weight_error for s in searched.layers if s.name in searched.weights) < \
        sum(r.weight_error for r in plain.layers if r.name in plain.weights)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_two_level_scales_keeps_the_row_scales_and_beats_rtn(act_order):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 128, generator=g)
    x = torch.randn(512, 128, generator=g) * torch.rand(128, generator=g) * 3
    h = x.T @ x / 512
    rtn = quantize_weight(w, 4, 32, True, scale_bits=4)
    qw = gptq_quantize_weight(w, h, 4, 32, True, act_order=act_order, scale_bits=4)
    assert qw.two_level and torch.equal(qw.channel_scales, rtn.channel_scales)  # fixed before any column
    assert torch.equal(qw.scales, qw.sub_scales.float() * qw.channel_scales[:, None])
    assert 1 <= int(qw.sub_scales.min()) and int(qw.sub_scales.max()) <= 16

    def err(q):
        d = w - q.dequantize()
        return float(torch.trace(d @ h @ d.T))
    assert err(qw) < err(rtn)
    assert err(gptq_quantize_weight(w, h, 4, 32, True, act_order=act_order, scale_bits=4, scale_search=True)) < err(qw)


def test_a_killed_gptq_resumes_after_its_last_block(lm, tmp_path, monkeypatch, caplog):
    """Killed in block 1 of 2, GPTQ goes on from block 1 with block 0's saved codes (two-level ones too),
    says so, gives the same codes, and leaves no checkpoint behind."""
    import workbench.quantize.gptq as gptq
    from workbench.files.workspace import Workspace
    gen = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, lm.model.config.vocab_size, (64,), generator=gen) for _ in range(3)]
    plan = QuantPlan.uniform("int4", group_size=32).with_override("*.v_proj", "int4-lpbq")
    whole = quantize_model(lm, plan, method="gptq", calibration=samples, workspace=Workspace(tmp_path / "a"),
                           progress=False)
    rounded = gptq.gptq_quantize_weight
    block0 = [n for n in whole.weights if ".layers.0." in n]
    block1 = [n for n in whole.weights if ".layers.1." in n]
    calls = []

    def killed_in_the_second_block(w, h, *args, **kwargs):
        calls.append(len(calls))
        if len(calls) > len(block0):  # the first layer of block 1
            raise KeyboardInterrupt
        return rounded(w, h, *args, **kwargs)
    monkeypatch.setattr(gptq, "gptq_quantize_weight", killed_in_the_second_block)
    ws = Workspace(tmp_path / "b")
    with pytest.raises(KeyboardInterrupt):
        quantize_model(lm, plan, method="gptq", calibration=samples, workspace=ws, progress=False)
    left = list((tmp_path / "b" / "gptq").iterdir())
    assert len(left) == 1 and (left[0] / "progress.json").is_file()
    calls.clear()
    monkeypatch.setattr(gptq, "gptq_quantize_weight", lambda *a, **k: (calls.append(1), rounded(*a, **k))[1])
    with caplog.at_level("INFO", logger="workbench"):
        resumed = quantize_model(lm, plan, method="gptq", calibration=samples, workspace=ws, progress=False)
    assert len(calls) == len(block1) and "GPTQ resumed after block 1 of 2" in caplog.text
    assert resumed.gptq["resumed_after_block"] == 1 and whole.gptq["resumed_after_block"] == 0
    for n, qw in whole.weights.items():
        other = resumed.weights[n]
        assert torch.equal(qw.qweight, other.qweight) and torch.equal(qw.scales, other.scales), n
        assert qw.two_level == other.two_level == n.endswith("v_proj")
    assert not any((tmp_path / "b" / "gptq").iterdir())  # the checkpoint is gone once the codes are whole


def test_full_range_gptq_uses_sixteen_levels_and_beats_full_range_rtn():
    w, x, h = _layer(rows=32, cols=128, seed=4)
    out_err = lambda qw: float((x @ (w - qw.dequantize()).T).square().sum())  # noqa: E731
    g = gptq_quantize_weight(w, h, 4, 32, True, full_range=True, scale_search=True)
    r = quantize_weight(w, 4, 32, True, full_range=True, scale_search=True)
    assert int(g.qweight.min()) == -8 and int(g.qweight.max()) <= 7
    assert out_err(g) < out_err(r)
    with pytest.raises(PlanError, match="symmetric 16-level"):
        gptq_quantize_weight(w, h, 4, 32, False, full_range=True)


@pytest.mark.parametrize("precision", ["int4-k", "int5-k"])
def test_gptq_with_two_level_minimums_stays_on_the_grid_and_beats_rtn(precision):
    from workbench.quantize.plan import get_precision
    p = get_precision(precision)
    w, x, h = _layer(rows=16, cols=512, tokens=2048, seed=3, rank=32)
    rtn = quantize_weight(w, p.bits, 32, True, scale_bits=p.sub_scales, scale_search=True, importance=torch.diag(h))
    for act_order in (False, True):
        q = gptq_quantize_weight(w, h, p.bits, 32, True, scale_bits=p.sub_scales, scale_search=True,
                                 act_order=act_order)
        assert q.mins is not None and q.sub_layout == p.sub_scales and int(q.qweight.max()) <= (1 << p.bits) - 1
        assert torch.equal(q.channel_scales, rtn.channel_scales) and torch.equal(q.channel_mins, rtn.channel_mins)
        def out_err(qw):
            return float((x @ (w - qw.dequantize()).T).square().mean())
        assert out_err(q) < 0.8 * out_err(rtn)


@pytest.mark.parametrize("bits", [4, 5])
def test_gptq_with_float_minimums_stays_on_the_float16_grid_and_beats_rtn(bits):
    w, x, h = _layer(rows=16, cols=512, tokens=2048, seed=3, rank=32)
    w = w + 0.3 * w.abs().mean()  # off zero: the minimum matters
    rtn = quantize_weight(w, bits, 32, True, minimums=True, scale_search=True, importance=torch.diag(h))
    def out_err(qw):
        return float((x @ (w - qw.dequantize()).T).square().mean())
    for act_order in (False, True):
        q = gptq_quantize_weight(w, h, bits, 32, True, scale_search=True, act_order=act_order, minimums=True)
        assert q.float_minimums and q.zeros is None and int(q.qweight.max()) <= (1 << bits) - 1
        assert torch.equal(q.mins.half().float(), q.mins) and torch.equal(q.scales.half().float(), q.scales)
        assert out_err(q) < 0.8 * out_err(rtn)
    with pytest.raises(PlanError, match="float minimums"):
        gptq_quantize_weight(w, h, bits, 32, True, full_range=True, minimums=True)
