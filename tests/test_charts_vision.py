"""charts.vision: one bar per plan for the answer KL, and quantized beside float image-text matching."""
from workbench.charts.vision import make_vision_quality_figure


def row(label, kl, itm, ref_itm):
    return {"label": label, "answer_kl": kl, "answer_kl_stderr": kl / 10, "answer_top1": 0.9, "answer_tokens": 40,
            "itm_accuracy": itm, "itm_accuracy_stderr": 0.05, "reference_itm_accuracy": ref_itm,
            "reference_itm_accuracy_stderr": 0.05, "itm_chance": 0.25, "source": "a set"}


def test_bars_follow_the_rows():
    fig = make_vision_quality_figure([row("projector fp16", 0.01, 0.8, 0.85), row("projector int4", 0.05, 0.6, 0.85)])
    kl, quant, ref = fig.data
    assert list(kl.y) == [0.01, 0.05] and list(quant.y) == [0.8, 0.6] and list(ref.y) == [0.85, 0.85]
    assert ref.name == "float model" and list(kl.x) == ["projector fp16", "projector int4"]
    assert any(a.text == "chance" for a in fig.layout.annotations)


def test_no_captions_no_matching_bars():
    r = row("int4", 0.02, None, None)
    assert len(make_vision_quality_figure([r]).data) == 1
