"""Vision-language models: load Qwen2-VL / Qwen2.5-VL / Qwen3-VL and SmolVLM / Idefics3 checkpoints with
transformers' own classes, name their parts, and turn a picture and a question into model inputs.

    lm = load_model("demo-vl")                       # the bundled demo VLM; any local VLM directory works
    for part in lm.parts(): print(part.name, part.prefixes, part.parameters, part.bytes)
    inputs = lm.processor(image, "What colour is the shape?")   # input_ids, pixel_values, ...

Layer names stay the checkpoint's own (``model.visual.blocks.0.attn.qkv``, ``model.visual.merger.mlp.0``,
``model.language_model.layers.0.mlp.down_proj``), so a plan can address vision layers like any other.
Images are preprocessed by transformers' PIL image processors (the default fast ones need torchvision);
no processor class that also loads a video processor is used. Safetensors only; never remote code.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import DataError, ModelLoadError
from ..evaluation.images import read_image
from ..evaluation.vision import AnswerScores, VisionSample

__all__ = ["VISION_MODEL_TYPES", "is_vision_config", "ModelPart", "model_parts", "VisionInputs",
           "load_vision_model", "answer_scorer", "answer_inputs", "answer_text", "part_of"]

# model_type -> (transformers class, image-prompt family)
VISION_MODEL_TYPES = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "qwen"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "qwen"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "qwen"),
    "smolvlm": ("SmolVLMForConditionalGeneration", "idefics"),
    "idefics3": ("Idefics3ForConditionalGeneration", "idefics"),
}
# where each part lives, longest prefix wins (a projector inside the vision tower belongs to the projector)
PART_PREFIXES = {
    "vision encoder": ("model.visual", "model.vision_model", "model.vision_tower"),
    "projector": ("model.visual.merger", "model.visual.deepstack_merger_list", "model.connector",
                  "model.multi_modal_projector"),
    "language model": ("model.language_model", "model.text_model", "lm_head"),
}


def is_vision_config(raw_cfg: dict) -> bool:
    """Whether a config.json describes an image-text model (a vision config, or a known VLM type)."""
    model_type = raw_cfg.get("model_type")
    return (isinstance(model_type, str) and model_type in VISION_MODEL_TYPES) or \
        isinstance(raw_cfg.get("vision_config"), dict)


@dataclass(frozen=True)
class ModelPart:
    """One part of a VLM: vision encoder, projector or language model, with the module prefixes it covers."""

    name: str
    prefixes: tuple[str, ...]
    parameters: int
    bytes: int  # as stored (each tensor at its own dtype), a tied weight counted once
    layers: int  # quantizable layers (Linear, Embedding) in the part

    def to_dict(self) -> dict:
        return {"name": self.name, "prefixes": list(self.prefixes), "parameters": self.parameters,
                "bytes": self.bytes, "layers": self.layers}


def _part_of(name: str, found: dict[str, str]) -> str | None:
    best = None
    for prefix, part in found.items():
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, part)
    return best[1] if best else None


def part_of(name: str, parts) -> str | None:
    """The part (``ModelPart.name``) a layer or parameter ``name`` belongs to among ``parts`` (longest prefix wins:
    the projector inside the vision tower is the projector), or None."""
    return _part_of(name, {prefix: part.name for part in parts for prefix in part.prefixes})


def model_parts(model: nn.Module, layer_names=()) -> list[ModelPart]:
    """The parts present in ``model``, in the order vision encoder, projector, language model (a text model:
    one part, the language model, under the empty prefix).

    Every parameter falls in exactly one part (longest matching prefix); one outside all of them would be
    a new architecture, named in an error rather than left out of the sums.
    """
    modules = dict(model.named_modules())
    found = {p: part for part, prefixes in PART_PREFIXES.items() for p in prefixes if p in modules}
    if not any(part == "vision encoder" for part in found.values()):  # a text model: one part, the whole model
        tensors = {id(p): p for p in model.parameters()}.values()
        return [ModelPart("language model", ("",), sum(t.numel() for t in tensors),
                          sum(t.numel() * t.element_size() for t in tensors), len(list(layer_names)))]
    params: dict[str, list[int]] = {part: [0, 0] for part in PART_PREFIXES}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        part = _part_of(name, found)
        if part is None:
            raise ModelLoadError(f"parameter '{name}' is in none of the parts of this vision-language model "
                                 f"({', '.join(found)}); this architecture is not supported")
        params[part][0] += p.numel()
        params[part][1] += p.numel() * p.element_size()
    counts = {part: 0 for part in PART_PREFIXES}
    for n in layer_names:
        part = _part_of(n, found)
        if part is not None:
            counts[part] += 1
    return [ModelPart(part, tuple(p for p, q in found.items() if q == part), *params[part], counts[part])
            for part in PART_PREFIXES if any(q == part for q in found.values())]


class VisionInputs:
    """Turns a picture and a question into a VLM's inputs: its PIL image processor, its tokenizer and chat
    template, and the image tokens expanded to the count the vision encoder produces (what transformers'
    processor classes do, without the video processor they also load)."""

    def __init__(self, family: str, image_processor, tokenizer, config):
        self.family, self.image_processor, self.tokenizer, self.config = family, image_processor, tokenizer, config
        self.image_token = tokenizer.convert_ids_to_tokens(int(config.image_token_id))

    def prompt_text(self, text: str, *, chat: bool = True) -> str:
        """The prompt with one image placeholder in front of ``text`` (through the chat template when the
        tokenizer has one and ``chat``)."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            msg = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            return self.tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        if self.family == "qwen":
            return f"<|vision_start|>{self.image_token}<|vision_end|>{text}"
        return f"{self.image_token}{text}"

    def __call__(self, image, text: str, *, chat: bool = True) -> dict[str, torch.Tensor]:
        if not text.strip():
            raise DataError("the question is empty: type what to ask about the picture")
        prompt = self.prompt_text(text, chat=chat)
        if prompt.count(self.image_token) != 1:
            raise DataError(f"the prompt must hold the image placeholder {self.image_token!r} exactly once, "
                            f"found {prompt.count(self.image_token)}")
        if self.family == "qwen":
            pix = self.image_processor([image], return_tensors="pt")
            merge = int(self.image_processor.merge_size)
            n = int(pix["image_grid_thw"].prod()) // (merge * merge)
            prompt = prompt.replace(self.image_token, self.image_token * n)
            inputs = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
        else:
            from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string
            pix = self.image_processor([[image]], return_tensors="pt", return_row_col_info=True)
            vc = self.config.vision_config
            seq_len = int((vc.image_size // vc.patch_size) ** 2 / (self.config.scale_factor ** 2))
            expanded = get_image_prompt_string(pix["rows"][0][0], pix["cols"][0][0], seq_len,
                                               "<fake_token_around_image>", self.image_token, "<global-img>")
            prompt = prompt.replace(self.image_token, expanded)
            inputs = {"pixel_values": pix["pixel_values"], "pixel_attention_mask": pix["pixel_attention_mask"]}
        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if self.family == "qwen":  # image tokens marked, as transformers' Qwen processors do: 3D (mrope) positions
            inputs["mm_token_type_ids"] = (ids == int(self.config.image_token_id)).long()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **inputs}


def _image_processor(family: str, path: Path, config):
    """The PIL image processor of a checkpoint, from its preprocessor_config.json (or the vision config's sizes)."""
    if family == "qwen":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    elif config.model_type == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as cls
    else:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as cls
    f = path / "preprocessor_config.json"
    if f.is_file():
        try:
            kwargs = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"'{f}' is not valid JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise ModelLoadError(f"'{f}' holds a JSON {type(kwargs).__name__}, not an object of settings")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("image_processor_type", "processor_class")}
    else:
        vc = config.vision_config
        kwargs = ({"patch_size": vc.patch_size, "temporal_patch_size": getattr(vc, "temporal_patch_size", 2),
                   "merge_size": vc.spatial_merge_size} if family == "qwen" else
                  {"max_image_size": {"longest_edge": vc.image_size}, "size": {"longest_edge": vc.image_size},
                   "do_image_splitting": False})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - one clear line for a bad preprocessor config
        raise ModelLoadError(f"could not build the image processor of '{path}': {' '.join(str(e).split())[:200]}") \
            from e


def load_vision_model(p: Path, raw_cfg: dict, torch_dtype: torch.dtype, *, trust_remote_code: bool = False):
    """``(model, loading info, config, family)`` for a VLM directory, built by its transformers class from
    safetensors only; the caller refuses weights that do not cover the model (``info``), never initialising
    any at random."""
    import transformers
    from transformers import AutoConfig
    model_type = raw_cfg.get("model_type")
    if model_type not in VISION_MODEL_TYPES:
        raise ModelLoadError(f"'{p}' is vision-language model_type '{model_type}', which this workbench cannot load; "
                             f"supported: {', '.join(VISION_MODEL_TYPES)}")
    if trust_remote_code:
        raise ModelLoadError(f"'{p}': vision-language models load only with transformers' own classes; drop "
                             "--trust-remote-code")
    if not any(p.glob("*.safetensors")):
        raise ModelLoadError(f"'{p}' keeps its weights in a pickle: vision-language models load from safetensors only "
                             "(convert the checkpoint to model.safetensors where you trust its source)")
    cls_name, family = VISION_MODEL_TYPES[model_type]
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
        cls = getattr(transformers, cls_name)
        model, info = cls.from_pretrained(p, config=config, dtype=torch_dtype, local_files_only=True,
                                          use_safetensors=True, output_loading_info=True,
                                          ignore_mismatched_sizes=True)
    except Exception as e:  # transformers raises many types; give one clear line
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise ModelLoadError(f"could not load the vision-language model in '{p}': {why}") from e
    return model, info, config, family


def vision_inputs(family: str, path: Path, config, tokenizer) -> VisionInputs | None:
    """The picture-and-question preprocessing of a loaded VLM (None without a tokenizer)."""
    if tokenizer is None:
        return None
    return VisionInputs(family, _image_processor(family, path, config), tokenizer, config)


def answer_text(prompt_ids: list[int], answer: str, tokenizer) -> str:
    """The answer as it follows the prompt: after a prompt ending in a space or a newline as it is, else after one
    space (what the demo VLM learned after ``Answer:``, and how most BPE vocabularies write a word that follows
    another)."""
    last = tokenizer.decode(prompt_ids[-1:]) if prompt_ids else ""
    return answer if not last or last[-1].isspace() else " " + answer


def answer_scorer(model: nn.Module, inputs: VisionInputs, *, chat: bool = True):
    """A scorer for ``workbench.evaluation.vision``: the log-probabilities of a sample's answer tokens given its
    picture and prompt, built by the same ``VisionInputs`` that ``generate`` uses (chat template, image tokens,
    their 3D positions), so a score and a generated answer see one prompt. ``model`` may be the float model or a
    quantized one built from it; only the answer positions' logits are computed (``logits_to_keep``)."""

    @torch.inference_mode()
    def score(sample: VisionSample) -> AnswerScores:
        feats, answer = answer_inputs(inputs, sample, chat=chat)
        device = next(model.parameters()).device  # pixels stay float32, as generate feeds them (float32 compute)
        feats = {k: v.to(device) for k, v in feats.items()}
        out = model(**feats, use_cache=False, logits_to_keep=len(answer) + 1)
        logits = out.logits[0, -(len(answer) + 1):-1]  # position j predicts token j + 1
        return AnswerScores(torch.log_softmax(logits.float().cpu(), dim=-1), torch.tensor(answer))

    return score


def answer_inputs(inputs: VisionInputs, sample: VisionSample, *, chat: bool = True) -> tuple[dict, list[int]]:
    """The model inputs of a sample's picture, prompt and answer (the answer's tokens after the prompt, as
    ``answer_scorer`` scores them and calibration runs them), and the answer's token ids."""
    tok = inputs.tokenizer
    if not (sample.answer or "").strip():
        raise DataError(f"{sample.where or 'a sample'}: the answer is empty; give each record a non-empty answer")
    image = read_image(sample.image) if isinstance(sample.image, (str, Path)) else sample.image
    feats = inputs(image, sample.prompt, chat=chat)
    ids = feats["input_ids"]
    answer = tok(answer_text(ids[0].tolist(), sample.answer, tok), add_special_tokens=False)["input_ids"]
    if not answer:
        raise DataError(f"{sample.where or 'a sample'}: the answer is empty after tokenizing; give each record "
                        "a non-empty answer")
    extra = torch.tensor([answer], dtype=ids.dtype)
    feats["input_ids"] = torch.cat([ids, extra], dim=1)
    feats["attention_mask"] = torch.ones_like(feats["input_ids"])
    if "mm_token_type_ids" in feats:
        feats["mm_token_type_ids"] = torch.cat([feats["mm_token_type_ids"], torch.zeros_like(extra)], dim=1)
    return feats, answer
