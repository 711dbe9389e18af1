"""Rockchip RKNPU2, ``rknn``: ``.rknn`` models built and simulated by the real RKNN-Toolkit2, and its build script.

    result = build_rknn(prep, "out/rknn")              # prep: convert.prepare_models(...)
    result.prefill.top1_agreement, result.decode.kl_divergence, result.rknn_bytes
    m = measure_rknn("demo", bits=8)                  # the same, with time and peak memory (benchmarks)

rknn-toolkit2 2.5.0 pins numpy/onnx/protobuf/torch below the project's, so it lives in its own
venv (``make rknn-env`` writes ``.venv-rknn``; ``WORKBENCH_RKNN_PYTHON`` names another python) and
runs as one subprocess (``rknn_build.py``) that builds, simulates and exports each graph: a
``.rknn`` reloaded with ``load_rknn`` cannot be simulated. Without that venv, ``convert`` writes
the graphs, calibration data and ``build_rknn.py`` as before, and says how to create it.

The static graphs are rewritten for the toolkit (``prepare_rknn_graph``):

- the causal mask's fill is ``MASK_FILL`` (-100) instead of float32's minimum, which the toolkit
  clamps to -10000 and which then ruins its int8 attention;
- cos/sin of the rotary embedding are graph inputs (``rope_cos`` / ``rope_sin``, ``[1, seq,
  head_dim]``, computed on the host by ``rope_feed``) instead of ``position_ids``: int8 angles of
  up to 511 radians are noise, while int8 cos/sin in [-1, 1] are not;
- decode calibration is spread over the past's positions (``spread_positions``), not all at one.

Precisions (rk3588 takes ``w8a8`` and ``w16a16i_dfp`` only): an all-float plan builds float16, an
all-int16 plan w16a16i_dfp, anything else w8a8 with the plan's float layers kept float16 through
hybrid quantization; 4-bit and other widths are built at 8 bits and named in the notes. The toolkit
quantizes the float weights itself (its own per-channel scales), so its figures are compared with
both the float model and the workbench's simulation of the plan.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..errors import WorkbenchError
from .base import inspect_graph
from .common import log_softmax
from .processes import owned_tempdir, run_killable, timeout_setting
from .registry import Target, register_target
from ..assets import demo_text_path
from ..evaluation.evaluate import encode_text, read_text
from ..quantize.plan import get_precision
from .convert import GAP_TOP1, prepare_models

__all__ = ["write_rknn_bundle", "convert_rknn", "TARGET", "MASK_FILL", "RKNN_ENV_HINT", "rknn_python",
           "prepare_rknn_graph", "rope_feed", "spread_positions", "RknnScores", "RknnResult", "build_rknn",
           "measure_rknn", "RknnMeasurement", "RknnError", "STALL_LAYERS", "DEFAULT_TIMEOUT", "TIMEOUT_VAR",
           "check_rknn_setup", "read_worker_result"]

MASK_FILL = -100.0  # exp(-100) is 0 in float16 and float32: masked keys stay masked, and int8 keeps resolution
REPO = Path(__file__).resolve().parents[2]
STUB = Path(__file__).resolve().parent / "rknn_stub"
WORKER = Path(__file__).resolve().parent / "rknn_build.py"
RKNN_ENV_HINT = "`make rknn-env` (in the repository) creates .venv-rknn with rknn-toolkit2 2.5.0"
STALL_LAYERS = 24  # rknn-toolkit2 2.5.0 stalled past 14 min in a graph-optimisation pass from this many blocks
DEFAULT_TIMEOUT = 1200.0  # seconds for the whole build + simulation subprocess
TIMEOUT_VAR = "WORKBENCH_RKNN_TIMEOUT"  # what `convert --target rknn` gives it instead
PYTHON_VAR = "WORKBENCH_RKNN_PYTHON"
TEMP_KIND = "workbench-rknn"  # <tmp>/workbench-rknn-<pid>-*: the toolkit's inputs and outputs (~300 MB), one run's
PLATFORM = "rk3588"
PLATFORM_DTYPES = {"rk3588": ("w8a8", "w16a16i_dfp")}


class RknnError(WorkbenchError):
    """The RKNN toolkit failed, timed out, or is not set up."""


def rknn_python() -> Path | None:
    """The rknn venv's python (``WORKBENCH_RKNN_PYTHON``, else ``.venv-rknn`` in the repository), or None when
    neither is there. ``WORKBENCH_RKNN_PYTHON`` naming no executable file is an error naming it: the user meant a
    toolkit, and "not set up" would hide the typo."""
    env = os.environ.get(PYTHON_VAR)
    py = Path(env) if env else REPO / ".venv-rknn" / "bin" / "python"
    if py.is_file() and os.access(py, os.X_OK):
        return py
    if env:
        why = "does not exist" if not py.exists() else "is not a file" if not py.is_file() else "is not executable"
        raise RknnError(f"${PYTHON_VAR} names '{env}', which {why}: point it at the python of a venv with "
                        f"rknn-toolkit2, or unset it ({RKNN_ENV_HINT})")
    return None


def check_rknn_setup() -> None:
    """Before any work: a ``$WORKBENCH_RKNN_PYTHON`` naming no python, or a bad ``$WORKBENCH_RKNN_TIMEOUT``."""
    rknn_python()
    timeout_setting(TIMEOUT_VAR, DEFAULT_TIMEOUT)


# -- graph rewriting -------------------------------------------------------------------------------

def _replace_mask_fill(proto, fill: float, threshold: float = -1e30) -> int:
    """Small float constants at or below ``threshold`` (the mask's fill) set to ``fill``; returns how many."""
    from onnx import numpy_helper
    n = 0
    tensors = list(proto.graph.initializer)
    tensors += [a.t for node in proto.graph.node if node.op_type == "Constant" for a in node.attribute
                if a.name == "value"]
    for t in tensors:
        if t.data_type in (1, 10) and int(np.prod(t.dims or [1])) <= 16 and not t.external_data:
            arr = numpy_helper.to_array(t)
            if arr.size and float(arr.min()) <= threshold:
                t.CopyFrom(numpy_helper.from_array(np.where(arr <= threshold, fill, arr).astype(arr.dtype), t.name))
                n += 1
    return n


def _rotary_to_inputs(proto) -> dict | None:
    """Make the Cos/Sin outputs graph inputs ``rope_cos`` / ``rope_sin`` and drop what only fed them.

    Returns ``{"inv_freq": [...]}`` (read from the graph), or None when the graph has no Cos/Sin pair.
    """
    from onnx import TensorProto, helper, numpy_helper
    g = proto.graph
    cos = next((n for n in g.node if n.op_type == "Cos"), None)
    sin = next((n for n in g.node if n.op_type == "Sin"), None)
    if cos is None or sin is None:
        return None
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    concat = producer[cos.input[0]]
    mul = producer[concat.input[0]]
    inv = next(numpy_helper.to_array(inits[i]) for i in mul.input if i in inits)
    seq = next(i for i in g.input if i.name == "input_ids").type.tensor_type.shape.dim[1].dim_value
    dim = 2 * int(inv.size)
    renames = {cos.output[0]: "rope_cos", sin.output[0]: "rope_sin"}
    keep = [n for n in g.node if n is not cos and n is not sin]
    for n in keep:
        for k, name in enumerate(n.input):
            if name in renames:
                n.input[k] = renames[name]
    # drop nodes whose outputs nothing reads any more (the position -> angle chain)
    needed = {o.name for o in g.output}
    alive = []
    for n in reversed(keep):
        if any(o in needed for o in n.output):
            alive.append(n)
            needed.update(n.input)
    del g.node[:]
    g.node.extend(reversed(alive))
    inputs = [i for i in g.input if i.name in needed]
    del g.input[:]
    g.input.extend(inputs)
    for name in ("rope_cos", "rope_sin"):
        g.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, seq, dim]))
    unused = [i for i in g.initializer if i.name not in needed]
    for i in unused:
        g.initializer.remove(i)
    return {"inv_freq": inv.astype(np.float32).reshape(-1).tolist()}


def prepare_rknn_graph(src: str | Path, dst: str | Path | None = None, *, mask_fill: float = MASK_FILL) -> dict:
    """Rewrite a static graph for the toolkit: finite mask fill, rotary cos/sin as inputs.

    ``dst`` (default ``src``) must sit in the same folder when the graph keeps external data.
    Returns ``{"mask_constants": n, "inv_freq": [...] | None, "inputs": [...], "sizes": [[...]]}``.
    """
    import onnx
    src = Path(src)
    dst = Path(dst) if dst else src
    proto = onnx.load(str(src), load_external_data=False)
    n = _replace_mask_fill(proto, mask_fill)
    rope = _rotary_to_inputs(proto)
    onnx.save(proto, str(dst))
    inputs = [i for i in proto.graph.input]
    return {"mask_constants": n, "inv_freq": rope and rope["inv_freq"], "inputs": [i.name for i in inputs],
            "sizes": [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in inputs]}


def rope_feed(inv_freq: Sequence[float], positions: Sequence[int], scaling: float = 1.0) -> dict[str, np.ndarray]:
    """``rope_cos`` / ``rope_sin`` ``[1, len(positions), 2 * len(inv_freq)]`` as the graph computed them."""
    freqs = np.asarray(positions, np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return {"rope_cos": (np.cos(emb) * scaling)[None].astype(np.float32),
            "rope_sin": (np.sin(emb) * scaling)[None].astype(np.float32)}


def spread_positions(count: int, past: int, first: int = 1) -> list[int]:
    """``count`` decode positions spread evenly over ``[first, past]`` (the past lengths calibrated or scored)."""
    if count < 1 or past < first:
        raise ValueError(f"need count >= 1 and past >= {first}, got count {count}, past {past}")
    return sorted({int(round(p)) for p in np.linspace(first, past, count)})


# -- feeds -----------------------------------------------------------------------------------------

def _torch_run(model, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits ``[n, vocab]`` and the KV cache (``[1, kv_heads, n, head_dim]`` per layer, key then value)."""
    import torch
    from transformers import DynamicCache
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=torch.as_tensor(ids[None], device=device), past_key_values=DynamicCache(),
                    use_cache=True)
    kv = [t.float().cpu().numpy() for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    return out.logits[0].float().cpu().numpy(), kv


def _prefill_feed(ids: np.ndarray, inv_freq, scaling: float) -> dict[str, np.ndarray]:
    n = len(ids)
    return {"input_ids": ids[None].astype(np.int64), "attention_mask": np.ones((1, n), np.int64),
            **rope_feed(inv_freq, range(n), scaling)}


def _decode_feed(token: int, kv: list[np.ndarray], position: int, past: int, inv_freq,
                 scaling: float) -> dict[str, np.ndarray]:
    mask = np.zeros((1, past + 1), np.int64)
    mask[0, :position] = 1
    mask[0, -1] = 1
    feed = {"input_ids": np.array([[token]], np.int64), "attention_mask": mask,
            **rope_feed(inv_freq, [position], scaling)}
    for i in range(len(kv) // 2):
        for j, kind in enumerate(("key", "value")):
            t = kv[2 * i + j][:, :, :position]
            feed[f"past_key_values.{i}.{kind}"] = np.pad(t, ((0, 0), (0, 0), (0, past - position), (0, 0)))
    return feed


def rknn_calibration_feeds(lm, static: tuple[int, int], samples: int, inv_freq, scaling: float = 1.0,
                           text: str | Path | None = None) -> dict[str, list[dict]]:
    """Calibration inputs of the rewritten graphs: prefill windows of the calibration text, and decode
    steps at past lengths spread over ``[1, past]`` (``spread_positions``), each with the float model's KV."""
    seq, past = static
    ids = np.asarray(encode_text(lm.tokenizer, read_text(text or demo_text_path("calibration")), source="calibration"))
    return {"prefill": [_prefill_feed(c, inv_freq, scaling) for c in _chunks(ids, seq, samples)],
            "decode": [f for f, *_ in _decode_steps(lm.model, ids, past, samples, inv_freq, scaling)]}


def _decode_steps(model, ids: np.ndarray, past: int, count: int, inv_freq, scaling: float, sim_model=None):
    """(decode feed, float logits [1, vocab], simulation logits or None) at ``count`` positions spread over the past.

    Positions take turns over chunks of ``past + 1`` tokens of ``ids``; one forward pass per chunk gives
    every position's logits and (causal) the KV cache of every prefix.
    """
    chunks = _chunks(ids, past + 1, max(1, -(-count // 16)))
    positions = spread_positions(count, past)
    for c, chunk in enumerate(chunks):
        logits, kv = _torch_run(model, chunk)
        sim_logits = _torch_run(sim_model, chunk)[0] if sim_model is not None else None
        for p in positions[c::len(chunks)]:
            yield (_decode_feed(int(chunk[p]), kv, p, past, inv_freq, scaling), logits[p:p + 1],
                   None if sim_logits is None else sim_logits[p:p + 1], int(chunk[p + 1]) if p + 1 < len(chunk) else -1)


def _chunks(ids: np.ndarray, length: int, count: int) -> list[np.ndarray]:
    if len(ids) < length:
        raise RknnError(f"the text has {len(ids)} tokens, fewer than the {length} a static graph needs: give a "
                        "longer --text")
    starts = np.linspace(0, len(ids) - length, count).astype(int)
    return [ids[s:s + length] for s in sorted(set(starts.tolist()))]


# -- results ---------------------------------------------------------------------------------------

@dataclass
class RknnScores:
    """One graph on the RKNN simulator against the float model (PyTorch) and the workbench's simulation."""

    positions: int = 0
    kl_divergence: float | None = None
    top1_agreement: float | None = None
    top1_agreement_vs_simulation: float | None = None
    simulation_kl_divergence: float | None = None  # the workbench's simulation against the float model
    simulation_top1_agreement: float | None = None
    perplexity: float | None = None  # on the next tokens of the text, where the window holds them
    simulation_perplexity: float | None = None
    reference_perplexity: float | None = None  # the float model's


@dataclass
class RknnResult:
    """What ``build_rknn`` built and measured."""

    dtype: str  # w8a8, w16a16i_dfp, or float16 (no quantization)
    platform: str
    prefill: RknnScores
    decode: RknnScores
    rknn_files: dict[str, str] = field(default_factory=dict)
    rknn_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # build, simulate per graph; total
    peak_rss_bytes: int = 0  # of the toolkit's subprocess
    float_layers: list[str] = field(default_factory=list)  # kept float16 by hybrid quantization
    float_spans: int = 0  # other sub-graphs kept float16 (the queries' rotary), summed over the graphs
    not_kept: dict[str, str] = field(default_factory=dict)  # layer -> what it was built as instead
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _score(ref: np.ndarray, sim: np.ndarray, got: np.ndarray, targets: np.ndarray) -> RknnScores:
    """Mean KL(ref || got), top-1 agreements and perplexities; rows are positions, ``targets`` -1 where unknown."""
    lr, ls, lg = log_softmax(ref), log_softmax(sim), log_softmax(got)
    pr = np.exp(lr)
    kl = lambda a: float(np.clip((pr * (lr - a)).sum(-1), 0, None).mean())  # noqa: E731
    has = targets >= 0
    t = np.where(has, targets, 0)
    ppl = lambda a: float(np.exp(-np.take_along_axis(a, t[:, None], 1)[has].mean())) if has.any() else None  # noqa: E731
    top = ref.argmax(-1)
    return RknnScores(len(ref), kl(lg), float((got.argmax(-1) == top).mean()),
                      float((got.argmax(-1) == sim.argmax(-1)).mean()), kl(ls), float((sim.argmax(-1) == top).mean()),
                      ppl(lg), ppl(ls), ppl(lr))


# -- the build -------------------------------------------------------------------------------------

def _precision_choice(qm, platform: str) -> tuple[str | None, list[str], dict[str, str]]:
    """(dtype or None for float16, layers kept float by hybrid quantization, layers not kept as planned)."""
    precs = {r.name: get_precision(r.precision) for r in qm.layers if get_precision(r.precision) is not None}
    if all(p.is_float for p in precs.values()):
        return None, [], {}
    ints = {n: p for n, p in precs.items() if not p.is_float}
    if all(p.bits == 16 for p in ints.values()) and "w16a16i_dfp" in PLATFORM_DTYPES.get(platform, ()):
        return "w16a16i_dfp", [n for n, p in precs.items() if p.is_float], {}
    floats = [n for n, p in precs.items() if p.is_float]
    not_kept = {n: "int8 (w8a8)" for n, p in ints.items() if p.bits != 8 or p.two_level or p.group_size}
    return "w8a8", floats, not_kept


def _float_outputs(graph_path: Path, tensors: Mapping[str, str], layers: Sequence[str]) -> dict[str, str]:
    """ONNX output of each listed layer's MatMul (the worker keeps those float16): output -> layer."""
    import onnx
    proto = onnx.load(str(graph_path), load_external_data=False)
    consumers: dict[str, list] = {}
    for n in proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    found = {}
    for layer in layers:
        for node in consumers.get(tensors.get(layer), []):
            if node.op_type in ("MatMul", "Gemm"):
                found[node.output[0]] = layer
                break
    return found


def rotary_spans(graph_path: Path) -> list[list[str]]:
    """``[rope_cos|rope_sin, rotary Add]`` ONNX spans of the rotary, kept float16 by hybrid quantization:
    on the demo model this lifts w8a8 top-1 from 0.924 to 0.959 (prefill) and 0.906 to 0.953 (decode)."""
    import onnx
    proto = onnx.load(str(graph_path), load_external_data=False)
    consumers: dict[str, list] = {}
    for n in proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    spans = []
    for source in ("rope_cos", "rope_sin"):
        frontier = [source]
        for _ in range(3):  # Unsqueeze, (Mul by the rope scaling), then the Mul with q or k
            nxt = []
            for t in frontier:
                for n in consumers.get(t, []):
                    if n.op_type == "Add":
                        spans.append([source, n.output[0]])
                    else:
                        nxt += list(n.output)
            frontier = nxt
        for t in frontier:
            for n in consumers.get(t, []):
                if n.op_type == "Add":
                    spans.append([source, n.output[0]])
    # prefill's key rotary ends in the KV output: kept float16 there, rknn-toolkit2 2.5.0's compiler aborts
    # ("Conv bias scale ... is empty"); decode's goes through a Concat with the past and is kept
    return sorted({tuple(s) for s in spans if not s[1].startswith("present.")})


def _write_feeds(folder: Path, feeds: Sequence[Mapping[str, np.ndarray]], inputs: Sequence[str]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, feed in enumerate(feeds):
        p = folder / f"{k:04d}.npz"
        np.savez(p, **{n: feed[n] for n in inputs})
        paths.append(str(p))
    return paths


def _write_dataset(folder: Path, feeds: Sequence[Mapping[str, np.ndarray]], inputs: Sequence[str]) -> Path:
    """The toolkit's dataset file: one line per sample listing one ``.npy`` per input."""
    lines = []
    for k, feed in enumerate(feeds):
        d = folder / f"{k:03d}"
        d.mkdir(parents=True, exist_ok=True)
        files = []
        for name in inputs:
            np.save(d / f"{name}.npy", feed[name])
            files.append(str((d / f"{name}.npy").resolve()))
        lines.append(" ".join(files))
    path = folder / "dataset.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def build_rknn(prep, out_dir: str | Path, *, static: tuple[int, int] = (128, 511), platform: str = PLATFORM,
               float16: bool = False, calibration_samples: int = 16, eval_windows: int = 4, decode_positions: int = 64,
               text: str | Path | None = None, calibration_text: str | Path | None = None,
               timeout: float = DEFAULT_TIMEOUT, say=None, export=None, algorithm: str = "normal",
               calibration: dict[str, list[dict]] | None = None, keep_rotary_float: bool = True) -> RknnResult:
    """Export (unless ``export`` is given), rewrite, build, simulate and score ``prep`` (``PreparedModels``).

    Prefill: ``eval_windows`` windows of ``static[0]`` held-out tokens, every position scored.
    Decode: ``decode_positions`` steps spread over the past, each fed the float model's KV cache
    (teacher forced), so the decode graph's own error is measured at every past length.
    """
    from ..onnx.export import export_onnx
    say = say or (lambda m: None)
    py = rknn_python()
    if py is None:
        raise RknnError(f"rknn-toolkit2 is not set up here: {RKNN_ENV_HINT}")
    lm, sim = prep.float_lm, prep.sim_lm
    layers = len(lm.model.model.layers)
    if layers >= STALL_LAYERS:
        raise RknnError(f"{layers} blocks: rknn-toolkit2 2.5.0 stalls (> 14 min) in a graph-optimisation pass from "
                        f"{STALL_LAYERS} blocks; build per block (a model cut to fewer layers per graph) or use "
                        "Rockchip's RKLLM toolkit for whole LLMs")
    dtype, float_layers, not_kept = (None, [], {}) if float16 else _precision_choice(prep.qm, platform)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seq, past = static
    if export is None:
        say("exporting static graphs for the RKNN toolkit")
        export = export_onnx(lm, out, static=static, check=False)
    graphs = {"prefill": Path(export.prefill_path), "decode": Path(export.decode_path)}
    specs = {name: prepare_rknn_graph(path) for name, path in graphs.items()}
    inv_freq = specs["prefill"]["inv_freq"]
    if inv_freq is None:
        raise RknnError("the graph has no Cos/Sin rotary sub-graph to feed as inputs: export it with "
                        "`workbench export --static SEQ,PAST` (plain rotary)")
    scaling = float(getattr(lm.model.model.rotary_emb, "attention_scaling", 1.0))
    (out / "rope_inv_freq.json").write_text(json.dumps({"inv_freq": inv_freq, "attention_scaling": scaling}))
    tok = lm.tokenizer
    work = owned_tempdir(TEMP_KIND)  # a killed run's is removed here, by the next one
    result = RknnResult(dtype or "float16", platform, RknnScores(), RknnScores(), not_kept=not_kept)
    try:
        say("calibration and evaluation inputs (the float model's KV cache for decode)")
        calib = calibration or rknn_calibration_feeds(lm, static, calibration_samples, inv_freq, scaling,
                                                      calibration_text)
        eval_ids = np.asarray(encode_text(tok, read_text(text or demo_text_path("heldout")), source="held-out"))
        feeds = {name: {"calib": calib[name], "eval": []} for name in graphs}
        refs: dict[str, list] = {"prefill": [], "decode": []}
        sims: dict[str, list] = {"prefill": [], "decode": []}
        targets: dict[str, list] = {"prefill": [], "decode": []}
        for chunk in _chunks(eval_ids, seq, eval_windows):
            feeds["prefill"]["eval"].append(_prefill_feed(chunk, inv_freq, scaling))
            refs["prefill"].append(_torch_run(lm.model, chunk)[0])
            sims["prefill"].append(_torch_run(sim.model, chunk)[0])
            targets["prefill"].append(np.append(chunk[1:], -1))
        for feed, logits, sim_logits, target in _decode_steps(lm.model, eval_ids, past, decode_positions, inv_freq, scaling,
                                                      sim.model):
            feeds["decode"]["eval"].append(feed)
            refs["decode"].append(logits)
            sims["decode"].append(sim_logits)
            targets["decode"].append(np.array([target]))
        request = {"platform": platform, "work": str(work), "graphs": []}
        float_outputs: dict[str, dict[str, str]] = {}
        for name, path in graphs.items():
            inputs = specs[name]["inputs"]
            outputs = _float_outputs(path, export.weight_names, float_layers) if dtype and float_layers else {}
            float_outputs[name] = outputs
            request["graphs"].append({
                "name": name, "onnx": str(path.resolve()), "inputs": inputs, "sizes": specs[name]["sizes"],
                "quantize": dtype is not None, "dtype": dtype or "w8a8", "algorithm": algorithm,
                "float_outputs": list(outputs),
                "float_spans": [list(x) for x in rotary_spans(path)] if dtype and keep_rotary_float else [],
                "dataset": str(_write_dataset(work / "calib" / name, feeds[name]["calib"], inputs)),
                "rknn": str((out / f"{name}.rknn").resolve()),
                "feeds": _write_feeds(work / "eval" / name, feeds[name]["eval"], inputs),
                "logits_dir": str(work / "logits" / name)})
        say(f"building and simulating with rknn-toolkit2 ({result.dtype}, {platform}); its log: "
            f"{out / 'rknn_build.log'}")
        response = _run_worker(py, request, work, out / "rknn_build.log", timeout, layers)
        result.peak_rss_bytes = int(response.get("peak_rss_bytes", 0))
        for g in response["graphs"]:
            if not g["ok"]:
                raise RknnError(f"rknn-toolkit2 could not build the {g['name']} graph: {g['error']} (log: "
                                f"{out / 'rknn_build.log'})")
            got = np.concatenate([np.load(p).reshape(-1, np.load(p).shape[-1]) for p in g["logits"]])
            ref = np.concatenate([r.reshape(-1, r.shape[-1]) for r in refs[g["name"]]])
            simr = np.concatenate([r.reshape(-1, r.shape[-1]) for r in sims[g["name"]]])
            if g["name"] == "decode":
                got = got.reshape(len(ref), -1, ref.shape[-1])[:, -1]
            setattr(result, g["name"], _score(ref, simr, got, np.concatenate(targets[g["name"]])))
            result.rknn_files[g["name"]] = str(out / f"{g['name']}.rknn")
            kept = {float_outputs[g["name"]][o] for o in g.get("float_kept", [])}
            result.float_spans += int(g.get("float_spans", 0))
            result.float_layers = sorted(set(result.float_layers) | kept)
            result.rknn_bytes += int(g["rknn_bytes"])
            for k, v in g["seconds"].items():
                result.seconds[f"{g['name']}.{k}"] = round(v, 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for layer in float_layers:
        if layer not in result.float_layers:
            result.not_kept.setdefault(layer, "int8 (w8a8): the toolkit's hybrid quantization could not keep it "
                                              "float16 (embedding lookups are quantized with the table)")
    not_kept = result.not_kept
    if not_kept:
        result.notes.append(f"{len(not_kept)} layer(s) built at int8 (rk3588 has w8a8 and w16a16i_dfp only): "
                            + ", ".join(list(not_kept)[:4]) + ("..." if len(not_kept) > 4 else ""))
    if result.float_spans:
        result.notes.append(f"{result.float_spans} rotary sub-graph(s) kept float16 by hybrid quantization (in "
                            "prefill the keys' rotary, which ends in the KV output, stays int8: kept float it aborts "
                            "the toolkit's compiler)")
    result.notes.append("the toolkit quantizes the float weights itself (its own per-channel scales); the graphs "
                        "take rope_cos/rope_sin [1, seq, head_dim] instead of position_ids (rope_inv_freq.json), "
                        f"and the mask fill is {MASK_FILL:g}")
    return result


def _run_worker(py: Path, request: dict, work: Path, log: Path, timeout: float, layers: int) -> dict:
    req, res = work / "request.json", work / "result.json"
    req.write_text(json.dumps(request))
    env = {**os.environ, "PYTHONPATH": str(STUB)}
    with open(log, "w") as f:
        try:
            status = run_killable([str(py), "-P", str(WORKER), str(req), str(res)], stdout=f,
                                  stderr=subprocess.STDOUT, env=env, cwd=work, timeout=timeout)
        except subprocess.TimeoutExpired:
            why = (f"its graph optimisation stalls from {STALL_LAYERS} blocks: build per block (fewer layers per "
                   "graph)" if layers >= STALL_LAYERS else "w8a8 calibration and hybrid quantization's passes over "
                   f"wide layers (a large vocabulary) are slow on a busy CPU: give more time (${TIMEOUT_VAR}=SECONDS "
                   "or timeout=), or build float16 (float16=True), or build per block")
            raise RknnError(f"rknn-toolkit2 did not finish in {timeout:g} s ({layers} blocks) and was stopped; "
                            f"{why}") from None
    if not res.is_file():
        raise RknnError(f"the rknn-toolkit2 subprocess exited with status {status} and no result; see {log}")
    return read_worker_result(res, [g["name"] for g in request.get("graphs", [])], work, log)


def read_worker_result(res: Path, graphs: Sequence[str], work: Path, log: Path) -> dict:
    """The worker's ``result.json``, refused in one line (naming it and the log) unless it is what the worker
    writes: every graph asked for, each ``ok`` with its logits files inside ``work``, or its error."""
    def bad(what: str) -> RknnError:
        return RknnError(f"the rknn-toolkit2 subprocess left an unusable result ({res}: {what}); see {log}")
    try:
        doc = json.loads(res.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad("empty" if not res.stat().st_size else f"not JSON, {e}") from None
    found = doc.get("graphs") if isinstance(doc, dict) else None
    if not isinstance(found, list) or not all(isinstance(g, dict) and isinstance(g.get("name"), str) for g in found):
        raise bad("no list of graphs")
    names = [g["name"] for g in found]
    if sorted(names) != sorted(graphs):
        raise bad(f"graphs {', '.join(names) or 'none'} where {', '.join(graphs)} were built; the toolkit stopped "
                  "part way")
    root = work.resolve()
    for g in found:
        if not g.get("ok"):
            g["ok"], g["error"] = False, str(g.get("error") or "no error given")
            continue
        logits = g.get("logits")
        if (not isinstance(logits, list) or not logits or not isinstance(g.get("rknn_bytes"), int)
                or not isinstance(g.get("seconds"), dict)
                or not all(isinstance(p, str) and Path(p).resolve().is_relative_to(root) and Path(p).is_file()
                           for p in logits)):
            raise bad(f"the {g['name']} graph has no logits files in its work folder, size or times")
    return doc


@dataclass
class RknnMeasurement:
    """``measure_rknn``'s typed result, for benchmarks (bench/devices_gap.py)."""

    model: str
    dtype: str
    prefill: RknnScores
    decode: RknnScores
    rknn_bytes: int
    seconds: float  # build + simulate + scoring, wall clock
    toolkit_seconds: dict[str, float]
    peak_rss_bytes: int  # the toolkit subprocess's peak resident memory
    process_peak_rss_bytes: int  # this (calling) process's peak so far: the float and simulated models, the feeds
    notes: list[str]


def measure_rknn(model, *, bits: int | None = 8, plan=None, float16: bool = False, out_dir: str | Path | None = None,
                 static: tuple[int, int] = (128, 511), decode_positions: int = 64, eval_windows: int = 4,
                 timeout: float = DEFAULT_TIMEOUT, prepared=None) -> RknnMeasurement:
    """Build and simulate ``model`` for rk3588; KL / top-1 per graph, ``.rknn`` size, time and peak memory."""
    prep = prepared or prepare_models(model, plan=plan, bits=None if plan is not None else bits)
    out = Path(out_dir) if out_dir else owned_tempdir(f"{TEMP_KIND}-out")
    t0 = time.perf_counter()
    try:
        r = build_rknn(prep, out, static=static, float16=float16, decode_positions=decode_positions,
                       eval_windows=eval_windows, timeout=timeout)
    finally:
        if out_dir is None:
            shutil.rmtree(out, ignore_errors=True)
    return RknnMeasurement(str(model), r.dtype, r.prefill, r.decode, r.rknn_bytes, time.perf_counter() - t0,
                           r.seconds, r.peak_rss_bytes,
                           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, r.notes)


# -- the bundle (what runs without the toolkit here) -----------------------------------------------

SCRIPT = '''"""Build RKNN models from the workbench's static graphs. Run where rknn-toolkit2 is installed:
    python build_rknn.py [--platform rk3588]

The graphs take rope_cos / rope_sin [1, seq, head_dim] (cos/sin of position x inv_freq, duplicated;
rope_inv_freq.json) instead of position_ids, and use a finite causal-mask fill.
"""
import argparse

from rknn.api import RKNN

GRAPHS = {graphs!r}

parser = argparse.ArgumentParser()
parser.add_argument("--platform", default="{platform}")
args = parser.parse_args()
for name, spec in GRAPHS.items():
    rknn = RKNN(verbose=False)
    rknn.config(target_platform=args.platform, quantized_dtype="{dtype}", quantized_algorithm="normal",
                optimization_level=3)
    if rknn.load_onnx(model=spec["onnx"], inputs=spec["inputs"], input_size_list=spec["sizes"]) != 0:
        raise SystemExit(f"load_onnx failed for {{name}}")
    if rknn.build(do_quantization=True, dataset=spec["dataset"]) != 0:
        raise SystemExit(f"build failed for {{name}}")
    rknn.export_rknn(f"{{name}}.rknn")
    rknn.release()
'''


def write_rknn_bundle(out_dir: str | Path, graphs: Mapping[str, Path],
                      feeds: Mapping[str, Sequence[Mapping[str, np.ndarray]]], *, platform: str = PLATFORM,
                      dtype: str = "w8a8") -> dict:
    """Write ``build_rknn.py`` and ``dataset_<graph>.txt`` (+ ``.npy`` inputs) for static ``graphs``."""
    import onnx
    out = Path(out_dir)
    spec = {}
    for name, path in graphs.items():
        proto = onnx.load(str(path), load_external_data=False)
        init = {i.name for i in proto.graph.initializer}
        inputs = [vi for vi in proto.graph.input if vi.name not in init]
        lines = []
        for k, feed in enumerate(feeds[name]):
            d = out / "calibration" / name / f"{k:03d}"
            d.mkdir(parents=True, exist_ok=True)
            files = []
            for vi in inputs:
                f = d / f"{vi.name}.npy"
                np.save(f, feed[vi.name])
                files.append(str(f.relative_to(out)))
            lines.append(" ".join(files))
        (out / f"dataset_{name}.txt").write_text("\n".join(lines) + "\n")
        spec[name] = {"onnx": Path(path).name, "inputs": [vi.name for vi in inputs],
                      "sizes": [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in inputs],
                      "dataset": f"dataset_{name}.txt"}
    script = out / "build_rknn.py"
    script.write_text(SCRIPT.format(graphs=spec, platform=platform, dtype=dtype))
    return {"commands": str(script), "notes": [f"quantized_dtype {dtype} for {platform}"]}


def _fill_report(job, r: RknnResult) -> None:
    rep = job.report
    p, d = r.prefill, r.decode
    rep.runnable = True
    rep.measured_on = r.rknn_files.get("prefill")
    rep.kl_divergence, rep.top1_agreement = p.kl_divergence, p.top1_agreement
    rep.top1_agreement_vs_simulation = p.top1_agreement_vs_simulation
    rep.perplexity, rep.reference_perplexity = p.perplexity, p.reference_perplexity
    rep.simulation = {"kl_divergence": p.simulation_kl_divergence, "top1_agreement": p.simulation_top1_agreement,
                      "perplexity": p.simulation_perplexity}
    rep.eval_tokens, rep.ctx = p.positions, job.static[0]
    rep.details["rknn"] = r.to_dict()
    low = [f"{name} {s.top1_agreement_vs_simulation:.3f}" for name, s in (("prefill", p), ("decode", d))
           if s.top1_agreement_vs_simulation < GAP_TOP1]
    if low:
        rep.gap = (f"top-1 agreement of the RKNN simulator with the workbench's simulation is {', '.join(low)} "
                   f"(< {GAP_TOP1}): the toolkit quantizes differently from the plan")
    rep.notes += r.notes
    rep.notes.append(f"RKNN simulator ({r.dtype}, {r.platform}): prefill KL {p.kl_divergence:.4f}, top-1 vs float "
                     f"{p.top1_agreement:.3f}, vs simulation {p.top1_agreement_vs_simulation:.3f} ({p.positions} "
                     f"positions); decode KL {d.kl_divergence:.4f}, top-1 vs float {d.top1_agreement:.3f}, vs "
                     f"simulation {d.top1_agreement_vs_simulation:.3f} ({d.positions} steps over the past)")


def convert_rknn(job) -> None:
    """The rewritten static graphs, calibration data and ``build_rknn.py``; where the toolkit's venv exists,
    the ``.rknn`` models built, simulated and scored too (a failed build is said in the notes)."""
    sx = job.export_static(job.out)
    rotary = job.prep.float_lm.model.model.rotary_emb
    inv_freq = rotary.inv_freq.float().cpu().numpy().tolist()
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    feeds = rknn_calibration_feeds(job.prep.float_lm, job.static, job.calibration_samples, inv_freq, scaling)
    result = None
    if rknn_python() is None:
        for path in (sx.prefill_path, sx.decode_path):
            prepare_rknn_graph(path)
        job.report.notes.append(f"rknn-toolkit2 is not set up, so no .rknn was built: {RKNN_ENV_HINT}; then convert "
                                "again to build and simulate it")
    else:
        try:
            result = build_rknn(job.prep, job.out, static=job.static, calibration_samples=job.calibration_samples,
                                text=job.text, say=job.say, export=sx, calibration=feeds, decode_positions=128,
                                timeout=timeout_setting(TIMEOUT_VAR, DEFAULT_TIMEOUT))
        except RknnError as e:
            job.report.notes.append(f"no .rknn: {e}")
            job.report.details["rknn"] = {"error": str(e)}
    dtype = result.dtype if result is not None and result.dtype != "float16" else "w8a8"
    info = write_rknn_bundle(job.out, {"prefill": sx.prefill_path, "decode": sx.decode_path}, feeds, dtype=dtype)
    job.report.notes += info["notes"]
    job.report.details["inspection"] = inspect_graph(sx.prefill_path, "rknn").summary()
    if result is not None:
        _fill_report(job, result)


TARGET = register_target(Target("rknn", "Rockchip RKNPU2", rules="rknn", convert=convert_rknn, module=__name__,
                                options=("static",), check_setup=check_rknn_setup))
