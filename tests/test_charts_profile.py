"""charts.profile: one bar per model in each of the three panels, from the profiles given."""
from workbench.charts.profile import make_profile_figure
from workbench.run.profile import RuntimeProfile


def test_three_panels_from_profiles_or_their_dicts():
    a = RuntimeProfile("float", "onnxruntime", [], 4_000_000, 1, 1, prefill_ms={8: 2.0, 32: 6.0},
                       decode_tokens_per_second=50.0)
    b = RuntimeProfile("ort-int4", "onnxruntime", [], 1_000_000, 1, 1, prefill_ms={8: 1.0, 32: 3.0},
                       decode_tokens_per_second=120.0).to_dict()
    b["prefill_ms"] = {str(k): v for k, v in b["prefill_ms"].items()}  # as read back from JSON
    fig = make_profile_figure([a, b])
    decode, prefill, size = fig.data
    assert list(decode.x) == ["float", "ort-int4"] and list(decode.y) == [50.0, 120.0]
    assert list(prefill.y) == [6.0, 3.0] and "32-token prompt" in fig.layout.annotations[1].text
    assert list(size.y) == [4.0, 1.0]
