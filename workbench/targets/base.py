"""The compatibility engine: a target's rule table (a JSON file in ``assets/targets/``) applied to a graph.

    report = inspect_graph("out/onnx/decode.onnx", "qnn")
    for f in report.findings: print(f.severity, f.rule, f.nodes[:3], f.fix)

Checks: operators the target cannot run, dynamic dimensions a static compiler cannot resolve,
normalisation epsilons and squares that do not survive float16, 64-bit integer tensors, MatMuls
with one fixed-point and one float input, and initializer bytes against NPU context limits.
Static graphs are constant-folded first (as every converter does), so shape arithmetic that
folds away is not reported.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import WorkbenchError
from ..onnx.inspect import SHAPE_OPS, OpCount, fold_constants, initializer_bytes, load_onnx, operator_inventory
from .registry import RULES_DIR, rules_path

__all__ = ["RULES_DIR", "Finding", "GraphReport", "load_rules", "inspect_graph", "graph_is_static",
           "FP16_MIN_NORMAL", "SEVERITIES"]

FP16_MIN_NORMAL = 6.103515625e-05  # smaller values are subnormal in float16 and flushed to zero by many NPUs
FP16_SQUARE_LIMIT = 255.9  # x * x overflows float16 (max 65504) above this magnitude
SEVERITIES = ("error", "warning", "info")
ALWAYS_SUPPORTED = {"Constant", "Identity"}  # every converter turns these into tensors


@dataclass
class Finding:
    """One problem (or note) about a graph for a target, with the nodes it concerns and what to do."""

    severity: str  # error | warning | info
    rule: str  # unsupported-op | dynamic-shape | int64 | fp16-epsilon | fp16-overflow | mixed-matmul | context-memory
    message: str
    fix: str
    nodes: list[str] = field(default_factory=list)
    op_type: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GraphReport:
    """Inventory and compatibility findings of one graph for one target."""

    path: Path
    target: str
    title: str
    nodes: int
    inventory: list[OpCount]
    findings: list[Finding]
    initializer_bytes: int
    static: bool
    folded: bool
    sources: list[dict]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"path": str(self.path), "target": self.target, "title": self.title, "nodes": self.nodes,
                "ok": self.ok, "static": self.static, "folded": self.folded,
                "initializer_bytes": self.initializer_bytes, "sources": self.sources,
                "inventory": [asdict(o) for o in self.inventory],
                "findings": [f.to_dict() for f in self.findings]}

    def summary(self) -> str:
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        verdict = "no blocking problems" if self.ok else f"{counts['error']} blocking problem(s)"
        return (f"{self.path.name} for {self.title}: {self.nodes} nodes, {len(self.inventory)} op types; {verdict}, "
                f"{counts['warning']} warning(s), {counts['info']} note(s)")


def load_rules(target: str) -> dict:
    """The rule table of ``target``: a registered target's (``Target.rules``), or ``assets/targets/<target>.json``."""
    return json.loads(rules_path(target).read_text(encoding="utf-8"))


def graph_is_static(proto) -> bool:
    init = {i.name for i in proto.graph.initializer}
    for vi in list(proto.graph.input) + list(proto.graph.output):
        if vi.name in init:
            continue
        for d in vi.type.tensor_type.shape.dim:
            if not d.HasField("dim_value"):
                return False
    return True


def _dynamic_dims(vi) -> list[str]:
    return [d.dim_param or "?" for d in vi.type.tensor_type.shape.dim if not d.HasField("dim_value")]


def _constant_values(proto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node outputs small enough to read (scalars and short vectors)."""
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data
    out = {}
    for init in proto.graph.initializer:
        if int(np.prod(init.dims or [1])) <= 16 and not uses_external_data(init):
            out[init.name] = numpy_helper.to_array(init)
    for node in proto.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and int(np.prod(a.t.dims or [1])) <= 16:
                    out[node.output[0]] = numpy_helper.to_array(a.t)
                elif a.name == "value_float":
                    out[node.output[0]] = np.array(a.f, np.float32)
    return out


def _node_label(node, i: int) -> str:
    return node.name or f"{node.op_type}_{i}"


def _shape_derived(proto) -> set[str]:
    """Tensors computed only from shapes and constants: they fold away once every shape is fixed."""
    derived = {i.name for i in proto.graph.initializer if len(i.dims) <= 1}
    for node in proto.graph.node:
        ins = [x for x in node.input if x]
        if node.op_type in ("Shape", "Size", "Constant") or (ins and all(x in derived for x in ins)):
            derived.update(node.output)
    return derived


def _check_ops(proto, rules: dict, static: bool) -> list[Finding]:
    ops = rules["ops"]
    allowed = {d: set(v) for d, v in ops["domains"].items()}
    fixes = rules.get("op_fixes", {})
    derived = set() if static else _shape_derived(proto)
    bad: dict[tuple[str, str, bool], list[str]] = {}
    for i, node in enumerate(proto.graph.node):
        dom = node.domain or "ai.onnx"
        if node.op_type in ALWAYS_SUPPORTED and dom == "ai.onnx":
            continue
        if ops["mode"] == "allow":
            unsupported = node.op_type not in allowed.get(dom, set())
        else:  # deny list: anything outside the standard domain, or listed
            unsupported = dom != "ai.onnx" or node.op_type in allowed.get(dom, set())
        if unsupported:
            shape_only = dom == "ai.onnx" and bool(node.output) and all(o in derived for o in node.output)
            bad.setdefault((node.op_type, dom, shape_only), []).append(_node_label(node, i))
    findings = []
    for (op, dom, shape_only), names in sorted(bad.items(), key=lambda kv: -len(kv[1])):
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        if shape_only:
            findings.append(Finding(
                "error", "dynamic-shape", f"{len(names)} {op} node(s) compute shapes at run time, which "
                f"{rules['title']} cannot run: '{names[0]}'{more}",
                rules.get("static_fix", "export with static shapes so the shape arithmetic folds into constants"),
                names, op))
            continue
        where = "" if dom == "ai.onnx" else f" from domain {dom}"
        fix = fixes.get(op) or (f"the op is outside {rules['title']}'s operator set: replace it with standard ops "
                                "the target supports, or let it run on the CPU side of a split graph")
        findings.append(Finding("error", "unsupported-op", f"{len(names)} {op} node(s){where} not supported by "
                                f"{rules['title']}: '{names[0]}'{more}", fix, names, op))
    return findings


def _check_dynamic(proto, rules: dict) -> list[Finding]:
    mode = rules.get("static_shapes", "optional")
    if mode == "optional":
        return []
    init = {i.name for i in proto.graph.initializer}
    dynamic = [(vi.name, _dynamic_dims(vi)) for vi in proto.graph.input if vi.name not in init]
    dynamic = [(n, d) for n, d in dynamic if d]
    if not dynamic:
        return []
    listed = "; ".join(f"{n} ({', '.join(d)})" for n, d in dynamic[:4]) + (f"; and {len(dynamic) - 4} more"
                                                                          if len(dynamic) > 4 else "")
    need = "needs fixed shapes" if mode == "required" else "needs an optimization profile for them"
    return [Finding("error" if mode == "required" else "warning", "dynamic-shape",
                    f"{len(dynamic)} input(s) have dynamic dimensions, and {rules['title']} {need}: {listed}",
                    rules.get("static_fix", "export with static shapes"), [n for n, _ in dynamic])]


def _check_int64(proto, rules: dict) -> list[Finding]:
    rule = rules.get("int64")
    if not rule:
        return []
    from onnx import TensorProto
    names = [vi.name for vi in list(proto.graph.input) + list(proto.graph.output)
             if vi.type.tensor_type.elem_type == TensorProto.INT64]
    n_init = sum(1 for i in proto.graph.initializer if i.data_type == TensorProto.INT64)
    if not names and not n_init:
        return []
    what = (f"graph inputs/outputs {', '.join(names)} are int64" if names else "") + \
        (f"{'; ' if names else ''}{n_init} int64 initializer(s)" if n_init else "")
    return [Finding(rule["severity"], "int64", f"64-bit integer tensors: {what}", rule["fix"], names)]


def _check_norms(proto, rules: dict) -> list[Finding]:
    if not rules.get("fp16_compute"):
        return []
    consts = _constant_values(proto)
    producers = {o: n for n in proto.graph.node for o in n.output}
    small_eps, eps_values, squares = [], set(), []
    for i, node in enumerate(proto.graph.node):
        label = _node_label(node, i)
        eps = None
        if node.op_type in ("LayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                            "SkipLayerNormalization", "RMSNormalization"):
            eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        elif node.op_type == "Add" and len(node.input) == 2:
            for a, b in ((0, 1), (1, 0)):
                src = producers.get(node.input[b])
                if node.input[a] in consts and src is not None and src.op_type == "ReduceMean":
                    val = consts[node.input[a]]
                    if val.size == 1 and np.issubdtype(val.dtype, np.floating):
                        eps = float(val.reshape(-1)[0])
        elif node.op_type == "Pow" and node.input[1] in consts:
            exp = consts[node.input[1]]
            if exp.size == 1 and float(exp.reshape(-1)[0]) == 2.0:
                squares.append(label)
        if eps is not None and eps < FP16_MIN_NORMAL:
            small_eps.append(label)
            eps_values.add(f"{eps:g}")
    findings = []
    if small_eps:
        findings.append(Finding(
            "warning", "fp16-epsilon", f"{len(small_eps)} normalisation epsilon(s) ({', '.join(sorted(eps_values))}) are "
            f"below float16's smallest normal value {FP16_MIN_NORMAL:.3g}: {rules['title']} computes in fp16 and flushes "
            f"them to zero, so a near-zero row divides by ~0: e.g. '{small_eps[0]}'",
            "keep the normalisation in fp32 (QNN: a float32 encoding override for these tensors; TensorRT: "
            "--layerPrecisions=<norm layers>:fp32 --precisionConstraints=obey), or raise epsilon to 1e-5 if the model "
            "tolerates it (check with `workbench eval`)", small_eps))
    if squares:
        findings.append(Finding(
            "warning", "fp16-overflow", f"{len(squares)} Pow(x, 2) node(s) square activations for RMSNorm: in fp16 "
            f"x*x overflows to inf for |x| > {FP16_SQUARE_LIMIT:.0f}, and LLM residual streams reach that: e.g. "
            f"'{squares[0]}'", "keep RMSNorm in fp32, or map it to the target's fused normalisation op "
            "(QNN RmsNorm, MNN LayerNorm) that accumulates in higher precision", squares))
    return findings


def _check_mixed_matmul(proto, rules: dict) -> list[Finding]:
    sev = rules.get("mixed_precision_matmul")
    if not sev:
        return []
    producers = {o: n for n in proto.graph.node for o in n.output}
    if not any(n.op_type == "DequantizeLinear" for n in proto.graph.node):
        return []
    mixed = []
    for i, node in enumerate(proto.graph.node):
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        kinds = []
        for name in node.input[:2]:
            src = producers.get(name)
            kinds.append(src is not None and src.op_type == "DequantizeLinear")
        if len(set(kinds)) == 2:
            mixed.append(_node_label(node, i))
    if not mixed:
        return []
    return [Finding(sev, "mixed-matmul", f"{len(mixed)} MatMul node(s) take one fixed-point (DequantizeLinear) input "
                    f"and one float input, which {rules['title']} fails to compile (mixed FP16 x UINT8 MatMul): "
                    f"e.g. '{mixed[0]}'",
                    "quantize both inputs (give the float side a 16-bit activation encoding) or keep both float: in the "
                    "plan set the layer to fp16 for weights AND activations, not weights only", mixed)]


def _check_memory(total: int, rules: dict) -> list[Finding]:
    findings = []
    for limit in rules.get("context_limits", []):
        if total > limit["bytes"]:
            findings.append(Finding(
                "error" if limit is rules["context_limits"][-1] else "warning", "context-memory",
                f"initializers hold {total / 2**30:.2f} GiB, over the {limit['bytes'] / 2**30:.0f} GiB limit of "
                f"{limit['name']}", "quantize the weights (int8 halves fp16 bytes, int4 quarters them) or split the "
                "model into several graphs/contexts by block ranges", []))
    return findings


def inspect_graph(path: str | Path, target: str, *, fold: bool = True) -> GraphReport:
    """Check an ONNX graph against ``target``'s rules; each finding names its nodes and the fix.

    Weights in external data are never read: the checks need shapes and small constants. A static
    graph with run-time shape arithmetic is constant-folded first (as converters do); one without
    (what ``workbench export --static`` writes) is already folded.
    """
    rules = load_rules(target)
    p = Path(path)
    proto = load_onnx(p)
    static = graph_is_static(proto)
    folded = False
    if static and fold:
        if not any(n.op_type in SHAPE_OPS for n in proto.graph.node):
            folded = True
        else:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    proto = load_onnx(fold_constants(p, Path(tmp) / "folded.onnx"))
                    folded = True
                except WorkbenchError:
                    raise
                except Exception:  # a graph onnxruntime itself cannot load is still inspected as written
                    pass
    sizes = initializer_bytes(proto)
    total = sum(sizes.values())
    findings = (_check_ops(proto, rules, static) + _check_dynamic(proto, rules) + _check_int64(proto, rules) +
                _check_norms(proto, rules) + _check_mixed_matmul(proto, rules) + _check_memory(total, rules))
    findings.sort(key=lambda f: SEVERITIES.index(f.severity))
    return GraphReport(p, target, rules["title"], len(proto.graph.node), operator_inventory(proto), findings, total,
                       static, folded, rules.get("sources", []))
