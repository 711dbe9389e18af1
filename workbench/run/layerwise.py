"""Where a converted graph leaves the simulation: each decoder block's output compared, graph against simulation.

    r = compare_blocks("float/prefill.onnx", "ort-qdq/prefill.qdq.onnx", float_lm.model, sim_lm.model, window)
    r.blocks[6]      # {"block": 3, "part": "attention", "graph": 0.12, "simulation": 0.03}: relative errors
    r.cause          # "... departs from the simulation at block 3's attention (model.layers.3.self_attn ...": ..."

A gap flagged at the logits says that a graph differs from the workbench's simulation, not where. Both are run on
the same window with the residual stream after every block's attention and MLP kept (the graph: a copy with those tensors as extra outputs, run in
onnxruntime's CPU; the simulation and the float model: PyTorch, hooks on each decoder layer), and each block's
output is compared with the float model's: the relative error ``|h - h_float| / |h_float|`` over the window. The
first point whose graph error exceeds ``BLOCK_RATIO`` x the simulation's + ``BLOCK_FLOOR`` is where the graph
departs; when none does but the logits do, it departs after the last block (the final norm and the output
layer); when neither does, no single layer is the cause (the cause text says by how much every point is off).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from ..runtime.onnx_runner import OnnxCausalLM

__all__ = ["BLOCK_RATIO", "BLOCK_FLOOR", "LayerwiseResult", "block_output_tensors", "graph_block_outputs",
           "torch_block_outputs", "relative_error", "compare_blocks"]

BLOCK_RATIO = 2.0  # a block's error this many times the simulation's (+ BLOCK_FLOOR) is the graph's own
BLOCK_FLOOR = 1e-3
_BLOCK_ADD = re.compile(r"^/model\.layers\.(\d+)/Add(_\d+)?$")  # the residual adds of a block (torch.onnx names)


POINTS = ("attention", "mlp")  # the residual stream after each half of a block


def block_output_tensors(proto) -> list[str]:
    """The residual stream after each block's attention and after its MLP (its first and last residual Add) in
    the exported graph: ``[block 0 attention, block 0 mlp, block 1 attention, ...]``."""
    adds: dict[int, list[str]] = {}
    for node in proto.graph.node:
        m = _BLOCK_ADD.match(node.name)
        if node.op_type == "Add" and m:
            adds.setdefault(int(m.group(1)), []).append(node.output[0])
    if not adds or any(len(a) != 2 for a in adds.values()):
        raise ValueError("no decoder blocks of two residual adds found (/model.layers.N/Add nodes): not a graph the "
                         "workbench exported")
    return [t for i in sorted(adds) for t in adds[i]]


def graph_block_outputs(path: str | Path, feed: dict, tensors: Sequence[str]) -> tuple[list[np.ndarray], np.ndarray]:
    """(block outputs, logits) of one run of the graph at ``path``, through a copy with ``tensors`` as outputs
    (written beside it, so its external data resolves, and removed after)."""
    import onnx
    import onnxruntime as ort
    path = Path(path)
    proto = onnx.load(str(path), load_external_data=False)
    have = {o.name for o in proto.graph.output}
    for t in tensors:
        if t not in have:
            proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    copy = path.with_name(f".{path.stem}.blocks.onnx")
    try:
        onnx.save(proto, str(copy))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(str(copy), opts, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        out = sess.run(["logits", *tensors], {k: v for k, v in feed.items() if k in names})
    finally:
        copy.unlink(missing_ok=True)
    return [np.asarray(o, np.float32) for o in out[1:]], np.asarray(out[0], np.float32)


def torch_block_outputs(model, ids: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """(the residual stream after each layer's attention and after its MLP, logits) of a Hugging Face causal LM
    on one window (the input of ``post_attention_layernorm``, and the layer's output)."""
    import torch
    layers = model.model.layers
    got: list = [None] * (2 * len(layers))

    def keep(k):
        return lambda t: got.__setitem__(k, (t[0] if isinstance(t, tuple) else t).detach().float().cpu().numpy())
    hooks = []
    for k, layer in enumerate(layers):
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda _m, args, f=keep(2 * k): f(args[0])))
        hooks.append(layer.register_forward_hook(lambda _m, _i, out, f=keep(2 * k + 1): f(out)))
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.as_tensor([list(ids)], device=next(model.parameters()).device)).logits
    finally:
        for h in hooks:
            h.remove()
    return got, logits.float().cpu().numpy()


def relative_error(h: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm((h - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-30))


@dataclass
class LayerwiseResult:
    """Relative error of each block's output (and of the logits) against the float model: graph and simulation."""

    blocks: list[dict] = field(default_factory=list)  # {"block", "part" (attention | mlp), "graph", "simulation"}
    logits: dict = field(default_factory=dict)  # {"graph", "simulation"}
    first_block: int | None = None  # the block where the graph departs from the simulation, if one does
    cause: str = ""
    tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def compare_blocks(float_graph: str | Path, graph: str | Path, float_model, sim_model, window: Sequence[int],
                   *, what: str = "the graph") -> LayerwiseResult:
    """Compare every block's output of ``graph`` and of the simulation with the float model's, on ``window``
    (at most the static graph's sequence length; the float graph gives the reference in onnxruntime too, so a
    difference of the exporter is not taken for one of the conversion)."""
    import onnx
    window = list(map(int, window))
    n = len(window)
    feed = OnnxCausalLM(float_graph).prefill_feed(window)
    tensors = block_output_tensors(onnx.load(str(graph), load_external_data=False))
    ref_blocks, ref_logits = graph_block_outputs(float_graph, feed, tensors)
    got_blocks, got_logits = graph_block_outputs(graph, feed, tensors)
    f_blocks, f_logits = torch_block_outputs(float_model, window)
    s_blocks, s_logits = torch_block_outputs(sim_model, window)
    r = LayerwiseResult(tokens=n)
    for k, (rb, gb, fb, sb) in enumerate(zip(ref_blocks, got_blocks, f_blocks, s_blocks)):
        r.blocks.append({"block": k // 2, "part": POINTS[k % 2], "graph": relative_error(gb[0, :n], rb[0, :n]),
                         "simulation": relative_error(sb[0, :n], fb[0, :n])})
    r.logits = {"graph": relative_error(got_logits[0, :n], ref_logits[0, :n]),
                "simulation": relative_error(s_logits[0, :n], f_logits[0, :n])}
    r.cause, r.first_block = _cause(r, what)
    return r


def _off(g: dict) -> bool:
    return g["graph"] > BLOCK_RATIO * g["simulation"] + BLOCK_FLOOR


def _cause(r: LayerwiseResult, what: str) -> tuple[str, int | None]:
    """Where ``what`` leaves the simulation: the first block half off by the rule, the output layer, or none."""
    layers = {"attention": "self_attn q/k/v/o_proj", "mlp": "mlp gate/up/down_proj"}
    k = next((i for i, b in enumerate(r.blocks) if _off(b)), None)
    if k is not None:
        b = r.blocks[k]
        before = (f"; up to it the graph keeps to the simulation ({r.blocks[k - 1]['graph']:.3g} vs "
                  f"{r.blocks[k - 1]['simulation']:.3g})" if k > 0 else "")
        return (f"{what} departs from the simulation at block {b['block']}'s {b['part']} (model.layers.{b['block']}."
                f"{layers[b['part']]}): the residual stream after it is off the float model's by {b['graph']:.3g} "
                f"(relative), the simulation's by {b['simulation']:.3g}{before}", b["block"])
    last = r.blocks[-1]
    if _off(r.logits):
        return (f"every block of {what} keeps to the simulation (last {last['graph']:.3g} vs {last['simulation']:.3g}); "
                f"it departs after them, in the final norm or the output layer (lm_head): logits off by "
                f"{r.logits['graph']:.3g} vs {r.logits['simulation']:.3g}", None)
    ratios = [b["graph"] / max(b["simulation"], 1e-30) for b in r.blocks]
    return (f"no single layer: every block half of {what} is off the float model by {min(ratios):.2f}-"
            f"{max(ratios):.2f} x the simulation's error (below {BLOCK_RATIO:g} x), and the logits by "
            f"{r.logits['graph'] / max(r.logits['simulation'], 1e-30):.2f} x: its layers round slightly "
            "differently from the simulation's throughout (e.g. scales of its own)", None)
