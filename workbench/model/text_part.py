"""A VLM's language model on its own, as a causal LM the text targets convert like any other.

    text_lm = language_model_view(lm)                 # model.layers.0..., lm_head: what export_onnx builds
    text_qm = text_part_quantized(qm)                 # the plan's integers for those layers, under those names

A Qwen2/2.5-VL keeps its decoder at ``model.language_model`` and its head at ``lm_head``; the text export, the
QDQ twin and the QNN encodings expect a decoder at ``model`` (``model.layers.0.self_attn.q_proj``). The view
shares the VLM's modules (no copy); names move from ``model.language_model.X`` to ``model.X``. For text alone
the multimodal rotary positions (mrope) are the plain ones (all three components equal), so the text graphs
compute what the VLM computes on text.
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..errors import ModelLoadError
from .load import LoadedModel, quantizable_layers
from ..quantize.model import QuantizedModel

__all__ = ["LANGUAGE_PREFIX", "TEXT_PREFIX", "text_name", "LanguageModel", "language_model", "language_model_view",
           "text_part_quantized"]

LANGUAGE_PREFIX = "model.language_model."
TEXT_PREFIX = "model."


def text_name(name: str | None) -> str | None:
    """A VLM layer's name in the language model view (``lm_head`` stays)."""
    if name is None or not name.startswith(LANGUAGE_PREFIX):
        return name
    return TEXT_PREFIX + name[len(LANGUAGE_PREFIX):]


class LanguageModel(nn.Module):
    """The decoder and head of a VLM as a causal LM (``model``, ``lm_head``, ``config`` = the text config);
    ``prefix``: its decoder's name in the VLM, for a writer that keeps the VLM's layer names (MNN's)."""

    prefix = LANGUAGE_PREFIX.rstrip(".")

    def __init__(self, decoder: nn.Module, head: nn.Module, config):
        super().__init__()
        self.model, self.lm_head, self.config = decoder, head, config

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, use_cache=use_cache)
        return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state),
                                      past_key_values=getattr(out, "past_key_values", None))


def language_model(model, name: str = "the model") -> LanguageModel:
    """The language model of a VLM (a transformers model with ``model.language_model``) as a ``LanguageModel``
    sharing its modules."""
    decoder = getattr(getattr(model, "model", None), "language_model", None)
    head = model.get_output_embeddings()
    if decoder is None or head is None:
        raise ModelLoadError(f"{name} keeps no decoder at model.language_model with a head: its language model "
                             "cannot be converted on its own")
    config = model.config.get_text_config()
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    return LanguageModel(decoder, head, config).eval()


def language_model_view(lm: LoadedModel) -> LoadedModel:
    """The language model of a VLM ``lm`` as a text ``LoadedModel`` sharing its modules (a text model: itself)."""
    if not getattr(lm, "is_vision", False):
        return lm
    view = language_model(lm.model, f"'{lm.path}'")
    return LoadedModel(view, lm.tokenizer, lm.path, f"{lm.name} (language model)", quantizable_layers(view))


def text_part_quantized(qm):
    """The ``QuantizedModel`` ``qm`` of a VLM restricted to its language model's layers, named as in
    ``language_model_view`` (the same integers; vision layers left out)."""

    def ours(name: str) -> bool:
        return name.startswith(LANGUAGE_PREFIX) or not name.startswith("model.")
    layers = [replace(r, name=text_name(r.name), tied_to=text_name(r.tied_to)) for r in qm.layers if ours(r.name)]
    weights = {text_name(k): v for k, v in qm.weights.items() if ours(k)}
    floats = {text_name(k): v for k, v in qm.float_overrides.items() if ours(k)}
    return QuantizedModel(qm.plan, qm.method, weights, layers, float_overrides=floats, awq=qm.awq, gptq=qm.gptq,
                          seconds=qm.seconds)
