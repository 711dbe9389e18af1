"""How closely another runtime reproduces PyTorch: a reference prefill and decode step, their differences,
and how many greedy tokens agree.

    ref = torch_reference(model, prompt)                 # before the runtime's session exists
    diffs = parity(ref, runner, prompt)                  # {"prefill.logits": ..., "decode.kv": ...}
    match, picks = greedy_agreement(model, prompt, runner.generate_greedy(prompt, 32))

The checks every export and conversion runs (``workbench.onnx.export``, the ONNX targets).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from torch import nn
from ..numerics.logits import final_hidden, head_logits

if TYPE_CHECKING:
    from .onnx_runner import OnnxCausalLM

__all__ = ["TorchReference", "torch_reference", "parity", "greedy_agreement"]


@torch.inference_mode()
def greedy_agreement(model: nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[int, list[int]]:
    """How many leading ``tokens`` (another runtime's greedy continuation of ``prompt``) ``model`` picks too.

    One forward pass over ``prompt + tokens`` instead of a decode loop: greedy decoding agrees for
    exactly as long as the model's argmax at each position is the next given token. Returns that
    count and the model's own greedy tokens as far as they are determined (one past the first
    disagreement).
    """
    tokens = [int(t) for t in tokens]
    if not tokens:
        return 0, []
    ids = torch.tensor([list(prompt) + tokens[:-1]], device=next(model.parameters()).device)
    hidden = final_hidden(model, ids)[0, len(prompt) - 1:]
    picks = head_logits(model.get_output_embeddings(), hidden).argmax(-1).tolist()
    match = 0
    while match < len(tokens) and picks[match] == tokens[match]:
        match += 1
    return match, picks[:match + 1]


@dataclass
class TorchReference:
    """What PyTorch computed for the parity check: the prompt's logits and KV, then one decode step's."""

    prefill_logits: np.ndarray
    prefill_kv: list[np.ndarray]
    token: int
    decode_logits: np.ndarray
    decode_kv: list[np.ndarray]


@torch.inference_mode()
def torch_reference(model: nn.Module, prompt: list[int]) -> TorchReference:
    """Prefill ``prompt`` and decode its greedy next token, keeping what the onnxruntime check compares.

    Computed before any onnxruntime session exists, so the PyTorch model can be let go meanwhile:
    a float graph's session holds every weight in float32 again.
    """
    from transformers import DynamicCache

    def kv(cache) -> list[np.ndarray]:
        return [t.float().cpu().numpy().copy() for layer in cache.layers for t in (layer.keys, layer.values)]

    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt], device=device), past_key_values=DynamicCache(), use_cache=True)
    logits, cache = out.logits.float().cpu().numpy().copy(), out.past_key_values
    token = int(logits[0, -1].argmax())
    prefill_kv = kv(cache)
    out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
    return TorchReference(logits, prefill_kv, token, out.logits[0, -1].float().cpu().numpy().copy(),
                           kv(out.past_key_values))


def parity(ref: TorchReference, runner: OnnxCausalLM, prompt: list[int]) -> dict[str, float]:
    """Max abs differences of logits and KV: prefill on the prompt, then one decode step."""
    _, logits, kv = runner.run_prefill(prompt)
    diffs = {"prefill.logits": float(np.abs(logits - ref.prefill_logits).max()),
             "prefill.kv": max(float(np.abs(a - b).max()) for a, b in zip(kv, ref.prefill_kv))}
    last, kv2, _ = runner.run_decode(ref.token, kv, len(prompt))
    diffs["decode.logits"] = float(np.abs(last - ref.decode_logits).max())
    diffs["decode.kv"] = max(float(np.abs(a - b).max()) for a, b in zip(kv2, ref.decode_kv))
    return diffs
