"""ONNX export of a causal LM as a prefill graph and a decode graph with a KV cache, checked by itself.

    result = export_onnx(load_model("demo"), "out/onnx")                 # dynamic batch/sequence/past
    result = export_onnx(lm, "out/onnx-static", static=(128, 512))     # what NPU compilers want
    result.max_abs_diff, result.greedy_match_steps, result.weight_names["model.layers.0.mlp.up_proj"]
    inventory = operator_inventory(result.prefill_path)

The prefill graph takes ``input_ids``, ``attention_mask``, ``position_ids`` and returns ``logits``
plus ``present.{i}.key/value``; the decode graph also takes ``past_key_values.{i}.key/value``
(the names onnxruntime-genai and Optimum use). A dynamic decode graph accepts a past of length 0,
so it serves prefill as well: ``OnnxCausalLM`` then runs that one session.

The graphs are built op by op from the model's modules (``workbench.graph_build``), whatever dtype
the model is stored in: each weight is widened to float32 on its own and written once. Above
``INLINE_LIMIT`` bytes the weights live in one ONNX external-data file (``weights.data``) that both
graphs reference; smaller models keep them inline in each graph.

Each quantizable layer's weight is stored under a name derived from its PyTorch FQN
(``model.layers.0.self_attn.q_proj.weight.T``: the Linear weight transposed to ``[in, out]`` for
MatMul), so per-tensor encodings (QNN overrides, ONNX Runtime tensor overrides) can be written
against the plan's layer names; ``ExportResult.weight_names`` records the map.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .errors import ModelLoadError
from .graph_build import DATA_FILE, INLINE_LIMIT, build_graphs, input_names, output_names
from .workspace import atomic_write_json

__all__ = ["ExportResult", "OpCount", "export_onnx", "load_onnx", "operator_inventory", "OnnxCausalLM",
           "greedy_agreement", "fold_constants", "input_names", "output_names", "DEFAULT_OPSET",
           "PREFILL_FILE", "DECODE_FILE", "DATA_FILE", "INLINE_LIMIT", "initializer_bytes",
           "initializer_bytes_by_block", "external_data_files", "share_external_data", "torch_threads"]

DEFAULT_OPSET = 17  # the oldest opset every target here accepts; LayerNormalization exists from 17
PREFILL_FILE = "prefill.onnx"
DECODE_FILE = "decode.onnx"
DEFAULT_PROMPT = "The workbench measures what each quantization choice costs before the model reaches a device."
SHAPE_OPS = ("Shape", "Size", "Range", "ConstantOfShape", "NonZero")  # run-time shape arithmetic


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
    data_path: Path | None = None  # the external-data file both graphs share; None when weights are inline

    @property
    def files(self) -> list[Path]:
        return [self.prefill_path, self.decode_path] + ([self.data_path] if self.data_path else [])

    @property
    def seconds(self) -> float:
        return self.export_seconds + self.check_seconds

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(prefill_path=str(self.prefill_path), decode_path=str(self.decode_path),
                 data_path=str(self.data_path) if self.data_path else None,
                 files=[{"path": str(p), "bytes": p.stat().st_size} for p in self.files], seconds=self.seconds,
                 static=list(self.static) if self.static else None)
        return d


@contextlib.contextmanager
def torch_threads(threads: int | None = 1):
    """PyTorch on ``threads`` threads inside (None: unchanged). Decode-sized matmuls are fastest on one
    thread; more threads oversubscribe a busy CPU badly."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def external_data_files(proto, base_dir: str | Path) -> dict[Path, int]:
    """External-data files a graph reads, with the bytes it needs from each (largest offset + length)."""
    from onnx.external_data_helper import uses_external_data
    need: dict[Path, int] = {}
    for init in proto.graph.initializer:
        if uses_external_data(init):
            info = {e.key: e.value for e in init.external_data}
            f = Path(base_dir) / info.get("location", "")
            end = int(info.get("offset", 0)) + int(info.get("length", 0))
            need[f] = max(need.get(f, 0), end)
    return need


def _uses_external_data(path: Path) -> bool:
    import onnx
    return bool(external_data_files(onnx.load(str(path), load_external_data=False), path.parent))


def share_external_data(paths: Sequence[str | Path], data_name: str = DATA_FILE) -> Path | None:
    """Move the external data of graphs in one folder into one file, each identical tensor stored once.

    For graphs written separately (QDQ prefill and decode): a tensor with the same name and bytes in
    several graphs is written once and all of them point at it. Streams one tensor at a time; old
    data files are removed. Returns the shared file, or None when no graph uses external data.
    """
    import hashlib
    import os

    import onnx
    from onnx.external_data_helper import uses_external_data
    paths = [Path(p) for p in paths]
    folder = paths[0].parent
    protos = [onnx.load(str(p), load_external_data=False) for p in paths]
    if not any(uses_external_data(i) for proto in protos for i in proto.graph.initializer):
        return None
    target, tmp = folder / data_name, folder / (data_name + ".partial")
    old, seen = set(), {}
    with open(tmp, "wb") as out:
        for proto in protos:
            for init in proto.graph.initializer:
                if not uses_external_data(init):
                    continue
                info = {e.key: e.value for e in init.external_data}
                src = folder / info["location"]
                old.add(src)
                with open(src, "rb") as f:
                    f.seek(int(info.get("offset", 0)))
                    data = f.read(int(info["length"])) if "length" in info else f.read()
                key = (init.name, hashlib.sha1(data).hexdigest())
                if key not in seen:
                    if len(data) >= 2**20 and out.tell() % 2**16:
                        out.write(b"\0" * (2**16 - out.tell() % 2**16))
                    seen[key] = out.tell()
                    out.write(data)
                del init.external_data[:]
                for k, v in (("location", data_name), ("offset", str(seen[key])), ("length", str(len(data)))):
                    e = init.external_data.add()
                    e.key, e.value = k, v
    for p, proto in zip(paths, protos):
        p.with_name(p.name + ".partial").write_bytes(proto.SerializeToString())
    os.replace(tmp, target)
    for p in paths:
        os.replace(p.with_name(p.name + ".partial"), p)
    for f in old - {target}:
        f.unlink(missing_ok=True)
    return target


def fold_constants(src: str | Path, dst: str | Path | None = None) -> Path:
    """Fold shape arithmetic into constants with onnxruntime's basic, standard-op-only optimisations.

    With static shapes, the Shape/Range/Equal/Where chains that build positions and the causal
    mask become initializers, which is what NPU converters expect (they reject or fall back on them).
    A graph with external data gets its folded weights in ``<dst>.data``.
    """
    import onnxruntime as ort
    src = Path(src)
    dst = Path(dst) if dst else src
    tmp = dst.with_name(dst.name + ".folding")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(tmp)
    opts.log_severity_level = 3
    if _uses_external_data(src):
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.name + ".data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])
    tmp.replace(dst)
    return dst


def load_onnx(path: str | Path, *, load_external_data: bool = False):
    """Read an ONNX file, saying clearly when it is missing, not ONNX, or cut short (its external data too).

    Weights kept in external data are not read unless ``load_external_data``: inspection needs
    shapes and small constants, not gigabytes of weights.
    """
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
        proto = onnx.load(str(p), load_external_data=False)
    except DecodeError as e:
        raise ModelLoadError(f"'{p}' is not a valid ONNX model ({size:,} bytes could not be parsed: {e}); the file "
                             "is truncated or not ONNX: export it again") from None
    except Exception as e:
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
    for data, needed in external_data_files(proto, p.parent).items():
        have = data.stat().st_size if data.is_file() else None
        if have is None or have < needed:
            state = "is missing" if have is None else f"holds {have:,} of the {needed:,} bytes the graph reads"
            raise ModelLoadError(f"'{p}' keeps its weights in '{data.name}', which {state}: copy it next to the "
                                 "graph or export again")
    if load_external_data:
        from onnx.external_data_helper import load_external_data_for_model
        load_external_data_for_model(proto, str(p.parent))
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


def _static_past(decode_path: str | Path) -> bool:
    """Whether a decode graph has a fixed past length (then prefill needs a session of its own)."""
    import onnx
    graph = onnx.load(str(decode_path), load_external_data=False).graph
    past = next((i for i in graph.input if i.name == "past_key_values.0.key"), None)
    return past is not None and past.type.tensor_type.shape.dim[2].HasField("dim_value")


class OnnxCausalLM:
    """Prefill + decode graphs in onnxruntime: greedy generation and logits for evaluation.

    A dynamic decode graph also runs prefill (past of length 0): then only that session is
    created, and ``prefill`` is the same session. Static graphs (fixed sequence / past) are
    driven the way a device runtime drives them: the prompt is right-padded to the graph's
    sequence length, the past is a fixed buffer whose unused slots the attention mask hides.
    ``accuracy_level`` runs the same files with every ``MatMulNBits`` at another accuracy level.
    """

    def __init__(self, prefill_path: str | Path, decode_path: str | Path | None = None, *,
                 providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None,
                 accuracy_level: int | None = None, session_options: Callable | None = None):
        self.providers, self.threads, self.accuracy_level = list(providers), threads, accuracy_level
        self.session_options = session_options  # f(SessionOptions), applied to each session's options (an EP)
        self._shared: dict | None = {} if decode_path and _static_past(decode_path) else None
        self.decode = self._session(decode_path) if decode_path else None
        self.static_past = self.kv_shape = None
        if self.decode is not None:
            shapes = {i.name: i.shape for i in self.decode.get_inputs()}
            past = shapes["past_key_values.0.key"]
            self.static_past = past[2] if isinstance(past[2], int) else None
            self.kv_shape = (past[1], past[3])
            self.kv_shapes = {n: (sh[1], sh[3]) for n, sh in shapes.items() if n.startswith("past_key_values.")}
        self.serves_prefill = self.decode is not None and self.static_past is None
        self.prefill = self.decode if self.serves_prefill else self._session(prefill_path)
        shape = {i.name: i.shape for i in self.prefill.get_inputs()}["input_ids"]
        self.static_seq = shape[1] if isinstance(shape[1], int) else None
        self.num_layers = (len(self.prefill.get_outputs()) - 1) // 2
        self.vocab = self.prefill.get_outputs()[0].shape[-1]
        # a graph that computes positions itself (GroupQueryAttention's rotary embedding) takes no position_ids
        self._positions = "position_ids" in {i.name for i in self.prefill.get_inputs()}

    def _feed(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self._positions:
            feed.pop("position_ids", None)
        return feed

    def _session(self, path: str | Path):
        import onnxruntime as ort
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if self.threads:
            opts.intra_op_num_threads = self.threads
        if self.session_options is not None:
            self.session_options(opts)
        if self._shared is not None:
            self._share_external_weights(opts, Path(path))
        if self.accuracy_level is None:
            return ort.InferenceSession(str(path), opts, providers=self.providers)
        import onnx
        from onnx import helper
        proto = onnx.load(str(path), load_external_data=False)
        for node in proto.graph.node:
            if node.op_type == "MatMulNBits":
                kept = [a for a in node.attribute if a.name != "accuracy_level"]
                del node.attribute[:]
                node.attribute.extend(kept + [helper.make_attribute("accuracy_level", self.accuracy_level)])
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(Path(path).parent))
        return ort.InferenceSession(proto.SerializeToString(), opts, providers=self.providers)

    def _share_external_weights(self, opts, path: Path) -> None:
        """Both static sessions read external weights from one memory map instead of a copy each.

        onnxruntime would load (and pre-pack) every weight once per session: two copies of the model
        for static prefill + decode graphs. Weights handed over as initializers are used where they
        lie; pre-packing is off so no session makes its own copy (measured on Qwen2.5-0.5B's shape,
        fp32 MatMul: the same speed, 2.0 GB resident instead of 5.8 GB).
        """
        import onnx
        import onnxruntime as ort
        from onnx.external_data_helper import uses_external_data
        opts.add_session_config_entry("session.disable_prepacking", "1")
        for init in onnx.load(str(path), load_external_data=False).graph.initializer:
            if not uses_external_data(init) or init.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
                continue  # packed 4-bit (QDQ) weights have no numpy view: the session reads those itself
            info = {e.key: e.value for e in init.external_data}
            file = (path.parent / info["location"]).resolve()
            key = (file, int(info.get("offset", 0)), init.name)
            if key not in self._shared:
                if file not in self._shared:
                    self._shared[file] = np.memmap(file, np.uint8, "r")
                dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
                size = int(np.prod(init.dims, dtype=np.int64)) * np.dtype(dtype).itemsize
                raw = self._shared[file][key[1]:key[1] + size]
                self._shared[key] = ort.OrtValue.ortvalue_from_numpy(raw.view(dtype).reshape(tuple(init.dims)))
            opts.add_initializer(init.name, self._shared[key])

    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        """Zero-length past tensors, when the decode session also runs prefill."""
        if not self.serves_prefill:
            return {}
        return {name: np.zeros((batch, self.kv_shapes[name][0], 0, self.kv_shapes[name][1]), np.float32)
                for name in input_names(self.num_layers, True)[3:]}  # a pruned model's layers may differ

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
        feed = self._feed({"input_ids": ids, "attention_mask": mask, "position_ids": pos, **self._empty_past(b)})
        if not isinstance(self.vocab, int):  # a graph from elsewhere with a symbolic vocabulary size
            return self.prefill.run(["logits"], feed)[0][:, :n]
        # onnxruntime writes the logits straight into this array: no arena copy of tokens x vocabulary kept
        out = np.empty((b, ids.shape[1], self.vocab), np.float32)
        binding = self.prefill.io_binding()
        for name, value in feed.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        for o in self.prefill.get_outputs()[1:]:
            binding.bind_output(o.name, "cpu")
        self.prefill.run_with_iobinding(binding)
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
        return self._feed({"input_ids": ids, "attention_mask": mask,
                           "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None], **self._empty_past(1)})

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
        return self._feed(feed)

    def run_decode(self, token: int, kv: list[np.ndarray],
                   position: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """One step: logits for ``token`` at ``position``, the grown compact KV, and the graph's raw present."""
        if self.decode is None:
            raise ValueError("no decode graph was given")
        outs = self.decode.run(None, self.decode_feed(token, kv, position))
        new_kv = [np.concatenate([t, o[:, :, -1:]], axis=2) for t, o in zip(kv, outs[1:])]
        return outs[0][0, -1], new_kv, outs[1:]

    def generate_greedy(self, prompt: Sequence[int], steps: int) -> list[int]:
        """``steps`` greedy tokens after ``prompt`` (no end-of-sequence stop): ``workbench.generate``'s loop."""
        from .generate import stream_tokens
        return list(stream_tokens(self, prompt, steps))


@torch.inference_mode()
def greedy_agreement(model: nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[int, list[int]]:
    """How many leading ``tokens`` (another runtime's greedy continuation of ``prompt``) ``model`` picks too.

    One forward pass over ``prompt + tokens`` instead of a decode loop: greedy decoding agrees for
    exactly as long as the model's argmax at each position is the next given token. Returns that
    count and the model's own greedy tokens as far as they are determined (one past the first
    disagreement).
    """
    from .logits import final_hidden, head_logits
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


def _check_graphs(paths: Sequence[Path]) -> None:
    import onnx
    for p in paths:
        onnx.checker.check_model(str(p), full_check=False)
        onnx.shape_inference.infer_shapes_path(str(p), str(p) + ".inferred", strict_mode=True, data_prop=False)
        Path(str(p) + ".inferred").unlink()


@dataclass
class _TorchReference:
    """What PyTorch computed for the parity check: the prompt's logits and KV, then one decode step's."""

    prefill_logits: np.ndarray
    prefill_kv: list[np.ndarray]
    token: int
    decode_logits: np.ndarray
    decode_kv: list[np.ndarray]


@torch.inference_mode()
def _torch_reference(model: nn.Module, prompt: list[int]) -> _TorchReference:
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
    return _TorchReference(logits, prefill_kv, token, out.logits[0, -1].float().cpu().numpy().copy(),
                           kv(out.past_key_values))


def _parity(ref: _TorchReference, runner: OnnxCausalLM, prompt: list[int]) -> dict[str, float]:
    """Max abs differences of logits and KV: prefill on the prompt, then one decode step."""
    _, logits, kv = runner.run_prefill(prompt)
    diffs = {"prefill.logits": float(np.abs(logits - ref.prefill_logits).max()),
             "prefill.kv": max(float(np.abs(a - b).max()) for a, b in zip(kv, ref.prefill_kv))}
    last, kv2, _ = runner.run_decode(ref.token, kv, len(prompt))
    diffs["decode.logits"] = float(np.abs(last - ref.decode_logits).max())
    diffs["decode.kv"] = max(float(np.abs(a - b).max()) for a, b in zip(kv2, ref.decode_kv))
    return diffs


def export_onnx(lm, out_dir: str | Path, *, static: tuple[int, int] | None = None, opset: int = DEFAULT_OPSET,
                check: bool = True, greedy_steps: int = 32, prompt: str | Sequence[int] | None = None,
                progress: Callable[[str], None] | None = None, inline_limit: int | None = None,
                release_model: bool = False) -> ExportResult:
    """Export ``lm`` (a ``LoadedModel``) to ``out_dir/prefill.onnx`` and ``out_dir/decode.onnx``.

    ``static=(seq, past)`` fixes every shape (batch 1): the prefill graph takes ``seq`` tokens, the
    decode graph one token and a past of ``past`` positions. Weights above ``inline_limit`` bytes
    (default ``INLINE_LIMIT``) go to one shared ``weights.data``. With ``check`` the graphs are
    verified: onnx checker and strict shape inference, onnxruntime vs PyTorch on logits and KV, and
    greedy decoding for ``greedy_steps`` tokens through prefill + decode. ``release_model`` is for a
    caller done with ``lm`` whose model is as stored at ``lm.path`` (the CLI): its weights are let go
    (``lm.release()``) while the check's onnxruntime session holds them in float32, and re-read from
    disk for the greedy comparison, so the two never sit in memory together.
    """
    log = progress or (lambda msg: None)
    model = lm.model
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
    t0 = time.perf_counter()
    log(f"building prefill and decode graphs ({'static ' + str(static) if static else 'dynamic shapes'})")
    built = build_graphs(model, out, static=static, opset=opset, inline_limit=inline_limit,
                         progress=progress is not None)
    missing = [info.name for info in lm.layers if info.name not in built.weight_names]
    if missing:
        raise ModelLoadError(f"the graphs hold no weight for {', '.join(missing[:3])}: the model has layers the export "
                             "does not know")
    names = {info.name: built.weight_names[info.name] for info in lm.layers}
    layouts = {info.name: built.weight_layouts[info.name] for info in lm.layers}
    atomic_write_json(out / "weight_names.json", {"weight_names": names, "weight_layouts": layouts})
    result = ExportResult(built.prefill_path, built.decode_path, names, layouts, None, None, greedy_steps, static,
                          opset, len(model.model.layers), time.perf_counter() - t0, 0.0, data_path=built.data_path)
    if not check:
        return result
    t1 = time.perf_counter()
    tokens = _prompt_tokens(lm, prompt)
    if static:
        tokens = tokens[:max(1, min(static[0], static[1] - greedy_steps))]
    log("checking: PyTorch reference (prefill and one decode step)")
    with torch_threads(1):
        ref = _torch_reference(model, tokens)
    if release_model:
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        del model
        lm.release()
    log("checking: onnx checker and shape inference")
    _check_graphs([result.prefill_path, result.decode_path])
    runner = OnnxCausalLM(result.prefill_path, result.decode_path, threads=1)
    log(f"checking: onnxruntime vs PyTorch on logits and KV cache, then greedy decoding for {greedy_steps} steps")
    result.diffs = _parity(ref, runner, tokens)
    result.max_abs_diff = max(result.diffs.values())
    result.onnx_tokens = runner.generate_greedy(tokens, greedy_steps)
    del runner
    if release_model:
        from .models import load_model
        model = load_model(lm.path, dtype=dtype, device=device, load_tokenizer=False).model
    with torch_threads(1):
        result.greedy_match_steps, result.torch_tokens = greedy_agreement(model, tokens, result.onnx_tokens)
    result.check_seconds = time.perf_counter() - t1
    return result


def _prompt_tokens(lm, prompt) -> list[int]:
    if prompt is not None and not isinstance(prompt, str):
        return [int(t) for t in prompt]
    text = prompt or DEFAULT_PROMPT
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"] if lm.tokenizer is not None else list(range(1, 17))
    return list(ids) or [1]
