"""TensorRT Edge-LLM, ``tensorrt-edgellm``: the plan's W4A16 model as the ONNX bundle NVIDIA's Jetson LLM path builds
engines from, holding the plan's own int4 codes and float16 group scales.

    convert("demo", "tensorrt-edgellm", "out/jetson", bits=4)   # checkpoint/, llm/ (model.onnx ...), build.sh
    bundle_weights("out/jetson/llm/model.onnx")                 # {layer: (codes [N, K], scales [N, K/g])}, read back
    check_bundle_codes("out/jetson/llm/model.onnx", qm)         # every quantized layer equals the plan's
    run_outside_plugins("out/jetson/llm", prep, ids)            # onnxruntime on every node it can run

The workbench writes the plan as the ModelOpt W4A16 checkpoint Edge-LLM's exporter reads (``weight`` two signed
4-bit codes a byte along the output axis, ``weight_scale`` ``[N, K/g]``, ``hf_quant_config.json`` naming the group
size), then runs ``tensorrt-edgellm-export`` from ``tensorrt-edgellm`` 0.11.0 in its own venv (``make edgellm-env``
writes ``.venv-edgellm``; ``WORKBENCH_EDGELLM_PYTHON`` names another python) as a subprocess. Its ONNX holds one
``Int4GroupwiseGemmPluginV2`` node per quantized layer (codes plus 8 in the cuteDSL kernel's fragment order,
scales ``[K/g, N]`` float16, dequantized as ``(nibble - 8) * scale``), ``AttentionPlugin`` nodes (rotary, paged KV
cache, attention) and plain ONNX for the rest; the embedding table is ``embedding.safetensors`` beside it.

Layouts the plugin holds (``carried_group``): symmetric 4-bit codes with one scale per group of columns (or per
channel: one group of the whole row) on layers whose both dimensions are multiples of 64 (the fragment layout's
tile). Asymmetric codes, other widths, two-level scales and minimums are refused by layer name. Float layers are
stored as float16 (Edge-LLM computes in float16).

Neither TensorRT nor the plugins install here, so no engine is built or run: ``build.sh`` in the bundle is the
one command that builds it on the Jetson (Edge-LLM's ``llm_build``). Here the bundle is checked by reading every
quantized layer back out of the ONNX (equal to the plan's codes and scales) and by running every node onnxruntime
can run (norms, SiLU, residual adds, the output layer), with the plugin nodes' outputs taken from the simulation.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import numpy as np

from ..errors import PlanError, WorkbenchError
from .processes import die_with_parent_fn
from .registry import Target, register_target
from ..assets import demo_text_path
from ..evaluation.textio import read_tokens
from .common import log_softmax

__all__ = ["carried_group", "edgellm_python", "write_checkpoint", "export_bundle", "unpack_fragment",
           "bundle_weights", "check_bundle_codes", "run_outside_plugins", "write_build_script", "convert_edgellm",
           "EdgeLlmError", "TARGET", "ENV_HINT", "TILE", "PLUGIN_DOMAIN"]

REPO = Path(__file__).resolve().parents[2]
ENV_HINT = "`make edgellm-env` (in the repository) creates .venv-edgellm with tensorrt-edgellm 0.11.0"
TILE = 64  # Int4GroupwiseGemmPluginV2's fragment layout needs N % 64 == 0 and K % 64 == 0
PLUGIN_DOMAIN = "trt_edgellm"
INT4_OP = "Int4GroupwiseGemmPluginV2"
DEFAULT_TIMEOUT = 900.0  # seconds for the exporter subprocess
CHECK_TOKENS = 128  # held-out tokens onnxruntime runs the graph outside the plugins on
LLM_DIR, CHECKPOINT_DIR, BUILD_SCRIPT = "llm", "checkpoint", "build.sh"
# the chat template Edge-LLM's exporter requires when the model's tokenizer has none: the messages' text in order
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# the fragment order of one 32-bit word: (bit shift, upper 32 rows of the 64, column offset), as the exporter packs it
_NIBBLES = ((0, False, 0), (4, False, 8), (8, True, 0), (12, True, 8),
            (16, False, 1), (20, False, 9), (24, True, 1), (28, True, 9))
_BN, _BK, _THREADS = 128, 64, 128


class EdgeLlmError(WorkbenchError):
    """Edge-LLM's exporter failed, timed out, or is not set up."""


def edgellm_python() -> Path | None:
    """The Edge-LLM venv's python (``WORKBENCH_EDGELLM_PYTHON``, else ``.venv-edgellm`` in the repository), or None."""
    env = os.environ.get("WORKBENCH_EDGELLM_PYTHON")
    py = Path(env) if env else REPO / ".venv-edgellm" / "bin" / "python"
    return py if py.is_file() and os.access(py, os.X_OK) else None


def carried_group(name: str, qw) -> int:
    """The group size the plugin holds a quantized layer with (the whole row when per channel); a one-line
    PlanError naming the layer and its layout when the plugin cannot hold it."""
    out, inp = qw.shape
    group = qw.group_size if qw.group_size and qw.group_size < inp else inp
    what = f"{qw.bits}-bit " + (f"per-{qw.group_size}" if qw.group_size and qw.group_size < inp else "per-channel")
    if not qw.symmetric or qw.zeros is not None:
        why = "the int4 plugin dequantizes (code - 8) * scale: symmetric codes, no zero points"
        what += " asymmetric"
    elif qw.two_level or qw.mins is not None or qw.super_block:
        why = "the int4 plugin takes one float16 scale per group"
        what += " two-level / minimum"
    elif qw.bits != 4:
        why = "Edge-LLM's W4A16 path holds 4-bit codes only"
    elif out % TILE or inp % TILE:
        why = f"the plugin's fragment layout needs both dimensions a multiple of {TILE} (this is {out} x {inp})"
    elif inp % group:
        why = f"its {inp} columns are not whole groups of {group}"
    else:
        return group
    raise PlanError(f"tensorrt-edgellm cannot hold layer '{name}' as {what} codes: {why}; give it symmetric int4 "
                    "per group or per channel, or keep it float (e.g. `workbench quantize MODEL --bits 4 --out Q`, "
                    "then convert Q)")


# -- the checkpoint Edge-LLM's exporter reads ---------------------------------------------------------------------

def _pack_rows(codes) -> "torch.Tensor":
    """Signed 4-bit codes ``[N, K]`` as ModelOpt packs them: two's complement nibbles, row 2i low, row 2i+1 high."""
    import torch
    c = codes.to(torch.int16) & 0xF
    return (c[0::2] | (c[1::2] << 4)).to(torch.uint8).contiguous()


def write_checkpoint(prep, folder: str | Path) -> dict:
    """The plan as a ModelOpt W4A16 checkpoint in ``folder`` (``model.safetensors``, ``config.json``,
    ``hf_quant_config.json``, the tokenizer): what ``tensorrt-edgellm-export`` reads. Returns what it holds."""
    import torch
    from safetensors.torch import save_file
    qm, lm = prep.qm, prep.sim_lm
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    groups, quantized, embedded = set(), [], []
    for name, qw in qm.weights.items():
        if qm.layer(name).kind == "linear":
            groups.add(carried_group(name, qw))
    if len(groups) > 1:  # hf_quant_config.json's W4A16 names one group size for the whole checkpoint
        raise PlanError(f"tensorrt-edgellm holds one group size per model; the plan has {sorted(groups)}: give every "
                        "int4 layer the same group size")
    tensors = {}
    for name, qw in qm.weights.items():  # the plan's layers, from its integers (not the module's buffers)
        if qm.layer(name).kind == "linear":
            tensors[name + ".weight"] = _pack_rows(qw.qweight)
            tensors[name + ".weight_scale"] = qw.scales.float().contiguous()
            quantized.append(name)
        else:  # a quantized embedding: its dequantized values, looked up in float16
            tensors[name + ".weight"] = qw.dequantize().half().contiguous()
            embedded.append(name)
    for key, value in lm.model.state_dict().items():  # everything else the simulation holds in float
        if key not in tensors and value.is_floating_point():
            tensors[key] = value.detach().half().contiguous().clone()
    config = lm.model.config.to_dict()
    if getattr(lm.model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied: Edge-LLM ties it to the embedding itself
    config.pop("quantization_config", None)
    config["dtype"] = config["torch_dtype"] = "float16"
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    group = groups.pop() if groups else 128
    # float linear layers (a tied output layer included) are excluded by name: the exporter's W4A16 fallback would
    # otherwise make any linear layer int4, weights or not
    floats = sorted(n for n, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear) and n not in qm.weights)
    (folder / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "workbench"},
        "quantization": {"quant_algo": "W4A16_AWQ", "group_size": group, "exclude_modules": floats}}, indent=2))
    lm.tokenizer.save_pretrained(str(folder))
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    if not tc.get("chat_template") and not getattr(lm.tokenizer, "chat_template", None):
        tc["chat_template"] = PLAIN_CHAT_TEMPLATE  # the exporter refuses a tokenizer without one
        tc_path.write_text(json.dumps(tc, indent=2))
    return {"group_size": group, "quantized_layers": len(quantized), "float_layers": floats,
            "dequantized_embeddings": embedded}


def export_bundle(ckpt: str | Path, out: str | Path, *, timeout: float = DEFAULT_TIMEOUT,
                  python: Path | None = None) -> dict:
    """``tensorrt-edgellm-export CKPT OUT`` in the Edge-LLM venv (a subprocess that dies with this process); its
    log is ``OUT/export.log``. Returns the seconds it took."""
    py = python or edgellm_python()
    if py is None:
        raise EdgeLlmError(f"tensorrt-edgellm is not installed: {ENV_HINT}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "export.log"
    code = "import sys; from tensorrt_edgellm.scripts.export import main; sys.argv[0] = 'tensorrt-edgellm-export'; main()"
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run([str(py), "-c", code, str(Path(ckpt).resolve()), str(out.resolve())], stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout, preexec_fn=die_with_parent_fn(), cwd=out)
        except subprocess.TimeoutExpired:
            raise EdgeLlmError(f"tensorrt-edgellm-export did not finish in {timeout:.0f} s; see {log}") from None
    if proc.returncode != 0 or not (out / LLM_DIR / "model.onnx").is_file():
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise EdgeLlmError(f"tensorrt-edgellm-export exited with status {proc.returncode}: {tail[0].strip()[:200]}; "
                           f"see {log}")
    return {"export_seconds": time.perf_counter() - t, "log": str(log)}


# -- reading the bundle back ---------------------------------------------------------------------------------------

def _fragment_index(n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every nibble of the fragment buffer: (row, word, shift) and the [N, K] position it holds (flat)."""
    num_n, num_k, kn = -(-n // _BN), -(-k // _BK), (_BK // 16) * (_BN // 64)
    nb, kt = np.meshgrid(np.arange(num_n), np.arange(num_k), indexing="ij")
    rows, words, shifts, flat = [], [], [], []
    for t in range(_THREADS):
        n_base, kb = t // 4, 2 * (t % 4)
        for kbl in range(_BK // 16):
            for p in range(_BN // 64):
                row = (nb * num_k + kt) * kn + kbl * (_BN // 64) + p
                n_lo = nb * _BN + n_base + 64 * p
                k0 = kt * _BK + 16 * kbl + kb
                for shift, hi, koff in _NIBBLES:
                    rows.append(row.ravel())
                    words.append(np.full(row.size, t))
                    shifts.append(np.full(row.size, shift))
                    nn, kk = (n_lo + 32 if hi else n_lo).ravel(), (k0 + koff).ravel()
                    flat.append(np.where((nn < n) & (kk < k), nn * k + kk, -1))
    return tuple(np.concatenate(a) for a in (rows, words, shifts, flat))


def unpack_fragment(buf: np.ndarray, n: int, k: int) -> np.ndarray:
    """The biased 4-bit nibbles ``[n, k]`` (code + 8) of an ``Int4GroupwiseGemmPluginV2`` weight ``[rows, 512]``
    int8: the inverse of the exporter's cuteDSL fragment packing (128-row by 64-column tiles)."""
    words = np.ascontiguousarray(buf).view(np.uint32).reshape(-1, _THREADS)
    rows, cols, shifts, flat = _fragment_index(n, k)
    if rows.max(initial=0) >= words.shape[0]:
        raise WorkbenchError(f"an int4 plugin weight of {words.shape[0]} rows cannot hold a {n} x {k} layer")
    keep = flat >= 0
    out = np.full(n * k, -1, dtype=np.int16)
    out[flat[keep]] = (words[rows[keep], cols[keep]] >> shifts[keep].astype(np.uint32)) & 0xF
    return out.reshape(n, k)


def _layer_of(initializer: str) -> str:
    """``_model.model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``."""
    name = initializer[len("_model."):] if initializer.startswith("_model.") else initializer
    return name.rsplit(".", 1)[0]


def bundle_weights(onnx_path: str | Path) -> dict[str, dict]:
    """Every ``Int4GroupwiseGemmPluginV2`` layer of the bundle, read back from its ONNX and external data:
    ``{layer: {"codes": int8 [N, K], "scales": float16 [N, K/g], "group_size": g, "pre_quant_scale": ... or None}}``."""
    import onnx
    from onnx import numpy_helper
    path = Path(onnx_path)
    model = onnx.load(str(path), load_external_data=True)
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.domain != PLUGIN_DOMAIN or node.op_type != INT4_OP:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        n, k, g = int(attrs["gemm_n"]), int(attrs["gemm_k"]), int(attrs["group_size"])
        w, s = numpy_helper.to_array(inits[node.input[1]]), numpy_helper.to_array(inits[node.input[2]])
        nibbles = unpack_fragment(w, n, k)
        out[_layer_of(node.input[1])] = {"codes": (nibbles - 8).astype(np.int8), "scales": s.T.astype(np.float16),
                                         "group_size": g}
    return out


def check_bundle_codes(onnx_path: str | Path, qm) -> int:
    """How many of the plan's quantized layers the bundle holds with the plan's own codes and float16 scales (read
    back from the ONNX); a layer that is missing or differs is an error naming it."""
    stored = bundle_weights(onnx_path)
    extra = sorted(n for n in stored if n not in qm.weights or qm.layer(n).kind != "linear")
    if extra:
        raise WorkbenchError(f"'{onnx_path}' holds {', '.join(extra)} as int4, which the plan keeps float: convert again")
    found = 0
    for name, qw in qm.weights.items():
        if qm.layer(name).kind != "linear":
            continue
        got = stored.get(name)
        if got is None:
            raise WorkbenchError(f"'{onnx_path}' has no int4 plugin node for '{name}': convert again")
        codes = qw.qweight.to(dtype=qw.qweight.dtype).cpu().numpy().astype(np.int8)
        scales = qw.scales.float().cpu().numpy().astype(np.float16)
        if got["codes"].shape != codes.shape or not np.array_equal(got["codes"], codes):
            raise WorkbenchError(f"'{onnx_path}' does not hold the plan's codes of '{name}': convert again")
        if got["scales"].shape != scales.shape or not np.array_equal(got["scales"], scales):
            raise WorkbenchError(f"'{onnx_path}' does not hold the plan's scales of '{name}': convert again")
        found += 1
    return found


# -- onnxruntime on what it can run ---------------------------------------------------------------------------------

def _shape_of(vi, tokens: int) -> list[int] | None:
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else tokens for d in vi.type.tensor_type.shape.dim]


def _open_part(onnx_path: Path):
    """The bundle's graph without its plugin nodes: their outputs become inputs, the activations they read
    become outputs. Returns (model proto, {plugin output: node}, [(layer, activation name)])."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=True)
    g = model.graph
    plugins = [n for n in g.node if n.domain == PLUGIN_DOMAIN]
    produced_by = {o: n for n in plugins for o in n.output}
    reads = []  # (layer, activation tensor) for each int4 node whose activation onnxruntime computes
    for n in plugins:
        if n.op_type == INT4_OP and n.input[0] not in produced_by:
            reads.append((_layer_of(n.input[1]), n.input[0]))
    wanted = ["logits"] + sorted({a for _, a in reads})
    keep, needed = [], set(wanted)
    for n in reversed([n for n in g.node if n.domain != PLUGIN_DOMAIN]):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(i for i in n.input if i)
    keep.reverse()
    vis = {v.name: v for v in list(g.value_info) + list(g.input) + list(g.output)}
    feeds = sorted(needed & set(produced_by))
    inputs = [i for i in g.input if i.name in needed]
    for name in feeds:
        vi = vis.get(name)
        inputs.append(vi if vi is not None else onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT16, None))
    outputs = [vis[w] if w in vis else onnx.helper.make_tensor_value_info(w, onnx.TensorProto.FLOAT16, None)
               for w in wanted]
    inits = [i for i in g.initializer if i.name in needed]
    part = onnx.helper.make_graph(keep, "edgellm-outside-plugins", inputs, outputs, inits)
    opsets = [o for o in model.opset_import if o.domain != PLUGIN_DOMAIN]
    out = onnx.helper.make_model(part, opset_imports=opsets, ir_version=model.ir_version)
    return out, {name: produced_by[name] for name in feeds}, reads, vis


def run_outside_plugins(llm_dir: str | Path, prep, ids) -> dict:
    """Run every node of the bundle's graph that onnxruntime can run, on ``ids`` (one prompt from position 0).

    The plugin nodes (int4 GEMMs, attention with its paged KV cache) exist only as TensorRT plugins, so their outputs
    are the simulation's (each int4 layer's output, each attention's output before ``o_proj``), fed in; the embedding
    comes from the bundle's ``embedding.safetensors``. onnxruntime then computes the norms, SiLU, residual adds and
    the output layer in float16, and each int4 layer's input and the logits are compared with the simulation's:
    the largest relative difference per layer, and the logits' KL and top-1 against the simulation."""
    import onnxruntime as ort
    import torch
    from safetensors.numpy import load_file
    llm_dir = Path(llm_dir)
    part, feeds_from, reads, vis = _open_part(llm_dir / "model.onnx")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    tokens = len(ids)
    caught: dict[str, tuple] = {}
    model = prep.sim_lm.model
    hooks = [m.register_forward_hook(lambda mod, a, o, name=name: caught.__setitem__(name, (a[0], o)))
             for name, m in model.named_modules() if name in prep.qm.weights or name.endswith("self_attn.o_proj")]
    try:
        with torch.no_grad():
            sim_logits = model(torch.from_numpy(ids)[None]).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()
    emb = load_file(str(llm_dir / "embedding.safetensors"))
    table = next(iter(emb.values()))
    feed = {}
    for vi in part.graph.input:
        name = vi.name
        if name == "inputs_embeds":
            feed[name] = table[ids].astype(np.float16)
        elif name == "logits_indices":
            feed[name] = np.arange(tokens, dtype=np.int64)
        elif name in feeds_from:
            node = feeds_from[name]
            if node.op_type == INT4_OP:
                value = caught[_layer_of(node.input[1])][1]
            elif node.op_type == "AttentionPlugin":  # its output is what o_proj of the same block reads
                block = int(next(o for o in node.input if o.startswith("past_key_values_")).rsplit("_", 1)[1])
                value = caught[f"model.layers.{block}.self_attn.o_proj"][0]
            else:
                raise WorkbenchError(f"the bundle's graph has a {node.op_type} plugin node this check does not know")
            shape = _shape_of(vis.get(name), tokens)
            value = value[0].float().numpy().astype(np.float16)
            feed[name] = value.reshape(shape) if shape else value
        else:
            raise WorkbenchError(f"the bundle's graph reads '{name}', which this check does not feed")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(part.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(names, feed)))
    layers = {}
    for layer, act in reads:
        ref = caught[layer][0][0].float().numpy().reshape(tokens, -1)
        x = got[act].astype(np.float32).reshape(tokens, -1)
        layers[layer] = float(np.abs(x - ref).max() / max(float(np.abs(ref).max()), 1e-12))
    logits = got["logits"].astype(np.float32).reshape(tokens, -1)
    p, q = log_softmax(sim_logits), log_softmax(logits)
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    return {"tokens": tokens, "nodes_run": len(part.graph.node), "plugin_outputs_fed": len(feeds_from),
            "layer_input_max_rel_diff": layers, "worst_layer_input_rel_diff": max(layers.values(), default=0.0),
            "logits_kl_vs_simulation": kl,
            "logits_top1_vs_simulation": float((logits.argmax(-1) == sim_logits.argmax(-1)).mean())}


# -- the bundle -------------------------------------------------------------------------------------------------------

def write_build_script(out: str | Path, *, max_input_len: int, max_kv: int) -> Path:
    """``build.sh``: the one command that builds the engine from ``llm/`` on the Jetson (Edge-LLM's ``llm_build``,
    from its C++ build; ``LLM_BUILD`` names it when it is not on PATH)."""
    out = Path(out)
    cmd = ["\"${LLM_BUILD:-llm_build}\"", "--onnxDir", LLM_DIR, "--engineDir", "engines", "--maxBatchSize", "1",
           "--maxInputLen", str(max_input_len), "--maxKVCacheCapacity", str(max_kv)]
    script = out / BUILD_SCRIPT
    script.write_text("#!/usr/bin/env bash\n"
                      "# Build the TensorRT Edge-LLM engine from llm/ on the Jetson (TensorRT and Edge-LLM's C++ build\n"
                      "# there; LLM_BUILD=path/to/build/examples/llm/llm_build if it is not on PATH).\n"
                      "set -euo pipefail\ncd \"$(dirname \"$0\")\"\n" + " ".join(cmd) + "\n")
    script.chmod(0o755)
    return script


def convert_edgellm(job) -> None:
    """The plan's int4 codes as Edge-LLM's ONNX bundle (its own exporter, in its venv), read back and checked."""
    prep, report = job.prep, job.report
    for name, qw in prep.qm.weights.items():  # refuse before writing anything, naming the layer
        if prep.qm.layer(name).kind == "linear":
            carried_group(name, qw)
    if edgellm_python() is None:
        raise EdgeLlmError(f"tensorrt-edgellm is not installed: {ENV_HINT}")
    job.say("writing the plan as a W4A16 checkpoint")
    t = time.perf_counter()
    info = write_checkpoint(prep, job.out / CHECKPOINT_DIR)
    job.say("exporting with tensorrt-edgellm-export (its own venv)")
    info.update(export_bundle(job.out / CHECKPOINT_DIR, job.out))
    report.details.setdefault("seconds", {})["write"] = time.perf_counter() - t
    onnx_path = job.out / LLM_DIR / "model.onnx"
    info["plan_layers_checked"] = check_bundle_codes(onnx_path, prep.qm)
    ctx = max(job.ctx or job.default_ctx, 2)
    max_pos = int(getattr(prep.float_lm.model.config, "max_position_embeddings", 0) or ctx)
    script = write_build_script(job.out, max_input_len=min(ctx, max_pos), max_kv=max_pos)
    info["build_command"] = f"bash {shlex.quote(str(script))}"
    if job.evaluate_outputs:  # the first CHECK_TOKENS of the text (nothing here runs the plugins: no KL to score)
        ids, _ = read_tokens(prep.float_lm.tokenizer, job.text or demo_text_path("heldout"), max_tokens=CHECK_TOKENS)
        job.say(f"running the graph outside its plugin nodes in onnxruntime ({len(ids)} tokens)")
        info["onnxruntime_outside_plugins"] = run_outside_plugins(job.out / LLM_DIR, prep, ids)
    report.details["edgellm"] = info
    report.notes += [
        "the plan's int4 codes and float16 scales are stored in the ONNX as they are (read back layer by layer)",
        "no engine is built here (TensorRT is not installable): build.sh builds it on the Jetson",
        "onnxruntime ran every node outside the TensorRT plugins (int4 GEMMs, attention), with the plugins' outputs "
        "taken from the simulation: see details.edgellm.onnxruntime_outside_plugins",
        "float layers and the embedding are float16 (Edge-LLM computes in float16)"]
    if info["dequantized_embeddings"]:
        report.notes.append(f"{', '.join(info['dequantized_embeddings'])}: the plan's codes are held as their "
                            "dequantized float16 values (Edge-LLM looks the embedding up in float16)")


def _missing() -> str | None:
    """One sentence when Edge-LLM's exporter (its own venv) is not on this machine, else None."""
    if edgellm_python() is not None:
        return None
    return ("TensorRT Edge-LLM's exporter is not installed on this machine (it lives in its own environment, which "
            "`make edgellm-env` creates), so the app cannot convert for it here")


TARGET = register_target(Target(
    "tensorrt-edgellm", "TensorRT Edge-LLM (Jetson, W4A16)", rules=None, convert=convert_edgellm, module=__name__,
    missing=_missing,
    int_bits=(4,), precision_note="Edge-LLM's int4 plugin holds symmetric 4-bit codes with float16 scales per group "
                                  "(one group size per model); float layers are float16"))
