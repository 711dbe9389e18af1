"""Build a decoder's ONNX graphs op by op from its modules, each weight converted and written once.

    built = build_graphs(lm.model, "out/onnx")                  # prefill.onnx + decode.onnx (+ weights.data)
    built = build_graphs(lm.model, "out/qnn", static=(128, 512))
    built.weight_names["model.layers.0.mlp.up_proj"]            # -> "model.layers.0.mlp.up_proj.weight.T"

Why not ``torch.onnx.export``: tracing needs the whole network in float32 (16 GB for a 4 B model)
and serialises every weight once per graph into protobufs capped at 2 GB. Here each tensor is
widened on its own and written once; when the weights pass ``inline_limit`` they go to one ONNX
external-data file (``weights.data``) that the prefill and the decode graph both reference.

The dynamic decode graph accepts a past of length 0, so it serves prefill too (``OnnxCausalLM``
runs one session); ``prefill.onnx`` (no past inputs) is there for tools that want a prompt-only
graph. Static graphs (``static=(seq, past)``) are built with every shape as a constant, so there
is no shape arithmetic left for NPU converters to fold.

What a layer becomes is a *weight policy*'s decision: ``FloatWeights`` (here) writes float32
``MatMul`` weights transposed to ``[in, out]``, what NPU converters read; ``targets.ort`` has the
INT4/INT8 policy (``MatMulNBits``, ``GatherBlockQuantized``). Supported architectures: decoders as
transformers implements Llama, Qwen2/2.5, Qwen3 and Mistral (RMSNorm, rotary embeddings with a
fixed frequency table, grouped-query attention, SiLU-gated MLP, optional biases, Qwen3's q/k norms).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ..numerics.compute import float32_weight
from ..errors import ModelLoadError
from ..runtime.onnx_runner import input_names

__all__ = ["DecoderSpec", "TensorStore", "GraphBuilder", "FloatWeights", "BuiltGraphs", "build_graphs",
           "DATA_FILE", "INLINE_LIMIT", "input_names", "output_names", "as_array", "rotary_tables", "apply_rotary"]

DATA_FILE = "weights.data"
INLINE_LIMIT = 64 * 2**20  # weights above this go to one external-data file (protobuf stops at 2 GB)
ALIGN_THRESHOLD, ALIGNMENT = 2**20, 2**16  # large tensors start on 64 KiB boundaries, so runtimes can map them
MASK_MIN = float(np.finfo(np.float32).min)  # what transformers' eager mask uses for hidden positions
UNSUPPORTED_ROPE = ("dynamic", "longrope")  # frequency tables that change with the sequence length


def output_names(num_layers: int) -> list[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def as_array(t: torch.Tensor, dtype=np.float32) -> np.ndarray:
    """A tensor's values as a contiguous numpy array of float32 or float16 (converted once, no wider copy)."""
    wanted = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}[np.dtype(dtype)]
    return np.ascontiguousarray(t.detach().to(wanted).cpu().numpy())


# -- the architecture ---------------------------------------------------------------------------

@dataclass
class DecoderSpec:
    """The modules and shapes of a Llama-style decoder, checked to be what the builder reproduces."""

    model: nn.Module
    base: nn.Module  # model.model: embed_tokens, layers, norm, rotary_emb
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    inv_freq: np.ndarray
    rope_scaling: float
    qk_norm: bool
    layer_heads: list[tuple[int, int]] = field(default_factory=list)  # (query, KV) heads of each layer

    def heads_of(self, i: int) -> tuple[int, int]:
        """Layer ``i``'s (query heads, KV heads): a pruned model's layers may differ (``layer_shapes``)."""
        return self.layer_heads[i] if self.layer_heads else (self.heads, self.kv_heads)

    @property
    def uniform(self) -> bool:
        """Whether every layer has the config's head counts (what single-count runtimes need)."""
        return all(h == (self.heads, self.kv_heads) for h in self.layer_heads)

    @classmethod
    def from_model(cls, model: nn.Module) -> "DecoderSpec":
        cfg = model.config
        arch = ", ".join(getattr(cfg, "architectures", None) or [type(model).__name__])
        base = getattr(model, "model", None)

        def refuse(why: str):
            raise ModelLoadError(f"ONNX export supports Llama-style decoders (Llama, Qwen2/2.5, Qwen3, Mistral); "
                                 f"{arch} {why}")
        if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            refuse("has no model.embed_tokens / layers / norm / rotary_emb")
        if model.get_output_embeddings() is None:
            refuse("has no output layer")
        if str(getattr(cfg, "hidden_act", "silu")) not in ("silu", "swish"):
            refuse(f"uses activation '{cfg.hidden_act}', not SiLU")
        kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
            refuse(f"uses {sorted(kinds)} attention (sliding windows are not built)")
        rotary = base.rotary_emb
        if getattr(rotary, "rope_type", "default") in UNSUPPORTED_ROPE:
            refuse(f"uses '{rotary.rope_type}' rotary scaling, whose frequencies change with the sequence length")
        for mod in (getattr(cfg, "final_logit_softcapping", None), getattr(cfg, "attn_logit_softcapping", None)):
            if mod:
                refuse("caps its logits")
        attn = base.layers[0].self_attn
        heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // heads
        for block in base.layers:
            a, m = block.self_attn, block.mlp
            if not all(hasattr(a, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                    not all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj")):
                refuse("has blocks without q/k/v/o and gate/up/down projections")
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                if not type(norm).__name__.endswith("RMSNorm"):
                    refuse(f"normalises with {type(norm).__name__}, not RMSNorm")
        vocab = getattr(model.get_output_embeddings(), "out_features", None) or cfg.vocab_size
        layer_heads = [(b.self_attn.q_proj.out_features // head_dim, b.self_attn.k_proj.out_features // head_dim)
                       for b in base.layers]  # from the modules: a pruned model's layers may differ
        return cls(model, base, len(base.layers), cfg.hidden_size, heads, kv_heads, head_dim, vocab,
                   as_array(rotary.inv_freq), float(getattr(rotary, "attention_scaling", 1.0)), hasattr(attn, "q_norm"),
                   layer_heads)


# -- where the weights go -----------------------------------------------------------------------

class TensorStore:
    """Weights written once and referenced by every graph: held inline while small, else one data file.

    Tensors are kept in memory until their total passes ``inline_limit``; then everything goes to
    ``directory/DATA_FILE`` (ONNX external data) and later tensors are appended as they come. An
    alias is a second initializer over the same bytes with another shape (no second copy).
    """

    def __init__(self, directory: Path, inline_limit: int):
        self.directory = Path(directory)
        self.inline_limit = inline_limit
        self._arrays: dict[str, np.ndarray] = {}  # inline tensors
        self._where: dict[str, tuple[int, int, tuple[int, ...], int]] = {}  # external: offset, length, shape, type
        self._aliases: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._inline_bytes = 0
        self._file = None
        self.bytes = 0

    @property
    def external(self) -> bool:
        return self._file is not None

    @property
    def data_path(self) -> Path:
        return self.directory / DATA_FILE

    def __contains__(self, name: str) -> bool:
        return name in self._arrays or name in self._where or name in self._aliases

    def add(self, name: str, array: np.ndarray) -> str:
        if name in self:
            raise ValueError(f"tensor '{name}' was already written")
        array = np.ascontiguousarray(array)
        self.bytes += array.nbytes
        if self._file is None:
            self._arrays[name] = array
            self._inline_bytes += array.nbytes
            if self._inline_bytes > self.inline_limit:
                self._spill()
        else:
            self._append(name, array)
        return name

    def alias(self, name: str, of: str, shape: Sequence[int]) -> str:
        """``name`` is ``of``'s bytes read with ``shape`` (same element count and type)."""
        self._aliases[name] = (of, tuple(int(d) for d in shape))
        return name

    def _spill(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = open(self.data_path, "wb")
        held, self._arrays = self._arrays, {}
        for name, array in held.items():
            self._append(name, array)

    def _append(self, name: str, array: np.ndarray) -> None:
        from onnx import helper
        f = self._file
        offset = f.tell()
        if array.nbytes >= ALIGN_THRESHOLD and offset % ALIGNMENT:
            f.write(b"\0" * (ALIGNMENT - offset % ALIGNMENT))
            offset = f.tell()
        f.write(array.tobytes())
        self._where[name] = (offset, array.nbytes, array.shape, helper.np_dtype_to_tensor_dtype(array.dtype))

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()

    def proto(self, name: str):
        """The TensorProto a graph holds for ``name``: the data itself, or a reference into the data file."""
        from onnx import TensorProto, numpy_helper
        base, shape = self._aliases.get(name, (name, None))
        if base in self._arrays:
            arr = self._arrays[base]
            return numpy_helper.from_array(arr if shape is None else arr.reshape(shape), name)
        offset, length, stored_shape, dtype = self._where[base]
        t = TensorProto()
        t.name, t.data_type = name, dtype
        t.dims.extend(stored_shape if shape is None else shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t


# -- one graph ----------------------------------------------------------------------------------

class GraphBuilder:
    """Nodes of one graph, written with ``op``; weights come from the shared ``TensorStore``.

    ``static`` is ``(batch, sequence, past)`` with every size known, or None for dynamic shapes;
    helpers choose constant shapes or the ``0`` / ``-1`` reshape conventions accordingly.
    """

    def __init__(self, store: TensorStore, opset: int, static: tuple[int, int, int] | None):
        self.store, self.opset, self.static = store, opset, static
        self.nodes: list = []
        self.weights: dict[str, None] = {}  # weight initializers this graph reads, in order
        self.constants: dict[str, object] = {}
        self._const_names: dict[tuple, str] = {}
        self._count = 0
        self.scope = ""
        self.ms_domain = False

    def op(self, op_type: str, inputs: Sequence[str], *, domain: str = "", name: str | None = None, **attrs) -> str:
        """Append a node; returns the name of its (single) output."""
        from onnx import helper
        self._count += 1
        if name is None:
            name = f"/{self.scope}/{op_type}_{self._count}" if self.scope else f"/{op_type}_{self._count}"
        out = f"{name}_output_0"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, domain=domain or None, **attrs))
        if domain == "com.microsoft":
            self.ms_domain = True
        return out

    def const(self, value, dtype=np.int64) -> str:
        """A small constant (shape, axis, scalar) as an inline initializer, shared by identical values."""
        from onnx import numpy_helper
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._const_names:
            name = f"const_{len(self._const_names)}"
            self._const_names[key] = name
            self.constants[name] = numpy_helper.from_array(arr, name)
        return self._const_names[key]

    def weight(self, name: str, make: Callable[[], np.ndarray]) -> str:
        """A weight initializer: ``make()`` runs only the first time any graph asks for ``name``."""
        if name not in self.store:
            self.store.add(name, make())
        self.weights[name] = None
        return name

    def alias(self, name: str, of: str, shape: Sequence[int]) -> str:
        """A weight initializer reading the bytes of weight ``of`` with another shape."""
        if name not in self.store:
            self.store.alias(name, of, shape)
        self.weights[name] = None
        return name

    def rename(self, old: str, new: str) -> None:
        for node in self.nodes:
            for seq in (node.input, node.output):
                for i, x in enumerate(seq):
                    if x == old:
                        seq[i] = new

    # -- shared pieces ------------------------------------------------------------------------
    def reduce_mean_last(self, x: str) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.const([-1])], keepdims=1)
        return self.op("ReduceMean", [x], axes=[-1], keepdims=1)

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", [x, self.const(list(axes))])

    def reshape(self, x: str, dims: Sequence[int]) -> str:
        return self.op("Reshape", [x, self.const(list(dims))])

    def rms_norm(self, x: str, module: nn.Module, name: str) -> str:
        """transformers' RMSNorm, ``weight * (x * 1 / sqrt(mean(x^2) + eps))`` in float32.

        Written as onnxruntime's normalisation fusion expects (Sqrt, then Div of 1), so its CPU runs
        one SimplifiedLayerNormalization kernel; NPU converters map the same pattern to their RMSNorm.
        """
        scope, self.scope = self.scope, name
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        sq = self.op("Pow", [x, self.const(2.0, np.float32)])
        var = self.op("Add", [self.reduce_mean_last(sq), self.const(eps, np.float32)])
        inv = self.op("Div", [self.const(1.0, np.float32), self.op("Sqrt", [var])])
        w = self.weight(f"{name}.weight", lambda: as_array(module.weight))
        out = self.op("Mul", [w, self.op("Mul", [x, inv])])
        self.scope = scope
        return out


# -- weight policies ----------------------------------------------------------------------------

class FloatWeights:
    """Every weight as float32 values: ``MatMul`` on ``[in, out]`` weights, ``Gather`` on ``[vocab, hidden]``.

    What NPU converters and QDQ quantizers read. A quantized module (the workbench's simulation)
    contributes its dequantized values. Records each layer's initializer name and layout.
    """

    def __init__(self):
        self.weight_names: dict[str, str] = {}
        self.weight_layouts: dict[str, str] = {}
        self.notes: dict[str, str] = {}

    def record(self, fqn: str, name: str, layout: str) -> None:
        self.weight_names.setdefault(fqn, name)
        self.weight_layouts.setdefault(fqn, layout)

    def bias(self, g: GraphBuilder, module: nn.Module, fqn: str, y: str) -> str:
        b = getattr(module, "bias", None)
        if b is None:
            return y
        return g.op("Add", [y, g.weight(f"{fqn}.bias", lambda: as_array(b))])

    def linear(self, g: GraphBuilder, module: nn.Module, fqn: str, x: str) -> str:
        name = g.weight(f"{fqn}.weight.T", lambda: as_array(float32_weight(module).T))
        self.record(fqn, name, "in_out")
        return self.bias(g, module, fqn, g.op("MatMul", [x, name], name=f"/{fqn}/MatMul"))

    def embedding(self, g: GraphBuilder, module: nn.Module, fqn: str, ids: str) -> str:
        name = g.weight(f"{fqn}.weight", lambda: as_array(float32_weight(module)))
        self.record(fqn, name, "out_in")
        return g.op("Gather", [name, ids], axis=0, name=f"/{fqn}/Gather")

    def lm_head(self, g: GraphBuilder, module: nn.Module, fqn: str, x: str, embedding: nn.Module) -> str:
        """A tied head gets its own transposed copy here: converters want a constant ``[in, out]`` MatMul weight."""
        return self.linear(g, module, fqn, x)


# -- the decoder --------------------------------------------------------------------------------

def rotary_tables(g: GraphBuilder, spec: DecoderSpec) -> tuple[str, str]:
    """cos and sin ``[batch, 1, seq, head_dim]`` from position_ids, as transformers computes them in float32."""
    pos = g.unsqueeze(g.op("Cast", ["position_ids"], to=1), [2])  # [B, S, 1]
    freqs = g.op("Mul", [pos, g.const(spec.inv_freq, np.float32)])  # == inv_freq @ positions: one product each
    emb = g.op("Concat", [freqs, freqs], axis=-1)
    cos, sin = g.op("Cos", [emb]), g.op("Sin", [emb])
    if spec.rope_scaling != 1.0:
        scale = g.const(spec.rope_scaling, np.float32)
        cos, sin = g.op("Mul", [cos, scale]), g.op("Mul", [sin, scale])
    return g.unsqueeze(cos, [1]), g.unsqueeze(sin, [1])


def apply_rotary(g: GraphBuilder, x: str, cos: str, sin: str, head_dim: int, axis: int = 3) -> str:
    """``x * cos + rotate_half(x) * sin`` over ``axis``, the head dimension (the text graphs' ``[B, H, S, d]``;
    the vision encoder's ``[heads, patches, d]`` gives -1)."""
    half = head_dim // 2
    x1 = g.op("Slice", [x, g.const([0]), g.const([half]), g.const([axis])])
    x2 = g.op("Slice", [x, g.const([half]), g.const([head_dim]), g.const([axis])])
    rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])


def _attention_bias(g: GraphBuilder, with_past: bool) -> str:
    """0 where a query may attend (causal, and the key is not padding), float32's minimum elsewhere."""
    pad = g.unsqueeze(g.op("Cast", ["attention_mask"], to=9), [1, 2])  # [B, 1, 1, T] bool
    if g.static:
        _, seq, past = g.static
        q = np.arange(past, past + seq)[:, None]
        k = np.arange(past + seq)[None, :]
        causal = g.const(k <= q, np.bool_)  # [S, T]
    else:
        seq = g.op("Shape", ["input_ids"], start=1, end=2)
        past = g.op("Shape", ["past_key_values.0.key"], start=2, end=3) if with_past else g.const([0])
        total = g.op("Add", [past, seq])
        squeeze = lambda t: g.op("Squeeze", [t, g.const([0])])  # noqa: E731
        one = g.const(1)
        q = g.op("Range", [squeeze(past), squeeze(total), one])
        k = g.op("Range", [g.const(0), squeeze(total), one])
        causal = g.op("LessOrEqual", [g.unsqueeze(k, [0]), g.unsqueeze(q, [1])])  # [S, T]
    allowed = g.op("And", [causal, pad])  # [B, 1, S, T]
    return g.op("Where", [allowed, g.const(0.0, np.float32), g.const(MASK_MIN, np.float32)])


def _attention(g: GraphBuilder, spec: DecoderSpec, policy: FloatWeights, attn: nn.Module, i: int, x: str, cos: str,
               sin: str, bias: str, with_past: bool) -> tuple[str, str, str]:
    fqn = f"model.layers.{i}.self_attn"
    g.scope = f"model.layers.{i}/self_attn"
    d, (hq, hkv) = spec.head_dim, spec.heads_of(i)
    b, s = (g.static[0], g.static[1]) if g.static else (0, 0)

    def heads(proj: str, n: int, norm: str | None) -> str:
        y = g.reshape(policy.linear(g, getattr(attn, proj), f"{fqn}.{proj}", x), [b, s, n, d])
        if norm:
            y = g.rms_norm(y, getattr(attn, norm), f"{fqn}.{norm}")
        return g.op("Transpose", [y], perm=[0, 2, 1, 3])  # [B, n, S, D]

    q = heads("q_proj", hq, "q_norm" if spec.qk_norm else None)
    k = heads("k_proj", hkv, "k_norm" if spec.qk_norm else None)
    v = heads("v_proj", hkv, None)
    q, k = apply_rotary(g, q, cos, sin, d), apply_rotary(g, k, cos, sin, d)
    if with_past:
        k = g.op("Concat", [f"past_key_values.{i}.key", k], axis=2)
        v = g.op("Concat", [f"past_key_values.{i}.value", v], axis=2)
    present_k, present_v = k, v
    if hq != hkv:  # transformers' repeat_kv: each KV head serves hq / hkv query heads
        total = g.static[1] + g.static[2] if g.static else -1
        rep = g.const([1, 1, hq // hkv, 1, 1])
        k = g.reshape(g.op("Expand", [g.unsqueeze(k, [2]), rep]), [b, hq, total, d])
        v = g.reshape(g.op("Expand", [g.unsqueeze(v, [2]), rep]), [b, hq, total, d])
    scale = float(getattr(attn, "scaling", d ** -0.5))
    scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), g.const(scale, np.float32)])
    probs = g.op("Softmax", [g.op("Add", [scores, bias])], axis=-1)
    out = g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    out = g.reshape(out, [b, s, hq * d])
    return policy.linear(g, attn.o_proj, f"{fqn}.o_proj", out), present_k, present_v


def _mlp(g: GraphBuilder, policy: FloatWeights, mlp: nn.Module, i: int, x: str) -> str:
    fqn = f"model.layers.{i}.mlp"
    g.scope = f"model.layers.{i}/mlp"
    gate = policy.linear(g, mlp.gate_proj, f"{fqn}.gate_proj", x)
    up = policy.linear(g, mlp.up_proj, f"{fqn}.up_proj", x)
    act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])  # SiLU
    return policy.linear(g, mlp.down_proj, f"{fqn}.down_proj", g.op("Mul", [act, up]))


def _decoder_graph(spec: DecoderSpec, policy: FloatWeights, store: TensorStore, *, with_past: bool,
                   static: tuple[int, int, int] | None, opset: int, progress: Callable[[int], None]):
    from onnx import TensorProto, helper
    g = GraphBuilder(store, opset, static)
    base, n = spec.base, spec.layers
    h = policy.embedding(g, base.embed_tokens, "model.embed_tokens", "input_ids")
    cos, sin = rotary_tables(g, spec)
    bias = _attention_bias(g, with_past)
    presents = []
    for i, block in enumerate(base.layers):
        g.scope = f"model.layers.{i}"
        x = g.rms_norm(h, block.input_layernorm, f"model.layers.{i}.input_layernorm")
        a, pk, pv = _attention(g, spec, policy, block.self_attn, i, x, cos, sin, bias, with_past)
        g.scope = f"model.layers.{i}"
        h = g.op("Add", [h, a])
        x = g.rms_norm(h, block.post_attention_layernorm, f"model.layers.{i}.post_attention_layernorm")
        m = _mlp(g, policy, block.mlp, i, x)
        g.scope = f"model.layers.{i}"
        h = g.op("Add", [h, m])
        presents += [pk, pv]
        progress(1)
    g.scope = ""
    h = g.rms_norm(h, base.norm, "model.norm")
    logits = policy.lm_head(g, spec.model.get_output_embeddings(), "lm_head", h, base.embed_tokens)
    outs = output_names(n)
    for value, name in zip([logits] + presents, outs):
        g.rename(value, name)

    if static:
        b, s, p = static
        dims = {"batch": b, "sequence": s, "past_sequence": p, "total_sequence": s + p}
    else:
        dims = {k: k for k in ("batch", "sequence", "past_sequence", "total_sequence")}
    total = dims["total_sequence"] if with_past else dims["sequence"]
    def kv_shape(j: int, length) -> list:  # the j-th past/present tensor: layer j // 2 (key, value)
        return [dims["batch"], spec.heads_of(j // 2)[1], length, spec.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [dims["batch"], dims["sequence"]]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [dims["batch"], total]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [dims["batch"], dims["sequence"]])]
    for j, name in enumerate(input_names(n, with_past)[3:]):
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape(j, dims["past_sequence"])))
    logits_shape = [dims["batch"], dims["sequence"], spec.vocab]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, logits_shape)]
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape(j, total))
                for j, name in enumerate(outs[1:])]
    return g, inputs, outputs


@dataclass
class BuiltGraphs:
    """What ``build_graphs`` wrote."""

    prefill_path: Path
    decode_path: Path
    data_path: Path | None  # the shared external-data file; None when the weights are inline
    weight_names: dict[str, str]
    weight_layouts: dict[str, str]
    weight_bytes: int  # bytes of distinct weights (written once)
    notes: dict[str, str] = field(default_factory=dict)  # layer -> what the policy could not do as planned

    @property
    def files(self) -> list[Path]:
        return [self.prefill_path, self.decode_path] + ([self.data_path] if self.data_path else [])


def build_graphs(model: nn.Module, out_dir: str | Path, *, static: tuple[int, int] | None = None,
                 policy: FloatWeights | None = None, opset: int = 17, inline_limit: int | None = None,
                 progress: bool = False) -> BuiltGraphs:
    """Write ``prefill.onnx`` and ``decode.onnx`` for ``model`` into ``out_dir``, weights once.

    ``static=(seq, past)`` fixes batch 1, the prefill sequence and the decode past. Files are
    written under temporary names and renamed into place, graphs last.
    """
    from onnx import helper
    from tqdm.auto import tqdm

    spec = DecoderSpec.from_model(model)
    policy = policy or FloatWeights()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / DATA_FILE, out / "prefill.onnx", out / "decode.onnx"):
        stale.unlink(missing_ok=True)  # a graph left from an earlier export must not point into new data
    store = TensorStore(out, INLINE_LIMIT if inline_limit is None else inline_limit)
    shapes = {"prefill": (1, static[0], 0) if static else None, "decode": (1, 1, static[1]) if static else None}
    paths = {}
    try:
        with torch.no_grad(), tqdm(total=2 * spec.layers, desc="build graphs", unit="block", disable=not progress,
                                   leave=False) as bar:
            built = {}
            for kind in ("prefill", "decode"):
                built[kind] = _decoder_graph(spec, policy, store, with_past=kind == "decode", static=shapes[kind],
                                             opset=opset, progress=bar.update)
        store.close()
        for kind, (g, inputs, outputs) in built.items():
            graph = helper.make_graph(g.nodes, f"{kind}", inputs, outputs,
                                      list(g.constants.values()) + [store.proto(w) for w in g.weights])
            opsets = [helper.make_opsetid("", opset)]
            if g.ms_domain:
                opsets.append(helper.make_opsetid("com.microsoft", 1))
            proto = helper.make_model(graph, opset_imports=opsets, producer_name="workbench")
            proto.ir_version = min(proto.ir_version, 10)  # what onnxruntime and the converters here read
            path = out / f"{kind}.onnx"
            tmp = path.with_name(path.name + ".partial")
            tmp.write_bytes(proto.SerializeToString())
            paths[kind] = (tmp, path)
    finally:
        store.close()
    for tmp, path in paths.values():
        os.replace(tmp, path)
    return BuiltGraphs(paths["prefill"][1], paths["decode"][1], store.data_path if store.external else None,
                       dict(policy.weight_names), dict(policy.weight_layouts), store.bytes, dict(policy.notes))
