"""A VLM's language model as a causal LM: same modules, text-model names, the plan's integers renamed with it."""
import torch

from workbench import load_model
from workbench.model.text_part import language_model_view, text_name, text_part_quantized
from workbench.quantize import quantize_model
from workbench.quantize.plan import QuantPlan


def test_view_computes_what_the_vlm_computes_on_text_and_exports():
    lm = load_model("demo-vl")
    view = language_model_view(lm)
    names = [info.name for info in view.layers]
    assert names[0] == "model.embed_tokens" and "model.layers.1.mlp.down_proj" in names and names[-1] == "lm_head"
    assert not any("visual" in n for n in names)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert torch.equal(view.model(input_ids=ids).logits, lm.model(input_ids=ids).logits)
    assert language_model_view(load_model("demo")).path == load_model("demo").path  # a text model is itself


def test_quantized_text_part_keeps_the_integers_under_text_names():
    lm = load_model("demo-vl")
    qm = quantize_model(lm, QuantPlan.uniform("int4"))
    text = text_part_quantized(qm)
    assert {r.name for r in text.layers} == {text_name(r.name) for r in qm.layers if "visual" not in r.name}
    key = "model.layers.0.self_attn.q_proj"
    assert text.weights[key] is qm.weights["model.language_model.layers.0.self_attn.q_proj"]
    head = next(r for r in text.layers if r.name == "lm_head")
    assert head.tied_to in (None, "model.embed_tokens")
