"""MNN, ``mnn``: convert an ONNX graph to ``.mnn`` with the MNN Python package, run it, and write llmexport's config.

    convert_to_mnn("sim/prefill.onnx", "mnn/prefill.mnn", weight_bits=4, block_size=128)
    runner = MnnCausalLM("mnn/prefill.mnn"); logits = runner.logits(ids)
    write_mnn_quant_config("mnn.json", lm, plan)     # llmexport.py --quant_config mnn.json

The converter is the package's compiled extension (``_tools.mnnconvert``), called directly:
``MNN.tools.mnnconvert`` (what the ``mnnconvert`` command runs) installs a logging SDK with pip
and sends usage data on import, which nothing here may do.

Weights: MNN re-quantizes float weights itself (``--weightQuantBits``, per block of
``--weightQuantBlock``). Fed the workbench's simulated (already dequantized) weights with the
same bits and block, its asymmetric (min/max) mode reproduces them exactly (measured: zero
difference on a 4-bit grid), while its symmetric mode rescales and moves codes (about 5% of the
weight range). It applies to every MatMul with constant weights, including layers a plan keeps
in float (for example a tied ``lm_head``) unless ``keep_matmul_weights_float`` gives those weights
a leading batch axis of 1: MNN leaves batched constant MatMul operands in float (measured), and
the product is unchanged by broadcasting.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import ModelLoadError, PlanError, WorkbenchError
from ..onnx.export import export_onnx
from ..model.load import LoadedModel
from ..quantize.plan import QuantPlan, get_precision
from ..quantize.model import resolve_group_size
from ..files.workspace import atomic_write_json
from .common import OverrideFile, block_role, half_layers, layer_precisions, native_output_to, read_json_object
from .registry import OverrideFormat, Target, check_precisions, register_target

__all__ = ["convert_to_mnn", "MnnCausalLM", "mnn_command_line", "keep_matmul_weights_float", "mnn_op_name",
           "run_mnnconvert", "mnn_weight_args", "quiet_fds", "mnn_quant_config", "write_mnn_quant_config", "read_mnn_quant_config", "convert_mnn", "open_mnn", "TARGET"]


def mnn_command_line(onnx_path: str | Path, mnn_path: str | Path, weight_bits: int | None = None,
                     block_size: int | None = None, asymmetric: bool = False, *, source: str = "ONNX",
                     extra: list[str] | None = None) -> list[str]:
    """The MNNConvert arguments (also valid for the ``MNNConvert`` binary built from MNN's sources); ``source``
    is the input's format (``ONNX``, or ``JSON``: the converter's own JSON form of a graph)."""
    args = ["mnnconvert", "-f", source, "--modelFile", str(onnx_path), "--MNNModel", str(mnn_path),
            "--bizCode", "workbench"] + list(extra or [])
    if weight_bits:
        args += ["--weightQuantBits", str(weight_bits)]
        if block_size:
            args += ["--weightQuantBlock", str(block_size)]
        if asymmetric:
            args.append("--weightQuantAsymmetric")
    return args


def keep_matmul_weights_float(onnx_path: str | Path, out_path: str | Path, initializers: list[str]) -> list[str]:
    """Reshape the named 2-D MatMul weights to ``[1, K, N]`` so ``--weightQuantBits`` leaves them in float.

    Weights in external data keep their bytes (the shape is all that changes), so ``out_path`` must sit
    in the same folder as ``onnx_path`` to find them.
    """
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data
    proto = onnx.load(str(onnx_path), load_external_data=False)
    wanted = set(initializers)
    users: dict[str, list] = {}
    for node in proto.graph.node:
        for i, x in enumerate(node.input):
            if x in wanted:
                users.setdefault(x, []).append((node, i))
    kept = []
    for init in proto.graph.initializer:
        if init.name in wanted and len(init.dims) == 2 and all(n.op_type == "MatMul" and i == 1
                                                                for n, i in users.get(init.name, [])):
            if uses_external_data(init):
                dims = list(init.dims)
                del init.dims[:]
                init.dims.extend([1] + dims)
            else:
                init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init)[None], init.name))
            kept.append(init.name)
    Path(out_path).write_bytes(proto.SerializeToString())
    return kept


def quiet_fds():
    """The converter prints from C++ straight to file descriptors 1 and 2; keep that out of CLI/JSON output."""
    return native_output_to(os.devnull)


def _converter():
    try:
        with quiet_fds():  # importing the extension prints the CPU's features to stdout
            import _tools  # the MNN wheel's converter extension
    except ImportError:
        raise WorkbenchError("the MNN converter is not available: install the MNN package "
                             "(pip install -c constraints.txt MNN)") from None
    return _tools


def run_mnnconvert(args: list[str], quiet: bool = True) -> None:
    """MNN's converter in-process with ``args`` (its command line), its printing kept out of the output."""
    tools = _converter()
    ctx = quiet_fds() if quiet else contextlib.nullcontext()
    with ctx, contextlib.redirect_stdout(io.StringIO()):
        tools.mnnconvert(args)


def convert_to_mnn(onnx_path: str | Path, mnn_path: str | Path, *, weight_bits: int | None = None,
                   block_size: int | None = None, asymmetric: bool = False, quiet: bool = True,
                   source: str = "ONNX", extra: list[str] | None = None) -> Path:
    """Run MNN's converter in-process on an ONNX (or ``source``) graph; the output is written atomically."""
    out = Path(mnn_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    tmp.unlink(missing_ok=True)
    tmp.with_name(tmp.name + ".weight").unlink(missing_ok=True)
    out.with_name(out.name + ".weight").unlink(missing_ok=True)  # a stale one would be read as this model's
    args = mnn_command_line(onnx_path, tmp, weight_bits, block_size, asymmetric, source=source, extra=extra)
    run_mnnconvert(args, quiet)
    if not tmp.is_file() or tmp.stat().st_size == 0:
        raise WorkbenchError(f"MNN's converter wrote nothing for '{onnx_path}'; run `{' '.join(args)}` to see why")
    weights = tmp.with_name(tmp.name + ".weight")  # MNN's converter puts the weights of large models beside it
    if weights.is_file():
        weights.replace(out.with_name(out.name + ".weight"))
    tmp.replace(out)
    return out


def _load_graph(nn, path: Path, inputs: list[str], outputs: list[str], rt, what: str):
    """One .mnn graph; an empty, missing, truncated or foreign file refused in one line naming it."""
    again = "convert again with --target mnn"
    if not path.is_file() or path.stat().st_size == 0:
        raise ModelLoadError(f"'{path}' is {'empty' if path.is_file() else 'missing'}: {again}")
    try:  # MNN reports a file it cannot parse (truncated, not .mnn) as a SystemError with no message
        if rt is None:
            return nn.load_module_from_file(str(path), inputs, outputs)
        return nn.load_module_from_file(str(path), inputs, outputs, runtime_manager=rt)
    except (SystemError, RuntimeError):
        raise ModelLoadError(f"MNN cannot load '{path}' as {what} (a truncated file, not .mnn, or another graph): "
                             f"{again}") from None


class MnnCausalLM:
    """A converted prefill graph run by MNN's Python runtime: ``logits(ids)`` for evaluation.

    ``run_prefill`` / ``run_decode`` (the shapes of ``OnnxCausalLM``'s) drive ``prefill.mnn`` and the
    ``decode.mnn`` beside it with the KV cache, for generation.
    """

    runtime = "MNN"

    def __init__(self, mnn_path: str | Path, threads: int = 1):
        self.path, self.threads, self._graphs = Path(mnn_path), threads, None
        with quiet_fds():  # MNN prints CPU features and the precision mode to stdout
            import MNN.expr as F
            import MNN.nn as nn
            config = {"backend": "CPU", "precision": "high", "numThread": threads}
            rt = nn.create_runtime_manager((config,))
            self.module = _load_graph(nn, self.path, ["input_ids", "attention_mask", "position_ids"], ["logits"], rt,
                                      "a prefill graph taking input_ids, attention_mask and position_ids")
        self._F = F

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        F = self._F
        ids = np.asarray(input_ids, dtype=np.int32)
        b, n = ids.shape
        mask = np.ones_like(ids)
        pos = np.broadcast_to(np.arange(n, dtype=np.int32), ids.shape).copy()
        inputs = [F.const(a.flatten().tolist(), list(a.shape), F.NCHW, F.int) for a in (ids, mask, pos)]
        out = self.module.forward(inputs)[0]
        return np.array(out.read(), dtype=np.float32).reshape(b, n, -1)

    # -- prefill and decode with the KV cache (generation) -------------------------------------------
    def _const(self, a: np.ndarray):
        F = self._F
        return F.const(np.ascontiguousarray(a), list(a.shape), F.NCHW, F.float if a.dtype.kind == "f" else F.int)

    def _stepping(self):
        """Prefill and decode graphs with their ``present`` outputs, loaded on first use."""
        if self._graphs is None:
            decode = self.path.with_name(self.path.name.replace("prefill", "decode"))
            if decode == self.path or not decode.is_file():
                raise ValueError(f"no decode graph beside '{self.path}' (expected '{decode.name}'): convert again")
            with quiet_fds():
                import MNN.nn as nn
                rt = nn.create_runtime_manager(({"backend": "CPU", "precision": "high", "numThread": self.threads},))
                graphs = []
                for path in (self.path, decode):
                    info = _load_graph(nn, path, [], [], None, "a graph").get_info()
                    graphs.append(_load_graph(nn, path, info["inputNames"], info["outputNames"], rt, "a graph"))
            self._graphs = tuple(graphs)
        return self._graphs

    def _run(self, module, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(v.read(), dtype=np.float32) for v in module.forward([self._const(a) for a in arrays])]

    def run_prefill(self, prompt) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """Last-position logits, the full logits [1, n, vocab], and the KV cache."""
        n = len(prompt)
        ids = np.asarray(prompt, dtype=np.int32)[None]
        outs = self._run(self._stepping()[0], [ids, np.ones_like(ids), np.arange(n, dtype=np.int32)[None]])
        logits = outs[0].reshape(1, n, -1)
        return logits[0, -1], logits, outs[1:]

    def run_decode(self, token: int, kv: list[np.ndarray],
                   position: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """One step: logits for ``token`` at ``position``, and the grown KV cache (also the graph's present)."""
        past = kv[0].shape[2]
        feed = [np.array([[token]], np.int32), np.ones((1, past + 1), np.int32), np.array([[position]], np.int32)]
        outs = self._run(self._stepping()[1], feed + list(kv))
        return outs[0].reshape(-1, outs[0].shape[-1])[-1], outs[1:], outs[1:]


def mnn_op_name(fqn: str) -> str | None:
    """The op name MNN's ``llmexport.py`` gives a linear layer (its ``--quant_config`` keys)."""
    if fqn == "lm_head":
        return "/lm/lm_head/Linear"
    role = block_role(fqn)
    return None if role is None else f"/layers.{role[0]}/{role[1].replace('.', '/')}/Linear"


def mnn_quant_config(lm: LoadedModel, plan: QuantPlan, *, notes: list[str] | None = None) -> dict:
    """``{op name: {"bits", "block_size", "symmetric"}}`` as ``llmexport.py --quant_config`` reads it."""
    notes = notes if notes is not None else []
    precisions = layer_precisions(lm.layers, plan)
    check_precisions(TARGET, precisions, "MNN's llmexport")
    cfg = {}
    for info in lm.layers:
        prec = get_precision(precisions[info.name])
        if prec is None:
            notes.append(f"{info.name}: left unchanged by the plan; llmexport's --quant_bit applies")
            continue
        if info.kind == "embedding":
            flag = 16 if prec.is_float else prec.bits
            notes.append(f"{info.name}: embeddings are not in the quant config; pass --embed_bit {flag} to llmexport"
                         + (" (it also stores them as bf16, not fp32)" if prec.is_float and prec.bits == 32 else ""))
            continue
        op = mnn_op_name(info.name)
        if op is None:
            notes.append(f"{info.name}: no MNN op name known for this layer; not expressible")
            continue
        if prec.is_float:
            if prec.bits != 16:
                notes.append(f"{info.name}: MNN keeps float linear weights at 16 bits; {prec.name} written as 16")
            cfg[op] = {"bits": 16}
        else:
            gs, _ = resolve_group_size(info.shape[1], plan.group_size)
            cfg[op] = {"bits": prec.bits, "block_size": gs or 0, "symmetric": bool(plan.symmetric)}
        if info.tied_to is not None:
            notes.append(f"{info.name}: tied to {info.tied_to}; unless llmexport gets --seperate_embed, MNN reuses "
                         "lm_head's quantized weights for the embedding")
    if plan.symmetric:
        notes.append("pass --sym to llmexport: MNN reads symmetry for the whole model when it lays out scales")
    return cfg


def write_mnn_quant_config(path: str | Path, lm: LoadedModel, plan: QuantPlan) -> OverrideFile:
    notes: list[str] = []
    cfg = mnn_quant_config(lm, plan, notes=notes)
    p = atomic_write_json(Path(path), cfg)
    return OverrideFile(p, "mnn", len(cfg), notes,
                        f"python llmexport.py --path MODEL --export mnn --quant_config {p}"
                        + (" --sym" if plan.symmetric else ""))


def read_mnn_quant_config(path: str | Path, lm: LoadedModel) -> dict[str, str]:
    """``{layer: precision}`` from an MNN quant config."""
    doc = read_json_object(path, "MNN quant config")
    by_op = {mnn_op_name(info.name): info.name for info in lm.layers if mnn_op_name(info.name)}
    out = {}
    for op, spec in doc.items():
        if op not in by_op:
            raise PlanError(f"'{path}': op '{op}' is not a linear layer of this model")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("bits"), int):
            raise PlanError(f"'{path}': op '{op}' needs an integer 'bits'")
        out[by_op[op]] = "fp16" if spec["bits"] == 16 else f"int{spec['bits']}"
    return out

def mnn_weight_args(qm) -> tuple[int | None, int | None, list[str]]:
    """MNN's --weightQuantBits / --weightQuantBlock for a quantized model, or (None, None) when one setting
    cannot express it; plus notes."""
    qws = [q for name, q in qm.weights.items() if qm.layer(name).kind == "linear"]
    embedded = [r for r in qm.layers if r.kind == "embedding" and r.name in qm.weights]
    notes = [f"{r.name} ({r.precision} in the plan) is a Gather, which MNN's weight quantization does not cover: "
             "stored as float32 (its simulated values)" for r in embedded]
    half = half_layers(qm)
    if half:
        notes.append(f"{half}: float16 in the plan, stored as float32 in the .mnn files (MNN's converter has no "
                     "per-layer float16 weights)")
    if not qws:
        return None, None, notes + ["the plan quantizes no linear layer: MNN stores float32 weights"]
    kinds = {(q.bits, q.effective_group_size if q.group_size else None) for q in qws}
    if len(kinds) > 1:
        return None, None, notes + ["the plan mixes bit widths or group sizes, which one MNN --weightQuantBits setting "
                                    "cannot express: MNN stores the simulated weights in float32 (the simulation's "
                                    "values, not a smaller file)"]
    if qm.plan.scale_search:
        # MNN takes each block's scale from its range; a searched scale (a clipped range) is not that range, so its
        # re-quantization moves codes (int4 g128, tiny model: top-1 agreement with the simulation 0.965, not > 0.99)
        return None, None, notes + ["the plan's group ranges were searched (scale search), which MNN's re-quantization "
                                    "from each block's range does not reproduce: MNN stores the simulated weights in "
                                    "float32 (the simulation's values, not a smaller file); quantize with "
                                    "--no-scale-search for MNN's own integer weights"]
    bits, group = next(iter(kinds))
    floats = [r.name for r in qm.layers if r.name not in qm.weights and r.kind == "linear"]
    notes.append(f"MNN re-quantizes the simulated weights with --weightQuantBits {bits} --weightQuantBlock "
                 f"{group or -1} --weightQuantAsymmetric: its min/max grid over values already on the workbench's grid "
                 "reproduces them (its symmetric mode does not: it rescales and moves every code)")
    if floats:
        notes.append(f"layers the plan keeps in float ({', '.join(floats[:4])}) get a [1, K, N] weight so MNN leaves "
                     "them unquantized, in float32")
    return bits, group, notes


def convert_mnn(job) -> None:
    """The simulation exported to ONNX and converted by MNN (which re-quantizes onto the same grid), then run."""
    prep, out, report = job.prep, job.out, job.report
    job.say("exporting the simulation to ONNX")
    ex = export_onnx(prep.sim_lm, job.work / "sim", check=False)
    wb, block, notes = mnn_weight_args(prep.qm)
    report.notes += notes + ["MNN stores each graph's weights in its own .mnn file"]
    float_inits = [ex.weight_names[r.name] for r in prep.qm.layers if r.name in ex.weight_names
                   and r.name not in prep.qm.weights and ex.weight_layouts.get(r.name) == "in_out"]
    job.say("converting to MNN")
    kept: list[str] = []
    for p in (ex.prefill_path, ex.decode_path):
        src = p
        if wb and float_inits:
            src = p.with_name(f"float-kept-{p.name}")
            kept = keep_matmul_weights_float(p, src, float_inits)
        convert_to_mnn(src, out / p.with_suffix(".mnn").name, weight_bits=wb, block_size=block, asymmetric=True)
    report.details["mnn"] = {"weight_bits": wb, "block": block, "asymmetric": True, "kept_float": kept}
    job.measure(MnnCausalLM(out / "prefill.mnn", threads=2).logits, out / "prefill.mnn", "mnn")


def _write(path, lm, plan, *, quantized=None, export=None, calibration=None) -> OverrideFile:
    return write_mnn_quant_config(path, lm, plan)


def _read(path, lm, export=None) -> dict[str, str]:
    return read_mnn_quant_config(path, lm)


def open_mnn(folder: str | Path, *, threads: int | None = None) -> MnnCausalLM:
    """The prefill and decode graphs of an mnn conversion in MNN (one thread unless told)."""
    return MnnCausalLM(Path(folder) / "prefill.mnn", threads=threads or 1)


TARGET = register_target(Target(
    "mnn", "MNN", rules="mnn", convert=convert_mnn, runnable=True, runner=open_mnn,
    files=("prefill.mnn", "decode.mnn"),
    overrides=OverrideFormat("mnn", _write, _read), module=__name__,
    precision_note="MNN re-quantizes the simulated weights with one float scale per block, which reproduces the "
                   "plan's 4 and 8-bit float16-scale grids but not two-level ones (measured on the demo model, "
                   "int4-lpbq g32: KL 0.00598 against the simulation's 0.00549, top-1 vs simulation 0.984, where "
                   "int4 g32 is reproduced exactly); other widths are not carried"))
