"""MNN-LLM, ``mnn-llm``: the plan's model as the directory MNN's own LLM engine (``llm_demo``, the MNN chat
app, ``MNN.llm``) loads, run and timed by that engine here.

    convert("demo", "mnn-llm", "out/mnn-llm", bits=4)     # config.json, llm_config.json, llm.mnn, ...
    lm = MnnLlm("out/mnn-llm"); lm.logits(ids); lm.steps(); lm.prefill_seconds(prompt)

The directory is what MNN's engine reads (its ``llmconfig.hpp`` / ``llm.cpp``): ``config.json`` (runtime
settings, names the files), ``llm_config.json`` (model shape), ``llm.mnn`` + ``llm.mnn.weight`` (the
decoder graph and its weights), ``embeddings_bf16.bin`` (the token embedding, read row by row from disk)
and ``tokenizer.txt`` (MNN's text tokenizer format: magic 430, type 3 = byte-level BPE vocabulary and merges).

The graph takes ``input_ids`` (the embedded tokens, ``[seq, 1, hidden]``), ``attention_mask``,
``position_ids`` ``[1, seq]`` and ``logits_index`` (``-1``: the last position, ``0``: all of them) and
gives ``logits``. Its attention is MNN's ``Attention`` op with ``kv_cache`` on: the engine keeps the KV
cache itself, so one graph serves prefill and decode. It is written here as an ONNX graph whose attention
is a custom ``FusedAttention`` node, built op by op (``onnx.build``: one weight widened at a time, large
models' weights in ONNX external data), converted by MNN's converter with ``--weightQuantBits`` (the same
asymmetric re-quantization of the simulated weights that reproduces the plan's integers in the ``mnn``
target, ``mnn_weight_args``) and its weights in their own file; the custom nodes are then rewritten as
``Attention`` ops in the converter's JSON form, which holds only the weights' offsets, and the plan's own
codes and scales are written into the weight file in place. A float output layer keeps float weights.

A vision-language model (Qwen2.5-VL) adds ``visual.mnn`` + ``visual.mnn.weight`` (``mnn_vision``: the encoder in the
form MNN's ``Omni`` engine feeds, the plan's vision codes written the same way), the image keys in
``llm_config.json`` and a language model taking 3-D positions; the engine then reads pictures itself
(``<img>PATH</img>`` in a prompt): ``image_logits``, ``image_generate``, ``picture_steps`` (``workbench generate
--image``) and ``picture_profile`` (``workbench profile``).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..errors import ModelLoadError, WorkbenchError, NativeEngineError
from ..onnx.build import (DATA_FILE, INLINE_LIMIT, DecoderSpec, FloatWeights, GraphBuilder, TensorStore, apply_rotary,
                          rotary_tables)
from ..files.workspace import atomic_write_json
from .common import score_in_runtime
from .mnn_vision import (VISUAL_FILE, VISUAL_PREFIXES, EngineQuestion, PartWeights, export_visual_onnx, mrope_tables,
                         noise_picture, picture_timing, score_vision, source_vision_inputs, text_view,
                         vision_llm_config)
from .mnn import mnn_weight_args, convert_to_mnn, keep_matmul_weights_float, run_mnnconvert
from .registry import Target, register_target
from ..files.folder_paths import folder_file, folder_json, named_paths
from .processes import ENGINE_TIMEOUT_VAR, ChildCrashed, ChildEngine, ChildFailed, ChildHung, engine_timeout

__all__ = ["check_mnn_llm_folder", "read_mnn_weights", "graph_weight_bytes",
           "export_engine_onnx", "plan_codes_layout", "write_plan_codes", "write_tokenizer_txt", "write_mnn_llm_folder", "MnnLlm", "open_mnn_llm",
           "convert_mnn_llm", "TARGET", "FILES"]

FILES = ("llm.mnn", "llm.mnn.weight", "embeddings_bf16.bin", "config.json", "llm_config.json", "tokenizer.txt")
# decoders whose blocks the builder writes (qwen2_5_vl_text: a Qwen2.5-VL's language model, 3-D positions)
MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen2_5_vl_text")
TOKENIZER_MAGIC, HUGGINGFACE_BPE = 430, 3  # tokenizer.txt's header, as MNN's tokenizer.cpp reads it
ATTENTION_DOMAIN = "LlmExporter"  # the custom op's domain, as MNN's llmexport.py writes it


def export_engine_onnx(model, path: str | Path, *, inline_limit: int | None = None) -> tuple[Path, str]:
    """The engine's graph of ``model`` as ONNX, built op by op (``onnx.build``): each weight widened to float32 on its
    own and, past ``inline_limit`` bytes, written to the external-data file beside ``path``, so no float32 copy of the
    model is held. Each linear layer's output (its bias Add's, when it has one: MNN's converter merges the two) is
    named after the layer, which MNN names its op from. Returns the path and the output layer's weight initializer."""
    from onnx import TensorProto, helper

    model = text_view(model)  # a VLM's language model, its layers named as in the VLM (prefix)
    prefix = getattr(model, "prefix", "model")
    cfg = model.config
    if cfg.model_type not in MODEL_TYPES:
        raise WorkbenchError(f"mnn-llm writes {', '.join(MODEL_TYPES)} decoders, not '{cfg.model_type}'; "
                             "use the mnn target for this model")
    spec = DecoderSpec.from_model(model)
    sections = getattr(spec.base.rotary_emb, "mrope_section", None)  # a VLM's 3-D positions: position_ids [3, seq]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (path, path.parent / DATA_FILE):
        stale.unlink(missing_ok=True)  # a graph left from an earlier export must not point into new data
    store = TensorStore(path.parent, INLINE_LIMIT if inline_limit is None else inline_limit)
    policy = FloatWeights()
    g = GraphBuilder(store, 17, None)
    d = spec.head_dim

    def linear(module, fqn: str, x: str) -> str:
        policy.linear(g, module, fqn, x)
        g.nodes[-1].output[0] = fqn  # the last node is the MatMul, or the bias Add after it
        return fqn

    try:
        with torch.no_grad():
            h = g.reshape("input_ids", [1, -1, spec.hidden])  # [seq, 1, hidden] -> [1, seq, hidden]
            if sections:
                cos, sin = mrope_tables(g, spec.inv_freq, sections)
            else:
                cos, sin = (g.op("Transpose", [t], perm=[0, 2, 1, 3]) for t in rotary_tables(g, spec))  # [1, seq, 1, d]
            for i, block in enumerate(spec.base.layers):
                p, a, m = f"{prefix}.layers.{i}", block.self_attn, block.mlp
                hq, hkv = spec.heads_of(i)
                g.scope = p
                x = g.rms_norm(h, block.input_layernorm, f"{p}.input_layernorm")
                q, k, v = (g.reshape(linear(getattr(a, n), f"{p}.self_attn.{n}", x), [1, -1, heads, d])
                           for n, heads in (("q_proj", hq), ("k_proj", hkv), ("v_proj", hkv)))
                if spec.qk_norm:
                    q = g.rms_norm(q, a.q_norm, f"{p}.self_attn.q_norm")
                    k = g.rms_norm(k, a.k_norm, f"{p}.self_attn.k_norm")
                q, k = apply_rotary(g, q, cos, sin, d), apply_rotary(g, k, cos, sin, d)
                att = g.op("FusedAttention", [q, k, v, "attention_mask"], domain=ATTENTION_DOMAIN,
                           name=f"/{p}/self_attn/FusedAttention", output_dim=hq * d, kv_cache=1, layer_index=i,
                           kv_shared_layer_index=-1)
                g.nodes[-1].attribute.append(helper.make_attribute("name", f"/layers.{i}/self_attn/FusedAttention"))
                g.scope = p
                h = g.op("Add", [h, linear(a.o_proj, f"{p}.self_attn.o_proj", att)])
                x = g.rms_norm(h, block.post_attention_layernorm, f"{p}.post_attention_layernorm")
                gate = linear(m.gate_proj, f"{p}.mlp.gate_proj", x)
                act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
                g.scope = p
                h = g.op("Add", [h, linear(m.down_proj, f"{p}.mlp.down_proj",
                                           g.op("Mul", [act, linear(m.up_proj, f"{p}.mlp.up_proj", x)]))])
            g.scope = ""
            start = g.op("Cast", ["logits_index"], to=TensorProto.INT64)
            h = g.op("Slice", [h, start, g.const([np.iinfo(np.int64).max]), g.const([1])])  # logits_index onward
            h = g.rms_norm(h, spec.base.norm, f"{prefix}.norm")
            policy.lm_head(g, spec.model.get_output_embeddings(), "lm_head", h, spec.base.embed_tokens)
            g.nodes[-1].output[0] = "logits"
        store.close()
        seq = "seq_len"
        inputs = [helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, [seq, 1, spec.hidden]),
                  helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, [1, 1, seq, seq]),
                  helper.make_tensor_value_info("position_ids", TensorProto.INT32, [3 if sections else 1, seq]),
                  helper.make_tensor_value_info("logits_index", TensorProto.INT32, [1])]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "logits_len", spec.vocab])]
        graph = helper.make_graph(g.nodes, "llm", inputs, outputs,
                                  list(g.constants.values()) + [store.proto(w) for w in g.weights])
        proto = helper.make_model(graph, producer_name="workbench", opset_imports=[
            helper.make_opsetid("", 17), helper.make_opsetid(ATTENTION_DOMAIN, 1)])
        proto.ir_version = min(proto.ir_version, 10)  # what the converters here read
        tmp = path.with_name(path.name + ".partial")
        tmp.write_bytes(proto.SerializeToString())
        os.replace(tmp, path)
    finally:
        store.close()
    return path, policy.weight_names["lm_head"]


def plan_codes_layout(qm) -> tuple[int, int] | None:
    """(bits, block) when every quantized linear layer is symmetric at one width (4 or 8) and one block size with
    one float scale per block: MNN's own block layout (codes and a scale per block) then holds the plan's integers
    as they are, whatever rounded them (scale search, AWQ, GPTQ). None otherwise."""
    qws = [q for name, q in qm.weights.items() if qm.layer(name).kind == "linear"]
    if not qws or any(q.zeros is not None or q.sub_scales is not None or q.mins is not None or q.super_block
                      for q in qws):
        return None
    widths = {q.bits for q in qws}
    # a layer whose block is its whole row (per channel, or a row narrower than the plan's group: the 96-wide vision
    # layers at g128) is one block a row in MNN's layout too, whatever the block (write_plan_codes checks each)
    blocks = {q.effective_group_size for q in qws if q.effective_group_size < q.qweight.shape[-1]}
    if len(widths) != 1 or len(blocks) > 1:
        return None
    bits = next(iter(widths))
    block = next(iter(blocks), None) or max(q.effective_group_size for q in qws)
    return (bits, block) if bits in (4, 8) and block else None


def write_plan_codes(doc: dict, weight_file: str | Path, qm, bits: int, block: int) -> int:
    """Put the plan's codes and scales into MNN's quantized ops, in place in their external weight file (``doc`` is
    the graph in the converter's JSON form, each op's ``external`` its offset and byte counts there): each block's
    scale is its ``alpha``, its codes index MNN's code table (``-2^(b-1)`` .. ``2^(b-1)-1``), high nibble first."""
    data = np.memmap(weight_file, dtype=np.uint8, mode="r+")
    done = 0
    for op in doc.get("oplists", []):
        if op.get("type") != "Convolution":
            continue
        name = op.get("name", "").split("__matmul_converted")[0]
        qw = qm.weights.get(name)
        main = op.get("main") or {}
        q, ext = main.get("quanParameter"), main.get("external")
        if qw is None or q is None or not ext:
            continue
        offset, size, alpha_bytes = (int(x) for x in ext[:3])
        buf = data[offset:offset + size]
        dims = 8 if q.get("shapeInt32") else 4  # the two dims: unsigned 16-bit, or 32-bit above 65,535
        rows, width = (int(x) for x in np.frombuffer(buf[1:1 + dims].tobytes(), np.int32 if dims == 8 else np.uint16))
        table = int(buf[1 + dims]) or 256
        header = 2 + dims + table
        codes = qw.qweight.to(torch.int16).numpy().reshape(-1, qw.effective_group_size) + (1 << (bits - 1))
        flat = codes.reshape(-1).astype(np.uint8)
        packed = (flat[0::2] << 4 | flat[1::2]) if bits == 4 else flat
        if ((rows, width) != codes.shape or q.get("aMaxOrBits") != bits or alpha_bytes != 4 * rows
                or q.get("scaleStorage", "FP32") != "FP32" or header + packed.size != size):
            raise WorkbenchError(f"MNN laid out '{name}' as {rows} x {width} {q.get('aMaxOrBits')}-bit blocks, not the "
                                 f"plan's {codes.shape[0]} x {block} {bits}-bit ones: this MNN version is not the one "
                                 "the project pins")
        buf[header:] = packed
        data[offset + size:offset + size + alpha_bytes] = qw.scales.float().numpy().reshape(-1).view(np.uint8)
        done += 1
    data.flush()
    del data
    return done


def read_mnn_weights(graph: str | Path, work: str | Path) -> dict[str, np.ndarray]:
    """Each quantized op's weight ``{layer name: values [rows, block]}`` read back from the graph's external weight
    file (``graph`` + ``.weight``) as MNN lays it out (``write_plan_codes``): the code buffer (dims, rows and
    block, the code table, the codes: two 4-bit codes a byte, high nibble first, or one 8-bit code), then one
    float32 scale per row; ``work`` holds the graph's JSON form."""
    graph, out = Path(graph), Path(work) / (Path(graph).name + ".json")
    run_mnnconvert(["mnnconvert", "-f", "MNN", "--modelFile", str(graph), "--JsonFile", str(out)])
    data = np.fromfile(f"{graph}.weight", dtype=np.uint8)
    found = {}
    for op in json.loads(out.read_text(encoding="utf-8"))["oplists"]:
        main = op.get("main") or {}
        q = main.get("quanParameter")
        if op.get("type") != "Convolution" or q is None or not main.get("external"):
            continue
        offset, size, alpha_bytes = (int(x) for x in main["external"][:3])
        buf = data[offset:offset + size]
        dims = 8 if q.get("shapeInt32") else 4
        rows, width = (int(x) for x in buf[1:1 + dims].view(np.int32 if dims == 8 else np.uint16))
        count = int(buf[1 + dims]) or 256
        table = buf[2 + dims:2 + dims + count].view(np.int8).astype(np.float32)
        codes = buf[2 + dims + count:]
        idx = np.stack([codes >> 4, codes & 15], -1).reshape(rows, width) if q.get("aMaxOrBits") == 4 else \
            codes.reshape(rows, width)
        alpha = data[offset + size:offset + size + alpha_bytes].view(np.float32)
        found[op.get("name", "").split("__matmul_converted")[0]] = table[idx] * alpha[:, None]
    return found


def _attention_ops(doc: dict) -> int:
    """Rewrite the converter's custom ``FusedAttention`` ops (in its JSON form) as MNN ``Attention`` ops."""
    count = 0
    for op in doc.get("oplists", []):
        main = op.get("main") or {}
        if op.get("type") != "Extra" or main.get("type") != "FusedAttention":
            continue
        attrs = {a["key"]: a for a in main.get("attr", [])}
        op.update({"type": "Attention", "main_type": "AttentionParam", "defaultDimentionFormat": "NHWC",
                   "name": attrs["name"]["s"],
                   "main": {"kv_cache": bool(attrs["kv_cache"].get("i", 1)),
                            "layer_index": attrs.get("layer_index", {}).get("i", -1),
                            "kv_shared_layer_index": -1}})
        count += 1
    return count


def write_tokenizer_txt(tokenizer, path: str | Path, stop_ids: Sequence[int]) -> Path:
    """The model's byte-level BPE tokenizer in MNN's ``tokenizer.txt`` format (header, special / stop / prefix
    ids, vocabulary in id order, merges by rank); other tokenizer kinds are refused."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise WorkbenchError("mnn-llm needs a fast (tokenizer.json) tokenizer to write MNN's tokenizer.txt")
    doc = json.loads(backend.to_str())
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or (doc.get("pre_tokenizer") or {}).get("type") not in ("ByteLevel", "Sequence"):
        raise WorkbenchError(f"mnn-llm writes byte-level BPE tokenizers; this one is {model.get('type')}: use the "
                             "mnn target, or MNN's llmexport.py for the tokenizer")
    vocab = dict(model["vocab"])
    special = []
    for tok in doc.get("added_tokens", []):
        vocab[tok["content"]] = tok["id"]
        if tok.get("special"):
            special.append(tok["id"])
    size = max(vocab.values()) + 1
    by_id = [""] * size
    for text, i in vocab.items():
        by_id[i] = text
    if any("\n" in t for t in by_id):
        raise WorkbenchError("a token of this tokenizer holds a newline, which MNN's line-based tokenizer.txt "
                             "cannot store")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    stops = [int(s) for s in dict.fromkeys(stop_ids)]
    lines = [f"{TOKENIZER_MAGIC} {HUGGINGFACE_BPE}", f"{len(special)} {len(stops)} 0",
             " ".join(str(i) for i in special + stops), f"{size} {len(merges)}", *by_id, *merges]
    path = Path(path)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _stop_ids(lm) -> list[int]:
    gen = getattr(lm.model, "generation_config", None)
    ids = [getattr(gen, "eos_token_id", None), lm.tokenizer.eos_token_id]
    out = []
    for i in ids:
        out += list(i) if isinstance(i, (list, tuple)) else [i] if i is not None else []
    return [int(i) for i in dict.fromkeys(out)]


def write_mnn_llm_folder(sim_lm, qm, out: str | Path, work: str | Path, *, threads: int = 4,
                         inline_limit: int | None = None, processor=None) -> dict:
    """MNN's LLM model directory for the simulation ``sim_lm`` of ``qm``; returns what was decided (notes).
    ``inline_limit``: the ONNX graph's weights past this many bytes go to external data (``INLINE_LIMIT``).
    A VLM's vision encoder goes to ``visual.mnn`` beside ``llm.mnn`` (``processor``: its picture preprocessing,
    whose size and normalisation the engine is told), each graph holding its own layers' codes."""
    out, work = Path(out), Path(work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = sim_lm.model
    text = text_view(model)
    vision = text is not model
    if vision and processor is None:
        raise WorkbenchError("a vision-language model needs its image processor to write MNN's picture settings")
    all_qm, qm = qm, PartWeights(qm, VISUAL_PREFIXES, keep=False) if vision else qm
    direct = plan_codes_layout(qm)
    bits, block, notes = mnn_weight_args(qm)
    if direct is not None:  # the plan's own codes and scales written into MNN's layout (any rounding method)
        bits, block = direct
        notes = [n for n in notes if "stores the simulated weights in float" not in n and "re-quantizes" not in n]
        notes.append(f"the plan's {bits}-bit codes and per-{block} float scales are written into MNN's quantized "
                     "weights as they are (MNN's symmetric block layout)")
    embed = model.get_input_embeddings()
    # the embedding is not in the graph here (embeddings_bf16.bin holds it): drop the mnn target's notes on it
    embed_names = [r.name for r in qm.layers if r.kind == "embedding"]
    notes = [n for n in notes if not any(n.startswith(e) for e in embed_names)]
    onnx_path, head = export_engine_onnx(model, work / "llm.onnx", inline_limit=inline_limit)
    float_head = "lm_head" not in qm.weights
    kept = []
    if bits and float_head:
        src = work / "llm-float-head.onnx"
        kept = keep_matmul_weights_float(onnx_path, src, [head])
        onnx_path = src
    if kept:
        notes.append("the output layer, float in the plan, keeps float32 weights in llm.mnn (a [1, K, N] weight, "
                     "which MNN's weight quantization leaves alone)")
    # with --weightQuantAsymmetric this converter writes one scale per block (checked by write_plan_codes), without it
    # a (minimum, scale) pair
    # with --weightQuantAsymmetric this converter writes one scale per block (checked by write_plan_codes), without it
    # a (minimum, scale) pair; the weights go to plain.mnn.weight, so the graph's JSON form holds only their offsets
    plain = convert_to_mnn(onnx_path, work / "plain.mnn", weight_bits=bits, block_size=block, asymmetric=True,
                           extra=["--allowCustomOp", "--saveExternalData"])
    weight_file = plain.with_name(plain.name + ".weight")
    if not weight_file.is_file():
        raise WorkbenchError(f"MNN's converter wrote no weight file beside '{plain}': convert again")
    graph_json = work / "llm.json"
    run_mnnconvert(["mnnconvert", "-f", "MNN", "--modelFile", str(plain), "--JsonFile", str(graph_json)])
    doc = json.loads(graph_json.read_text(encoding="utf-8"))
    written = write_plan_codes(doc, weight_file, qm, bits, block) if direct is not None else 0
    quantized = sum(1 for name in qm.weights if qm.layer(name).kind == "linear")
    if direct is not None and written != quantized:
        raise WorkbenchError(f"found {written} of the plan's {quantized} quantized layers among MNN's ops: export again")
    rewritten = _attention_ops(doc)
    if rewritten != len(text.model.layers):
        raise WorkbenchError(f"MNN's converter kept {rewritten} of {len(text.model.layers)} attention ops: "
                             "this MNN version does not carry the custom op; install the pinned MNN")
    graph_json.write_text(json.dumps(doc), encoding="utf-8")
    convert_to_mnn(graph_json, out / "llm.mnn", source="JSON")  # its ops keep their offsets into the weight file
    weight_file.replace(out / "llm.mnn.weight")
    emb = embed.weight.detach()
    (out / "embeddings_bf16.bin").write_bytes(emb.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    write_tokenizer_txt(sim_lm.tokenizer, out / "tokenizer.txt", _stop_ids(sim_lm))
    cfg = text.config
    visual = write_visual_mnn(model, PartWeights(all_qm, VISUAL_PREFIXES), out, work) if vision else None
    atomic_write_json(out / "llm_config.json", {
        "model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "layer_nums": cfg.num_hidden_layers,
        "attention_mask": "float", "attention_type": "full", "is_visual": False, "is_audio": False,
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 0) or 0),
        **(vision_llm_config(model, processor.image_processor) if vision else {})})
    atomic_write_json(out / "config.json", {
        "llm_model": "llm.mnn", "llm_weight": "llm.mnn.weight", "embedding_file": "embeddings_bf16.bin",
        "tokenizer_file": "tokenizer.txt", "backend_type": "cpu", "thread_num": threads, "precision": "high",
        "memory": "high", "sampler_type": "greedy", "use_template": False, "max_new_tokens": 512,
        # the encoder runs when the picture is read (vision_us), not lazily inside the prefill
        **({"visual_model": VISUAL_FILE, "async": False} if vision else {})})
    if visual is not None:
        notes += visual.pop("notes")
    notes.append("the token embedding is stored as bfloat16 (embeddings_bf16.bin, the engine's float embedding "
                 "format): its simulated values rounded to 8 significant bits")
    return {"weight_bits": bits, "block": block, "plan_codes_written": written, "visual": visual,
            "kept_float": kept,
            "attention_ops": rewritten, "notes": notes}


def write_visual_mnn(model, vq, out: Path, work: Path) -> dict:
    """``visual.mnn`` + ``visual.mnn.weight``: the VLM's vision encoder as MNN's engine calls it
    (``mnn_vision.export_visual_onnx``), its linear layers holding the plan's codes and scales (``vq``: the
    plan's vision layers) as ``llm.mnn`` does, or MNN's re-quantization of the simulated values where one MNN
    block layout cannot hold the plan."""
    onnx_path = export_visual_onnx(model, work / "visual" / "visual.onnx")
    direct = plan_codes_layout(vq)
    bits, block, notes = mnn_weight_args(vq)
    if direct is not None:
        bits, block = direct
        notes = [f"visual.mnn: the plan's {bits}-bit codes and per-{block} float scales of the vision layers are "
                 "written into MNN's quantized weights as they are"]
    else:
        notes = [f"visual.mnn: {n}" for n in notes]
    plain = convert_to_mnn(onnx_path, work / "visual" / "plain.mnn", weight_bits=bits, block_size=block,
                           asymmetric=True, extra=["--saveExternalData"])
    weight_file = plain.with_name(plain.name + ".weight")
    written = 0
    if direct is not None:
        graph_json = work / "visual" / "visual.json"
        run_mnnconvert(["mnnconvert", "-f", "MNN", "--modelFile", str(plain), "--JsonFile", str(graph_json)])
        written = write_plan_codes(json.loads(graph_json.read_text(encoding="utf-8")), weight_file, vq, bits, block)
        if written != len(vq.weights):
            raise WorkbenchError(f"found {written} of the plan's {len(vq.weights)} quantized vision layers among "
                                 "MNN's ops: export again")
    os.replace(plain, out / VISUAL_FILE)
    if weight_file.is_file():
        os.replace(weight_file, out / (VISUAL_FILE + ".weight"))
    info = {"weight_bits": bits, "block": block, "plan_codes_written": written, "notes": notes}
    if direct is not None:  # read back as MNN lays it out: each value the plan's code times its scale
        back = read_mnn_weights(out / VISUAL_FILE, work / "visual")
        missing = [n for n in vq.weights if n not in back]
        if missing:
            raise WorkbenchError(f"visual.mnn holds no quantized op for {', '.join(missing[:3])}: export again")
        info["read_back_max_abs_error"] = max(float(np.abs(back[n].reshape(q.shape) - q.dequantize().float().numpy())
                                                    .max()) for n, q in vq.weights.items())
        info["read_back_layers"] = len(vq.weights)
    return info


PATH_KEY = re.compile(r"(^|_)(model|weight|file|dir|path|config)$")  # config keys MNN joins to its base_dir
PICTURE_PROMPT = "Describe the picture."  # the text after the picture when the profile times the picture path
ENGINE_SCRIPT = Path(__file__).with_name("mnn_llm_engine.py")
LIMITS = {"hidden_size": 1 << 16, "layer_nums": 1024, "max_position_embeddings": 1 << 24}  # far past any edge LM
RUN_LIMITS = {"max_all_tokens": 1 << 24, "max_new_tokens": 1 << 24, "thread_num": 1024}  # config.json's, when given


def _mnn_path_key(key) -> bool:
    return isinstance(key, str) and bool(PATH_KEY.search(key))


def _manifest_sizes(folder: Path) -> dict[str, int]:
    """``{file: bytes}`` from the folder's ``manifest.json`` (what `workbench convert` wrote); {} when it is absent or
    unreadable (the other checks do not rely on it)."""
    try:
        doc = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        files = doc.get("files") if isinstance(doc, dict) else None
        return {k: int(v["size"]) for k, v in (files or {}).items()
                if isinstance(v, dict) and isinstance(v.get("size"), int)}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _read_tokenizer_header(path: Path) -> tuple[int, list[int]]:
    """(vocabulary size, special/stop/prefix ids) of MNN's ``tokenizer.txt`` (byte-level BPE, type 3), after checking
    its header and that it holds the lines the header promises; ModelLoadError naming the file otherwise."""
    bad = f"'{path}' is not MNN's tokenizer.txt"
    try:
        with open(path, "rb") as f:
            head = [f.readline() for _ in range(4)]
            lines = 4 + sum(1 for _ in f)
        magic, kind = (int(x) for x in head[0].split())
        counts = [int(x) for x in head[1].split()]
        ids = [int(x) for x in head[2].split()]
        sizes = [int(x) for x in head[3].split()]
    except (OSError, ValueError):
        raise ModelLoadError(f"{bad} (its header does not parse): convert it again") from None
    if magic != TOKENIZER_MAGIC:
        raise ModelLoadError(f"{bad} (magic {magic}, not {TOKENIZER_MAGIC}): convert it again")
    if kind != HUGGINGFACE_BPE:
        return 0, []  # another tokenizer kind (MNN's exporter writes several): its body is the engine's to read
    if len(counts) != 3 or min(counts) < 0 or len(ids) != sum(counts) or len(sizes) != 2 or min(sizes) < 1:
        raise ModelLoadError(f"{bad} (its counts line does not match its ids): convert it again")
    vocab, merges = sizes
    if lines < 4 + vocab + merges:
        raise ModelLoadError(f"'{path}' promises {vocab:,} tokens and {merges:,} merges but holds {lines - 4:,} lines: "
                             "it is truncated; convert it again")
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ModelLoadError(f"'{path}' names special token {max(ids) if max(ids) >= vocab else min(ids)}, outside its "
                             f"{vocab:,}-token vocabulary: convert it again")
    return vocab, ids


CONVOLUTION, BLOB = 9, 7  # MNN.fbs's OpParameter union: the tables whose ``external`` points into the weight file
EXTERNAL_FIELD = {CONVOLUTION: 6, BLOB: 9}  # Convolution2D.external, Blob.external: [offset, bytes, bytes...]


def graph_weight_bytes(graph: str | Path) -> int:
    """The bytes of ``llm.mnn.weight`` an MNN graph reads: the furthest end (offset plus its byte counts) of its ops'
    ``external`` ranges, read from the graph's flatbuffer (``Net.oplists[i].main``) without MNN; ModelLoadError when
    the flatbuffer does not parse (a garbage or truncated graph, which MNN would read past its end)."""
    import struct

    from flatbuffers import encode, number_types as nt
    from flatbuffers.table import Table
    graph = Path(graph)
    buf = bytearray(graph.read_bytes())

    def field(t: Table, i: int) -> int:
        return t.Offset(4 + 2 * i)

    try:
        net = Table(buf, encode.Get(nt.UOffsetTFlags.packer_type, buf, 0))
        ops = field(net, 3)  # Net.oplists
        count = net.VectorLen(ops) if ops else 0
        if count * 4 > len(buf):
            raise IndexError(count)
        start, end = net.Vector(ops) if ops else 0, 0
        for k in range(count):
            op = Table(buf, net.Indirect(start + 4 * k))
            kind_at, main_at = field(op, 1), field(op, 2)  # Op.main: the union's type, then its table
            kind = op.Get(nt.Uint8Flags, op.Pos + kind_at) if kind_at else 0
            if kind not in EXTERNAL_FIELD or not main_at:
                continue
            main = Table(buf, op.Indirect(op.Pos + main_at))
            ext_at = field(main, EXTERNAL_FIELD[kind])
            if not ext_at:
                continue
            n, at = main.VectorLen(ext_at), main.Vector(ext_at)
            if not 2 <= n <= 8:
                raise IndexError(n)
            ext = [main.Get(nt.Int64Flags, at + 8 * j) for j in range(n)]
            if min(ext) < 0:
                raise IndexError(ext)
            end = max(end, ext[0] + sum(ext[1:]))
    except (IndexError, struct.error, ValueError, OverflowError, TypeError):
        raise ModelLoadError(f"'{graph}' is not an MNN graph (its op table does not parse): it is damaged or "
                             "truncated; convert it again") from None
    return end


def check_mnn_llm_folder(folder: str | Path) -> dict:
    """Check an ``mnn-llm`` folder as MNN's engine would read it, before the engine gets it; the files it reads.

    Both configs parse; ``base_dir`` is refused (MNN prefixes it to every name); every name a config gives lies
    inside the folder (no absolute path, no ``..``, no symlink out); each file the engine reads is there with a
    plausible size: the embedding ``vocab x hidden x 2`` bytes (bf16), ``llm.mnn.weight`` non-empty and holding
    what the graph's ops and ``tie_embeddings`` point at, ``llm_config.json``'s sizes sane, the tokenizer's header
    whole, and each file the size ``manifest.json`` recorded when the folder was written."""
    folder = Path(folder)
    config_file = folder / "config.json"
    config = folder_json(config_file, "`workbench convert MODEL --target mnn-llm`")
    if "base_dir" in config:
        raise ModelLoadError(f"'{config_file}' sets base_dir ({config['base_dir']!r}), which sends MNN's engine to "
                             "read every file from there: a folder's config may only name its own files; remove it")
    named_paths(folder, config, config_file, _mnn_path_key)  # every path-like key, used or not, stays inside
    for key, limit in RUN_LIMITS.items():
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit):
            raise ModelLoadError(f"'{config_file}' gives {key} {value!r}: a whole number from 1 to {limit:,} is "
                                 "needed; convert it again")
    recorded = _manifest_sizes(folder)

    def named(key: str, default: str, **size) -> Path:
        value = config.get(key, default)
        if not isinstance(value, str):
            raise ModelLoadError(f"'{config_file}' gives {key} as {value!r}, not a file name: convert it again")
        path = folder_file(folder, value, config_file, key, **size)
        want = recorded.get(value)
        if want is not None and path.stat().st_size != want:
            raise ModelLoadError(f"'{folder / value}' holds {path.stat().st_size:,} bytes, not the {want:,} "
                                 "manifest.json recorded when it was written: it is damaged; convert it again")
        return path

    llm_config_file = named("llm_config", "llm_config.json")
    llm_config = folder_json(llm_config_file, "`workbench convert MODEL --target mnn-llm`")
    named_paths(folder, llm_config, llm_config_file, _mnn_path_key)
    for key, limit in LIMITS.items():
        value = llm_config.get(key)
        if key == "max_position_embeddings" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
            raise ModelLoadError(f"'{llm_config_file}' gives {key} {value!r}: a whole number from 1 to {limit:,} is "
                                 "needed (MNN sizes its buffers from it); convert it again")
    kv = llm_config.get("key_value_shape", [])
    if not isinstance(kv, list) or any(isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 16
                                       for v in kv):
        raise ModelLoadError(f"'{llm_config_file}' gives key_value_shape {kv!r}: whole numbers from 1 to 65,536 are "
                             "needed; convert it again")
    hidden = llm_config["hidden_size"]
    graph = named("llm_model", "llm.mnn", at_least=16, why="of a graph's header")
    with open(graph, "rb") as f:
        root = int.from_bytes(f.read(4), "little")  # a flatbuffer starts with its root table's offset
    if not 4 <= root < graph.stat().st_size:
        raise ModelLoadError(f"'{graph}' is not an MNN graph (its root offset {root:,} lies outside its "
                             f"{graph.stat().st_size:,} bytes): convert it again")
    weight = named("llm_weight", "llm.mnn.weight", at_least=max(1, graph_weight_bytes(graph)),
                   why=f"its graph '{graph.name}' reads (the end of its ops' external ranges)")
    tokenizer = named("tokenizer_file", "tokenizer.txt", at_least=8, why="of a tokenizer header")
    vocab, _ = _read_tokenizer_header(tokenizer)
    files = {"config": config_file, "llm_config": llm_config_file, "llm_model": graph, "llm_weight": weight,
             "tokenizer_file": tokenizer}
    if llm_config.get("is_visual"):
        files.update(_check_visual(folder, config, config_file, llm_config, llm_config_file, vocab, named))
    tied = llm_config.get("tie_embeddings")
    if tied is not None:  # the embedding is read from llm.mnn.weight: [offset, bytes, alpha offset, alpha bytes, ...]
        parts = tied[:4] if isinstance(tied, list) else None
        size = weight.stat().st_size
        if (not parts or len(parts) < 4 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in parts)
                or parts[0] + parts[1] > size or parts[2] + parts[3] > size):
            raise ModelLoadError(f"'{llm_config_file}' gives tie_embeddings {tied!r}, which does not lie within "
                                 f"'{weight}' ({size:,} bytes): convert it again")
        return files
    row = hidden * 2
    emb = named("embedding_file", "embeddings_bf16.bin", at_least=row, why=f"of one bf16 row of {hidden} values")
    have = emb.stat().st_size
    if have % row or have // row < vocab:
        raise ModelLoadError(f"'{emb}' holds {have:,} bytes, not vocab x hidden x 2 = {vocab:,} x {hidden} x 2 = "
                             f"{vocab * row:,} (bf16 rows of llm_config.json's hidden_size for each token of "
                             f"'{tokenizer.name}'): it is truncated or not this model's; convert it again")
    files["embedding_file"] = emb
    return files


def _check_visual(folder: Path, config: dict, config_file: Path, llm_config: dict, llm_config_file: Path, vocab: int,
                  named) -> dict:
    """The picture side of a VL folder (``is_visual``): ``visual.mnn`` (or ``visual_model``) inside the folder and
    a whole graph, the weight file beside it holding what its ops read, and the image keys sane (the size a picture
    is resized to, the image token ids within the vocabulary)."""
    visual = named("visual_model", VISUAL_FILE, at_least=16, why="of a graph's header")
    need = graph_weight_bytes(visual)
    weight = visual.with_name(visual.name + ".weight")
    if need and (not weight.is_file() or weight.stat().st_size < need):
        have = f"holds {weight.stat().st_size:,} bytes" if weight.is_file() else "is missing"
        raise ModelLoadError(f"'{weight}' {have}, but its graph '{visual.name}' reads {need:,} bytes of it: "
                             "convert it again")
    size = llm_config.get("image_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 14 <= size <= 8192:
        raise ModelLoadError(f"'{llm_config_file}' gives image_size {size!r}: a whole number of pixels from 14 to "
                             "8,192 is needed (the square a picture is resized to); convert it again")
    for key in ("image_pad", "vision_start", "vision_end"):
        value = llm_config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < max(vocab, 1):
            raise ModelLoadError(f"'{llm_config_file}' gives {key} {value!r}, not a token of the {vocab:,}-token "
                                 "vocabulary: convert it again")
    return {"visual_model": visual, **({"visual_weight": weight} if need else {})}


class _EngineView:
    """What a caller may still ask the engine directly (its tokenizer, its counters): answered by the child."""

    def __init__(self, lm: "MnnLlm", name: str):
        self.lm, self.name = lm, name

    def tokenizer_encode(self, text: str) -> list[int]:
        return list(self.lm._call("tokenizer_encode", self.name, text))

    @property
    def context(self):
        from types import SimpleNamespace
        return SimpleNamespace(**self.lm._call("context", self.name))

    def reset(self) -> None:
        self.lm._call("reset", self.name)


class MnnLlm:
    """A ``mnn-llm`` folder in MNN's own LLM engine: logits, token steps, and the engine's own timings.

    ``logits(ids)`` runs a fresh prompt with every position's logits (``all_logits``); ``steps()`` is what
    ``stream_tokens`` drives (the engine's KV cache, one token a step); ``prefill_seconds`` and
    ``decode_seconds`` read the engine's ``prefill_us`` / ``decode_us`` counters.

    The folder is checked first (``check_mnn_llm_folder``), and the engine runs in a child process
    (``mnn_llm_engine.py``): a folder that still crashes it is one error naming the folder, and the workbench
    goes on. ``call_seconds`` is the time the child spent in the engine for the last call (its own clock, not
    the pipe's), which the token loop and the profile report; ``load_seconds`` likewise.
    """

    runtime = "MNN-LLM"
    out_of_process = True  # times, load time and memory are the child's (call_seconds, load_seconds, peak_rss_added_mb)

    def __init__(self, folder: str | Path, threads: int | None = None):
        self.folder = Path(folder)
        missing = [f for f in FILES if not (self.folder / f).is_file()]
        if missing:
            raise ModelLoadError(f"'{self.folder}' has no {', '.join(missing)}: convert it again "
                                 "(`workbench convert MODEL --target mnn-llm --out DIR`)")
        self.files = check_mnn_llm_folder(self.folder)
        self.threads = threads or 1
        self._child = None
        self._engine_name = None
        self.call_seconds = 0.0
        self.load_seconds = self._engine("step")

    def _crashed(self, how: str, doing: str):
        names = ", ".join(p.name for p in self.files.values() if not p.name.endswith(".json"))
        return NativeEngineError(f"MNN's LLM engine crashed ({how}) {doing} '{self.folder}': its files ({names}) are "
                                 "damaged or not what config.json says; convert it again")

    def _call(self, op: str, *args):
        """One request to the engine's child; its crash or error becomes one line naming the folder."""
        doing = "loading" if op == "load" else "running"
        try:
            if self._child is None:
                self._child = ChildEngine(ENGINE_SCRIPT, timeout=engine_timeout())
            result = self._child.call(op, *args)
        except ChildHung as e:
            self.close()
            raise NativeEngineError(f"MNN's LLM engine hung {doing} '{self.folder}' ({e.how}): its files may be "
                                    f"damaged (convert it again), or it needs longer (${ENGINE_TIMEOUT_VAR}=SECONDS)") from None
        except ChildCrashed as e:
            self.close()
            raise self._crashed(e.how, doing) from None
        except ChildFailed as e:
            if "No module named 'MNN'" in str(e):
                raise WorkbenchError("MNN's LLM engine is not available: install the MNN package "
                                     "(pip install -c constraints.txt MNN)") from None
            raise ModelLoadError(f"MNN's LLM engine failed {doing} '{self.folder}' ({e}): convert it again") from None
        self.call_seconds = self._child.seconds
        return result

    def _engine(self, name: str) -> float:
        """Load the engine ``name`` (``step``: last position's logits, ``score``: all of them) in the child, in place
        of the other (one engine's weights resident at a time); the seconds its load took."""
        if not self._call("load", str(self.folder / "config.json"), self.threads, name == "score", name):
            raise ModelLoadError(f"MNN's LLM engine could not load '{self.folder}': convert it again")
        self._engine_name = name
        return self.call_seconds

    def _use(self, name: str) -> str:
        if self._engine_name != name:
            self._engine(name)
        return name

    @property
    def m(self) -> _EngineView:
        """The engine that steps and times (the last position's logits), loaded again if ``logits`` let it go."""
        return _EngineView(self, self._use("step"))

    def _forward(self, name: str, ids: Sequence[int], reset: bool = False) -> np.ndarray:
        return self._call("forward", self._use(name), [int(i) for i in ids], reset)

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits ``[1, n, vocab]`` of one fresh prompt, every position (an engine loaded with ``all_logits``, on
        first use, in place of the stepping one: one engine's weights resident at a time)."""
        ids = np.asarray(input_ids).reshape(-1)
        return self._forward("score", ids, reset=True).reshape(1, len(ids), -1)

    def steps(self, max_length: int | None = None) -> "_EngineSteps":
        """One generation's steps through the engine's own KV cache (what ``stream_tokens`` drives)."""
        return _EngineSteps(self)

    @property
    def context(self):
        """The engine's counters of its last generation (``prompt_len``, ``gen_seq_len``, ``prefill_us``, ...)."""
        return self.m.context

    def run_prefill(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray, None]:
        """A fresh prompt through the engine's cache: the last position's logits (twice: the engine gives only
        that one here) and no KV cache of ours (the engine keeps its own); ``run_decode`` calls follow in order."""
        last = self._forward("step", prompt, reset=True)[-1]
        return last, last[None, None], None

    def run_decode(self, token: int, kv, position: int) -> tuple[np.ndarray, None, None]:
        """The next token through the engine's own cache (``kv`` is unused: the engine's state is the cache, so
        steps go in order after ``run_prefill``)."""
        return self._forward("step", [token])[-1], None, None

    def _generate(self, prompt: Sequence[int], new_tokens: int):
        """The engine's own generate loop (greedy, as config.json says); its context after."""
        from types import SimpleNamespace
        return SimpleNamespace(**self._call("generate", self._use("step"), [int(i) for i in prompt], int(new_tokens)))

    def prefill_seconds(self, prompt: Sequence[int]) -> float:
        """The engine's own prefill time of ``prompt`` (``context.prefill_us``)."""
        return self._generate(prompt, 1).prefill_us / 1e6

    def decode_seconds(self, prompt: Sequence[int], steps: int) -> float:
        """The engine's own time for ``steps`` tokens after the first (``context.decode_us`` over the
        ``gen_seq_len - 1`` tokens it decoded after ``prompt``, scaled to ``steps``)."""
        ctx = self._generate(prompt, steps + 1)
        made = ctx.gen_seq_len - 1
        if made < 1:
            raise WorkbenchError(f"MNN's engine stopped after {ctx.gen_seq_len} token(s); nothing was decoded")
        return ctx.decode_us / 1e6 * steps / made

    @property
    def is_visual(self) -> bool:
        """Whether the folder holds a vision encoder (``visual.mnn``) the engine reads pictures with."""
        return "visual_model" in self.files

    def image_logits(self, text: str) -> tuple[list[int], np.ndarray]:
        """The engine's ids and every position's logits for ``text`` with ``<img>PATH</img>`` (the engine reads,
        encodes and places the picture itself)."""
        r = self._call("image_prompt", self._use("score"), text, 0)
        return r["ids"], r["logits"]

    def image_generate(self, text: str, new_tokens: int):
        """The engine's own generate of ``text`` with a picture; its context (``vision_us``: the encoder's time,
        ``prefill_us``, ``decode_us``) and the ids."""
        from types import SimpleNamespace
        return SimpleNamespace(**self._call("image_prompt", self._use("step"), text, int(new_tokens)))

    def picture_inputs(self, source: Path, tokenizer):
        """The float VLM's picture-and-question preprocessing when this folder reads pictures (``visual.mnn``)."""
        return source_vision_inputs(source, tokenizer) if self.is_visual else None

    def picture_steps(self, images, image, question: str) -> tuple["_PictureRunner", list[int]]:
        """What ``stream_tokens`` drives for a question about ``image`` (``images``: the float model's
        ``VisionInputs``): the engine reads the picture itself at the first step; and the prompt's ids (the float
        model's, which the engine's must equal)."""
        import tempfile
        size = int(folder_json(self.files["llm_config"], "`workbench convert MODEL --target mnn-llm`")["image_size"])
        tmp = tempfile.TemporaryDirectory(prefix="workbench-mnn-picture-")
        try:
            q = EngineQuestion(images, image, question, size, Path(tmp.name))
        except BaseException:
            tmp.cleanup()
            raise
        return _PictureRunner(self, q, tmp), list(q.ids)

    def picture_profile(self, steps: int, repeats: int) -> dict:
        """The engine's encoder, prefill and decode times for a prompt with one picture of the folder's own size
        (a fixed noise picture: the encoder's cost depends on the size only), after a warm-up (``picture_timing``)."""
        import tempfile
        size = int(folder_json(self.files["llm_config"], "`workbench convert MODEL --target mnn-llm`")["image_size"])
        with tempfile.TemporaryDirectory(prefix="workbench-mnn-picture-") as tmp:
            picture = noise_picture(size, Path(tmp))
            out = picture_timing(self, f"<img>{picture}</img>{PICTURE_PROMPT}", steps, repeats)
        return {"image_size": size, **out}

    def peak_rss_added_mb(self) -> float | None:
        """The peak resident memory the engine's child added over its own start (MiB), or None off Linux."""
        return self._call("peak_rss_added_mb")

    def close(self) -> None:
        """End the engine's child process (it also ends with this object, or with the workbench)."""
        child, self._child, self._engine_name = self._child, None, None
        if child is not None:
            child.close()


class _EngineSteps:
    """One generation through the engine's KV cache: the prompt, then one token a step. ``engine_seconds``: the
    engine's own time for the last of them (measured in its child process)."""

    def __init__(self, lm: MnnLlm):
        self.lm = lm

    @property
    def engine_seconds(self) -> float:
        return self.lm.call_seconds

    def start(self, prompt: list[int]) -> np.ndarray:
        return self.lm._forward("step", prompt, reset=True)[-1]

    def step(self, token: int, position: int) -> np.ndarray:
        return self.lm._forward("step", [token])[-1]


class _PictureRunner:
    """One question about a picture in MNN's engine, as ``stream_tokens`` drives it (``steps``): the first step
    hands the engine the prompt with ``<img>PATH</img>`` (it reads, encodes and places the picture), the later
    ones one token each through its KV cache."""

    def __init__(self, lm: MnnLlm, question, tmp):
        self.lm, self.question, self.tmp = lm, question, tmp

    def steps(self, total: int) -> "_PictureRunner":
        return self

    @property
    def engine_seconds(self) -> float:
        return self.lm.call_seconds

    def start(self, prompt: list[int]) -> np.ndarray:
        try:
            r = self.lm._call("image_start", self.lm._use("step"), self.question.text)
        finally:
            self.tmp.cleanup()  # the engine has read the picture
        if r["ids"] != self.question.ids:
            raise WorkbenchError(f"MNN's engine made {len(r['ids'])} ids of the prompt where transformers made "
                                 f"{len(self.question.ids)}: its tokenizer.txt or image settings are not this "
                                 "model's; convert it again")
        return r["logits"]

    def step(self, token: int, position: int) -> np.ndarray:
        return self.lm._forward("step", [token])[-1]


def open_mnn_llm(folder: str | Path, *, threads: int | None = None) -> MnnLlm:
    return MnnLlm(folder, threads=threads)


def convert_mnn_llm(job) -> None:
    """The simulation as MNN's LLM directory (the plan's integers re-derived by MNN), scored by the engine."""
    prep, report = job.prep, job.report
    job.say("writing MNN's LLM model directory")
    t = time.perf_counter()
    info = write_mnn_llm_folder(prep.sim_lm, prep.qm, job.out, job.work / "mnn-llm",
                                processor=getattr(prep.float_lm, "processor", None))
    report.details["seconds"]["write"] = time.perf_counter() - t
    report.notes += info.pop("notes")
    report.details["mnn_llm"] = info
    runner = MnnLlm(job.out, threads=2)
    try:
        score_in_runtime(job, runner, "mnn-llm", job.out / "llm.mnn",
                         "the engine's own counters (context.prefill_us, context.decode_us)")
        if runner.is_visual and job.evaluate_outputs:
            score_vision(job, runner)
    finally:
        runner.close()


TARGET = register_target(Target(
    "mnn-llm", "MNN-LLM", rules="mnn", convert=convert_mnn_llm, runnable=True, runner=open_mnn_llm, files=FILES,
    module=__name__,
    precision_note="MNN re-quantizes the simulated weights with one float scale and minimum per block, which "
                   "reproduces the plan's 4 and 8-bit grids; other widths are not carried"))
