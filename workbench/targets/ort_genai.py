"""ONNX Runtime CPU, ``ort-genai``: one fused graph with the plan's integers, run by onnxruntime-genai.

    build = build_fused_onnx(sim_model, "out/genai", qm.precisions, accuracy_level=4)
    convert("demo", "ort-genai", "out/genai", bits=4)     # builds, checks, runs and compares
    model = GenaiCausalLM("out/genai", threads=2)         # onnxruntime-genai's runtime over the folder

What ``ort-int4`` writes is the workbench's op-by-op decoder (thousands of small nodes, prefill and
decode graphs). For a CPU host this target writes instead the graph onnxruntime's CPU kernels are
built for, the layout onnxruntime-genai's own model builder produces: one ``model.onnx`` serving
prefill and decode, ``GroupQueryAttention`` (rotary embedding and KV cache inside, the cache shared
with the past in place), ``SimplifiedLayerNormalization`` / ``SkipSimplifiedLayerNormalization``
(residual adds fused into the norms), q/k/v and gate/up projections fused into one ``MatMulNBits``
each where they share bits and block size, and the head and embedding per the plan
(``MatMulNBits``, ``GatherBlockQuantized``: a tied pair reads one copy of the codes).

The weights are the plan's own integers (RTN, AWQ, GPTQ, mixed INT4/INT8 per layer), packed from
the ``QuantizedModel``'s codes, never quantized again: concatenating two layers' codes along the
output axis is exact. Scales are stored as float16 where every value is one (the workbench keeps
them so) and widened once when the session loads, so the file holds the weights once at the size
the plan counts. The folder is what onnxruntime-genai opens: ``model.onnx`` (+ ``weights.data``
above the inline limit), ``genai_config.json`` and the tokenizer files of the model.

Checks: plain onnxruntime runs the graph against the PyTorch simulation (logits and KV of a
prefill and a decode step, then greedy tokens) and through the evaluation (KL, top-1), as every
target; onnxruntime-genai runs it for generation and decode speed. Supported: Llama, Mistral,
Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k norms); other architectures are refused.
Rules: ``assets/targets/ort.json``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from torch import nn

from ..errors import ModelLoadError, WorkbenchError
from ..files.folder_paths import check_graph_paths, folder_file, inside_folder, json_items, refuse_native_libraries
from ..numerics.memory import release_freed_memory
from ..onnx.build import DATA_FILE, INLINE_LIMIT, DecoderSpec, GraphBuilder, TensorStore, as_array
from ..runtime.onnx_runner import OnnxCausalLM
from ..runtime.parity import greedy_agreement, parity, torch_reference
from ..runtime.stream import torch_threads
from .ort_int4 import (ACCURACY_LEVELS, NBitsWeights, nbits_tensors, release_float_model, storage_notes,
                       matmulnbits_block_size)
from .registry import Target, register_target
from ..onnx.inspect import decode_step_bytes
from ..quantize.plan import get_precision

__all__ = ["FusedBuild", "FusedWeights", "build_fused_onnx", "refuse_per_layer_heads", "write_genai_folder", "GenaiCausalLM", "convert_ort_genai",
           "is_genai_folder", "GENAI_TYPES", "MODEL_FILE", "GENAI_CONFIG", "TOKENIZER_FILES", "TARGET"]

MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
GENAI_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> genai's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")
OPSET = 17


@dataclass
class FusedBuild:
    """What ``build_fused_onnx`` wrote: the graph, its data file, which layers became integer ops."""

    path: Path
    data_path: Path | None
    weight_bytes: int  # distinct tensors written (once)
    replaced: dict[str, str] = field(default_factory=dict)  # layer FQN -> integer node
    kept_float: dict[str, str] = field(default_factory=dict)  # layer FQN -> why it stayed float
    fused: dict[str, list[str]] = field(default_factory=dict)  # fused node -> the layers whose codes it carries
    ops: dict[str, int] = field(default_factory=dict)  # op type -> count

    @property
    def files(self) -> list[Path]:
        return [self.path] + ([self.data_path] if self.data_path else [])


def _half_scales(scales: np.ndarray) -> np.ndarray:
    """float16 scales when that keeps every value (the workbench's scales are float16 values), else float32."""
    half = scales.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), scales) else scales


class FusedWeights(NBitsWeights):
    """``NBitsWeights`` whose scales are stored as float16 (widened when loaded) and whose sibling projections
    (q/k/v, gate/up) share one ``MatMulNBits`` when their integers have the same form."""

    def __init__(self, precisions: Mapping[str, str | None], accuracy_level: int = 4):
        super().__init__(precisions, accuracy_level)
        self.fused: dict[str, list[str]] = {}

    def _scales(self, g: GraphBuilder, name: str, scales: np.ndarray) -> str:
        from onnx import TensorProto
        array = _half_scales(scales)
        stored = g.weight(name, lambda: array)
        if array.dtype == np.float16:
            return g.op("Cast", [stored], to=TensorProto.FLOAT, name=f"/{name}/Cast")  # folded when the session loads
        return stored

    def _tensors(self, g: GraphBuilder, qw, fqn: str, block: int, kind: str) -> tuple[str, str, str | None]:
        n, k = qw.shape
        codes_shape = [n, k // block, block * qw.bits // 8] if kind == "matmul" else [n, k * qw.bits // 8]
        first = self._codes.get(id(qw.qweight))
        if first is None:
            codes, scales, zeros = nbits_tensors(qw, block)
            qweight = g.weight(f"{fqn}.weight.qweight", lambda: codes.reshape(codes_shape))
            zname = g.weight(f"{fqn}.weight.zeros", lambda: zeros) if zeros is not None else None
            first = (qweight, self._scales(g, f"{fqn}.weight.scales", scales), zname)
            self._codes[id(qw.qweight)] = first
            return first
        name = f"{fqn}.weight.qweight"
        if first[0] == name:
            return first
        return (g.alias(name, first[0], codes_shape), first[1], first[2])  # a tied head: the embedding's bytes

    def fusable(self, modules: Sequence[nn.Module]) -> bool:
        """Whether ``modules`` are integer layers of one form (bits, block, symmetry, inputs): then their codes
        concatenate into one MatMulNBits weight exactly."""
        qws = [getattr(m, "quantized", None) for m in modules]
        if any(q is None for q in qws):
            return False
        form = {(q.bits, matmulnbits_block_size(q.effective_group_size), q.symmetric, q.shape[1]) for q in qws}
        return len(form) == 1 and next(iter(form))[1] is not None

    def fused_linear(self, g: GraphBuilder, modules: Sequence[nn.Module], fqns: Sequence[str], fused_name: str,
                     x: str, split: bool = True) -> list[str]:
        """The outputs of ``modules`` on ``x``: one ``MatMulNBits`` over their concatenated codes and a Split when
        they share bits, block and symmetry (``split`` False: the concatenated output alone); else one op each."""
        from onnx import helper
        if len(modules) < 2 or not self.fusable(modules):
            return [self.linear(g, m, f, x) for m, f in zip(modules, fqns)]
        qws = [m.quantized for m in modules]
        block = matmulnbits_block_size(qws[0].effective_group_size)
        parts = [nbits_tensors(q, block) for q in qws]
        widths = [q.shape[0] for q in qws]
        n, k, bits = sum(widths), qws[0].shape[1], qws[0].bits
        qweight = g.weight(f"{fused_name}.weight.qweight", lambda: np.concatenate([p[0] for p in parts]))
        scales = self._scales(g, f"{fused_name}.weight.scales", np.concatenate([p[1] for p in parts]))
        zeros = None
        if parts[0][2] is not None:
            zeros = g.weight(f"{fused_name}.weight.zeros", lambda: np.concatenate([p[2] for p in parts]))
        del parts
        node = f"/{fused_name}/MatMulNBits"
        y = g.op("MatMulNBits", [x, qweight, scales] + ([zeros] if zeros else []), domain="com.microsoft", name=node,
                 K=k, N=n, bits=bits, block_size=block, accuracy_level=self.accuracy_level)
        biases = [getattr(m, "bias", None) for m in modules]
        if any(b is not None for b in biases):
            bias = np.concatenate([np.zeros(w, np.float32) if b is None else as_array(b)
                                   for b, w in zip(biases, widths)])
            y = g.op("Add", [y, g.weight(f"{fused_name}.bias", lambda: bias)])
        for fqn in fqns:
            self.record(fqn, qweight, "nbits")
            self.replaced[fqn] = node
        self.fused[node] = list(fqns)
        if not split:
            return [y]
        outs = [f"{node}/Split_output_{i}" for i in range(len(modules))]
        g.nodes.append(helper.make_node("Split", [y, g.const(widths)], outs, name=f"/{fused_name}/Split", axis=-1))
        return outs


def _multi(g: GraphBuilder, op_type: str, inputs: Sequence[str], outputs: int, name: str, used: Sequence[int],
           **attrs) -> list[str]:
    """A node with several outputs (only the ``used`` ones named); the contrib ops live in com.microsoft."""
    from onnx import helper
    names = [f"{name}_output_{i}" if i in used else "" for i in range(outputs)]
    while names and not names[-1]:
        names.pop()
    domain = "com.microsoft" if op_type in ("GroupQueryAttention", "SkipSimplifiedLayerNormalization") else None
    g.nodes.append(helper.make_node(op_type, list(inputs), names, name=name, domain=domain, **attrs))
    g.ms_domain = g.ms_domain or domain is not None
    return [names[i] for i in used]


def _eps(module: nn.Module) -> float:
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))


def _norm_weight(g: GraphBuilder, module: nn.Module, name: str) -> str:
    return g.weight(f"{name}.weight", lambda: as_array(module.weight))


def _rotary_caches(g: GraphBuilder, spec: DecoderSpec, positions: int) -> tuple[str, str]:
    """cos and sin ``[positions, head_dim / 2]`` as transformers computes them (float32, attention scaling), written
    as nodes over constants: onnxruntime folds them once when it loads the model, and the file does not carry
    them (8 MB for 32,768 positions of a 64-wide head)."""
    pos = g.op("Range", [g.const(0.0, np.float32), g.const(float(positions), np.float32), g.const(1.0, np.float32)],
               name="/rotary/Range")
    freqs = g.op("Mul", [g.op("Unsqueeze", [pos, g.const([1])], name="/rotary/Unsqueeze"),
                         g.const(spec.inv_freq.astype(np.float32), np.float32)], name="/rotary/freqs")
    scale = g.const(spec.rope_scaling, np.float32)
    return (g.op("Mul", [g.op("Cos", [freqs], name="/rotary/Cos"), scale], name="/rotary/cos_cache"),
            g.op("Mul", [g.op("Sin", [freqs], name="/rotary/Sin"), scale], name="/rotary/sin_cache"))


def _genai_type(model: nn.Module) -> str:
    cfg = model.config
    kind = str(getattr(cfg, "model_type", ""))
    if kind not in GENAI_TYPES:
        arch = ", ".join(getattr(cfg, "architectures", None) or [type(model).__name__])
        raise ModelLoadError(f"ort-genai builds Llama, Mistral, Qwen2/Qwen2.5 and Qwen3 decoders; {arch} (model_type "
                             f"'{kind}') is not one: convert it with --target ort-int4")
    return GENAI_TYPES[kind]


def _positions(model: nn.Module) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 4096)


def refuse_per_layer_heads(spec: DecoderSpec) -> None:
    """onnxruntime-genai's genai_config (and its KV cache) holds one head count for all layers: refuse others."""
    if spec.uniform:
        return
    odd = [f"layer {i}: {h}/{kv}" for i, (h, kv) in enumerate(spec.layer_heads)
           if (h, kv) != (spec.heads, spec.kv_heads)]
    raise ModelLoadError(f"ort-genai cannot hold a model whose layers have different head counts (query/KV heads "
                         f"{', '.join(odd)}; the others {spec.heads}/{spec.kv_heads}): genai_config has one count for "
                         "every layer; convert to ort-int4 (or ort-qdq, qnn, mnn), or prune with the same counts in "
                         "every layer (spread 'layer', keep_first_last false)")


def build_fused_onnx(sim_model: nn.Module, out_dir: str | Path, precisions: Mapping[str, str | None], *,
                     accuracy_level: int = 4, inline_limit: int | None = None) -> FusedBuild:
    """``model.onnx`` in ``out_dir``: ``sim_model`` (a plan's simulation) as one fused graph with its integers.

    Inputs ``input_ids``, ``attention_mask`` and ``past_key_values.{i}.key/value``; outputs ``logits`` and
    ``present.{i}.key/value`` (onnxruntime-genai's names). A past of length 0 runs prefill.
    """
    from onnx import TensorProto, helper
    _genai_type(sim_model)
    spec = DecoderSpec.from_model(sim_model)
    refuse_per_layer_heads(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / DATA_FILE, out / MODEL_FILE):
        stale.unlink(missing_ok=True)
    store = TensorStore(out, INLINE_LIMIT if inline_limit is None else inline_limit)
    policy = FusedWeights(precisions, accuracy_level)
    g = GraphBuilder(store, OPSET, None)
    base, d, hq, hkv = spec.base, spec.head_dim, spec.heads, spec.kv_heads
    try:
        import torch
        with torch.no_grad():
            # positions: GroupQueryAttention reads seqlens_k (tokens seen - 1) and the total length from the mask
            seen = g.op("ReduceSum", ["attention_mask", g.const([1])], keepdims=0, name="/mask/ReduceSum")
            seqlens_k = g.op("Cast", [g.op("Sub", [seen, g.const(1)], name="/mask/Sub")], to=TensorProto.INT32,
                             name="/mask/seqlens_k")
            total = g.op("Gather", [g.op("Shape", ["attention_mask"], name="/mask/Shape"), g.const(1)], axis=0,
                         name="/mask/Gather")
            total = g.op("Cast", [total], to=TensorProto.INT32, name="/mask/total_sequence_length")
            cos, sin = _rotary_caches(g, spec, _positions(sim_model))
            h = policy.embedding(g, base.embed_tokens, "model.embed_tokens", "input_ids")
            residual, pending = h, None  # pending: the block output not yet added to the residual stream
            presents = []
            for i, block in enumerate(base.layers):
                p = f"model.layers.{i}"
                a, m = block.self_attn, block.mlp
                x, residual = _add_norm(g, residual, pending, block.input_layernorm, f"{p}.input_layernorm")
                projs = [a.q_proj, a.k_proj, a.v_proj]
                names = [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]
                if not spec.qk_norm and policy.fusable(projs):  # packed q/k/v: GroupQueryAttention splits it
                    q, k, v = policy.fused_linear(g, projs, names, f"{p}.self_attn.qkv_proj", x, split=False) + ["", ""]
                else:
                    q, k, v = policy.fused_linear(g, projs, names, f"{p}.self_attn.qkv_proj", x)
                if spec.qk_norm:
                    q = _head_norm(g, q, a.q_norm, f"{p}.self_attn.q_norm", d, hq)
                    k = _head_norm(g, k, a.k_norm, f"{p}.self_attn.k_norm", d, hkv)
                attn, pk, pv = _multi(
                    g, "GroupQueryAttention",
                    [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total, cos, sin],
                    3, f"/{p}/self_attn/GroupQueryAttention", (0, 1, 2), num_heads=hq, kv_num_heads=hkv,
                    scale=float(getattr(a, "scaling", d ** -0.5)), do_rotary=1, rotary_interleaved=0,
                    local_window_size=-1)
                o = policy.linear(g, a.o_proj, f"{p}.self_attn.o_proj", attn)
                x, residual = _add_norm(g, residual, o, block.post_attention_layernorm,
                                        f"{p}.post_attention_layernorm")
                gate, up = policy.fused_linear(g, [m.gate_proj, m.up_proj], [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"],
                                               f"{p}.mlp.gate_up_proj", x)
                act = g.op("Mul", [gate, g.op("Sigmoid", [gate], name=f"/{p}/mlp/Sigmoid")], name=f"/{p}/mlp/SiLU")
                pending = policy.linear(g, m.down_proj, f"{p}.mlp.down_proj",
                                        g.op("Mul", [act, up], name=f"/{p}/mlp/Mul"))
                presents += [(pk, f"present.{i}.key"), (pv, f"present.{i}.value")]
            x, _ = _add_norm(g, residual, pending, base.norm, "model.norm")
            logits = policy.lm_head(g, sim_model.get_output_embeddings(), "lm_head", x, base.embed_tokens)
        for value, name in [(logits, "logits")] + presents:
            g.rename(value, name)
        store.close()
        kv = lambda length: ["batch_size", hkv, length, d]  # noqa: E731
        inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
                  helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                ["batch_size", "total_sequence_length"])]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                 ["batch_size", "sequence_length", spec.vocab])]
        for i in range(spec.layers):
            for part in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{part}", TensorProto.FLOAT,
                                                            kv("past_sequence_length")))
                outputs.append(helper.make_tensor_value_info(f"present.{i}.{part}", TensorProto.FLOAT,
                                                             kv("total_sequence_length")))
        graph = helper.make_graph(g.nodes, "model", inputs, outputs,
                                  list(g.constants.values()) + [store.proto(w) for w in g.weights])
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                        helper.make_opsetid("com.microsoft", 1)],
                                  producer_name="workbench")
        proto.ir_version = min(proto.ir_version, 10)
        path = out / MODEL_FILE
        tmp = path.with_name(path.name + ".partial")
        tmp.write_bytes(proto.SerializeToString())
        os.replace(tmp, path)
    finally:
        store.close()
    kept = dict(policy.notes)
    for fqn, prec in precisions.items():
        if fqn not in policy.replaced and fqn not in kept and prec and prec.startswith("int"):
            kept[fqn] = f"{prec} in the plan, but the layer reached the graph as float"
    ops: dict[str, int] = {}
    for node in g.nodes:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return FusedBuild(path, store.data_path if store.external else None, store.bytes, dict(policy.replaced), kept,
                      dict(policy.fused), dict(sorted(ops.items(), key=lambda kv: -kv[1])))


def _add_norm(g: GraphBuilder, residual: str, pending: str | None, norm: nn.Module, name: str) -> tuple[str, str]:
    """``(norm(residual + pending), residual + pending)``: one SkipSimplifiedLayerNormalization (or the plain norm
    when nothing is pending, before the first block)."""
    w = _norm_weight(g, norm, name)
    if pending is None:
        return g.op("SimplifiedLayerNormalization", [residual, w], axis=-1, epsilon=_eps(norm), stash_type=1,
                    name=f"/{name}/SimplifiedLayerNormalization"), residual
    out, total = _multi(g, "SkipSimplifiedLayerNormalization", [residual, pending, w], 4,
                        f"/{name}/SkipSimplifiedLayerNormalization", (0, 3), epsilon=_eps(norm))
    return out, total


def _head_norm(g: GraphBuilder, x: str, norm: nn.Module, name: str, head_dim: int, heads: int) -> str:
    """Qwen3's RMSNorm over each head's ``head_dim`` values, before the rotary embedding."""
    y = g.op("Reshape", [x, g.const([0, -1, head_dim])], name=f"/{name}/Reshape")
    y = g.op("SimplifiedLayerNormalization", [y, _norm_weight(g, norm, name)], axis=-1, epsilon=_eps(norm),
             stash_type=1, name=f"/{name}/SimplifiedLayerNormalization")
    return g.op("Reshape", [y, g.const([0, -1, heads * head_dim])], name=f"/{name}/Reshape_back")


# -- the folder onnxruntime-genai opens -------------------------------------------------------------

def _config_docs(model_dir: Path | None, model: nn.Module) -> dict:
    doc = model.config.to_dict()
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        try:
            gen = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
            doc = {**doc, **{k: v for k, v in gen.items() if k.endswith("token_id") and v is not None}}
        except ValueError:
            pass
    return doc


def write_genai_folder(out_dir: str | Path, sim_model: nn.Module, model_dir: str | Path | None,
                       tokenizer=None) -> Path:
    """``genai_config.json`` and the tokenizer files beside ``model.onnx``: what ``og.Model`` / ``og.Tokenizer``
    read. Tokenizer files come from ``model_dir`` (or are written by ``tokenizer``)."""
    out = Path(out_dir)
    src = Path(model_dir) if model_dir is not None else None
    doc = _config_docs(src, sim_model)
    spec = DecoderSpec.from_model(sim_model)
    eos = doc.get("eos_token_id")
    eos = eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
    pad = doc.get("pad_token_id")
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) and eos else eos)
    positions = _positions(sim_model)
    config = {
        "model": {
            "bos_token_id": doc.get("bos_token_id") if doc.get("bos_token_id") is not None else pad,
            "context_length": positions,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE, "head_size": spec.head_dim, "hidden_size": spec.hidden,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": spec.heads, "num_hidden_layers": spec.layers,
                "num_key_value_heads": spec.kv_heads},
            "eos_token_id": eos, "pad_token_id": pad, "type": _genai_type(sim_model), "vocab_size": spec.vocab},
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": positions, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": True, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }
    (out / GENAI_CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
    copied = []
    if src is not None:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
                copied.append(name)
    if "tokenizer.json" not in copied and tokenizer is not None:
        tokenizer.save_pretrained(out)
    if not (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").is_file():
        raise ModelLoadError(f"no tokenizer files (tokenizer.json or tokenizer.model) in '{src}' to put beside the "
                             "model: onnxruntime-genai needs them; load the model with its tokenizer")
    return out / GENAI_CONFIG


def is_genai_folder(path: str | Path) -> bool:
    p = Path(path)
    return (p / GENAI_CONFIG).is_file() and (p / MODEL_FILE).is_file()


def _check_named_files(folder: Path, doc, config_file: Path) -> None:
    """Every file name genai_config.json gives (``filename``, ``config_filename``, ...) lies inside the folder, and
    each graph it names is there, parses, and names only files inside the folder itself (external data)."""
    for _, k, v in json_items(doc):
        if isinstance(v, str) and (k == "filename" or k.endswith("_filename") or k.endswith("_file")):
            inside_folder(folder, v, config_file, k)
            if v.endswith(".onnx"):
                graph = folder_file(folder, v, config_file, k, at_least=8, why="of an ONNX graph")
                try:
                    check_graph_paths(graph)
                except ModelLoadError:
                    raise
                except Exception as e:  # onnx's own parse error for a damaged graph
                    raise ModelLoadError(f"'{graph}' is not a readable ONNX graph ({type(e).__name__}): it is "
                                         "damaged or truncated; convert with --target ort-genai again") from None


class GenaiCausalLM:
    """onnxruntime-genai's runtime over an ``ort-genai`` folder: its KV cache (shared with the past in place),
    its generator and its search.

    ``steps()`` gives what ``workbench.run.generate.stream_tokens`` drives (logits after each appended token,
    picked by the workbench's own picker, so sampling reads the same across runtimes); ``greedy`` runs
    onnxruntime-genai's own greedy search; ``decode_speed`` times it.
    """

    runtime = "onnxruntime-genai"

    def __init__(self, folder: str | Path, threads: int | None = None, allow_custom_ops: bool = False):
        try:
            import onnxruntime_genai as og
        except ImportError:
            raise WorkbenchError("onnxruntime-genai is not installed: pip install --no-deps onnxruntime-genai==0.18.0 "
                                 "(its own pins would replace onnxruntime)") from None
        self.folder = Path(folder)
        if not is_genai_folder(self.folder):
            raise ModelLoadError(f"'{self.folder}' has no {GENAI_CONFIG} and {MODEL_FILE}: convert with --target "
                                 "ort-genai")
        config_file = self.folder / GENAI_CONFIG
        try:
            doc = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"'{config_file}' is not readable JSON ({e}): convert with --target ort-genai "
                                 "again") from None
        if not allow_custom_ops:
            refuse_native_libraries(doc, config_file)
        try:
            self.max_length = int(doc["search"]["max_length"])
            self.vocab = int(doc["model"]["vocab_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"'{config_file}' lacks {e} (search.max_length and model.vocab_size are needed): "
                                 "convert with --target ort-genai again") from None
        _check_named_files(self.folder, doc.get("model"), config_file)
        self.threads = threads
        self._og = og
        try:
            config = og.Config(str(self.folder))
            if threads:
                config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                    "intra_op_num_threads": int(threads), "inter_op_num_threads": 1}}}}))
            self.model = og.Model(config)
        except Exception as e:  # the runtime's own message for a folder it cannot load
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"onnxruntime-genai could not load '{self.folder}': {first}; convert again") from None

    def generation_settings(self) -> dict:
        """End-of-sequence ids and positions from the folder's ``genai_config.json`` (the folder holds its
        tokenizer too, so it generates without the model it was converted from)."""
        folder = self.folder
        try:
            model = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))["model"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ModelLoadError(f"'{folder / 'genai_config.json'}' is not onnxruntime-genai's config: convert again") \
                from None
        return {"eos_token_id": model.get("eos_token_id"), "max_position_embeddings": model.get("context_length")}

    def generator(self, max_length: int | None = None):
        og = self._og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=min(max_length or self.max_length, self.max_length), do_sample=False,
                                  top_k=1)
        return og.Generator(self.model, params)

    def steps(self, max_length: int | None = None) -> "_GenaiSteps":
        """One generation's steps; ``max_length`` (prompt plus new tokens) sizes its KV buffer, which otherwise
        holds the model's whole context (2.7 GB for 32,768 positions of the 301 M shape)."""
        return _GenaiSteps(self, max_length)

    def greedy(self, prompt: Sequence[int], steps: int) -> list[int]:
        """``steps`` tokens of onnxruntime-genai's own greedy search after ``prompt`` (no end-of-sequence stop)."""
        gen = self.generator(len(prompt) + steps)
        gen.append_tokens([int(t) for t in prompt])
        out = []
        while len(out) < steps and not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return out

    def prefill_seconds(self, prompt: Sequence[int]) -> float:
        """Seconds to run ``prompt`` through a new generator (what yields the first token's logits)."""
        gen = self.generator(len(prompt) + 1)
        t = time.perf_counter()
        gen.append_tokens([int(t) for t in prompt])
        return time.perf_counter() - t

    def decode_seconds(self, prompt: Sequence[int], steps: int) -> float:
        """Seconds of ``steps`` tokens of onnxruntime-genai's generate loop after ``prompt`` and one token more
        (prefill and the first step excluded)."""
        gen = self.generator(len(prompt) + steps + 2)
        gen.append_tokens([int(t) for t in prompt])
        gen.generate_next_token()
        t = time.perf_counter()
        for _ in range(steps):
            gen.generate_next_token()
        return time.perf_counter() - t

    def decode_speed(self, prompt: Sequence[int], steps: int = 32, repeats: int = 3) -> float:
        """Tokens/s of onnxruntime-genai's generate loop (``decode_seconds``), the fastest of ``repeats`` runs."""
        best = min(self.decode_seconds(prompt, steps) for _ in range(repeats))
        return steps / best if best > 0 else math.inf


class _GenaiSteps:
    """One generation's state in onnxruntime-genai: the prompt appended, then one token at a time."""

    def __init__(self, lm: GenaiCausalLM, max_length: int | None = None):
        self.lm, self.max_length, self.gen = lm, max_length, None

    def _logits(self) -> np.ndarray:
        return np.asarray(self.gen.get_logits(), np.float32).reshape(-1, self.lm.vocab)[-1]

    def start(self, prompt: list[int]) -> np.ndarray:
        self.gen = self.lm.generator(max(self.max_length or 0, len(prompt) + 1) if self.max_length else None)
        self.gen.append_tokens([int(t) for t in prompt])
        return self._logits()

    def step(self, token: int, position: int) -> np.ndarray:
        self.gen.append_tokens([int(token)])
        return self._logits()


def fused_runner(folder: str | Path, threads: int | None = 1) -> OnnxCausalLM:
    """Plain onnxruntime over the fused graph (one session, prefill and decode): for parity and KL checks."""
    path = Path(folder) / MODEL_FILE if Path(folder).is_dir() else Path(folder)
    return OnnxCausalLM(path, path, threads=threads)


# -- the converter ----------------------------------------------------------------------------------

def _float_head_note(qm, model_path: Path) -> str | None:
    """What a float ``lm_head`` costs each decoded token on the CPU (read as float32), when the plan keeps it so."""
    prec = get_precision(qm.precisions.get("lm_head")) if qm.precisions.get("lm_head") else None
    r = next((r for r in qm.layers if r.name == "lm_head"), None)
    if r is None or (prec is not None and not prec.is_float):
        return None
    head, step = 4 * r.shape[0] * r.shape[1], decode_step_bytes(model_path)
    return (f"lm_head stays {prec.name if prec else 'float'} in the plan: the CPU reads it as float32, "
            f"{head / 1e6:.1f} MB of the {step / 1e6:.1f} MB each decoded token reads; give it int8 or int4 in the "
            "plan to decode faster")


def convert_ort_genai(job) -> None:
    """The fused graph from the plan's integers; parity with the simulation, greedy tokens in both runtimes,
    decode speed in onnxruntime-genai, KL and top-1 in onnxruntime."""
    prep, report, say = job.prep, job.report, job.say
    seconds, t = report.details["seconds"], time.perf_counter()
    sim = prep.sim_lm.model
    refuse_per_layer_heads(DecoderSpec.from_model(sim))
    say("building the fused ONNX Runtime graph from the plan's integers")
    build = build_fused_onnx(sim, job.out, prep.qm.precisions, accuracy_level=job.accuracy_level)
    write_genai_folder(job.out, sim, prep.float_lm.path, prep.float_lm.tokenizer)
    report.details.update(accuracy_level=job.accuracy_level, accuracy_level_meaning=ACCURACY_LEVELS[job.accuracy_level],
                          replaced_layers=len(build.replaced), kept_float=build.kept_float,
                          weight_bytes=build.weight_bytes, plan_storage_bytes=prep.qm.storage_bytes(),
                          fused_nodes=dict(build.fused), ops=build.ops,
                          external_data=build.data_path is not None)
    report.notes += storage_notes(prep.qm, build.kept_float)
    head_note = _float_head_note(prep.qm, build.path)
    if head_note:
        report.notes.append(head_note)
    seconds["build"] = time.perf_counter() - t
    t = time.perf_counter()
    prompt = prep.float_lm.tokenizer("The workbench measures what each choice costs.",
                                     add_special_tokens=False)["input_ids"]
    with torch_threads(1):
        ref = torch_reference(sim, prompt)
    ev = job.evaluator()
    if job.owns_models:
        release_float_model(prep, keep=[ev.head] if ev is not None else [])
    release_freed_memory()
    seconds["reference_and_simulation"] = time.perf_counter() - t
    t = time.perf_counter()
    say("checking the graph against the simulation in onnxruntime")
    runner = fused_runner(job.out)
    report.details["parity_vs_simulation"] = parity(ref, runner, prompt)
    tokens = runner.generate_greedy(prompt, job.greedy_steps)
    report.details["greedy_match_steps_vs_simulation"] = greedy_agreement(prep.sim_lm.model, prompt, tokens)[0]
    report.details["greedy_steps"] = job.greedy_steps
    if ev is not None:
        cand = ev.score(runner.logits, "ort-genai (onnxruntime)")
        ev.fill(report, cand, build.path)
    del runner
    if job.accuracy_level != 0:  # float activations: what is left is the packing, which must be exact
        exact = OnnxCausalLM(build.path, build.path, threads=1, accuracy_level=0)
        report.details["parity_vs_simulation_accuracy_level_0"] = parity(ref, exact, prompt)
        del exact
    release_freed_memory()
    seconds["check"] = time.perf_counter() - t
    t = time.perf_counter()
    say("running it in onnxruntime-genai")
    genai = GenaiCausalLM(job.out, threads=1)
    genai_tokens = genai.greedy(prompt, job.greedy_steps)
    report.details["greedy_match_steps_genai_vs_onnxruntime"] = next(
        (i for i, (a, b) in enumerate(zip(genai_tokens, tokens)) if a != b), min(len(genai_tokens), len(tokens)))
    report.details["decode_tokens_per_second"] = {"onnxruntime-genai, 1 thread": genai.decode_speed(prompt)}
    del genai
    seconds["genai"] = time.perf_counter() - t


TARGET = register_target(Target(
    "ort-genai", "ONNX Runtime CPU, fused graph for onnxruntime-genai (GroupQueryAttention, MatMulNBits)",
    rules="ort", convert=convert_ort_genai, runnable=True, signed_scales=True, runner=GenaiCausalLM, files=(MODEL_FILE, GENAI_CONFIG),
    module=__name__))
