"""ONNX export of a causal LM as a prefill graph and a decode graph with a KV cache, checked by itself.

    result = export_onnx(load_model("demo"), "out/onnx")                 # dynamic batch/sequence/past
    result = export_onnx(lm, "out/onnx-static", static=(128, 512))     # what NPU compilers want
    result.max_abs_diff, result.greedy_match_steps, result.weight_names["model.layers.0.mlp.up_proj"]
    inventory = operator_inventory(result.prefill_path)

The prefill graph takes ``input_ids``, ``attention_mask``, ``position_ids`` and returns ``logits``
plus ``present.{i}.key/value``; the decode graph also takes ``past_key_values.{i}.key/value``
(the names onnxruntime-genai and Optimum use). Export goes through the TorchScript exporter
(``dynamo=False``, eager attention): about a second on a small model, where the dynamo exporter
takes ~18 s and cannot express the ``past + sequence`` dimension.

Each quantizable layer's weight is stored under a name derived from its PyTorch FQN
(``model.layers.0.self_attn.q_proj.weight.T`` when the exporter folded the transpose of a Linear
into the initializer), so per-tensor encodings (QNN overrides, ONNX Runtime tensor overrides)
can be written against the plan's layer names; ``ExportResult.weight_names`` records the map.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .errors import ModelLoadError
from .workspace import atomic_write_json

__all__ = ["ExportResult", "OpCount", "export_onnx", "load_onnx", "operator_inventory", "OnnxCausalLM",
           "LogitsModule", "greedy_tokens_torch", "fold_constants", "input_names", "output_names", "DEFAULT_OPSET",
           "PREFILL_FILE", "DECODE_FILE", "initializer_bytes", "initializer_bytes_by_block"]

DEFAULT_OPSET = 17  # the oldest opset every target here accepts; LayerNormalization exists from 17
PREFILL_FILE = "prefill.onnx"
DECODE_FILE = "decode.onnx"
DEFAULT_PROMPT = "The workbench measures what each quantization choice costs before the model reaches a device."


@dataclass
class ExportResult:
    """What ``export_onnx`` wrote and how closely onnxruntime reproduced PyTorch."""

    prefill_path: Path
    decode_path: Path
    weight_names: dict[str, str]  # layer FQN -> ONNX initializer holding its weight
    weight_layouts: dict[str, str]  # layer FQN -> "out_in" (as in PyTorch) or "in_out" (transposed)
    max_abs_diff: float | None  # over logits and KV of both graphs; None when checks were skipped
    greedy_match_steps: int | None  # leading greedy tokens onnxruntime and PyTorch agree on
    greedy_steps: int
    static: tuple[int, int] | None
    opset: int
    num_layers: int
    export_seconds: float
    check_seconds: float
    diffs: dict[str, float] = field(default_factory=dict)  # per output group, e.g. "decode.logits"
    onnx_tokens: list[int] = field(default_factory=list, repr=False)
    torch_tokens: list[int] = field(default_factory=list, repr=False)

    @property
    def files(self) -> list[Path]:
        return [self.prefill_path, self.decode_path]

    @property
    def seconds(self) -> float:
        return self.export_seconds + self.check_seconds

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(prefill_path=str(self.prefill_path), decode_path=str(self.decode_path),
                 files=[{"path": str(p), "bytes": p.stat().st_size} for p in self.files], seconds=self.seconds,
                 static=list(self.static) if self.static else None)
        return d


def input_names(num_layers: int, with_past: bool) -> list[str]:
    names = ["input_ids", "attention_mask", "position_ids"]
    if with_past:
        names += [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return names


def output_names(num_layers: int) -> list[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


class _KVCacheWrapper(nn.Module):
    """Flat tensors in and out, so the exporter sees the KV cache as graph inputs and outputs."""

    def __init__(self, model: nn.Module, num_layers: int):
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache
        cache = DynamicCache()
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        flat = [out.logits]
        for layer in out.past_key_values.layers[:self.num_layers]:
            flat += [layer.keys, layer.values]
        return tuple(flat)


@contextlib.contextmanager
def _eager_attention(model: nn.Module):
    """Eager attention traces to plain MatMul/Softmax; SDPA would bake shape checks into the trace."""
    before = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if before and before != "eager":
            model.set_attn_implementation(before)


@contextlib.contextmanager
def _single_thread():
    """Decode-sized matmuls are fastest on one thread; more threads oversubscribe a busy CPU badly."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _kv_geometry(config) -> tuple[int, int, int]:
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers, kv_heads, head_dim


def _export_one(wrapper: nn.Module, path: Path, args: tuple, with_past: bool, static: bool, opset: int) -> None:
    n = wrapper.num_layers
    ins, outs = input_names(n, with_past), output_names(n)
    dynamic_axes = None
    if not static:
        total = "total_sequence"
        dynamic_axes = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
                        "attention_mask": {0: "batch", 1: total if with_past else "sequence"},
                        "logits": {0: "batch", 1: "sequence"}}
        for name in ins[3:]:
            dynamic_axes[name] = {0: "batch", 2: "past_sequence"}
        for name in outs[1:]:
            dynamic_axes[name] = {0: "batch", 2: total if with_past else "sequence"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about cache bookkeeping that is constant per graph
        torch.onnx.export(wrapper, args, str(path), input_names=ins, output_names=outs, dynamic_axes=dynamic_axes,
                          opset_version=opset, dynamo=False, do_constant_folding=True,
                          keep_initializers_as_inputs=False)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


def _name_weights(path: Path, model: nn.Module, layers) -> tuple[dict[str, str], dict[str, str]]:
    """Find each layer's weight among the initializers (by content) and give it a stable FQN-based name."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(path))
    modules = dict(model.named_modules())
    wanted: dict[tuple[tuple[int, ...], str], list[tuple[str, str]]] = {}
    for info in layers:
        w = modules[info.name].weight.detach().float().cpu().numpy()
        wanted.setdefault((w.shape, _digest(w)), []).append((info.name, "out_in"))
        wanted.setdefault((w.T.shape, _digest(w.T)), []).append((info.name, "in_out"))
    names, layouts, renames = {}, {}, {}
    taken = {init.name for init in proto.graph.initializer}
    for init in proto.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT or len(init.dims) != 2:
            continue
        arr = numpy_helper.to_array(init)
        for fqn, layout in wanted.get((arr.shape, _digest(arr)), []):
            if fqn in names:
                continue
            new = f"{fqn}.weight" if layout == "out_in" else f"{fqn}.weight.T"
            if new != init.name and new not in taken:
                renames[init.name] = new
                taken.add(new)
            names[fqn], layouts[fqn] = renames.get(init.name, init.name), layout
            break  # one initializer holds one layer (a tied pair has two layouts, hence two initializers)
    for init in proto.graph.initializer:  # the export wrapper's "model." prefix says nothing to a reader
        if init.name not in renames and init.name.startswith(("model.model.", "model.lm_head.")):
            new = init.name[len("model."):]
            if new not in taken:
                renames[init.name] = new
                taken.add(new)
    if renames:
        for init in proto.graph.initializer:
            if init.name in renames:
                init.name = renames[init.name]
        for node in proto.graph.node:
            for i, name in enumerate(node.input):
                if name in renames:
                    node.input[i] = renames[name]
        onnx.save(proto, str(path))
    missing = [info.name for info in layers if info.name not in names]
    if missing:
        raise RuntimeError(f"export lost track of the weights of {', '.join(missing[:3])}: no initializer holds "
                           "them unchanged")
    return names, layouts


def fold_constants(src: str | Path, dst: str | Path | None = None) -> Path:
    """Fold shape arithmetic into constants with onnxruntime's basic, standard-op-only optimisations.

    With static shapes, the Shape/Range/Equal/Where chains that build positions and the causal
    mask become initializers, which is what NPU converters expect (they reject or fall back on them).
    """
    import onnxruntime as ort
    src = Path(src)
    dst = Path(dst) if dst else src
    tmp = dst.with_name(dst.name + ".folding")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(tmp)
    opts.log_severity_level = 3
    ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])
    tmp.replace(dst)
    return dst


def load_onnx(path: str | Path, *, load_external_data: bool = True):
    """Read an ONNX file, saying clearly when it is missing, not ONNX, or cut short."""
    import onnx
    from google.protobuf.message import DecodeError

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"ONNX file '{p}' does not exist")
    size = p.stat().st_size
    if size == 0:
        raise ModelLoadError(f"'{p}' is empty (0 bytes): re-run the export")
    with open(p, "rb") as f:
        head = f.read(64)
    if head.lstrip()[:1] in (b"{", b"[", b"<") or head.startswith((b"PK", b"\x89HDF", b"#", b"\x93NUMPY")):
        raise ModelLoadError(f"'{p}' is not an ONNX model (it starts like a text/JSON/archive file); pass the "
                             ".onnx file written by `workbench export`")
    try:
        proto = onnx.load(str(p), load_external_data=load_external_data)
    except DecodeError as e:
        raise ModelLoadError(f"'{p}' is not a valid ONNX model ({size:,} bytes could not be parsed: {e}); the file "
                             "is truncated or not ONNX: export it again") from None
    except Exception as e:  # external data missing, unreadable
        raise ModelLoadError(f"could not read ONNX model '{p}': {e}") from None
    if not proto.graph.node:
        raise ModelLoadError(f"'{p}' parsed as ONNX but has no graph nodes; the file is truncated or not an ONNX "
                             "model: export it again")
    declared = {o.name for o in proto.graph.output}
    produced = {o for n in proto.graph.node for o in n.output} | {i.name for i in proto.graph.input} | \
        {i.name for i in proto.graph.initializer}
    lost = sorted(declared - produced)
    if lost:
        raise ModelLoadError(f"'{p}' is incomplete: graph outputs {', '.join(lost[:3])} are produced by no node; "
                             "the file is truncated: export it again")
    return proto


@dataclass(frozen=True)
class OpCount:
    """One row of an operator inventory."""

    op_type: str
    domain: str  # "ai.onnx" for the standard domain
    opset: int | None
    count: int


def operator_inventory(model) -> list[OpCount]:
    """Operator types with their counts and domain/opset, most frequent first (subgraphs included)."""
    proto = model if hasattr(model, "graph") else load_onnx(model, load_external_data=False)
    opsets = {(imp.domain or "ai.onnx"): imp.version for imp in proto.opset_import}
    counts: dict[tuple[str, str], int] = {}
    for node in _iter_nodes(proto.graph):
        key = (node.op_type, node.domain or "ai.onnx")
        counts[key] = counts.get(key, 0) + 1
    rows = [OpCount(op, dom, opsets.get(dom), n) for (op, dom), n in counts.items()]
    return sorted(rows, key=lambda r: (-r.count, r.op_type))


def _iter_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                yield from _iter_nodes(attr.g)
            for g in attr.graphs:
                yield from _iter_nodes(g)


def initializer_bytes(proto) -> dict[str, int]:
    """Bytes of each initializer as stored (raw data or typed fields), without materialising arrays."""
    from onnx import helper
    out = {}
    for init in proto.graph.initializer:
        n = int(np.prod(init.dims)) if init.dims else 1
        try:
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        except Exception:
            itemsize = 1
        bits = 4 if init.data_type in (21, 22) else itemsize * 8  # UINT4 / INT4 pack two per byte
        out[init.name] = -(-n * bits // 8)
    return out


def _block_of(name: str) -> str:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return f"layers.{parts[i + 1]}"
    for top in ("embed_tokens", "lm_head", "norm"):
        if top in parts:
            return top
    return "other"


def initializer_bytes_by_block(model) -> dict[str, int]:
    """Initializer bytes per transformer block (``layers.N``), ``embed_tokens``, ``norm``, ``lm_head``, ``other``."""
    proto = model if hasattr(model, "graph") else load_onnx(model)
    totals: dict[str, int] = {}
    for name, n in initializer_bytes(proto).items():
        block = _block_of(name)
        totals[block] = totals.get(block, 0) + n

    def order(b: str):
        if b.startswith("layers."):
            return (1, int(b.split(".")[1]))
        return ({"embed_tokens": 0, "norm": 2, "lm_head": 3}.get(b, 4), 0)
    return dict(sorted(totals.items(), key=lambda kv: order(kv[0])))


class OnnxCausalLM:
    """Prefill + decode graphs in onnxruntime: greedy generation and logits for evaluation.

    Static graphs (fixed sequence / past) are driven the way a device runtime drives them: the
    prompt is right-padded to the graph's sequence length, the past is a fixed buffer whose unused
    slots the attention mask hides.
    """

    def __init__(self, prefill_path: str | Path, decode_path: str | Path | None = None, *,
                 providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None):
        import onnxruntime as ort
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        self.prefill = ort.InferenceSession(str(prefill_path), opts, providers=list(providers))
        self.decode = ort.InferenceSession(str(decode_path), opts, providers=list(providers)) if decode_path else None
        shape = {i.name: i.shape for i in self.prefill.get_inputs()}["input_ids"]
        self.static_seq = shape[1] if isinstance(shape[1], int) else None
        self.num_layers = (len(self.prefill.get_outputs()) - 1) // 2
        self.static_past = None
        if self.decode is not None:
            past = {i.name: i.shape for i in self.decode.get_inputs()}["past_key_values.0.key"]
            self.static_past = past[2] if isinstance(past[2], int) else None

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits [batch, seq, vocab] of the prefill graph for unpadded windows of equal length."""
        ids = np.asarray(input_ids, dtype=np.int64)
        b, n = ids.shape
        if self.static_seq is not None:
            if n > self.static_seq:
                raise ValueError(f"window of {n} tokens exceeds the static graph's sequence length {self.static_seq}")
            if b > 1:  # a static graph has batch 1
                return np.concatenate([self.logits(row[None]) for row in ids])
            mask = np.zeros((b, self.static_seq), np.int64)
            mask[:, :n] = 1
            ids = np.pad(ids, ((0, 0), (0, self.static_seq - n)))
        else:
            mask = np.ones_like(ids)
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
        out = self.prefill.run(["logits"], {"input_ids": ids, "attention_mask": mask, "position_ids": pos})[0]
        return out[:, :n]

    def run_prefill(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """Last-position logits, the full logits, and the compact KV cache (only real positions)."""
        n = len(prompt)
        outs = self.prefill.run(None, self.prefill_feed(prompt))
        kv = [o[:, :, :n] for o in outs[1:]]
        return outs[0][0, n - 1], outs[0][:, :n], kv

    def prefill_feed(self, prompt: Sequence[int]) -> dict[str, np.ndarray]:
        """Inputs of the prefill graph for one prompt (right-padded to a static sequence length)."""
        n = len(prompt)
        ids = np.asarray(prompt, dtype=np.int64)[None]
        mask = np.ones_like(ids)
        if self.static_seq is not None:
            if n > self.static_seq:
                raise ValueError(f"prompt of {n} tokens exceeds the static graph's sequence length {self.static_seq}")
            ids = np.pad(ids, ((0, 0), (0, self.static_seq - n)))
            mask = np.pad(mask, ((0, 0), (0, self.static_seq - n)))
        return {"input_ids": ids, "attention_mask": mask, "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None]}

    def decode_feed(self, token: int, kv: list[np.ndarray], position: int) -> dict[str, np.ndarray]:
        """Inputs of the decode graph: one token, the compact KV cache padded to a static past if needed."""
        past_len = kv[0].shape[2]
        feed = {"input_ids": np.array([[token]], np.int64), "position_ids": np.array([[position]], np.int64)}
        if self.static_past is not None:
            if past_len > self.static_past:
                raise ValueError(f"the KV cache holds {past_len} positions, more than the static decode graph's "
                                 f"past length {self.static_past}")
            pad = self.static_past - past_len
            feed["attention_mask"] = np.array([[1] * past_len + [0] * pad + [1]], np.int64)
            kv = [np.pad(t, ((0, 0), (0, 0), (0, pad), (0, 0))) for t in kv]
        else:
            feed["attention_mask"] = np.ones((1, past_len + 1), np.int64)
        for i in range(self.num_layers):
            feed[f"past_key_values.{i}.key"] = kv[2 * i]
            feed[f"past_key_values.{i}.value"] = kv[2 * i + 1]
        return feed

    def run_decode(self, token: int, kv: list[np.ndarray],
                   position: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """One step: logits for ``token`` at ``position``, the grown compact KV, and the graph's raw present."""
        if self.decode is None:
            raise ValueError("no decode graph was given")
        outs = self.decode.run(None, self.decode_feed(token, kv, position))
        new_kv = [np.concatenate([t, o[:, :, -1:]], axis=2) for t, o in zip(kv, outs[1:])]
        return outs[0][0, -1], new_kv, outs[1:]

    def generate_greedy(self, prompt: Sequence[int], steps: int) -> list[int]:
        last, _, kv = self.run_prefill(prompt)
        tokens, position = [], len(prompt)
        for _ in range(steps):
            tok = int(np.argmax(last))
            tokens.append(tok)
            if len(tokens) == steps:
                break
            last, kv, _ = self.run_decode(tok, kv, position)
            position += 1
        return tokens

    def as_module(self) -> "LogitsModule":
        return LogitsModule(self.logits)


class LogitsModule(nn.Module):
    """Wrap any ``ids -> logits`` runtime (onnxruntime, MNN) so ``workbench.evaluate`` scores it unchanged."""

    def __init__(self, run_logits: Callable[[np.ndarray], np.ndarray], config=None, *, record_argmax: bool = False):
        super().__init__()
        self.run_logits = run_logits
        self.config = config
        self._anchor = nn.Parameter(torch.zeros(()), requires_grad=False)  # evaluate() asks for a device
        self.argmax_rows: list[np.ndarray] | None = [] if record_argmax else None  # top-1 per row, in call order

    def forward(self, input_ids: torch.Tensor, **_) -> SimpleNamespace:
        logits = np.ascontiguousarray(self.run_logits(input_ids.cpu().numpy()))
        if self.argmax_rows is not None:
            self.argmax_rows.extend(logits.argmax(-1))
        return SimpleNamespace(logits=torch.from_numpy(logits))


@torch.inference_mode()
def greedy_tokens_torch(model: nn.Module, prompt: Sequence[int], steps: int) -> list[int]:
    """Greedy decoding in PyTorch with a KV cache: the reference for ``OnnxCausalLM.generate_greedy``."""
    from transformers import DynamicCache
    cache = DynamicCache()
    ids = torch.tensor([list(prompt)])
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    tokens = []
    for _ in range(steps):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        if len(tokens) == steps:
            break
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def _check_graphs(paths: Sequence[Path]) -> None:
    import onnx
    for p in paths:
        onnx.checker.check_model(str(p), full_check=False)
        onnx.shape_inference.infer_shapes_path(str(p), str(p) + ".inferred", strict_mode=True, data_prop=False)
        Path(str(p) + ".inferred").unlink()


@torch.inference_mode()
def _parity(model: nn.Module, runner: OnnxCausalLM, prompt: list[int]) -> dict[str, float]:
    """Max abs differences of logits and KV: prefill on the prompt, then one decode step."""
    from transformers import DynamicCache
    ids = torch.tensor([prompt])
    ref = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    ref_kv = [t for layer in ref.past_key_values.layers for t in (layer.keys, layer.values)]
    _, logits, kv = runner.run_prefill(prompt)
    diffs = {"prefill.logits": float(np.abs(logits - ref.logits.numpy()).max()),
             "prefill.kv": max(float(np.abs(a - b.numpy()).max()) for a, b in zip(kv, ref_kv))}
    tok = int(ref.logits[0, -1].argmax())
    ref2 = model(input_ids=torch.tensor([[tok]]), past_key_values=ref.past_key_values, use_cache=True)
    ref2_kv = [t for layer in ref2.past_key_values.layers for t in (layer.keys, layer.values)]
    last, kv2, _ = runner.run_decode(tok, kv, len(prompt))
    diffs["decode.logits"] = float(np.abs(last - ref2.logits[0, -1].numpy()).max())
    diffs["decode.kv"] = max(float(np.abs(a - b.numpy()).max()) for a, b in zip(kv2, ref2_kv))
    return diffs


def export_onnx(lm, out_dir: str | Path, *, static: tuple[int, int] | None = None, opset: int = DEFAULT_OPSET,
                check: bool = True, greedy_steps: int = 32, prompt: str | Sequence[int] | None = None,
                progress: Callable[[str], None] | None = None) -> ExportResult:
    """Export ``lm`` (a ``LoadedModel``) to ``out_dir/prefill.onnx`` and ``out_dir/decode.onnx``.

    ``static=(seq, past)`` fixes every shape (batch 1): the prefill graph takes ``seq`` tokens, the
    decode graph one token and a past of ``past`` positions. With ``check`` the graphs are verified:
    onnx checker and strict shape inference, onnxruntime vs PyTorch on logits and KV, and greedy
    decoding for ``greedy_steps`` tokens through prefill + decode.
    """
    log = progress or (lambda msg: None)
    model = lm.model
    if next(model.parameters()).dtype != torch.float32:
        raise ModelLoadError("export needs a float32 model: load it with load_model(path, dtype='float32')")
    if opset < 17:
        raise ValueError(f"opset {opset} is too old; use 17 or newer")
    if static is not None:
        seq, past = (int(x) for x in static)
        if seq < 1 or past < 1:
            raise ValueError(f"static shapes must be positive, got sequence {seq}, past {past}")
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if max_pos and past + 1 > max_pos:
            raise ValueError(f"static past {past} + 1 exceeds the model's max_position_embeddings ({max_pos})")
        static = (seq, past)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_layers, kv_heads, head_dim = _kv_geometry(model.config)
    wrapper = _KVCacheWrapper(model, n_layers).eval()
    t0 = time.perf_counter()
    prefill_path, decode_path = out / PREFILL_FILE, out / DECODE_FILE
    with _eager_attention(model), _single_thread(), torch.inference_mode(False), torch.no_grad():
        seq, past = static or (8, 4)
        ids = torch.zeros((1, seq), dtype=torch.long)
        log(f"exporting prefill graph ({'sequence ' + str(seq) if static else 'dynamic shapes'})")
        _export_one(wrapper, prefill_path.with_suffix(".tmp"), (ids, torch.ones_like(ids), torch.arange(seq)[None]),
                    False, static is not None, opset)
        dseq = 1 if static else 2
        past_kv = [torch.zeros((1, kv_heads, past, head_dim)) for _ in range(2 * n_layers)]
        ids = torch.zeros((1, dseq), dtype=torch.long)
        log("exporting decode graph")
        _export_one(wrapper, decode_path.with_suffix(".tmp"),
                    (ids, torch.ones((1, past + dseq), dtype=torch.long), torch.arange(past, past + dseq)[None],
                     *past_kv), True, static is not None, opset)
    names, layouts = {}, {}
    for tmp, final in ((prefill_path.with_suffix(".tmp"), prefill_path), (decode_path.with_suffix(".tmp"), decode_path)):
        if static:
            fold_constants(tmp)
        graph_names, layouts = _name_weights(tmp, model, lm.layers)
        if names and graph_names != names:
            raise RuntimeError("prefill and decode graphs named the layer weights differently")
        names = graph_names
        tmp.replace(final)
    export_seconds = time.perf_counter() - t0
    atomic_write_json(out / "weight_names.json", {"weight_names": names, "weight_layouts": layouts})
    result = ExportResult(prefill_path, decode_path, names, layouts, None, None, greedy_steps, static, opset, n_layers,
                          export_seconds, 0.0)
    if not check:
        return result
    t1 = time.perf_counter()
    log("checking: onnx checker and shape inference")
    _check_graphs(result.files)
    runner = OnnxCausalLM(prefill_path, decode_path, threads=1)
    tokens = _prompt_tokens(lm, prompt)
    if static:
        tokens = tokens[:max(1, min(static[0], static[1] - greedy_steps))]
    log("checking: onnxruntime vs PyTorch on logits and KV cache")
    with _single_thread():
        result.diffs = _parity(model, runner, tokens)
        result.max_abs_diff = max(result.diffs.values())
        log(f"checking: greedy decoding for {greedy_steps} steps")
        result.onnx_tokens = runner.generate_greedy(tokens, greedy_steps)
        result.torch_tokens = greedy_tokens_torch(model, tokens, greedy_steps)
    match = 0
    for a, b in zip(result.onnx_tokens, result.torch_tokens):
        if a != b:
            break
        match += 1
    result.greedy_match_steps = match
    result.check_seconds = time.perf_counter() - t1
    return result


def _prompt_tokens(lm, prompt) -> list[int]:
    if prompt is not None and not isinstance(prompt, str):
        return [int(t) for t in prompt]
    text = prompt or DEFAULT_PROMPT
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"] if lm.tokenizer is not None else list(range(1, 17))
    return list(ids) or [1]
