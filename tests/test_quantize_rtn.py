"""Round-to-nearest: code ranges, error bounds, exactness, clipping, bad inputs."""
import pytest
import torch

from workbench.errors import PlanError
from workbench.quantize import fake_quantize, quantize_weight


def _weights(seed=0, out=16, inp=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g) * 3


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, None])
def test_symmetric_codes_and_error_bound(bits, group_size):
    w = _weights()
    qw = quantize_weight(w, bits, group_size, True)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    assert qw.qweight.dtype == torch.int8 and qw.zeros is None
    assert lo <= int(qw.qweight.min()) and int(qw.qweight.max()) <= hi
    g = group_size or w.shape[1]
    assert qw.scales.shape == (w.shape[0], w.shape[1] // g)
    # the largest magnitude of each group maps to the largest code, so nothing is clipped
    err = (w - qw.dequantize()).abs().view(w.shape[0], -1, g).amax(-1)
    assert torch.all(err <= qw.scales / 2 * (1 + 1e-3) + 1e-7)
    # scales are float16 values, exactly what is saved
    assert torch.equal(qw.scales.half().float(), qw.scales)


@pytest.mark.parametrize("bits", [4, 8])
def test_asymmetric_codes_zeros_and_error_bound(bits):
    w = _weights(1) + 0.7  # off-centre: asymmetric quantization should use the whole range
    qw = quantize_weight(w, bits, 64, False)
    assert qw.qweight.dtype == torch.uint8 and qw.zeros.dtype == torch.uint8
    assert int(qw.qweight.max()) <= 2 ** bits - 1 and int(qw.zeros.max()) <= 2 ** bits - 1
    err = (w - qw.dequantize()).abs().view(w.shape[0], -1, 64).amax(-1)
    assert torch.all(err <= qw.scales / 2 * (1 + 1e-3) + 1e-7)
    sym = quantize_weight(w, bits, 64, True)
    assert (w - qw.dequantize()).pow(2).mean() < (w - sym.dequantize()).pow(2).mean()


def test_representable_weights_are_exact():
    codes = torch.randint(-7, 8, (8, 64), generator=torch.Generator().manual_seed(2)).float()
    codes[:, 0] = 7  # every row reaches the top code, so the scale is found exactly
    w = codes * 0.25
    qw = quantize_weight(w, 4, None, True)
    assert torch.equal(qw.dequantize(), w)
    assert torch.equal(qw.qweight.float(), codes)


def test_all_zero_group_has_no_nan():
    w = torch.zeros(4, 64)
    w[0, :32] = torch.linspace(-1, 1, 32)
    for sym in (True, False):
        deq = quantize_weight(w, 4, 32, sym).dequantize()
        assert torch.isfinite(deq).all() and torch.equal(deq[1:], w[1:])


def test_clip_max_limits_the_range():
    w = _weights(3, 4, 64)
    clip = torch.full((4, 2), 0.1)
    deq = quantize_weight(w, 8, 32, True, clip_max=clip).dequantize()
    assert float(deq.abs().max()) <= 0.1 * (1 + 1e-3)  # the float16 scale is rounded up by at most 2^-11


def test_fake_quantize_matches_quantize_weight():
    w = _weights(4)
    for sym in (True, False):
        assert torch.equal(fake_quantize(w, 4, 32, sym), quantize_weight(w, 4, 32, sym).dequantize())


def test_bad_inputs_are_named():
    w = _weights(out=4, inp=96)
    with pytest.raises(PlanError, match="group size 64 does not divide the 96 input features"):
        quantize_weight(w, 4, 64)
    with pytest.raises(PlanError, match="7-bit weights are not supported"):
        quantize_weight(w, 7, 32)
    with pytest.raises(PlanError, match="only 2-D weights"):
        quantize_weight(torch.zeros(4), 4, 32)
    with pytest.raises(PlanError, match="group_size must be a positive integer"):
        quantize_weight(w, 4, 0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_scale_search_never_does_worse_than_min_max_and_usually_better(symmetric):
    from workbench.quantize.rtn import SEARCH_RATIOS
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    w[0, 5] = 12.0  # one outlier: min/max wastes most of its group's codes on it
    plain = quantize_weight(w, 4, 32, symmetric)
    searched = quantize_weight(w, 4, 32, symmetric, scale_search=True)
    err = lambda qw: (w - qw.dequantize()).square().reshape(64, 8, 32).sum(-1)  # noqa: E731
    assert bool((err(searched) <= err(plain) + 1e-6).all())  # ratio 1.0 is in the grid
    assert float(err(searched).sum()) < 0.98 * float(err(plain).sum())  # 5% (asymmetric) to 20% less here
    assert 1.0 in SEARCH_RATIOS and searched.qweight.dtype == plain.qweight.dtype


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_two_level_scales_cover_every_group_and_are_stored_parts(bits, group_size):
    w = _weights(4)
    qw = quantize_weight(w, bits, group_size, True, scale_bits=4)
    assert qw.two_level and qw.sub_scales.dtype == torch.uint8
    assert 1 <= int(qw.sub_scales.min()) and int(qw.sub_scales.max()) <= 16
    assert torch.equal(qw.channel_scales.half().float(), qw.channel_scales)  # float16 channel scales
    assert torch.equal(qw.scales, qw.sub_scales.float() * qw.channel_scales[:, None])
    assert int(qw.sub_scales.amax(-1).min()) == 16  # each row's widest group uses the largest sub-scale
    err = (w - qw.dequantize()).abs().view(w.shape[0], -1, group_size).amax(-1)
    assert torch.all(err <= qw.scales / 2 * (1 + 1e-5) + 1e-7)  # ceil keeps every group's range: nothing clipped
    assert torch.equal(fake_quantize(w, bits, group_size, True, scale_bits=4), qw.dequantize())


def test_two_level_g32_beats_float16_scales_at_the_same_bytes():
    """4-bit sub-scales cost 0.125 bit a weight at g32: the bytes of float16 scales at g128, with finer groups."""
    w = _weights(5, 64, 512)
    two = quantize_weight(w, 4, 32, True, scale_bits=4)
    one = quantize_weight(w, 4, 128, True)
    assert two.storage_bytes() == one.storage_bytes() + 2 * 64  # the same, plus one float16 per row
    assert (w - two.dequantize()).pow(2).mean() < (w - one.dequantize()).pow(2).mean()
    searched = quantize_weight(w, 4, 32, True, scale_bits=4, scale_search=True)
    assert (w - searched.dequantize()).pow(2).mean() <= (w - two.dequantize()).pow(2).mean()
    assert torch.equal(searched.channel_scales, two.channel_scales)


def test_two_level_scales_are_symmetric_only():
    with pytest.raises(PlanError, match="two-level scales .* are symmetric"):
        quantize_weight(_weights(), 4, 32, False, scale_bits=4)


# -- the 16-level symmetric grid (llama.cpp's Q4_0 / Q5_0 rounding) -----------------------------------------------

def test_full_range_codes_and_scale_on_hand_made_blocks():
    # a block whose largest magnitude is negative: scale = -3.2 / -8 = 0.4, so -3.2 takes code -8
    neg = torch.tensor([-3.2, 0.4, 0.8, 2.0, -0.2] + [0.0] * 27)
    # a block whose largest magnitude is positive: scale = 4 / -8 = -0.5 (the sign kept), 4 -> code -8
    pos = torch.tensor([4.0, -1.0, 0.5, 0.25, -3.5] + [0.0] * 27)
    qw = quantize_weight(torch.stack([neg, pos]), 4, 32, True, full_range=True)
    assert qw.scales[:, 0].tolist() == [pytest.approx(0.4, rel=1e-3), -0.5]
    assert qw.qweight[0, :5].tolist() == [-8, 1, 2, 5, 0]  # -0.2 / 0.4 = -0.5 rounds half up to 0
    assert qw.qweight[1, :5].tolist() == [-8, 2, -1, 0, 7]  # 0.25 / -0.5 = -0.5 -> 0; -3.5 / -0.5 = 7
    assert int(qw.qweight.min()) >= -8 and int(qw.qweight.max()) <= 7
    # 15 levels (the default grid) never reach -8 on these blocks
    assert int(quantize_weight(torch.stack([neg, pos]), 4, 32, True).qweight.min()) > -8


@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q5_0", 5)])
def test_full_range_equals_the_gguf_package_quantizer(kind, bits):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize
    from workbench.targets.gguf_file import pack_blocks
    w = _weights(seed=3, out=24, inp=256)
    w[0, :32] = 0.0  # an all-zero block: scale 0, as llama.cpp writes it
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    ref = quantize(w.numpy(), qtype)
    qw = quantize_weight(w, bits, 32, True, full_range=True)
    assert pack_blocks(qw)[1].tobytes() == ref.tobytes()  # the same bytes, block for block
    assert torch.equal(qw.dequantize(), torch.from_numpy(dequantize(ref, qtype)).reshape(w.shape))


def test_full_range_beats_fifteen_levels_and_search_never_loses_to_reference():
    w = _weights(seed=5, out=64, inp=256)
    err = {name: float((w - quantize_weight(w, 4, 32, True, **kw).dequantize()).square().sum())
           for name, kw in {"15": {}, "16": {"full_range": True},
                            "16+search": {"full_range": True, "scale_search": True}}.items()}
    assert err["16"] < err["15"]
    assert err["16+search"] < err["16"]


def test_full_range_search_tries_stretched_ranges_too():
    """A group whose largest weight sits best at -7 (a stretched range, llama.cpp's search reaches it): each
    group's searched error is at most that of the largest weight mapped to 7.1 ... 7.9 steps with the
    least-squares scale."""
    w = _weights(seed=9, out=64, inp=256)
    wg = w.reshape(64, 8, 32)
    got = (wg - quantize_weight(w, 4, 32, True, full_range=True, scale_search=True).dequantize().reshape(wg.shape))
    got = got.square().sum(-1)
    top = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))
    for steps in (7.1, 7.3, 7.5, 7.7, 7.9):
        q = torch.floor(wg * (-steps / top) + 0.5).clamp(-8, 7)
        s = ((q * wg).sum(-1) / (q * q).sum(-1)).half().float()
        assert bool((got <= (wg - s[..., None] * q).square().sum(-1) + 1e-7).all()), steps


def test_importance_weighting_lowers_the_weighted_error():
    w = _weights(seed=7, out=64, inp=256)
    g = torch.Generator().manual_seed(8)
    imp = torch.rand(256, generator=g) ** 4 * 100  # a few columns matter far more, as activations do
    for kw in ({"full_range": True}, {}):
        plain = quantize_weight(w, 4, 32, True, scale_search=True, **kw).dequantize()
        weighted = quantize_weight(w, 4, 32, True, scale_search=True, importance=imp, **kw).dequantize()
        werr = lambda wh: float(((w - wh).square() * imp).sum())  # noqa: E731
        assert werr(weighted) < werr(plain)
    with pytest.raises(PlanError, match="one weight per input column"):
        quantize_weight(w, 4, 32, True, scale_search=True, importance=imp[:10])


def test_full_range_refuses_asymmetric_and_two_level():
    w = _weights()
    with pytest.raises(PlanError, match="symmetric 16-level"):
        quantize_weight(w, 4, 32, False, full_range=True)
    with pytest.raises(PlanError, match="two-level"):
        quantize_weight(w, 4, 32, True, full_range=True, scale_bits=4)


@pytest.mark.parametrize("precision", ["int4-k", "int5-k"])
def test_two_level_minimums_fit_offset_groups_and_search_never_loses(precision):
    """Q4_K / Q5_K's layout: unsigned codes, w = d*sc*q - dmin*m; a group sitting off zero keeps its levels
    (symmetric codes would spend half of them on the empty side), and the weighted search beats min/max."""
    from workbench.quantize.plan import get_precision
    p = get_precision(precision)
    torch.manual_seed(0)
    w = torch.randn(8, 512) * 0.1 + torch.linspace(-1, 1, 8)[:, None]  # rows offset from zero
    imp = torch.rand(512) * 4
    plain = quantize_weight(w, p.bits, 32, True, scale_bits=p.sub_scales)
    searched = quantize_weight(w, p.bits, 32, True, scale_bits=p.sub_scales, scale_search=True, importance=imp)
    for qw in (plain, searched):
        assert qw.qweight.dtype == torch.uint8 and int(qw.qweight.max()) <= (1 << p.bits) - 1 and not qw.symmetric
        assert 1 <= int(qw.sub_scales.min()) and int(qw.sub_scales.max()) <= 63 and int(qw.sub_mins.max()) <= 63
        assert qw.channel_scales.shape == qw.channel_mins.shape == (8, 2)
        assert torch.equal(qw.dequantize(), (qw.qweight.float().view(8, 16, 32) * qw.scales[..., None]
                                             - qw.mins[..., None]).view(8, 512))
    def err(qw):
        return float(((w - qw.dequantize()).square() * imp).sum())
    assert err(searched) < err(plain)
    sym = quantize_weight(w, p.bits, 32, True, scale_search=True, importance=imp)  # float16 scales, no minimum
    assert err(searched) < 0.6 * err(sym)
    with pytest.raises(PlanError, match="256-column super-blocks"):
        quantize_weight(torch.randn(4, 96), p.bits, 32, True, scale_bits=p.sub_scales)


@pytest.mark.parametrize("bits", [4, 5])
def test_float_minimums_fit_offset_groups_at_float16_and_search_never_loses(bits):
    """Q4_1 / Q5_1's layout: unsigned codes, w = d*q - m with d and m float16 values per 32 weights; an
    offset group keeps all its levels, and the weighted search beats min/max on the error it weighs."""
    torch.manual_seed(0)
    w = torch.randn(8, 256) * 0.1 + torch.linspace(-1, 1, 8)[:, None]
    imp = torch.rand(256) * 4
    plain = quantize_weight(w, bits, 32, True, minimums=True)
    searched = quantize_weight(w, bits, 32, True, minimums=True, scale_search=True, importance=imp)
    for qw in (plain, searched):
        assert qw.float_minimums and qw.zeros is None and qw.qweight.dtype == torch.uint8
        assert int(qw.qweight.max()) <= (1 << bits) - 1
        assert torch.equal(qw.scales.half().float(), qw.scales) and torch.equal(qw.mins.half().float(), qw.mins)
        assert torch.equal(qw.dequantize(), (qw.qweight.float().view(8, 8, 32) * qw.scales[..., None]
                                             - qw.mins[..., None]).view(8, 256))
    def err(qw):
        return float(((w - qw.dequantize()).square() * imp).sum())
    assert err(searched) < err(plain)
    zero_point = quantize_weight(w, bits, 32, False, scale_search=True, importance=imp)  # an integer zero point
    assert err(searched) < err(zero_point)
    assert torch.equal(fake_quantize(w, bits, 32, True, minimums=True), plain.dequantize())
    with pytest.raises(PlanError, match="float minimums"):
        quantize_weight(w, bits, 32, True, minimums=True, scale_bits=4)


@pytest.mark.parametrize("bits,top", [(8, 127)])
def test_full_range_search_finds_a_weight_already_on_a_q8_0_grid_exactly(bits, top):
    """A trained model shipped as Q8_0 (scale max/127, codes -127..127) sits on a grid the 16-level rule
    (max/-128) does not reach; the search tries Q8_0's own rule, so re-rounding such a weight loses nothing."""
    g = torch.Generator().manual_seed(bits)
    d = (torch.rand(16, 4, generator=g) * 0.01 + 0.001).half().float()
    codes = torch.randint(-top, top + 1, (16, 4, 32), generator=g).float()
    codes[..., 0] = top  # each block's largest weight positive, at the top code
    w = (codes * d[..., None]).view(16, 128)
    exact = quantize_weight(w, bits, 32, True, full_range=True, scale_search=True)
    assert torch.equal(exact.dequantize(), w)
    plain = quantize_weight(w, bits, 32, True, full_range=True)
    assert not torch.equal(plain.dequantize(), w)  # the 16-level rule alone moves it


def test_importance_is_tempered_toward_each_rows_larger_weights():
    """The search weighs a weight's error by importance x sqrt(sigma2 + w^2), as llama.cpp's imatrix quantizers:
    a larger weight in the same column counts more, a row's scale does not change the ranking within it."""
    from workbench.quantize.rtn import search_weights
    wg = torch.tensor([[[1.0, -3.0, 0.0, 2.0]], [[10.0, -30.0, 0.0, 20.0]]])
    imp = torch.tensor([[1.0, 1.0, 4.0, 0.5]])
    got = search_weights(wg, imp)
    sigma2 = torch.tensor([3.5, 350.0])[:, None, None]
    assert torch.allclose(got, imp * (sigma2 + wg.square()).sqrt())
    assert torch.allclose(got[1], 10 * got[0])  # a row ten times larger: ten times the weights, same order


@pytest.mark.parametrize("kw", [{"full_range": True}, {}, {"symmetric": False}])
def test_the_scale_search_in_row_blocks_equals_one_block(monkeypatch, kw):
    """The search runs over blocks of rows to stay in cache; the blocks change nothing, bit for bit."""
    import workbench.quantize.rtn as rtn
    w = _weights(seed=3, out=37, inp=192)
    imp = torch.rand(192, generator=torch.Generator().manual_seed(4)) + 0.1
    whole = quantize_weight(w, 4, 32, scale_search=True, importance=imp, **kw)
    monkeypatch.setattr(rtn, "SEARCH_BLOCK_VALUES", 5 * 192)  # 5 rows a block, the last one 2
    blocked = quantize_weight(w, 4, 32, scale_search=True, importance=imp, **kw)
    assert torch.equal(whole.qweight, blocked.qweight) and torch.equal(whole.scales, blocked.scales)
    assert (whole.zeros is None) == (blocked.zeros is None)
    if whole.zeros is not None:
        assert torch.equal(whole.zeros, blocked.zeros)
