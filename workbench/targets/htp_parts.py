"""A QDQ graph cut into parts whose HTP context binaries each fit the SoC's limit, as Qualcomm ships its LLMs.

    parts = plan_parts(block_bytes, head_bytes=h, tail_bytes=t, limit=soc.context_limit_bytes)   # [(first, end)]
    files = split_graph("twin/prefill.qdq.onnx", "parts/", parts)    # prefill_part_1_of_3.onnx, ...
    logits = run_parts(files, feed)["logits"]                         # the parts chained: the whole graph's outputs
    split = split_to_fit("twin/prefill.qdq.onnx", budget)             # plan + split, each part's blocks and I/O
    check_chained("twin/prefill.qdq.onnx", files, feed)["identical"]  # True: bit for bit on the CPU
    runner = PartsCausalLM(prefill_parts, decode_parts)               # the parts driven as one prefill / decode graph

Qualcomm's recipe (qai-hub-models 0.65.0, ``models/qwen3_*/model.py``) splits every LLM into 2-4 parts:
the embedding, then the decoder blocks spread over the rest, the last part carrying the head; it names no
byte limit, but splits further when the phone refuses to load a context ("Could not create context from
binary ... err 1002": Qwen3-1.7B's single transformer part). The workbench takes the limit from the SoC's
device profile (``npu_memory_limit_gb``: 2 GiB before HTP v73, 4 GiB from v73) and sizes each part by the
bytes of the weights it holds. Parts meet at a block boundary, the residual stream after a block, passed
as the 16-bit codes of its ``QuantizeLinear`` (what Qualcomm's parts pass too): chained, the parts compute
exactly what the whole graph does. Parts are named as Qualcomm names them, ``<graph>_part_<k>_of_<n>``;
``htp.write_htp_binaries`` compiles them and writes the manifest (``PARTS_FILE``).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..errors import PlanError
from ..runtime.onnx_runner import OnnxCausalLM

__all__ = ["PARTS_FILE", "PARTS_FORMAT", "part_stem", "block_boundaries", "weight_bytes_by_block", "plan_parts",
           "split_graph", "split_to_fit", "graph_io", "run_parts", "check_chained", "ChainedSession", "PartsCausalLM",
           "read_parts"]

PARTS_FILE = "parts.json"  # beside the context binaries: every graph's parts in order and what passes between them
PARTS_FORMAT = "workbench-htp-parts"

_BLOCK_ADD = re.compile(r"^/model\.layers\.(\d+)/Add_\d+$")
_KV_OUT = re.compile(r"^present\.(\d+)\.")
_KV_IN = re.compile(r"^past_key_values\.(\d+)\.")


def part_stem(graph: str, k: int, n: int) -> str:
    """The name of part ``k`` (from 1) of ``n`` of ``graph`` (``prefill``), as Qualcomm numbers an LLM's parts."""
    return f"{graph}_part_{k}_of_{n}"


def _load(path):
    import onnx
    return onnx.load(str(path), load_external_data=False)


def block_boundaries(proto) -> dict[int, str]:
    """``{block: the quantized residual stream after it}``: the ``QuantizeLinear`` output of each block's last Add."""
    last: dict[int, object] = {}
    for n in proto.graph.node:
        m = _BLOCK_ADD.match(n.name)
        if n.op_type == "Add" and m:
            last[int(m.group(1))] = n
    out = {}
    for i, add in last.items():
        q = next((n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == add.output[0]), None)
        if q is None:
            raise PlanError(f"block {i}'s residual stream has no QuantizeLinear: split a QDQ graph (the qnn target's "
                            "ort-qdq-twin, or `workbench convert --target ort-qdq`)")
        out[i] = q.output[0]
    return dict(sorted(out.items()))


def _tensor_bytes(init) -> int:
    """Bytes a weight takes packed (4-bit codes two a byte, as in the context binary)."""
    from onnx import TensorProto, helper
    n = int(np.prod(init.dims)) if init.dims else 1
    if init.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (n + 1) // 2
    return n * np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize


def weight_bytes_by_block(graph) -> tuple[int, list[int], int]:
    """Bytes of the initializers read by the embedding (head), by each block, and by the final norm and lm_head
    (tail) of a graph (a path or a loaded proto), from the weights' names and the nodes' scopes."""
    proto = _load(graph) if isinstance(graph, (str, Path)) else graph
    sizes = {i.name: _tensor_bytes(i) for i in proto.graph.initializer}
    seen: set[str] = set()
    head, tail, blocks = 0, 0, {}
    for n in proto.graph.node:
        for i in n.input:
            if i in sizes and i not in seen:
                seen.add(i)
                m = re.match(r"^model\.layers\.(\d+)\.", i) or re.match(r"^/model\.layers\.(\d+)[./]", n.name)
                if m:
                    blocks[int(m.group(1))] = blocks.get(int(m.group(1)), 0) + sizes[i]
                elif "embed_tokens" in n.name or "embed_tokens" in i:
                    head += sizes[i]
                else:
                    tail += sizes[i]
    return head, [blocks.get(k, 0) for k in range(max(blocks, default=-1) + 1)], tail


def plan_parts(block_bytes: Sequence[int], *, limit: int, head_bytes: int = 0, tail_bytes: int = 0
               ) -> list[tuple[int, int]]:
    """Blocks ``[first, end)`` of each part, in order, the fewest parts whose weights each fit ``limit``: blocks
    fill a part until the next would not fit; the first part also holds the embedding, the last the head."""
    parts, start, used = [], 0, head_bytes
    n = len(block_bytes)
    for i, b in enumerate(block_bytes):
        extra = tail_bytes if i == n - 1 else 0
        if max(b + extra, head_bytes + b if i == 0 else 0) > limit:
            raise PlanError(f"block {i} alone ({(b + extra) / 2**20:.1f} MiB with what its part must hold) is over the "
                            f"context limit of {limit / 2**20:.1f} MiB: quantize it to fewer bits")
        if used + b + extra > limit and i > start:
            parts.append((start, i))
            start, used = i, 0
        used += b
    if used + tail_bytes > limit and start < n - 1:
        parts.append((start, n - 1))
        start = n - 1
    parts.append((start, n))
    return parts


def _needed(proto, outputs: Sequence[str], stop: set[str]):
    """Nodes that compute ``outputs`` back to ``stop`` tensors or graph inputs, in graph order."""
    producer = {o: k for k, n in enumerate(proto.graph.node) for o in n.output}
    want, keep = list(outputs), set()
    while want:
        t = want.pop()
        k = producer.get(t)
        if t in stop or k is None or k in keep:
            continue
        keep.add(k)
        want.extend(i for i in proto.graph.node[k].input if i)
    return [proto.graph.node[k] for k in sorted(keep)]


def split_graph(graph: str | Path, out_dir: str | Path, parts: Sequence[tuple[int, int]]) -> list[Path]:
    """Write the parts of a QDQ graph (``plan_parts``) beside each other in ``out_dir``: part k takes the residual
    stream's codes after block ``first - 1`` (part 1: the token ids) with the graph's mask / position inputs and
    its blocks' past KV, and gives the codes after its last block (the last part: the logits) and its presents."""
    import onnx
    from onnx import helper
    graph, out = Path(graph), Path(out_dir)
    proto = _load(graph)
    g = proto.graph
    cuts = block_boundaries(proto)
    types = {i.name: i.data_type for i in g.initializer}
    qnodes = {n.output[0]: n for n in g.node if n.op_type == "QuantizeLinear"}
    data_files = {e.value for i in g.initializer for e in i.external_data if e.key == "location"}
    if data_files and out.resolve() != graph.parent.resolve():
        raise PlanError(f"{graph.name} keeps its weights in {', '.join(sorted(data_files))}: write its parts in the "
                        f"same folder ({graph.parent})")
    out.mkdir(parents=True, exist_ok=True)
    n_blocks = len(cuts)
    # the residual stream passed between parts: [batch, sequence] of the token ids, then the hidden size
    stream = [d.dim_value for d in g.input[0].type.tensor_type.shape.dim] + [_hidden(proto, cuts[0])] if cuts else None
    written = []
    for k, (first, end) in enumerate(parts):
        outs = [cuts[end - 1]] if end < n_blocks else ["logits"]
        outs += [o.name for o in g.output if _KV_OUT.match(o.name) and first <= int(_KV_OUT.match(o.name).group(1)) < end]
        stop = {cuts[first - 1]} if first > 0 else set()
        nodes = _needed(proto, outs, stop)
        used = {i for n in nodes for i in n.input}
        inputs = [v for v in g.input if v.name in used and not (_KV_IN.match(v.name) and not
                                                              first <= int(_KV_IN.match(v.name).group(1)) < end)]
        if first > 0:
            cut = cuts[first - 1]
            inputs.insert(0, helper.make_tensor_value_info(cut, types[qnodes[cut].input[2]], stream))
        outputs = [v for v in g.output if v.name in outs]
        if end < n_blocks:
            cut = cuts[end - 1]
            outputs.insert(0, helper.make_tensor_value_info(cut, types[qnodes[cut].input[2]], stream))
        part = helper.make_graph(nodes, f"{graph.stem}_part{k + 1}", inputs, outputs,
                                 [i for i in g.initializer if i.name in used])
        model = helper.make_model(part, opset_imports=list(proto.opset_import), producer_name="workbench")
        model.ir_version = proto.ir_version
        path = out / f"{part_stem(graph.name.split('.')[0], k + 1, len(parts))}.onnx"
        tmp = path.with_name(path.name + ".partial")
        onnx.save(model, str(tmp))
        os.replace(tmp, path)
        written.append(path)
    return written


def _hidden(proto, tensor: str) -> int:
    """The hidden size: the first MatMul weight's input width (the residual stream's last dimension)."""
    from onnx import numpy_helper  # noqa: F401
    for i in proto.graph.initializer:
        if i.name.endswith("q_proj.weight.T_quantized") and len(i.dims) == 2:
            return int(i.dims[0])
    raise PlanError(f"cannot tell the width of {tensor}: no q_proj weight in the graph")


def run_parts(parts: Sequence[str | Path], feed: Mapping[str, np.ndarray], *, session_options=None) -> dict:
    """Run the parts in order on onnxruntime (CPU, or the provider ``session_options`` sets), each fed the graph's
    inputs it takes and what the parts before it gave; returns every part's outputs by name."""
    import onnxruntime as ort
    have = dict(feed)
    for p in parts:
        opts = ort.SessionOptions()
        if session_options is not None:
            session_options(opts)
        s = ort.InferenceSession(str(p), opts, providers=None if session_options else ["CPUExecutionProvider"])
        names = [o.name for o in s.get_outputs()]
        have.update(zip(names, s.run(names, {i.name: have[i.name] for i in s.get_inputs()})))
    return have


def _value_info(v) -> dict:
    from onnx import helper
    t = v.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
    return {"name": v.name, "dtype": np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).name,
            "shape": dims if t.HasField("shape") else None}


def graph_io(graph: str | Path) -> tuple[list[dict], list[dict]]:
    """``(inputs, outputs)`` of an ONNX file, each ``{"name", "dtype", "shape"}`` in the graph's order (initializers
    listed as inputs left out)."""
    g = _load(graph).graph
    inits = {i.name for i in g.initializer}
    return [_value_info(v) for v in g.input if v.name not in inits], [_value_info(v) for v in g.output]


def split_to_fit(graph: str | Path, budget: int, out_dir: str | Path | None = None) -> dict:
    """``plan_parts`` and ``split_graph`` for one QDQ graph whose parts' weights must each fit ``budget`` bytes; the
    parts go beside the graph (``out_dir``: elsewhere, for a graph without external data). Returns ``{"graph",
    "weight_bytes", "outputs", "parts": [{"part", "of", "blocks": [first, end], "weight_bytes", "onnx", "inputs",
    "outputs"}]}``: each part's inputs and outputs as ``graph_io`` gives them, a tensor one part passes to the next
    marked ``"from_part"`` / ``"to_part"``. One part (the graph fits) is not written: its ``onnx`` is the graph."""
    graph = Path(graph)
    head, blocks, tail = weight_bytes_by_block(graph)
    parts = plan_parts(blocks, limit=budget, head_bytes=head, tail_bytes=tail)
    whole_in, whole_out = graph_io(graph)
    files = [graph] if len(parts) == 1 else split_graph(graph, out_dir or graph.parent, parts)
    made: dict[str, int] = {}
    entries = []
    for k, ((first, end), f) in enumerate(zip(parts, files), start=1):
        inputs, outputs = graph_io(f)
        for v in inputs:
            if v["name"] in made:
                v["from_part"] = made[v["name"]]
        for v in outputs:
            made[v["name"]] = k
        entries.append({"part": k, "of": len(parts), "blocks": [first, end],
                        "weight_bytes": (head if first == 0 else 0) + sum(blocks[first:end])
                        + (tail if end == len(blocks) else 0),
                        "onnx": str(f), "inputs": inputs, "outputs": outputs})
    for e in entries:
        for v in e["outputs"]:
            later = [p["part"] for p in entries if any(i.get("from_part") == e["part"] and i["name"] == v["name"]
                                                       for i in p["inputs"])]
            if later:
                v["to_part"] = later[0]
    return {"graph": graph.name, "weight_bytes": head + sum(blocks) + tail, "outputs": [v["name"] for v in whole_out],
            "parts": entries}


def check_chained(graph: str | Path, parts: Sequence[str | Path], feed: Mapping[str, np.ndarray]) -> dict:
    """The parts chained on the CPU against the whole graph, for one feed: ``{"identical": every output bit for
    bit, "max_abs_diff", "outputs": how many compared}``."""
    import onnxruntime as ort
    whole = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = [o.name for o in whole.get_outputs()]
    ref = dict(zip(names, whole.run(names, dict(feed))))
    got = run_parts(parts, feed)
    diff = max(float(np.max(np.abs(got[n].astype(np.float64) - ref[n].astype(np.float64)), initial=0.0))
               for n in names)
    return {"identical": all(np.array_equal(got[n], ref[n]) for n in names), "max_abs_diff": diff,
            "outputs": len(names)}


def _output_order(name: str) -> tuple:
    """The whole graph's output order: the logits, then each layer's present key and value."""
    m = _KV_OUT.match(name)
    if name == "logits":
        return (0, 0, 0)
    return (1, int(m.group(1)), 0 if name.endswith(".key") else 1) if m else (2, 0, 0)


class ChainedSession:
    """The parts of one graph run in order as if one onnxruntime session: ``run``, ``get_inputs``, ``get_outputs``
    (what ``OnnxCausalLM`` calls). Its inputs are the parts' inputs no earlier part gives; its outputs those no
    later part reads, in the whole graph's order (logits, then each layer's present key and value)."""

    def __init__(self, sessions: Sequence):
        self.sessions = list(sessions)
        made: set[str] = set()
        self._inputs, seen = [], set()
        for s in self.sessions:
            for i in s.get_inputs():
                if i.name not in made and i.name not in seen:
                    self._inputs.append(i)
                    seen.add(i.name)
            made |= {o.name for o in s.get_outputs()}
        read = {i.name for s in self.sessions[1:] for i in s.get_inputs()}
        outs = [o for s in self.sessions for o in s.get_outputs() if o.name not in read]
        self._outputs = sorted(outs, key=lambda o: _output_order(o.name))

    def get_inputs(self) -> list:
        return list(self._inputs)

    def get_outputs(self) -> list:
        return list(self._outputs)

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray], run_options=None) -> list:
        have = dict(feed)
        for s in self.sessions:
            outs = [o.name for o in s.get_outputs()]
            have.update(zip(outs, s.run(outs, {i.name: have[i.name] for i in s.get_inputs()}, run_options)))
        return [have[n] for n in (names or [o.name for o in self._outputs])]


class PartsCausalLM(OnnxCausalLM):
    """``OnnxCausalLM`` over graphs held in parts: ``prefill_parts`` and ``decode_parts`` (QDQ parts, or their
    context models) each run chained (``ChainedSession``); everything else is ``OnnxCausalLM``'s, options included
    (``session_options`` puts every part on the HTP)."""

    def __init__(self, prefill_parts: Sequence[str | Path], decode_parts: Sequence[str | Path] | None = None,
                 **kwargs):
        if not prefill_parts:
            raise PlanError("PartsCausalLM needs the prefill graph's parts, at least one")
        chains = [list(map(Path, p)) for p in (prefill_parts, decode_parts) if p]
        self._chains = {str(c[0]): c for c in chains}
        super().__init__(chains[0][0], chains[1][0] if len(chains) > 1 else None, **kwargs)

    def _open_session(self, path: str | Path):
        return ChainedSession([super(PartsCausalLM, self)._open_session(p) for p in self._chains[str(Path(path))]])


def read_parts(folder: str | Path) -> dict:
    """The manifest (``PARTS_FILE``) ``htp.write_htp_binaries`` wrote in ``folder``, checked: every part's files
    (context model and binaries) there, numbered 1..n in order."""
    import json
    path = Path(folder) / PARTS_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        graphs = doc["graphs"]
        for name, g in graphs.items():
            parts = g["parts"]
            if [p["part"] for p in parts] != list(range(1, len(parts) + 1)):
                raise ValueError(f"{name}'s parts are not numbered 1..{len(parts)} in order")
            for p in parts:
                for f in [p["ctx"], *p.get("bin", [])]:
                    if not (Path(folder) / f).is_file():
                        raise ValueError(f"{f} is missing")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError(f"'{path}' is not the manifest `workbench convert --target qnn --soc` writes ({e}): convert "
                        "again") from None
    return doc
