"""Image embeddings computed elsewhere (a target's vision encoder: llama.cpp's clip, an NPU graph) compared with the
workbench's, and fed to a language model in place of its own vision part, so the answer-token KL measures what the
target's encoder does to the whole model.

    want = image_features(lm.model, inputs)                  # [image tokens, LM hidden], the model's own
    embedding_error(got, want)                               # cosine (mean over tokens) and relative error
    score = fed_answer_scorer(sim_model, lm.processor, {path: got})   # a scorer for evaluation.vision.answer_kl
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..errors import PlanError
from .vision import answer_scorer

__all__ = ["image_features", "embedding_error", "fed_answer_scorer"]


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


def embedding_error(got: np.ndarray, want: np.ndarray) -> dict:
    """``cosine``: the mean over image tokens of each token's cosine similarity; ``relative_error``:
    ||got - want|| / ||want|| over all of them; ``max_abs_diff``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise PlanError(f"the target's image embeddings are {got.shape}, the model's {want.shape}: the picture was "
                        "cut into a different number of tokens (image size bounds differ)")
    cos = (got * want).sum(-1) / np.maximum(np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1), 1e-30)
    return {"cosine": float(cos.mean()), "min_cosine": float(cos.min()),
            "relative_error": float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)),
            "max_abs_diff": float(np.abs(got - want).max())}


def fed_answer_scorer(model, inputs, embeddings: dict[str, np.ndarray]):
    """An ``answer_scorer`` of ``model`` whose image features are ``embeddings[str(sample.image)]`` instead of its
    own vision part's output (the language model sees the target's embeddings; everything else is unchanged)."""
    score = answer_scorer(model, inputs)
    base = _base(model)

    def run(sample):
        key = str(sample.image)
        if key not in embeddings:
            raise PlanError(f"no target image embeddings for '{Path(key).name}'")
        emb = torch.as_tensor(embeddings[key])
        base.get_image_features = lambda *a, **k: SimpleNamespace(pooler_output=(emb,))
        try:
            return score(sample)
        finally:
            del base.get_image_features
    return run

