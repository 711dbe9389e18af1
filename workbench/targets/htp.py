"""Qualcomm Hexagon (HTP) through onnxruntime-qnn, ``htp``: Qualcomm's own backend compiles and runs the QDQ graphs.

    runner = get_target("htp").runner("out/qnn/prefill.qdq.onnx", decode_path=..., device="8gen3")
    runner.logits(ids)                                   # on the HTP emulator for soc 57 (HTP v75)
    write_context_binaries({"prefill": p, "decode": d}, "out/qnn/htp", htp_soc("8gen3"))
    write_htp_binaries({"prefill": p, "decode": d}, "out/qnn/htp", "8gen3", limit=64 << 20)   # split to fit
    m = measure_htp(float_graphs, qdq_graphs, ids, device="8gen1")   # HtpMeasurement

``onnxruntime-qnn`` (``pip install --no-deps onnxruntime-qnn==2.7.0``) is Qualcomm's QNN execution
provider as an onnxruntime plugin; on x86-64 its HTP backend emulates the NPU's fixed-point
arithmetic for the SoC it is told (``soc_model``, from the device profile's ``qnn_soc_model``).
Without a SoC it cannot finalise a graph; with CPU fallback off (always, here) a node the HTP
refuses fails the session, and ``HtpRefused`` names each such node and why, from the backend's log.
Context binaries (``<graph>_ctx.onnx`` + ``<graph>_ctx_qnn.bin``) are what a phone loads; their size
is checked against the SoC's context limit (the profile's ``npu_memory_limit_gb``). ``write_htp_binaries``
splits a graph whose binary would be over it into parts (``htp_parts``), each compiled on its own
(``<graph>_part_<k>_of_<n>_ctx.onnx`` + ``<graph>_part_<k>_of_<n>.bin``) and listed in ``parts.json``.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import ModelLoadError, PlanError, WorkbenchError
from .common import log_softmax, native_output_to
from .processes import die_with_parent, owned_temporary
from .registry import Target, register_target
from ..devices.profiles import get_device, load_devices
from ..quantize.plan import get_precision
from ..runtime.onnx_runner import GraphLoadError, OnnxCausalLM
from .base import Finding, load_rules
from .htp_parts import PARTS_FILE, PARTS_FORMAT, PartsCausalLM, read_parts, split_to_fit

__all__ = ["INSTALL", "DEFAULT_DEVICE", "HtpUnavailable", "HtpRefused", "HtpSoc", "qnn_available", "htp_soc",
           "htp_socs", "generation_rules", "float_layers_refused", "soc_runs", "soc_plan_changes", "soc_findings",
           "htp_session_options", "open_htp", "backend_soc", "write_context_binaries", "CONTEXT_OVERHEAD",
           "write_htp_binaries",
           "HtpMeasurement", "measure_htp", "DEPART_ERROR", "layer_divergence", "departing_layers",
           "TARGET"]

INSTALL = "pip install --no-deps onnxruntime-qnn==2.7.0"
DEFAULT_DEVICE = "8gen3"
EP = "QNNExecutionProvider"
GiB = 1 << 30


class HtpUnavailable(WorkbenchError):
    """onnxruntime-qnn is not installed: nothing can run on the HTP here."""


class HtpRefused(PlanError):
    """The HTP backend refused nodes of a graph for a SoC (CPU fallback is off)."""


def qnn_available() -> bool:
    try:
        import onnxruntime_qnn  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class HtpSoc:
    """A Snapdragon as its device profile gives it: QNN's soc id, the HTP generation, the context limit."""

    device: str  # the profile's key (`workbench devices`)
    name: str
    soc_model: int
    arch: int  # 69, 73, 75, 79
    context_limit_bytes: int | None

    @property
    def label(self) -> str:
        return f"{self.name} (soc {self.soc_model}, HTP v{self.arch})"


def htp_socs() -> dict[str, HtpSoc]:
    """Every device profile with a QNN soc id and an HTP generation."""
    return {k: _soc(d) for k, d in load_devices().items() if d.qnn_soc_model and d.htp_arch}


def _soc(d) -> HtpSoc:
    limit = int(d.npu_memory_limit_gb * GiB) if d.npu_memory_limit_gb else None
    return HtpSoc(d.key, d.name, int(d.qnn_soc_model), int(d.htp_arch), limit)


def htp_soc(device: str | HtpSoc | None = None) -> HtpSoc:
    """The SoC of a device profile by name or alias (``8gen3``, ``Snapdragon 8 Elite``, ``sm8450``)."""
    if isinstance(device, HtpSoc):
        return device
    d = get_device(device or DEFAULT_DEVICE)
    if not d.qnn_soc_model or not d.htp_arch:
        raise PlanError(f"device '{d.key}' has no Hexagon HTP (no qnn_soc_model / htp_arch in its profile); choose "
                        f"one of: {', '.join(sorted(htp_socs()))}")
    return _soc(d)


def generation_rules() -> dict:
    """What each HTP generation runs (``assets/targets/qnn.json`` ``htp_generations``)."""
    return load_rules("qnn")["htp_generations"]


def float_layers_refused(precisions: Mapping[str, str | None], soc: HtpSoc) -> list[str]:
    """Layers whose QDQ weights would be 16-bit (the plan keeps them float) on an HTP that refuses 16-bit weights."""
    if soc.arch >= generation_rules()["min_arch_16bit_weights"]:
        return []
    return [layer for layer, name in precisions.items()
            if get_precision(name) is not None and get_precision(name).is_float]


def soc_runs(precision, soc: HtpSoc) -> bool:
    """Whether ``soc``'s HTP generation runs weights of ``precision`` (``htp_generations.weight_bits``; a float
    precision is a 16-bit weight in the QDQ graph)."""
    p = get_precision(precision)
    if p is None:
        return True
    bits = generation_rules()["weight_bits"].get(str(soc.arch))
    return bits is None or (16 if p.is_float else p.bits) in bits


def soc_plan_changes(before: Mapping[str, str | None], after: Mapping[str, str | None], soc: HtpSoc) -> dict:
    """``{layer: (before, after)}``: the layers whose precision ``before`` ``soc`` does not run and that ``after``
    (the plan made for it) gives another one."""
    return {n: (p, after.get(n)) for n, p in before.items() if not soc_runs(p, soc) and after.get(n) != p}


def soc_findings(onnx_path: str | Path, device: str | HtpSoc) -> list:
    """``Finding``s for a QDQ graph on ``device``'s HTP generation: 16-bit MatMul weights below v73, by layer."""
    import onnx
    soc = htp_soc(device)
    rules = generation_rules()
    if soc.arch >= rules["min_arch_16bit_weights"]:
        return []
    proto = onnx.load(str(onnx_path), load_external_data=False)
    wide = {i.name for i in proto.graph.initializer if i.data_type in (onnx.TensorProto.UINT16, onnx.TensorProto.INT16)}
    readers: dict[str, list[str]] = {}
    for n in proto.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    weights = sorted({n.input[0].removesuffix("_quantized") for n in proto.graph.node
                      if n.op_type == "DequantizeLinear" and n.input[0] in wide
                      and any(op in ("MatMul", "Gemm") for op in readers.get(n.output[0], []))})
    if not weights:
        return []
    return [Finding("error", "htp-generation", f"{soc.label} runs no 16-bit weights (HTP v"
                    f"{rules['min_arch_16bit_weights']}+ does): {len(weights)} MatMul weight(s) are 16-bit, the "
                    "backend refuses them (error 3110)", rules["fix"], nodes=weights)]


def _require_qnn():
    try:
        import onnxruntime_qnn
    except ImportError:
        raise HtpUnavailable(f"onnxruntime-qnn is not installed, so nothing runs on the Hexagon HTP here: {INSTALL}") \
            from None
    return onnxruntime_qnn


_EP_DEVICES: list | None = None


def _ep_devices() -> list:
    """Register the QNN plugin once per process; its devices from ``get_ep_devices``."""
    global _EP_DEVICES
    if _EP_DEVICES is None:
        import onnxruntime as ort
        qnn = _require_qnn()
        if not any(d.ep_name == EP for d in ort.get_ep_devices()):
            ort.register_execution_provider_library(EP, qnn.get_library_path())
        _EP_DEVICES = [d for d in ort.get_ep_devices() if d.ep_name == EP]
        if not _EP_DEVICES:
            raise HtpUnavailable(f"onnxruntime-qnn is installed but offers no {EP} device; reinstall it: {INSTALL}")
    return _EP_DEVICES


def htp_session_options(soc: HtpSoc, *, context_file: str | Path | None = None) -> Callable:
    """``f(SessionOptions)``: the HTP backend for ``soc``, CPU fallback off, and (``context_file``) the context
    binary written beside it (``<context_file>`` + ``<stem>_qnn.bin``)."""
    qnn = _require_qnn()
    devices = _ep_devices()

    def apply(opts) -> None:
        opts.add_provider_for_devices(devices, {"backend_path": qnn.get_qnn_htp_path(),
                                                "soc_model": str(soc.soc_model)})
        opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        opts.log_severity_level = 2  # the backend's refusals are warnings: keep them for HtpRefused
        if context_file is not None:
            opts.add_session_config_entry("ep.context_enable", "1")
            opts.add_session_config_entry("ep.context_file_path", str(context_file))
            opts.add_session_config_entry("ep.context_embed_mode", "0")
    return apply


_REFUSED = re.compile(r"failed for node `([^`]+)` of type `([^`]+)` with error code (\d+)")
_UNSUPPORTED = re.compile(r"Unsupported nodes in QNN EP: \{ name: ([^,]+), type: ([^ }]+)")
_ERRORS = {  # QNN op-validation codes seen from the HTP backend, and what they mean for a workbench plan
    "3110": "the HTP generation does not support this operator's configuration (16-bit weights: HTP v73+ only, and "
            "with 16-bit activations)",
}


def refusals(log: str) -> list[tuple[str, str, str]]:
    """``[(node, QNN op or ONNX op, why)]`` from onnxruntime-qnn's log, each refused node once.

    The EP's 'Unsupported nodes' lines name the ONNX nodes; the backend's validation lines say why
    (it validates a node again under a suffixed name, ``/lm_head/MatMul_2``, when it retries a partition).
    """
    why: dict[str, tuple[str, str]] = {}
    for node, op, code in _REFUSED.findall(log):
        why.setdefault(node, (op, f"error {code}: {_ERRORS.get(code, 'rejected by the backend op validator')}"))
    out: dict[str, tuple[str, str, str]] = {}
    for node, op in _UNSUPPORTED.findall(log):
        node = node.strip()
        match = why.get(node) or next((v for n, v in why.items() if re.fullmatch(re.escape(node) + r"_\d+", n)), None)
        out.setdefault(node, (node, *(match or (op, "no QNN mapping for this node in the QNN execution provider"))))
    if not out:  # validation failures without the summary line
        out = {n: (n, op, r) for n, (op, r) in why.items()}
    return list(out.values())


def _session(path: str | Path, opts_fn: Callable, soc: HtpSoc):
    """One HTP session, raising ``HtpRefused`` (naming each refused node) when the backend refuses any."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts_fn(opts)
    with owned_temporary("workbench-htp") as tmp:
        log = Path(tmp) / "qnn.log"
        try:
            with native_output_to(log):
                return ort.InferenceSession(str(path), opts)
        except Exception as e:
            _raise_refused(Path(path), soc, log.read_text(errors="replace"), e)


_BITS = {2: 8, 3: 8, 4: 16, 5: 16, 21: 4, 22: 4}  # ONNX data types of QDQ zero points: uint8, int8, uint16, int16, 4-bit


def matmul_bits(path: str | Path, nodes: Sequence[str]) -> dict[str, tuple[int | None, int | None]]:
    """``{node: (weight bits, activation bits)}`` of the named MatMul / Gemm nodes of a QDQ graph, read from the
    zero points of the DequantizeLinear nodes feeding them (None where an input is not quantized)."""
    import onnx
    proto = onnx.load(str(path), load_external_data=False)
    inits = {i.name: i.data_type for i in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    out = {}
    for node in proto.graph.node:
        if node.name not in nodes or node.op_type not in ("MatMul", "Gemm"):
            continue
        weight = act = None
        for name in node.input[:2]:
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            source = dq.input[2] if len(dq.input) > 2 and dq.input[2] in inits else dq.input[0]
            bits = _BITS.get(inits.get(source))
            if dq.input[0] in inits:
                weight = bits
            else:
                act = bits
        out[node.name] = (weight, act)
    return out


def _layer_of(node: str) -> str:
    """``/model.layers.0.mlp.down_proj/MatMul`` or ``/lm_head/MatMul`` -> ``model.layers.0.mlp.down_proj``, ``lm_head`` (the exporter's node names)."""
    return ".".join(node.strip("/").split("/")[:-1]) or node


def _raise_refused(path: Path, soc: HtpSoc, log: str, error: Exception):
    found = refusals(log)
    if found and soc.arch >= generation_rules()["min_arch_16bit_weights"]:
        bits = matmul_bits(path, [n for n, _, _ in found])
        pairs = [n for n, _, why in found if "error 3110" in why and bits.get(n, (None, None)) == (16, 8)]
        if pairs:
            layers = sorted({_layer_of(n) for n in pairs})
            rules = ", ".join(f'{{"pattern": "{name}", "precision": "int8"}}' for name in layers)
            raise HtpRefused(
                f"{soc.label} refuses {len(pairs)} node(s) of {path.name} ({', '.join(pairs)}): 16-bit weights with "
                f"8-bit activations, which its HTP does not pair. The plan keeps {', '.join(layers)} in float (--bits "
                "keeps lm_head and the embeddings fp16), and a float layer's weights are 16-bit in the QDQ "
                f"graph: quantize it, with {rules} in the plan's \"rules\" (--plan PLAN.json), or keep "
                "--activation-bits 16") from None
    if found:
        nodes = "; ".join(f"{n} ({op}: {why})" for n, op, why in found)
        raise HtpRefused(f"{soc.label} refuses {len(found)} node(s) of {path.name}: {nodes}; change those layers' "
                         f"precision in the plan (`workbench plan --target qnn --soc {soc.device}` says which) or "
                         "choose a newer SoC") from None
    raise HtpRefused(f"{soc.label} could not compile {path.name}: {str(error).strip().splitlines()[0]}") from None


def open_htp(prefill_path: str | Path | Sequence[str | Path], decode_path: str | Path | Sequence[str | Path] | None
             = None, *, threads: int | None = None, device: str | HtpSoc | None = None):
    """``OnnxCausalLM`` on the HTP emulator for ``device``: QDQ graphs or their ``_ctx.onnx`` context models; a
    graph given as a list of its parts in order (``write_htp_binaries``) runs them chained (``PartsCausalLM``)."""
    soc = htp_soc(device)
    apply = htp_session_options(soc)

    def listed(p):
        return p if p is None else [p] if isinstance(p, (str, Path)) else list(p)
    in_parts = not all(isinstance(p, (str, Path)) for p in (prefill_path, decode_path) if p is not None)
    if in_parts:
        prefill_path, decode_path = listed(prefill_path), listed(decode_path)
    runner = PartsCausalLM if in_parts else OnnxCausalLM
    with owned_temporary("workbench-htp") as tmp:
        log = Path(tmp) / "qnn.log"
        try:
            with native_output_to(log):
                return runner(prefill_path, decode_path, providers=(), threads=threads, session_options=apply)
        except GraphLoadError as e:  # the graph that failed, prefill or decode, is the one named
            _raise_refused(e.path, soc, log.read_text(errors="replace"), e.cause)
        except WorkbenchError:
            raise
        except Exception as e:
            last = decode_path or prefill_path
            _raise_refused(Path(last[0] if in_parts else last), soc, log.read_text(errors="replace"), e)


CONTEXT_FILES = ("prefill_ctx.onnx", "decode_ctx.onnx")
QDQ_FILES = ("prefill.qdq.onnx", "decode.qdq.onnx")
SOC_FILE = "htp.json"  # beside the context binaries: the device (SoC) they were compiled for


def htp_runner(path: str | Path, *, threads: int | None = None, device: str | HtpSoc | None = None):
    """The registry's runner: the context binaries in ``path`` (a folder ``convert --target qnn --soc`` wrote)
    on the HTP emulator for the SoC recorded beside them, or ``device``; a folder of QDQ graphs (ort-qdq's
    ``prefill.qdq.onnx`` + ``decode.qdq.onnx``) compiled for ``device``; a single graph file runs alone."""
    import json
    p = Path(path)
    if p.is_file():
        return open_htp(p, threads=threads, device=device)
    if device is None and (p / SOC_FILE).is_file():
        try:
            device = json.loads((p / SOC_FILE).read_text(encoding="utf-8")).get("device")
        except (OSError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"'{p / SOC_FILE}' is not the JSON `workbench convert --target qnn --soc` writes "
                                 f"({e}): convert again, or pass the device") from None
    if (p / PARTS_FILE).is_file():  # graphs split to fit the SoC's context limit: their parts chained
        graphs = read_parts(p)["graphs"]
        prefill, decode = ([p / part["ctx"] for part in graphs[g]["parts"]] for g in ("prefill", "decode"))
        return open_htp(prefill, decode, threads=threads, device=device)
    graphs = CONTEXT_FILES if (p / CONTEXT_FILES[0]).is_file() else QDQ_FILES
    missing = [g for g in graphs if not (p / g).is_file()]
    if missing:
        raise WorkbenchError(f"'{p}' has no {' / '.join(missing)}: pass a folder `workbench convert --target qnn "
                             "--soc DEVICE` wrote (its htp-DEVICE folder), or an ort-qdq output")
    return open_htp(p / graphs[0], p / graphs[1], threads=threads, device=device)


def htp_files(folder: str | Path) -> tuple[str, ...] | None:
    """The registry's layout: the files of a folder whose graphs are split into parts (its manifest's context
    models, prefill first, then the manifest; each model names its binary, which sizes count through it); None for
    a folder of whole graphs (``CONTEXT_FILES``). A manifest that ``read_parts`` refuses is the whole listing, so
    the runner opens it and says what is wrong with it."""
    if not (Path(folder) / PARTS_FILE).is_file():
        return None
    try:
        graphs = read_parts(folder)["graphs"]
    except PlanError:
        return (PARTS_FILE,)
    return (*(str(part["ctx"]) for g in ("prefill", "decode") if g in graphs
              for part in graphs[g]["parts"]), PARTS_FILE)


def backend_soc(soc_model: int, graph: str | Path) -> dict:
    """What the HTP backend itself says of ``soc_model`` while compiling ``graph``: ``{"chip", "arch"}``.

    From its verbose log ('... unsupported on soc SM8650', '... will overwrite it to 75'): the check
    behind each profile's ``qnn_soc_model`` / ``htp_arch``. Runs in a child process: the plugin's log
    level is fixed when it is registered.
    """
    import multiprocessing as mp
    _require_qnn()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_backend_soc_child, args=(queue, int(soc_model), str(graph)))
    proc.start()
    text = queue.get()
    proc.join()
    chip = re.search(r"unsupported on soc (\S+)", text)
    arch = re.search(rf"associated with SoC {int(soc_model)}, will overwrite it to (\d+)", text)
    return {"chip": chip.group(1) if chip else None, "arch": int(arch.group(1)) if arch else None}


def _in_child() -> None:
    """First thing in a spawned HTP child: the kernel kills it when the parent dies (killed runs leave none)."""
    import multiprocessing as mp
    die_with_parent(mp.parent_process().pid)


def _backend_soc_child(queue, soc_model: int, graph: str) -> None:
    _in_child()
    import onnxruntime as ort
    ort.set_default_logger_severity(0)
    qnn = _require_qnn()
    with owned_temporary("workbench-htp") as tmp:
        log = Path(tmp) / "qnn.log"
        with native_output_to(log):
            try:
                opts = ort.SessionOptions()
                opts.log_severity_level = 0
                opts.add_provider_for_devices(_ep_devices(), {"backend_path": qnn.get_qnn_htp_path(),
                                                              "soc_model": str(soc_model)})
                opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
                ort.InferenceSession(graph, opts)
            except Exception:
                pass  # a refused node does not hide what the backend said of the SoC
        queue.put(log.read_text(errors="replace"))


def write_context_binaries(graphs: Mapping[str, str | Path], out_dir: str | Path, device: str | HtpSoc | None = None
                           ) -> list[dict]:
    """Compile each QDQ graph for the SoC into ``<name>_ctx.onnx`` + ``<name>_ctx_qnn.bin`` in ``out_dir``.

    Returns ``[{"graph", "ctx", "bin", "bytes", "seconds"}]``; a binary over the SoC's context limit is refused.
    """
    soc = htp_soc(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, path in graphs.items():
        ctx = out / f"{name}_ctx.onnx"
        for old in (ctx, out / f"{name}_ctx_qnn.bin"):
            old.unlink(missing_ok=True)
        t0 = time.perf_counter()
        _session(path, htp_session_options(soc, context_file=ctx), soc)
        bins = sorted(out.glob(f"{name}_ctx*.bin"))
        if not ctx.is_file() or not bins:
            raise HtpRefused(f"onnxruntime-qnn wrote no context binary for {Path(path).name} ({soc.label})")
        size = sum(b.stat().st_size for b in bins)
        for b in bins:
            if soc.context_limit_bytes and b.stat().st_size > soc.context_limit_bytes:
                raise HtpRefused(f"{b.name} is {_mib(b.stat().st_size)}, over {soc.label}'s context limit of "
                                 f"{_mib(soc.context_limit_bytes)}; split the graph into parts (write_htp_binaries, "
                                 "which `workbench convert --target qnn --soc` uses) or quantize more layers to 4 bits")
        written.append({"graph": name, "ctx": str(ctx), "bin": [str(b) for b in bins], "bytes": size,
                        "limit_bytes": soc.context_limit_bytes, "seconds": time.perf_counter() - t0})
    import json
    (out / SOC_FILE).write_text(json.dumps({"device": soc.device, "soc_model": soc.soc_model, "arch": soc.arch},
                                           indent=2) + "\n", encoding="utf-8")
    return written


def _mib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


CONTEXT_OVERHEAD = 0.10  # a context binary's bytes beyond its weights', as a share (5-9 % measured on the demo, INT8)


def _rename_binary(entry: dict, stem: str) -> dict:
    """The context binary of ``entry`` renamed ``<stem>.bin`` (Qualcomm's part names) and its context model pointed
    at it; left as onnxruntime named it when the model holds several binaries."""
    import onnx
    ctx = Path(entry["ctx"])
    proto = onnx.load(str(ctx))
    nodes = [n for n in proto.graph.node if n.op_type == "EPContext"]
    if len(nodes) != 1 or len(entry["bin"]) != 1:
        return entry
    old, new = Path(entry["bin"][0]), ctx.with_name(f"{stem}.bin")
    for a in nodes[0].attribute:
        if a.name == "ep_cache_context":
            a.s = new.name.encode()
    os.replace(old, new)
    tmp = ctx.with_name(ctx.name + ".partial")
    onnx.save(proto, str(tmp))
    os.replace(tmp, ctx)
    return {**entry, "bin": [str(new)]}


def _compile_to_fit(name: str, graph: Path, out: Path, soc: HtpSoc, limit: int, tries: int) -> tuple[dict, list]:
    """``graph`` in the fewest parts whose context binaries are each under ``limit``: planned by the weights' bytes
    with ``CONTEXT_OVERHEAD``, compiled, and planned again tighter (by the largest binary's excess) while a part is
    still over. Returns (``htp_parts.split_to_fit``'s description, the context binaries written)."""
    unchecked = replace(soc, context_limit_bytes=None)
    budget = int(limit / (1 + CONTEXT_OVERHEAD))
    for _ in range(tries):
        split = split_to_fit(graph, budget)
        parts = split["parts"]
        if len(parts) == 1:
            written = write_context_binaries({name: graph}, out, unchecked)
        else:
            written = []
            for p in parts:
                stem = Path(p["onnx"]).stem
                entry = write_context_binaries({stem: p["onnx"]}, out, unchecked)[0]
                written.append(_rename_binary({**entry, "part": p["part"], "of": len(parts)}, stem))
        worst = max(w["bytes"] for w in written)
        if worst <= limit:
            return split, [{**w, "limit_bytes": limit} for w in written]
        for w in written:  # over the limit: none of these are kept
            for f in (w["ctx"], *w["bin"]):
                Path(f).unlink(missing_ok=True)
        if len(parts) > 1:
            for p in parts:
                Path(p["onnx"]).unlink(missing_ok=True)
        budget = int(budget * limit / worst * 0.97)
    raise HtpRefused(f"{graph.name} still has a context binary over {soc.label}'s limit of {_mib(limit)} after "
                     f"{tries} splits: quantize more layers to 4 bits, or give a larger limit")


def write_htp_binaries(graphs: Mapping[str, str | Path], out_dir: str | Path, device: str | HtpSoc | None = None, *,
                       limit: int | None = None, tries: int = 3) -> dict:
    """Context binaries of QDQ graphs for the SoC, each under ``limit`` bytes (default the SoC's context limit).

    A graph whose binary would be over the limit (its weights' bytes plus ``CONTEXT_OVERHEAD``) is split at block
    boundaries (``htp_parts``) into the fewest parts that fit, written beside the graph (its weights may be
    there), each compiled on its own into ``out_dir`` as ``<graph>_part_<k>_of_<n>_ctx.onnx`` +
    ``<graph>_part_<k>_of_<n>.bin``; a part still over the limit once compiled is planned again, tighter. When
    any graph is split, ``parts.json`` (``htp_parts.PARTS_FILE``) lists every graph's parts in order (a graph that
    fits as one part of one) with their blocks, weights, binaries and sizes, and the tensors each part takes and
    gives (one passed between parts marked ``from_part`` / ``to_part``). Returns ``{"limit_bytes",
    "context_binaries": [write_context_binaries' entries], "graphs": {name: [context models in order]}, "parts":
    the manifest or None}``.
    """
    import json
    soc = htp_soc(device)
    limit = limit or soc.context_limit_bytes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / PARTS_FILE).unlink(missing_ok=True)
    written, order, described = [], {}, {}
    for name, path in graphs.items():
        if limit is None:
            w = write_context_binaries({name: path}, out, soc)
            written += w
            order[name] = [w[0]["ctx"]]
            continue
        split, w = _compile_to_fit(name, Path(path), out, soc, limit, tries)
        written += w
        order[name] = [e["ctx"] for e in w]
        for part, e in zip(split["parts"], w):
            part.update(ctx=Path(e["ctx"]).name, bin=[Path(b).name for b in e["bin"]], bytes=e["bytes"],
                        qdq=os.path.relpath(part.pop("onnx"), out))
        described[name] = {"source": Path(path).name, **{k: v for k, v in split.items() if k != "graph"}}
    manifest = None
    if any(len(g["parts"]) > 1 for g in described.values()):
        manifest = {"format": PARTS_FORMAT, "version": 1, "device": soc.device, "soc": soc.label,
                    "soc_model": soc.soc_model, "arch": soc.arch, "limit_bytes": limit,
                    "soc_limit_bytes": soc.context_limit_bytes, "graphs": described}
        tmp = out / (PARTS_FILE + ".partial")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, out / PARTS_FILE)
    return {"limit_bytes": limit, "context_binaries": written, "graphs": order, "parts": manifest}


DEPART_ERROR = 0.02  # a layer run alone whose HTP output is off the simulation's by more (relative RMS) departs
_WEIGHTED_MATMUL = re.compile(r"^/(.+)/MatMul$")


def _layer_probes(qdq_graph: Path) -> list[dict]:
    """Each weighted MatMul of a QDQ graph (node ``/<layer>/MatMul``): its quantized input, the input's and the
    output's DequantizeLinear / QuantizeLinear parameters, and its weight's DequantizeLinear."""
    import onnx
    from onnx import numpy_helper
    g = onnx.load(str(qdq_graph), load_external_data=False).graph
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    inits = {i.name: i for i in g.initializer}
    probes = []
    for n in g.node:
        m = _WEIGHTED_MATMUL.match(n.name)
        if n.op_type != "MatMul" or not m:
            continue
        x_dq, w_dq = producer.get(n.input[0]), producer.get(n.input[1])
        out_q = next((r for r in readers.get(n.output[0], []) if r.op_type == "QuantizeLinear"), None)
        if (x_dq is None or w_dq is None or out_q is None or x_dq.op_type != "DequantizeLinear"
                or w_dq.op_type != "DequantizeLinear" or w_dq.input[0] not in inits):
            continue
        zero = numpy_helper.to_array(inits[out_q.input[2]]).reshape(-1)
        probes.append({"layer": m.group(1), "x_dq": x_dq, "w_dq": w_dq, "out_q": out_q, "zero_point": int(zero[0])})
    return probes


def _probe_graph(qdq_graph: Path, probes: list[dict], inputs: Sequence[np.ndarray], out: Path) -> Path:
    """One graph of every probed MatMul alone: quantized input -> DequantizeLinear -> MatMul (the layer's own
    weight) -> QuantizeLinear -> quantized output, beside ``qdq_graph`` so its weights' data file resolves."""
    import onnx
    from onnx import helper
    proto = onnx.load(str(qdq_graph), load_external_data=False)
    g = proto.graph
    types = {i.name: i.data_type for i in g.initializer}
    nodes, graph_in, graph_out, keep = [], [], [], set()
    for k, (p, x) in enumerate(zip(probes, inputs)):
        inp, y, code = f"probe.{k}.input", f"probe.{k}.matmul", f"probe.{k}.output"
        graph_in.append(helper.make_tensor_value_info(inp, helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape)))
        nodes.append(helper.make_node("DequantizeLinear", [inp, *p["x_dq"].input[1:]], [f"probe.{k}.x"]))
        nodes.append(helper.make_node("DequantizeLinear", list(p["w_dq"].input), [f"probe.{k}.w"],
                                      axis=next((a.i for a in p["w_dq"].attribute if a.name == "axis"), 1)))
        nodes.append(helper.make_node("MatMul", [f"probe.{k}.x", f"probe.{k}.w"], [y], name=f"/{p['layer']}/MatMul"))
        nodes.append(helper.make_node("QuantizeLinear", [y, *p["out_q"].input[1:]], [code]))
        graph_out.append(helper.make_tensor_value_info(code, types[p["out_q"].input[2]], None))
        keep |= set(p["x_dq"].input[1:]) | set(p["w_dq"].input) | set(p["out_q"].input[1:])
    graph = helper.make_graph(nodes, "layer_probes", graph_in, graph_out, [i for i in g.initializer if i.name in keep])
    model = helper.make_model(graph, opset_imports=list(proto.opset_import), producer_name="workbench")
    model.ir_version = proto.ir_version
    onnx.save(model, str(out))
    return out


def _captured_inputs(qdq_graph: Path, probes: list[dict], feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The quantized input of each probed MatMul as the CPU QDQ graph computes it for ``feed``."""
    import onnx
    import onnxruntime as ort
    proto = onnx.load(str(qdq_graph), load_external_data=False)
    names = [p["x_dq"].input[0] for p in probes]
    wanted = list(dict.fromkeys(names))
    del proto.graph.output[:]
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in wanted)
    side = qdq_graph.with_name(f".{qdq_graph.stem}.probe-inputs.{os.getpid()}.onnx")
    try:
        onnx.save(proto, str(side))
        session = ort.InferenceSession(str(side), providers=["CPUExecutionProvider"])
    finally:
        side.unlink(missing_ok=True)
    got = dict(zip(wanted, session.run(wanted, dict(feed))))
    return [got[n] for n in names]


def _output_error(cpu: np.ndarray, htp: np.ndarray, zero_point: int, rows: int) -> dict:
    """How far the HTP's output codes are from the CPU's over the first ``rows`` positions: the relative error
    (RMS of the difference over RMS of the CPU's output, both in steps from the zero point: the scale cancels),
    the largest difference in quantization steps, and the share of outputs more than one step off."""
    c = cpu.astype(np.int64).reshape(-1, cpu.shape[-2], cpu.shape[-1])[:, :rows] - zero_point
    h = htp.astype(np.int64).reshape(-1, htp.shape[-2], htp.shape[-1])[:, :rows] - zero_point
    d = np.abs(c - h)
    if not d.size:
        return {"relative_error": 0.0, "max_steps": 0, "off_fraction": 0.0}
    rms = float(np.sqrt(np.mean(c.astype(np.float64) ** 2))) or 1.0
    return {"relative_error": float(np.sqrt(np.mean(d.astype(np.float64) ** 2))) / rms,
            "max_steps": int(d.max(initial=0)), "off_fraction": float((d > 1).mean())}


def layer_divergence(qdq_graph: str | Path, feed: Mapping[str, np.ndarray], device: str | HtpSoc | None = None, *,
                     rows: int | None = None) -> dict:
    """Each weighted layer of a QDQ graph run alone on the HTP emulator and on the CPU (the simulation of what the
    HTP should compute), from the same quantized input: the CPU graph's own input to that layer for ``feed``.

    Qualcomm holds some layers at int8 because "int4 matmul saturates the HTP accumulator ... on-target output
    diverges from QuantSim"; run alone, a layer's output differs from the CPU's by the HTP's own rounding
    (a few 16-bit steps), and a layer whose relative error is above ``DEPART_ERROR`` departs. ``rows``:
    positions compared (the real tokens of a right-padded window). Returns ``{"layers": {layer:
    {"relative_error", "max_steps", "off_fraction", "departs"}}, "departing": [layers], ...}``.
    """
    import onnxruntime as ort
    qdq_graph = Path(qdq_graph)
    soc = htp_soc(device)
    probes = _layer_probes(qdq_graph)
    if not probes:
        raise PlanError(f"{qdq_graph.name} has no weighted MatMul behind Q/DQ nodes to probe: pass a QDQ graph "
                        "(`workbench convert --target ort-qdq` or qnn's ort-qdq-twin)")
    t0 = time.perf_counter()
    inputs = _captured_inputs(qdq_graph, probes, feed)
    probe = qdq_graph.with_name(f".{qdq_graph.stem}.probes.{os.getpid()}.onnx")
    try:
        _probe_graph(qdq_graph, probes, inputs, probe)
        feeds = {f"probe.{k}.input": x for k, x in enumerate(inputs)}
        cpu = ort.InferenceSession(str(probe), providers=["CPUExecutionProvider"]).run(None, feeds)
        htp = _session(probe, htp_session_options(soc), soc).run(None, feeds)
    finally:
        probe.unlink(missing_ok=True)
    rows = rows or inputs[0].shape[-2]
    layers = {}
    for p, c, h in zip(probes, cpu, htp):
        stats = _output_error(c, h, p["zero_point"], rows)
        stats["departs"] = stats["relative_error"] > DEPART_ERROR
        layers[p["layer"]] = stats
    return {"device": soc.device, "soc": soc.label, "graph": qdq_graph.name, "positions": int(rows),
            "threshold": DEPART_ERROR, "layers": layers,
            "departing": [n for n, st in layers.items() if st["departs"]], "seconds": time.perf_counter() - t0}


def departing_layers(conversion: str | Path) -> list[str]:
    """The layers a ``convert --target qnn --soc`` output found departing from the simulation on the HTP
    (``conversion.json`` ``details.htp.divergence.departing``): what ``plan --htp-divergence`` raises to int8."""
    import json
    p = Path(conversion)
    p = p / "conversion.json" if p.is_dir() else p
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
        return list(doc["details"]["htp"]["divergence"]["departing"])
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read '{p}' ({e}): pass the folder `workbench convert --target qnn --soc DEVICE` "
                        "wrote, or its conversion.json") from None
    except (KeyError, TypeError):
        raise PlanError(f"'{p}' has no HTP layer comparison (details.htp.divergence): convert with --target qnn "
                        "--soc DEVICE and evaluation on") from None


@dataclass
class HtpMeasurement:
    """One HTP evaluation (``measure_htp``): agreement with the float model and with the CPU QDQ simulation."""

    device: str
    soc_model: int
    arch: int
    prefill: dict  # kl_vs_float, top1_vs_float, kl_vs_simulation, top1_vs_simulation, tokens
    decode: dict  # the same, teacher-forced after a prompt, every step; plus prompt
    simulation: dict  # the CPU QDQ graphs against the float graphs: prefill and decode KL / top-1
    context_bytes: int
    context_files: list = field(default_factory=list)
    compile_seconds: float = 0.0
    eval_seconds: float = 0.0
    peak_rss_bytes: int = 0  # of the process that compiled and ran (a child process of its own by default)
    parts: dict | None = None  # the graphs split to fit the context limit (write_htp_binaries' manifest), or None

    def to_dict(self) -> dict:
        return asdict(self)


class _Agreement:
    """Running KL(ref || cand) and top-1 agreement over rows of logits."""

    def __init__(self):
        self.kl, self.top1, self.n = 0.0, 0, 0

    def add(self, ref: np.ndarray, cand: np.ndarray) -> None:
        r, c = log_softmax(ref), log_softmax(cand)
        self.kl += float(np.clip((np.exp(r) * (r - c)).sum(-1), 0, None).sum())
        self.top1 += int((r.argmax(-1) == c.argmax(-1)).sum())
        self.n += r.shape[0]

    def result(self, prefix: str) -> dict:
        n = max(self.n, 1)
        return {f"kl_vs_{prefix}": self.kl / n, f"top1_vs_{prefix}": self.top1 / n}


def _teacher_forced(runner, ids: Sequence[int], prompt: int) -> np.ndarray:
    """Decode logits at positions prompt .. len(ids) - 2, each step fed the cache the steps before wrote."""
    _, _, kv = runner.run_prefill(list(ids[:prompt]))
    out = []
    for pos in range(prompt, len(ids) - 1):
        step, kv, _ = runner.run_decode(int(ids[pos]), kv, pos)
        out.append(np.asarray(step, np.float32))
    return np.stack(out)


def _measure(float_graphs, qdq_graphs, windows, device, out_dir, prompt, decode_windows, threads,
             limit=None) -> HtpMeasurement:
    import resource
    soc = htp_soc(device)
    t0 = time.perf_counter()
    if limit is None:
        ctx = write_context_binaries({"prefill": qdq_graphs[0], "decode": qdq_graphs[1]}, out_dir, soc)
        graphs, parts = [c["ctx"] for c in ctx], None
    else:
        w = write_htp_binaries({"prefill": qdq_graphs[0], "decode": qdq_graphs[1]}, out_dir, soc, limit=limit)
        ctx, parts = w["context_binaries"], w["parts"]
        graphs = [w["graphs"][g] if parts else w["graphs"][g][0] for g in ("prefill", "decode")]
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    htp = open_htp(*graphs, device=soc, threads=threads)
    cpu = OnnxCausalLM(*qdq_graphs, threads=threads)
    ref = OnnxCausalLM(*float_graphs, threads=threads) if float_graphs else None
    acc = {k: _Agreement() for k in ("pf", "ps", "df", "ds", "sf", "sdf")}
    for k, w in enumerate(windows):
        w = np.asarray(w, np.int64)
        h, c = htp.logits(w[None])[0, :-1], cpu.logits(w[None])[0, :-1]
        acc["ps"].add(c, h)
        if ref is not None:
            f = ref.logits(w[None])[0, :-1]
            acc["pf"].add(f, h)
            acc["sf"].add(f, c)
        if k < decode_windows and len(w) > prompt + 1:
            hd, cd = _teacher_forced(htp, w, prompt), _teacher_forced(cpu, w, prompt)
            acc["ds"].add(cd, hd)
            if ref is not None:
                acc["df"].add(f[prompt:], hd)
                acc["sdf"].add(f[prompt:], cd)
    prefill = {**acc["pf"].result("float"), **acc["ps"].result("simulation"), "tokens": acc["ps"].n}
    decode = {**acc["df"].result("float"), **acc["ds"].result("simulation"), "tokens": acc["ds"].n,
              "prompt": prompt}
    sim = {"prefill": acc["sf"].result("float"), "decode": acc["sdf"].result("float")}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return HtpMeasurement(soc.device, soc.soc_model, soc.arch, prefill, decode, sim,
                          sum(c["bytes"] for c in ctx), ctx, compile_s, time.perf_counter() - t0, peak, parts)


def _measure_child(queue, args) -> None:
    _in_child()
    try:
        queue.put(("ok", _measure(*args)))
    except BaseException as e:  # handed back to the parent, which raises it there
        queue.put(("error", e if isinstance(e, WorkbenchError) else RuntimeError(f"{type(e).__name__}: {e}")))


def measure_htp(float_graphs: Sequence[str | Path] | None, qdq_graphs: Sequence[str | Path],
                windows: Sequence[Sequence[int]], *, device: str | HtpSoc | None = None,
                out_dir: str | Path | None = None, prompt: int | None = None, decode_windows: int | None = None,
                threads: int | None = None, isolated: bool = True, limit: int | None = None) -> HtpMeasurement:
    """Compile the QDQ (prefill, decode) graphs for ``device``'s HTP, run them on the emulator, and compare.

    ``windows``: token windows (each at most the static sequence length); prefill scores every
    position, decode runs teacher-forced after ``prompt`` tokens (default half the window) on the
    first ``decode_windows`` (default all), every step scored. Compared against the float graphs
    (``float_graphs``, optional) and the CPU QDQ graphs (the simulation of what HTP runs). The
    context binaries go to ``out_dir`` (a temporary folder by default). ``isolated`` runs it all in a
    child process, so ``peak_rss_bytes`` is the HTP evaluation's own peak. ``limit``: each context binary under
    this many bytes, a graph over it split into parts (``write_htp_binaries``), run chained on the HTP.
    """
    _require_qnn()
    soc = htp_soc(device)
    windows = [list(map(int, w)) for w in windows]
    if not windows:
        raise PlanError("measure_htp needs at least one token window")
    prompt = prompt or max(1, len(windows[0]) // 2)
    decode_windows = len(windows) if decode_windows is None else decode_windows
    with contextlib.ExitStack() as stack:
        if out_dir is None:
            out_dir = stack.enter_context(owned_temporary("workbench-htp-ctx"))
        args = (list(map(str, float_graphs)) if float_graphs else None, list(map(str, qdq_graphs)), windows, soc,
                str(out_dir), prompt, decode_windows, threads, limit)
        if not isolated:
            return _measure(*args)
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure_child, args=(queue, args))
        proc.start()
        status, value = queue.get()
        proc.join()
        if status == "error":
            raise value
        return value


TARGET = register_target(Target(
    "htp", "Qualcomm Hexagon HTP (onnxruntime-qnn; the emulator on x86-64)", rules="qnn", runnable=True,
    runner=htp_runner, files=CONTEXT_FILES, layout=htp_files, int_bits=(4, 8), float_bits=(16,), module=__name__,
    precision_note="runs the QDQ graphs `convert --target qnn` writes: 4 and 8-bit weights, 16-bit ones on HTP v73+"))
