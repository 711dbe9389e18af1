"""What every target module shares: the written override file, plan and graph lookups, float16 layers.

Kept apart from ``workbench.precision.overrides`` (which dispatches to the targets) so target modules never
import their dispatcher.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..errors import PlanError
from ..quantize.plan import QuantPlan, get_precision
from ..files.workspace import read_json_file

__all__ = ["score_in_runtime", "PROFILE_PROMPT", "native_output_to", "log_softmax", "OverrideFile", "layer_precisions", "graph_names", "tensor_for", "read_json_object", "graph_consumers",
           "half_layers", "layers_from_tensors", "block_role", "LINEAR_ROLES"]


@contextlib.contextmanager
def native_output_to(path: str | Path = os.devnull):
    """File descriptors 1 and 2 into ``path`` while the block runs: native libraries (MNN's converter, QNN's
    libnative, onnxruntime's logger) print there directly, which would break `--json` output and the progress
    lines."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


@dataclass
class OverrideFile:
    """A written override file: where, which format, how many tensors it names, what it could not say."""

    path: Path
    format: str
    tensors: int
    notes: list[str] = field(default_factory=list)
    usage: str = ""

    def to_dict(self) -> dict:
        return {"path": str(self.path), "format": self.format, "tensors": self.tensors, "notes": list(self.notes),
                "usage": self.usage}


def layer_precisions(layers, plan: QuantPlan) -> dict[str, str | None]:
    """``{layer: precision name}`` of ``plan`` over ``layers`` (LayerInfo), after checking every rule matches."""
    names = [info.name for info in layers]
    plan.validate(names)
    return plan.resolve(names)


def graph_names(export) -> tuple[dict[str, str], dict[str, str]]:
    """(weight_names, weight_layouts) from an ``ExportResult`` or a plain mapping of names."""
    if export is None:
        raise PlanError("this format names tensors of the exported ONNX graph: pass export=export_onnx(lm, dir) "
                        "(or the weight_names mapping it returns)")
    if isinstance(export, Mapping):
        return dict(export), {}
    return dict(export.weight_names), dict(getattr(export, "weight_layouts", {}) or {})


def tensor_for(weight_names: Mapping[str, str], name: str) -> str:
    try:
        return weight_names[name]
    except KeyError:
        raise PlanError(f"layer '{name}' has no weight tensor in the exported graph; export the same model the plan "
                        "was made for") from None


def read_json_object(path, what: str) -> dict:
    doc = read_json_file(path, f"{what} file", error=PlanError)
    if not isinstance(doc, dict):
        raise PlanError(f"{what} file '{Path(path)}' must hold a JSON object")
    return doc


def graph_consumers(graph, tensor: str) -> list:
    """Nodes that read ``tensor``, looking through a Transpose/Cast between an initializer and its MatMul."""
    out = []
    for node in graph.node:
        if tensor in node.input:
            if node.op_type in ("Transpose", "Cast", "Identity") and node.output:
                out.extend(graph_consumers(graph, node.output[0]))
            else:
                out.append(node)
    return out


def half_layers(qm) -> str | None:
    """The layers a quantized model keeps in float16 (a tied pair once), as a short list for notes; None if none."""
    half = [r.name for r in qm.layers if r.precision and get_precision(r.precision).is_float
            and get_precision(r.precision).bits == 16 and not (r.tied_to and not r.untied)]
    if not half:
        return None
    return ", ".join(half[:4]) + (f" and {len(half) - 4} more" if len(half) > 4 else "")


def layers_from_tensors(raw: Mapping[str, dict], export, path) -> dict[str, str]:
    """``{layer: precision}`` from ``{tensor: {"precision": ...}}`` read out of a file naming graph tensors."""
    weight_names, _ = graph_names(export)
    by_tensor: dict[str, list[str]] = {}
    for name, tensor in weight_names.items():
        by_tensor.setdefault(tensor, []).append(name)
    out = {}
    for tensor, info in raw.items():
        if tensor not in by_tensor:
            raise PlanError(f"'{path}' names tensor '{tensor}', which holds no layer weight of this graph")
        for name in by_tensor[tensor]:
            out[name] = info["precision"]
    return out


LINEAR_ROLES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def block_role(fqn: str) -> tuple[int, str] | None:
    """``(block index, role)`` of a decoder block's linear layer (``model.layers.3.mlp.up_proj`` -> 3, ``mlp.up_proj``)."""
    m = _LAYER_RE.match(fqn)
    if m and m.group(2) in LINEAR_ROLES:
        return int(m.group(1)), m.group(2)
    return None


def log_softmax(x):
    """Log-probabilities of logits ``x`` (numpy, last axis) in float64: what a runtime's outputs are scored with."""
    import numpy as np
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


PROFILE_PROMPT = 64  # held-out tokens of the prompt a conversion times its runtime on


def score_in_runtime(job, runner, label: str, main_file: Path, source: str, *, warm_up: bool = False) -> None:
    """Score a runtime's own logits (prefill, then decode through its own cache) and time it, into the report.

    ``runner`` has ``logits``, ``prefill_seconds``, ``decode_seconds``, ``runtime``, ``threads`` and
    ``load_seconds``; ``source`` says where its times come from (its own counters, or a clock around calls)."""
    ev = job.evaluator()
    if ev is None:
        return
    report = job.report
    ev.fill(report, ev.score(runner.logits, label), main_file)
    ev.fill_decode(report, ev.score_decode(runner, label), main_file)
    prompt = list(ev.ids[:PROFILE_PROMPT].tolist())
    if warm_up:
        runner.prefill_seconds(prompt)
    prefill = runner.prefill_seconds(prompt)
    decode = runner.decode_seconds(prompt, job.greedy_steps)
    report.details["runtime_speed"] = {
        "runtime": runner.runtime, "source": source, "threads": runner.threads, "prompt_tokens": len(prompt),
        "prefill_ms": prefill * 1000, "prefill_tokens_per_second": len(prompt) / prefill,
        "decode_tokens_per_second": job.greedy_steps / decode, "load_seconds": runner.load_seconds}
