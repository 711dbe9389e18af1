"""ONNX export of a causal LM as a prefill graph and a decode graph with a KV cache, checked by itself.

    result = export_onnx(load_model("demo"), "out/onnx")                 # dynamic batch/sequence/past
    result = export_onnx(lm, "out/onnx-static", static=(128, 512))     # what NPU compilers want
    result.max_abs_diff, result.greedy_match_steps, result.weight_names["model.layers.0.mlp.up_proj"]
    inventory = operator_inventory(result.prefill_path)

The prefill graph takes ``input_ids``, ``attention_mask``, ``position_ids`` and returns ``logits``
plus ``present.{i}.key/value``; the decode graph also takes ``past_key_values.{i}.key/value``
(the names onnxruntime-genai and Optimum use). A dynamic decode graph accepts a past of length 0,
so it serves prefill as well: ``OnnxCausalLM`` then runs that one session.

The graphs are built op by op from the model's modules (``workbench.onnx.build``), whatever dtype
the model is stored in: each weight is widened to float32 on its own and written once. Above
``INLINE_LIMIT`` bytes the weights live in one ONNX external-data file (``weights.data``) that both
graphs reference; smaller models keep them inline in each graph.

Each quantizable layer's weight is stored under a name derived from its PyTorch FQN
(``model.layers.0.self_attn.q_proj.weight.T``: the Linear weight transposed to ``[in, out]`` for
MatMul), so per-tensor encodings (QNN overrides, ONNX Runtime tensor overrides) can be written
against the plan's layer names; ``ExportResult.weight_names`` records the map.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..errors import ModelLoadError
from ..runtime.onnx_runner import OnnxCausalLM
from ..runtime.parity import greedy_agreement, parity, torch_reference
from ..runtime.stream import torch_threads
from ..files.workspace import atomic_write_json
from .build import DATA_FILE, build_graphs
from ..model.load import load_model

__all__ = ["ExportResult", "export_onnx", "share_external_data", "check_graphs", "DEFAULT_OPSET", "PREFILL_FILE",
           "DECODE_FILE", "DEFAULT_PROMPT"]

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


def check_graphs(paths: Sequence[Path]) -> None:
    """The onnx checker and strict shape inference on each graph (what an export's check starts with)."""
    import onnx
    for p in paths:
        onnx.checker.check_model(str(p), full_check=False)
        onnx.shape_inference.infer_shapes_path(str(p), str(p) + ".inferred", strict_mode=True, data_prop=False)
        Path(str(p) + ".inferred").unlink()


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
        ref = torch_reference(model, tokens)
    if release_model:
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        del model
        lm.release()
    log("checking: onnx checker and shape inference")
    check_graphs([result.prefill_path, result.decode_path])
    runner = OnnxCausalLM(result.prefill_path, result.decode_path, threads=1)
    log(f"checking: onnxruntime vs PyTorch on logits and KV cache, then greedy decoding for {greedy_steps} steps")
    result.diffs = parity(ref, runner, tokens)
    result.max_abs_diff = max(result.diffs.values())
    result.onnx_tokens = runner.generate_greedy(tokens, greedy_steps)
    del runner
    if release_model:
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
