"""``OnnxCausalLM``: prefill and decode graphs in onnxruntime, the runner of every ONNX target's output.

    runner = OnnxCausalLM("out/onnx/prefill.onnx", "out/onnx/decode.onnx", threads=1)
    last, logits, kv = runner.run_prefill(prompt); last, kv, _ = runner.run_decode(token, kv, len(prompt))
    runner.logits(ids)                                  # [batch, seq, vocab], for the evaluation
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import ModelLoadError, WorkbenchError
from .stream import stream_tokens
from workbench.files.folder_paths import check_graph_paths, inside_folder

__all__ = ["OnnxCausalLM", "GraphLoadError", "input_names"]


def input_names(num_layers: int, with_past: bool) -> list[str]:
    """The inputs of an exported graph, in the order the runner feeds them (``onnx.build`` names its graphs' by it)."""
    names = ["input_ids", "attention_mask", "position_ids"]
    if with_past:
        names += [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return names


class GraphLoadError(ModelLoadError):
    """onnxruntime (or onnx) refused one graph file: the message names that file; ``path`` and ``cause`` let a
    runner on another backend read the refusal itself."""

    def __init__(self, path: str | Path, cause: BaseException):
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(f"onnxruntime could not load '{path}': {first}; export or convert it again")
        self.path, self.cause = Path(path), cause


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
    ``session_options`` is called with every ``onnxruntime.SessionOptions`` this runner creates, before
    its session is made: another execution provider is configured there (a plugin EP's
    ``add_provider_for_devices``, session config entries); when it sets providers, ``providers`` is not
    passed to the session (onnxruntime would otherwise use those instead).
    """

    runtime = "onnxruntime"

    def __init__(self, prefill_path: str | Path, decode_path: str | Path | None = None, *,
                 providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None,
                 accuracy_level: int | None = None, session_options: Callable[[object], None] | None = None):
        self.providers, self.threads, self.accuracy_level = list(providers), threads, accuracy_level
        self.session_options = session_options
        try:
            static = bool(decode_path) and _static_past(decode_path)
        except Exception as e:  # not an ONNX file onnx can parse
            raise GraphLoadError(decode_path, e) from None
        self._shared: dict | None = {} if static else None
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
        """One session over ``path``; any refusal by onnxruntime (a damaged file, external data it will not
        read) is a one-line GraphLoadError naming the file."""
        try:
            return self._open_session(path)
        except WorkbenchError:
            raise
        except Exception as e:
            raise GraphLoadError(path, e) from None

    def _open_session(self, path: str | Path):
        import onnxruntime as ort
        check_graph_paths(path)  # nothing a graph names outside its folder is opened, by us or by onnxruntime
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if self.threads:
            opts.intra_op_num_threads = self.threads
        if self._shared is not None:
            self._share_external_weights(opts, Path(path))
        if self.session_options is not None:
            self.session_options(opts)
        providers = None if getattr(opts, "has_providers", lambda: False)() else self.providers
        if self.accuracy_level is None:
            return ort.InferenceSession(str(path), opts, providers=providers)
        import onnx
        from onnx import helper
        proto = onnx.load(str(path), load_external_data=False)
        for node in proto.graph.node:
            if node.op_type == "MatMulNBits":
                kept = [a for a in node.attribute if a.name != "accuracy_level"]
                del node.attribute[:]
                node.attribute.extend(kept + [helper.make_attribute("accuracy_level", self.accuracy_level)])
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(Path(path).parent))
        return ort.InferenceSession(proto.SerializeToString(), opts, providers=providers)

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
            file = inside_folder(path.parent, info.get("location", ""), path, "external data location")
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
        if not isinstance(self.vocab, int) or not hasattr(self.prefill, "io_binding"):
            # a graph from elsewhere with a symbolic vocabulary size, or one run in parts (htp_parts.ChainedSession)
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
        """``steps`` greedy tokens after ``prompt`` (no end-of-sequence stop): ``workbench.run.generate``'s loop."""
        return list(stream_tokens(self, prompt, steps))
