"""Reading ONNX graphs: load them with clear errors, fold shape arithmetic, count operators and weight bytes.

    proto = load_onnx("out/onnx/decode.onnx")          # says what is wrong with a missing or cut-short file
    operator_inventory(proto)[0].op_type, initializer_bytes_by_block(proto)["layers.0"]
    decode_step_bytes("out/onnx/decode.onnx")         # what one decode step reads: the bound on decode speed

Nothing here runs a model or imports torch: ``workbench inspect``, the targets' rule checks and the
profiler read graphs through it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError
from ..files.folder_paths import inside_folder

__all__ = ["OpCount", "load_onnx", "operator_inventory", "fold_constants", "initializer_bytes",
           "initializer_bytes_by_block", "external_data_files", "decode_step_bytes", "SHAPE_OPS"]

SHAPE_OPS = ("Shape", "Size", "Range", "ConstantOfShape", "NonZero")  # run-time shape arithmetic


def external_data_files(proto, base_dir: str | Path, named_by: str | Path | None = None) -> dict[Path, int]:
    """External-data files a graph reads, with the bytes it needs from each (largest offset + length); a location
    leaving ``base_dir`` (absolute, ``..``, a symlink out) is ModelLoadError naming it (``named_by``: the graph)."""
    from onnx.external_data_helper import uses_external_data
    need: dict[Path, int] = {}
    for init in proto.graph.initializer:
        if uses_external_data(init):
            info = {e.key: e.value for e in init.external_data}
            inside_folder(base_dir, info.get("location", ""), named_by or base_dir,
                          f"external data location of '{init.name}'")
            f = Path(base_dir) / info.get("location", "")
            end = int(info.get("offset", 0)) + int(info.get("length", 0))
            need[f] = max(need.get(f, 0), end)
    return need


def _uses_external_data(path: Path) -> bool:
    import onnx
    return bool(external_data_files(onnx.load(str(path), load_external_data=False), path.parent))


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
    for data, needed in external_data_files(proto, p.parent, p).items():
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


def context_cache_files(proto, folder: Path) -> list[Path]:
    """The context binaries an execution provider's ``EPContext`` nodes keep outside the graph (``embed_mode`` 0,
    as the HTP's ``_ctx.onnx`` files): the compiled graph, its weights included, named beside ``folder``'s graph."""
    files = []
    for node in proto.graph.node:
        if node.op_type != "EPContext":
            continue
        attrs = {a.name: a for a in node.attribute}
        embedded = "embed_mode" in attrs and attrs["embed_mode"].i == 1
        if "ep_cache_context" in attrs and not embedded:
            path = Path(folder) / attrs["ep_cache_context"].s.decode("utf-8", "replace")
            if path not in files:
                files.append(path)
    return files


def decode_step_bytes(decode: Path) -> int:
    """Bytes one decode step reads: the decode graph's weights, except that an embedding table (an initializer
    only Gather reads) and GroupQueryAttention's rotary caches are read one row per token, and a float16
    initializer only a Cast to float32 reads counts at float32 (onnxruntime folds the Cast when it loads the
    model and reads the widened copy). A non-ONNX graph counts its whole file."""
    decode = Path(decode)
    if decode.suffix != ".onnx":
        return decode.stat().st_size
    from onnx import TensorProto

    proto = load_onnx(decode)
    caches = context_cache_files(proto, decode.parent)
    if caches:  # a compiled context: its binary holds the weights, all of them read each step
        return sum(f.stat().st_size for f in caches if f.is_file())
    sizes = initializer_bytes(proto)
    half = {init.name for init in proto.graph.initializer if init.data_type == TensorProto.FLOAT16}
    dims = {init.name: list(init.dims) for init in proto.graph.initializer}
    consumers: dict[str, list] = {}
    for node in proto.graph.node:
        for x in set(node.input):
            consumers.setdefault(x, []).append(node)

    def to_float(node) -> bool:
        return node.op_type == "Cast" and any(a.name == "to" and a.i == TensorProto.FLOAT for a in node.attribute)

    def kind(name: str, node, i: int) -> str:
        if (node.op_type.startswith("Gather") and i == 0) or (node.op_type == "GroupQueryAttention" and i in (7, 8)):
            return "rows"  # an embedding table, GroupQueryAttention's cos / sin caches: a row a position
        if name in half and (to_float(node) or (node.op_type == "Transpose" and consumers.get(node.output[0])
                                                and all(to_float(c) for c in consumers[node.output[0]]))):
            return "widened"
        return "full"

    total = 0
    for name, n in sizes.items():
        kinds = {kind(name, node, i) for node in consumers.get(name, []) for i, x in enumerate(node.input) if x == name}
        total += (2 * n if "widened" in kinds else 0) + (n if "full" in kinds or not kinds else 0)
        if kinds == {"rows"} or ("rows" in kinds and "full" not in kinds):
            total += n // max(dims[name][0], 1) if dims[name] else n
    return total
