"""ONNX Runtime CPU, ``ort-int4``: the plan's own integers as ``MatMulNBits`` / ``GatherBlockQuantized``.

    build = build_nbits_onnx(sim_model, "ort-int4", qm.precisions, accuracy_level=4)
    convert("demo", "ort-int4", "out/int4", bits=4)       # builds, runs and compares (``convert_ort_int4``)

``build_nbits_onnx`` builds the graphs straight from the workbench's simulation of a plan
(``QuantizedModel.build_model()``): integer layers become ``MatMulNBits`` and an integer embedding
``GatherBlockQuantized``, carrying the codes, scales and zero points unchanged (no second
quantization), so the ONNX model computes what the simulation computes, up to kernel arithmetic.
A tied ``lm_head`` reads the embedding's bytes (written once). Layers the plan keeps in float16 are
stored as float16 (onnxruntime's CPU widens them when it loads the model). ``accuracy_level`` 4
lets the kernel quantize activations to int8 (faster decode on AVX2/NEON, small extra error); 0
keeps them float. Rules: ``assets/targets/ort.json``; runner: ``OnnxCausalLM``.

Bit widths: onnxruntime 1.32's CPU ``MatMulNBits`` runs 2, 4 and 8-bit codes (its kernel refuses
3, 5, 6 and 7: "Only 2b, 4b and 8b quantization is supported"), so int3/int5/int6 are refused by the
target's rule. Two-level scales map exactly: each block's scale is its integer sub-scale times
the channel's float16 scale, a product exact in float32 (at most 11 + 8 significant bits), which is
the scales' type here (the graphs compute in float32). In float16 it would not be exact in general
(an 11-bit mantissa times a sub-scale up to 16 needs up to 15 bits), so the file stores float32
block scales: 32 bits per block where the plan stores ``scale_bits``, and the conversion reports
the file as written.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from ..numerics.memory import release_freed_memory
from ..model.load import LoadedModel
from ..onnx.build import BuiltGraphs, FloatWeights, GraphBuilder, as_array, build_graphs
from ..quantize.plan import get_precision
from ..runtime.onnx_runner import OnnxCausalLM
from ..runtime.parity import greedy_agreement
from .common import half_layers
from .registry import Target, register_target
from ..quantize.qtensor import pack_bits

__all__ = ["Int4Build", "NBitsWeights", "build_nbits_onnx", "matmulnbits_block_size", "ACCURACY_LEVELS",
           "convert_ort_int4", "decode_speed", "open_graphs", "TARGET"]

ACCURACY_LEVELS = {0: "unset (float activations)", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8 activations"}
NBITS = (2, 4, 8)  # what onnxruntime 1.32's CPU MatMulNBits kernel runs
GATHER_BITS = (4, 8)  # what GatherBlockQuantized takes


def matmulnbits_block_size(group_size: int) -> int | None:
    """The largest power of two (>= 16) dividing ``group_size``: MatMulNBits blocks must be powers of two."""
    b = group_size & -group_size
    return b if b >= 16 else None


@dataclass
class Int4Build:
    """What ``build_nbits_onnx`` wrote, which layers became integer ops, and which could not."""

    path: Path  # the prefill graph
    graphs: BuiltGraphs | None = None  # both graphs and the shared data file
    replaced: dict[str, str] = field(default_factory=dict)  # layer FQN -> MatMulNBits / GatherBlockQuantized node
    kept_float: dict[str, str] = field(default_factory=dict)  # layer FQN -> why it stayed float (and at what width)
    accuracy_level: int = 0


def nbits_tensors(qw, block: int):
    """MatMulNBits B, scales and zero points from a QuantizedWeight, repeating scales when groups > blocks."""
    import torch

    n, k = qw.shape
    repeat = qw.effective_group_size // block
    scales = qw.scales.float().repeat_interleave(repeat, dim=1)  # [N, k_blocks]
    k_blocks = k // block
    codes = qw.storage_codes()  # uint8 [N, K], symmetric codes offset by 2^(bits-1) = MatMulNBits' default zero
    # blocks of >= 16 codes fill whole bytes, so one bitstream (lowest bits first) is every block's blob in turn
    b = pack_bits(codes, qw.bits).reshape(n, k_blocks, block * qw.bits // 8)
    zeros = None
    if qw.zeros is not None:  # zero points packed the same way, each row padded to whole bytes
        z = qw.zeros.to(torch.uint8).repeat_interleave(repeat, dim=1)
        if qw.bits == 8:
            zeros = z
        else:
            per_byte = 8 // qw.bits
            z = torch.nn.functional.pad(z, (0, -z.shape[1] % per_byte))
            zeros = pack_bits(z, qw.bits).reshape(n, -1)
    return b.cpu().numpy(), scales.cpu().numpy().astype(np.float32), None if zeros is None else zeros.cpu().numpy()


def _written() -> np.ndarray:
    raise AssertionError("tensor expected in the store already")


class NBitsWeights(FloatWeights):
    """The plan's integers as ``MatMulNBits`` / ``GatherBlockQuantized``; float16 layers stored as float16.

    Reads modules of the simulation: a module with a ``quantized`` QuantizedWeight is an integer
    layer. Codes are written once per tensor: a tied ``lm_head`` aliases the embedding's bytes.
    """

    def __init__(self, precisions: Mapping[str, str | None], accuracy_level: int = 0):
        super().__init__()
        if accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(f"accuracy_level must be one of {sorted(ACCURACY_LEVELS)}, got {accuracy_level}")
        self.precisions, self.accuracy_level = dict(precisions), accuracy_level
        self.replaced: dict[str, str] = {}
        self._codes: dict[int, tuple[str, str, str | None]] = {}  # id(codes tensor) -> (qweight, scales, zeros)

    def _half(self, fqn: str) -> bool:
        p = get_precision(self.precisions.get(fqn)) if self.precisions.get(fqn) else None
        return p is not None and p.is_float and p.bits == 16

    def _block(self, fqn: str, qw, kind: str = "matmul") -> int | None:
        block = matmulnbits_block_size(qw.effective_group_size)
        if block is None:
            self.notes[fqn] = (f"group size {qw.effective_group_size} has no power-of-two block >= 16, which "
                               "onnxruntime's integer ops need: kept as dequantized float32")
        elif kind == "gather" and qw.bits not in GATHER_BITS:
            self.notes[fqn] = (f"{qw.bits}-bit codes: onnxruntime's GatherBlockQuantized takes "
                               f"{' and '.join(map(str, GATHER_BITS))}-bit ones: kept as dequantized float32")
            return None
        return block

    def _tensors(self, g: GraphBuilder, qw, fqn: str, block: int, kind: str) -> tuple[str, str, str | None]:
        """Initializer names of codes, scales, zeros, shaped for ``kind`` ("matmul" or "gather"); written once."""
        n, k = qw.shape
        codes_shape = [n, k // block, block * qw.bits // 8] if kind == "matmul" else [n, k * qw.bits // 8]
        names = (f"{fqn}.weight.qweight", f"{fqn}.weight.scales",
                 f"{fqn}.weight.zeros" if qw.zeros is not None else None)
        first = self._codes.get(id(qw.qweight))
        if first is None:
            codes, scales, zeros = nbits_tensors(qw, block)
            for name, array in zip(names, (codes.reshape(codes_shape), scales, zeros)):
                if name:
                    g.weight(name, lambda array=array: array)
            self._codes[id(qw.qweight)] = names
            return names
        for name in first:  # already written (by the other graph, or by the layer these codes are tied to)
            if name:
                g.weight(name, _written)
        if first[0] == names[0]:
            return first
        return (g.alias(names[0], first[0], codes_shape), first[1], first[2])  # same bytes, this op's shape

    def linear(self, g: GraphBuilder, module, fqn: str, x: str) -> str:
        from onnx import TensorProto
        qw = getattr(module, "quantized", None)
        if qw is not None and self._block(fqn, qw):
            block = matmulnbits_block_size(qw.effective_group_size)
            qweight, scales, zeros = self._tensors(g, qw, fqn, block, "matmul")
            n, k = qw.shape
            name = f"/{fqn}/MatMulNBits"
            y = g.op("MatMulNBits", [x, qweight, scales] + ([zeros] if zeros else []), domain="com.microsoft",
                     name=name, K=k, N=n, bits=qw.bits, block_size=block, accuracy_level=self.accuracy_level)
            self.record(fqn, qweight, "nbits")
            self.replaced[fqn] = name
            return self.bias(g, module, fqn, y)
        if qw is None and self._half(fqn):
            w = g.weight(f"{fqn}.weight.T", lambda: as_array(module.weight.T, np.float16))
            self.record(fqn, w, "in_out")
            y = g.op("MatMul", [x, g.op("Cast", [w], to=TensorProto.FLOAT)], name=f"/{fqn}/MatMul")
            return self.bias(g, module, fqn, y)
        return super().linear(g, module, fqn, x)

    def embedding(self, g: GraphBuilder, module, fqn: str, ids: str) -> str:
        from onnx import TensorProto
        qw = getattr(module, "quantized", None)
        if qw is not None and self._block(fqn, qw, "gather"):
            block = matmulnbits_block_size(qw.effective_group_size)
            qweight, scales, zeros = self._tensors(g, qw, fqn, block, "gather")
            name = f"/{fqn}/GatherBlockQuantized"
            self.record(fqn, qweight, "nbits")
            self.replaced[fqn] = name
            return g.op("GatherBlockQuantized", [qweight, ids, scales] + ([zeros] if zeros else []),
                        domain="com.microsoft", name=name, gather_axis=0, quantize_axis=1, block_size=block,
                        bits=qw.bits)
        if qw is None and self._half(fqn):
            w = g.weight(f"{fqn}.weight", lambda: as_array(module.weight, np.float16))
            self.record(fqn, w, "out_in")
            return g.op("Cast", [g.op("Gather", [w, ids], axis=0, name=f"/{fqn}/Gather")], to=TensorProto.FLOAT)
        return super().embedding(g, module, fqn, ids)

    def lm_head(self, g: GraphBuilder, module, fqn: str, x: str, embedding) -> str:
        """A tied float16 head reads the embedding's float16 table (transposed and widened when loaded)."""
        from onnx import TensorProto
        tied = getattr(module, "weight", None) is not None and module.weight is getattr(embedding, "weight", None)
        if getattr(module, "quantized", None) is None and tied and self._half(fqn) and \
                self.weight_names.get("model.embed_tokens") == "model.embed_tokens.weight":
            table = self.weight_names["model.embed_tokens"]
            self.record(fqn, table, "out_in")
            w = g.op("Cast", [g.op("Transpose", [table], perm=[1, 0])], to=TensorProto.FLOAT)
            return self.bias(g, module, fqn, g.op("MatMul", [x, w], name=f"/{fqn}/MatMul"))
        return self.linear(g, module, fqn, x)


def build_nbits_onnx(sim_model, out_dir: str | Path, precisions: Mapping[str, str | None], *,
                     accuracy_level: int = 0, inline_limit: int | None = None, progress: bool = False) -> Int4Build:
    """Prefill and decode graphs of ``sim_model`` (a plan's simulation) with its integers in ONNX Runtime ops.

    ``precisions`` maps layer names to the plan's precision (``QuantizedModel.precisions``): float16
    layers are stored as float16. What could not be expressed is listed in ``kept_float``.
    """
    policy = NBitsWeights(precisions, accuracy_level)
    built = build_graphs(sim_model, out_dir, policy=policy, progress=progress, inline_limit=inline_limit)
    kept = dict(policy.notes)
    for fqn, prec in precisions.items():
        if fqn not in policy.replaced and fqn not in kept and prec and prec.startswith("int"):
            kept[fqn] = f"{prec} in the plan, but the layer reached the graph as float"
    return Int4Build(built.prefill_path, built, dict(policy.replaced), kept, accuracy_level)


def storage_notes(qm, kept_float: dict[str, str]) -> list[str]:
    """What the plan's float layers became in the ONNX Runtime graphs (never silently float32)."""
    notes = [f"{k}: {v}" for k, v in kept_float.items()]
    two_level = [n for n, qw in qm.weights.items() if qw.two_level and n not in kept_float]
    if two_level:
        notes.append(f"{len(two_level)} layer(s) with two-level scales ({', '.join(two_level[:2])}...): each block's "
                     "scale is written as its exact float32 product sub-scale x channel scale (MatMulNBits has no "
                     "integer sub-scales), so the file holds 32 bits per block where the plan stores the sub-scale")
    half = half_layers(qm)
    if half:
        notes.append(f"{half}: float16 in the plan, stored as float16 (onnxruntime's CPU widens float16 weights to "
                     "float32 when it loads the model: on the CPU they compute as float32)")
    return notes


def release_float_model(prep, keep=()) -> None:
    """Drop the float model once its reference outputs are captured; the simulation keeps what it shares.

    Only for models the conversion loaded itself. The float copies of the integer layers (most of the
    network) then leave memory before onnxruntime loads the converted model. The loader maps the
    checkpoint file and parameters are views of that map, so the float tensors still in use (the
    simulation's, and those of the ``keep`` modules) get their own copies, letting the map close.
    """
    lm = prep.float_lm
    prep.float_lm = LoadedModel(None, lm.tokenizer, lm.path, lm.name, lm.layers)
    prep.qm.source = None
    del lm
    for p in {id(p): p for m in (prep.sim_lm.model, *keep) for p in m.parameters()}.values():
        p.data = p.data.clone()
    release_freed_memory()


def convert_ort_int4(job) -> None:
    """MatMulNBits graphs from the plan's integers; greedy tokens, decode speed and accuracy per accuracy level."""
    prep, report, say = job.prep, job.report, job.say
    seconds, t = report.details["seconds"], time.perf_counter()
    say("building the ONNX Runtime graphs from the plan's integers")
    build = build_nbits_onnx(prep.sim_lm.model, job.out, prep.qm.precisions, accuracy_level=job.accuracy_level,
                             progress=job.progress)
    graphs = build.graphs
    report.details.update(accuracy_level=job.accuracy_level, accuracy_level_meaning=ACCURACY_LEVELS[job.accuracy_level],
                          replaced_layers=len(build.replaced), kept_float=build.kept_float,
                          weight_bytes=graphs.weight_bytes, external_data=graphs.data_path is not None)
    report.notes += storage_notes(prep.qm, build.kept_float)
    if graphs.data_path is not None:
        report.notes.append(f"prefill.onnx and decode.onnx share their weights in {graphs.data_path.name}; the decode "
                            "graph also runs prefill (a past of length 0)")
    seconds["build"] = time.perf_counter() - t
    release_freed_memory()
    t = time.perf_counter()
    ev = job.evaluator()
    if job.owns_models:
        release_float_model(prep, keep=[ev.head] if ev is not None else [])
    release_freed_memory()
    seconds["reference_and_simulation"] = time.perf_counter() - t
    prompt = prep.float_lm.tokenizer("The workbench measures what each choice costs.",
                                     add_special_tokens=False)["input_ids"]
    report.details["decode_tokens_per_second"], levels = {}, {}
    for level in [job.accuracy_level] + ([0] if job.accuracy_level != 0 else []):
        say(f"running accuracy level {level} in onnxruntime")
        t = time.perf_counter()
        runner = OnnxCausalLM(graphs.prefill_path, graphs.decode_path, threads=1,
                              accuracy_level=None if level == job.accuracy_level else level)
        if level == job.accuracy_level:
            tokens = runner.generate_greedy(prompt, job.greedy_steps)
            report.details["greedy_match_steps_vs_simulation"] = greedy_agreement(prep.sim_lm.model, prompt, tokens)[0]
        report.details["decode_tokens_per_second"][level] = decode_speed(runner, prompt)
        if ev is not None:
            # the second level checks the integers against the simulation: one window is enough on a budget
            windows = 1 if level != job.accuracy_level and ev.budget_note else None
            cand = ev.score(runner.logits, f"ort-int4 level {level}", windows)
            levels[level] = {"kl_divergence": cand.kl_divergence, "top1_agreement": cand.top1_agreement,
                             "top1_agreement_vs_simulation": cand.top1_agreement_vs_simulation, "tokens": cand.tokens}
            if level == job.accuracy_level:
                ev.fill(report, cand, graphs.prefill_path)
        del runner  # one runtime in memory at a time
        release_freed_memory()
        seconds[f"accuracy_level_{level}"] = time.perf_counter() - t
    if levels:
        report.details["accuracy_levels"] = levels


def decode_speed(runner: OnnxCausalLM, prompt: list[int], steps: int = 32, repeats: int = 3) -> float:
    """Decode tokens per second after one warm-up step (prefill excluded): the best of ``repeats`` runs
    while a run takes under a second, so a busy machine's pauses do not decide a small model's figure."""
    _, _, kv0 = runner.run_prefill(prompt)
    runner.run_decode(1, kv0, len(prompt))  # warm-up
    best = math.inf
    for _ in range(repeats):
        kv, pos, t = kv0, len(prompt), time.perf_counter()
        for i in range(steps):
            _, kv, _ = runner.run_decode(1 + i % 7, kv, pos)
            pos += 1
        best = min(best, time.perf_counter() - t)
        if best >= 1.0:
            break
    return steps / best if best > 0 else math.inf


def open_graphs(folder: str | Path, *, threads: int | None = None) -> OnnxCausalLM:
    """The prefill and decode graphs of an ort-int4 conversion (or a ``workbench export`` output) in onnxruntime."""
    return OnnxCausalLM(Path(folder) / "prefill.onnx", Path(folder) / "decode.onnx", threads=threads)


TARGET = register_target(Target(
    "ort-int4", "ONNX Runtime CPU, INT4/INT8 MatMulNBits", rules="ort", convert=convert_ort_int4, runnable=True,
    signed_scales=True,
    runner=open_graphs, files=("prefill.onnx", "decode.onnx"), module=__name__, int_bits=NBITS,
    two_level=tuple((b, k) for b in NBITS for k in range(1, 9)),
    precision_note="onnxruntime's CPU MatMulNBits runs 2, 4 and 8-bit codes only; int3, int5 and int6 run in the "
                   "workbench's simulation"))
