"""Image embeddings computed elsewhere (a target's vision encoder: llama.cpp's clip, an NPU graph) compared with the
workbench's, and fed to a language model in place of its own vision part, so the answer-token KL measures what the
target's encoder does to the whole model.

    want = image_features(lm.model, inputs)                  # [image tokens, LM hidden], the model's own
    embedding_error(got, want)           # cosine (mean over tokens), relative error; or lists of pictures'
    score = fed_answer_scorer(sim_model, lm.processor, {path: got})   # a scorer for evaluation.vision.answer_kl
    with injected_encoder(model, lambda pixels, grid: got): ...      # the encoder replaced for any call
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import PlanError
from .vision import answer_scorer

__all__ = ["image_features", "embedding_error", "injected_encoder", "fed_answer_scorer"]


def _base(model):
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "get_image_features"):
        raise PlanError(f"{type(model).__name__} has no image-feature step to feed: only vision-language models "
                        "(Qwen-VL) take a target's image embeddings")
    return inner


@torch.inference_mode()
def image_features(model, inputs: dict) -> np.ndarray:
    """The vision encoder + projector's output for one picture's ``inputs`` (``VisionInputs``' dict), float32."""
    out = _base(model).get_image_features(inputs["pixel_values"], inputs.get("image_grid_thw"))
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
    return feats.float().cpu().numpy()


def embedding_error(got, want) -> dict:
    """How far a target's image embeddings ``got`` are from ``want``: one picture's ``[tokens, hidden]`` or a
    sequence of pictures' (paired in order). ``cosine`` / ``cosine_min``: the mean and lowest over image tokens of
    each token's cosine similarity; ``relative_error``: ||got - want|| / ||want|| over all tokens of all pictures,
    ``relative_error_max``: the worst picture's; ``max_abs_diff``; ``tokens``, ``pictures``. Every target's
    encoder (llama.cpp's clip, the HTP's graph, ``visual.mnn``) is scored by this one measure."""
    many = isinstance(want, (list, tuple))
    if many and (not want or len(got) != len(want)):
        raise PlanError(f"{len(got)} pictures' image embeddings against {len(want)}: give one per picture, paired")
    pairs = list(zip(got, want)) if many else [(got, want)]
    cos, rel, diff, norm, worst = [], [], 0.0, 0.0, 0.0
    for g, w in pairs:
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            raise PlanError(f"the target's image embeddings are {g.shape}, the model's {w.shape}: the picture was "
                            "cut into a different number of tokens (image size bounds differ)")
        cos.append((g * w).sum(-1) / np.maximum(np.linalg.norm(g, axis=-1) * np.linalg.norm(w, axis=-1), 1e-30))
        d2, n2 = float(((g - w) ** 2).sum()), float((w ** 2).sum())
        rel.append(np.sqrt(d2 / max(n2, 1e-30)))
        diff, norm, worst = diff + d2, norm + n2, max(worst, float(np.abs(g - w).max()))
    cos = np.concatenate([c.reshape(-1) for c in cos])
    return {"cosine": float(cos.mean()), "cosine_min": float(cos.min()),
            "relative_error": float(np.sqrt(diff / max(norm, 1e-30))), "relative_error_max": float(max(rel)),
            "max_abs_diff": worst, "tokens": int(cos.size), "pictures": len(pairs)}


@contextlib.contextmanager
def injected_encoder(model, encode: Callable[[np.ndarray, tuple], np.ndarray]):
    """While inside, ``model``'s vision encoder is ``encode(pixel_values, grid_thw)`` (another runtime's
    embeddings, injected where the image tokens are); its own forward is back afterwards."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    visual = _base(model).visual

    def forward(pixel_values, grid_thw=None, **_kwargs):
        grid = tuple(int(v) for v in grid_thw[0])
        emb = encode(pixel_values.detach().float().cpu().numpy(), grid)
        return BaseModelOutputWithPooling(last_hidden_state=None,
                                          pooler_output=torch.from_numpy(np.asarray(emb, np.float32)).to(visual.dtype))
    visual.forward = forward
    try:
        yield model
    finally:
        del visual.forward


def fed_answer_scorer(model, inputs, embeddings: dict[str, np.ndarray]):
    """An ``answer_scorer`` of ``model`` whose image features are ``embeddings[str(sample.image)]`` instead of its
    own vision part's output (the language model sees the target's embeddings, ``injected_encoder``; everything
    else is unchanged)."""
    score = answer_scorer(model, inputs)
    _base(model)  # a text model is refused here, not at its first question

    def run(sample):
        key = str(sample.image)
        if key not in embeddings:
            raise PlanError(f"no target image embeddings for '{Path(key).name}'")
        with injected_encoder(model, lambda _pixels, _grid: embeddings[key]):
            return score(sample)
    return run
