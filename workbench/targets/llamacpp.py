"""llama.cpp, ``llama.cpp``: the quantized model as one GGUF holding the plan's own integers.

    convert("demo", "llama.cpp", "out/gguf", plan="plan.json")  # out/gguf/model.gguf, read back and checked
    write_llamacpp_tensor_types("types.txt", lm, plan)  # the plan as llama-quantize --tensor-type rules

llama.cpp reads GGUF, not ONNX, so this target has no operator rule table. Its converter writes
``model.gguf`` with ``workbench.targets.gguf_file``: every integer layer in the llama.cpp block
type that holds its codes and scales exactly (Q4_0 / Q5_0 / Q8_0 for symmetric 4/5/8-bit codes with
float16 scales per 32 weights or a multiple, Q3_K / Q4_K / Q5_K / Q6_K for ``int3-k`` / ``int4-k`` /
``int5-k`` / ``int6-k``), then reads it
back with the gguf package's own dequantizer and requires every weight to equal the simulation's.
So ``llama-perplexity -m model.gguf`` scores the model the workbench measured, GPTQ / AWQ / scale
search included. ``commands.sh`` holds that command. The tensor-type file (the plan as
``llama-quantize`` rules, for re-quantizing a float GGUF with llama.cpp's own scales) is the
override format. A vision-language model (Qwen2.5-VL) also gets ``mmproj.gguf`` (``gguf_mmproj``), checked the
same way; where ``$LLAMA_CPP_DIR`` holds ``llama-mtmd-cli``, llama.cpp's multimodal runtime answers held-out
picture questions from the two files and its image embeddings are scored (``llamacpp_mtmd``, ``details["mtmd"]``).
"""
from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import torch

from ..errors import PlanError
from ..evaluation.images import read_image
from ..evaluation.vision import answer_kl, capture_answer_reference
from ..model.load import LoadedModel
from ..model.vision import answer_scorer
from ..model.vision_feed import embedding_error, fed_answer_scorer, image_features
from ..model.vision_quality import vision_eval_set
from ..quantize.plan import QuantPlan, get_precision
from ..quantize.storage import stored_integer_layers
from ..files.workspace import atomic_write_text
from .common import OverrideFile, layer_precisions
from .gguf_file import check_gguf, gguf_parameter_name, write_gguf
from .gguf_mmproj import check_mmproj, write_mmproj
from .llamacpp_mtmd import find_mtmd_cli, image_token_bounds, run_mtmd
from .registry import OverrideFormat, Target, check_precisions, register_target

__all__ = ["gguf_tensor_name", "llamacpp_tensor_types", "write_llamacpp_tensor_types", "read_llamacpp_tensor_types",
           "convert_llamacpp", "TARGET"]

def gguf_tensor_name(fqn: str) -> str | None:
    """The GGUF tensor (without ``.weight``) of a Hugging Face layer name, as llama.cpp's converter names it."""
    if fqn.endswith("embed_tokens"):
        return "token_embd"
    name = gguf_parameter_name(f"{fqn}.weight")
    return None if name is None else name.removesuffix(".weight")


def _gguf_type(precision, symmetric: bool) -> str:
    """The ggml type of a precision (by kind and width: a registered alias of int8 is q8_0)."""
    if precision.is_float:
        return {16: "f16", 32: "f32"}[precision.bits]
    if precision.super_block:
        return {3: "q3_k", 4: "q4_k", 5: "q5_k", 6: "q6_k"}[precision.bits]
    if precision.minimums:
        return {4: "q4_1", 5: "q5_1"}[precision.bits]
    return {8: "q8_0", 5: "q5_0" if symmetric else "q5_1", 4: "q4_0" if symmetric else "q4_1"}[precision.bits]


_GGUF_TO_PRECISION = {"f32": "fp32", "f16": "fp16", "bf16": "fp16", "q8_0": "int8", "q4_0": "int4", "q4_1": "int4-min",
                      "q5_0": "int5", "q5_1": "int5-min", "q3_k": "int3-k", "q6_k": "int6-k",
                      "q4_k": "int4-k", "q5_k": "int5-k"}


def llamacpp_tensor_types(lm: LoadedModel, plan: QuantPlan, *, notes: list[str] | None = None) -> list[tuple[str, str]]:
    """``(pattern, ggml type)`` pairs for ``llama-quantize --tensor-type``; patterns are anchored regexes."""
    notes = notes if notes is not None else []
    precisions = layer_precisions(lm.layers, plan)
    check_precisions(TARGET, precisions, "llama.cpp")
    out = []
    for info in lm.layers:
        prec = get_precision(precisions[info.name])
        gguf = gguf_tensor_name(info.name)
        if prec is None:
            notes.append(f"{info.name}: left unchanged by the plan; llama-quantize's base type applies")
            continue
        if gguf is None:
            notes.append(f"{info.name}: no GGUF tensor name known for this layer; not expressible")
            continue
        if info.tied_to is not None:
            tied_prec = precisions.get(info.tied_to)
            if tied_prec != precisions[info.name]:
                notes.append(f"{info.name}: tied to {info.tied_to}; llama.cpp stores one token_embd tensor for both, "
                             f"so {info.name} at {prec.name} cannot differ from {info.tied_to} at {tied_prec}")
            continue
        out.append((f"^{re.escape(gguf)}\\.weight$", _gguf_type(prec, plan.symmetric)))
    if any(get_precision(p) is not None and not get_precision(p).is_float for p in precisions.values()):
        notes.append("llama-quantize computes its own scales from a float GGUF: this file re-quantizes the plan "
                     "(`workbench convert --target llama.cpp` writes the plan's own integers instead)")
    return out


def write_llamacpp_tensor_types(path: str | Path, lm: LoadedModel, plan: QuantPlan) -> OverrideFile:
    """A ``--tensor-type-file``: one ``pattern=type`` per line (also valid as ``--tensor-type`` arguments)."""
    notes: list[str] = []
    pairs = llamacpp_tensor_types(lm, plan, notes=notes)
    p = atomic_write_text(Path(path), "".join(f"{pat}={t}\n" for pat, t in pairs))
    base = _base_type(plan)
    return OverrideFile(p, "llamacpp", len(pairs), notes,
                        f"llama-quantize --tensor-type-file {p} model-f16.gguf model-mixed.gguf {base}  "
                        f"(or: {' '.join(f'--tensor-type {a}={b}' for a, b in pairs[:2])} ...)")


def read_llamacpp_tensor_types(path: str | Path, lm: LoadedModel) -> dict[str, str]:
    """``{layer: precision}`` from a tensor-type file or ``--tensor-type`` argument list."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"llama.cpp tensor-type file '{p}' does not exist")
    words = [w for w in p.read_text(encoding="utf-8").split() if w != "--tensor-type"]
    by_gguf = {}
    for info in lm.layers:  # a tied lm_head has no tensor of its own: llama.cpp reads token_embd for it
        g = gguf_tensor_name(info.tied_to) if info.tied_to else gguf_tensor_name(info.name)
        if g:
            by_gguf.setdefault(f"{g}.weight", []).append(info.name)
    out: dict[str, str] = {}
    for i, w in enumerate(words):
        if "=" not in w:
            raise PlanError(f"'{p}': entry {i + 1} '{w}' is not PATTERN=TYPE")
        pattern, gtype = w.rsplit("=", 1)
        if gtype.lower() not in _GGUF_TO_PRECISION:
            raise PlanError(f"'{p}': entry {i + 1} has type '{gtype}', which this reader does not map to a precision")
        rx = re.compile(pattern)
        hits = [name for tensor, names in by_gguf.items() if rx.search(tensor) for name in names]
        if not hits:
            raise PlanError(f"'{p}': pattern '{pattern}' matches no tensor of this model")
        for name in hits:
            out[name] = _GGUF_TO_PRECISION[gtype.lower()]
    return out


MTMD_QUESTIONS = 6  # held-out questions asked of llama.cpp's multimodal runtime, when it is found
MTMD_TOKENS = 6  # tokens each answer may run to (the demo VLM's answers are one or two words)
MTMD_TIMING_IMAGES = 8  # one picture this many times in one prompt: every encode after the first is a warm one
MTMD_TIMING_TOKENS = 32


def _write_mmproj(job) -> Path:
    """A VLM's vision encoder and projector as ``mmproj.gguf``, read back equal to the plan."""
    qm = job.prep.qm
    job.say("writing mmproj.gguf")
    t0 = time.perf_counter()
    path = write_mmproj(qm, job.out / "mmproj.gguf")
    job.report.details.setdefault("seconds", {})["write_mmproj"] = time.perf_counter() - t0
    check = check_mmproj(qm, path)
    if check["max_abs_diff"] != 0.0:
        raise PlanError(f"'{path}' does not hold the planned vision weights (largest difference "
                        f"{check['max_abs_diff']:g}); this is a bug in the mmproj writer: please report it with the "
                        "plan")
    job.report.details.update(mmproj_check=check, mmproj_bytes=path.stat().st_size)
    types = ", ".join(f"{n} x{c}" for n, c in sorted(check["types"].items()))
    job.report.notes.append(f"mmproj.gguf: the vision encoder and projector in llama.cpp's clip format ({types}); all "
                            f"{check['weights']:,} values read back by the gguf package equal the plan's "
                            f"({check['integer_layers']} integer layers, the rest at the file's float type)")
    return path


def _answers_from_mtmd(job, cli: Path, model: Path, mmproj: Path) -> None:
    """Ask llama.cpp's multimodal runtime the first held-out questions. Its answers beside the simulation's (greedy,
    transformers' generate on the workbench's quantized model); its image embeddings against the float model's and
    the simulation's; the answer-token KL (against the float model) of the simulation's language model fed
    llama.cpp's embeddings, beside the simulation's own; its times. In ``details["mtmd"]``."""
    lm, sim = job.prep.float_lm, job.prep.sim_lm.model
    bounds = image_token_bounds(lm.processor.image_processor)
    samples = vision_eval_set(max_questions=MTMD_QUESTIONS).questions
    rows, fed = [], {}
    for sample in samples:
        job.say(f"llama-mtmd-cli: {Path(sample.image).name}: {sample.prompt}")
        got = run_mtmd(cli, model, mmproj, Path(sample.image), sample.prompt, max_tokens=MTMD_TOKENS,
                       image_tokens=bounds, embeddings=True)
        inputs = lm.processor(read_image(sample.image), sample.prompt)
        with torch.inference_mode():
            ids = sim.generate(**inputs, max_new_tokens=MTMD_TOKENS, do_sample=False)
        mine = lm.tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        fed[str(sample.image)] = got.embeddings
        rows.append({"image": Path(sample.image).name, "question": sample.prompt, "expected": sample.answer,
                     "llama_cpp": got.text, "workbench": mine, **got.to_dict(),
                     "embedding_vs_float": embedding_error(got.embeddings, image_features(lm.model, inputs)),
                     "embedding_vs_simulation": embedding_error(got.embeddings, image_features(sim, inputs))})
    job.say("llama-mtmd-cli: timing the encoder on a warm process")
    timed = run_mtmd(cli, model, mmproj, [Path(samples[0].image)] * MTMD_TIMING_IMAGES, "Describe this image in one "
                     "sentence.", max_tokens=MTMD_TIMING_TOKENS, image_tokens=bounds, ignore_eos=True)
    warm = sorted(timed.encodes_ms[1:])
    reference = capture_answer_reference(answer_scorer(lm.model, lm.processor), samples)
    own = answer_kl(answer_scorer(sim, lm.processor), samples, reference=reference)
    fed_kl = answer_kl(fed_answer_scorer(sim, lm.processor, fed), samples, reference=reference)

    def first_word(t):
        return (t.split() or [""])[0].strip(".,").lower()

    def median(key, sub=None):
        vals = sorted(r[key][sub] if sub else r[key] for r in rows if r[key] is not None)
        return vals[len(vals) // 2] if vals else None
    agree = sum(first_word(r["llama_cpp"]) == first_word(r["workbench"]) for r in rows)
    right = sum(first_word(r["llama_cpp"]) == r["expected"].split()[0].lower() for r in rows)
    summary = {"binary": str(cli), "questions": len(rows), "first_word_agreement": agree, "correct": right,
               "image_tokens": bounds, "median_encode_ms": median("encode_ms"),
               "warm_encode_ms": warm[len(warm) // 2] if warm else None, "timing_run": timed.to_dict(),
               "decode_tokens_per_second": timed.decode_tokens_per_second,
               "prompt_tokens_per_second": timed.prompt_tokens_per_second,
               "median_embedding_cosine_vs_float": median("embedding_vs_float", "cosine"),
               "median_embedding_relative_error_vs_float": median("embedding_vs_float", "relative_error"),
               "median_embedding_relative_error_vs_simulation": median("embedding_vs_simulation", "relative_error"),
               "answer_kl_llama_cpp_vision": fed_kl.kl_divergence,
               "answer_top1_llama_cpp_vision": fed_kl.top1_agreement,
               "answer_kl_simulation": own.kl_divergence, "answer_top1_simulation": own.top1_agreement,
               "answers": rows}
    job.report.details["mtmd"] = summary
    job.report.notes.append(
        f"llama.cpp's multimodal runtime ({cli.name}) answered {len(rows)} held-out questions from model.gguf + "
        f"mmproj.gguf: first word equal to the workbench's in {agree}, right in {right}; its image embeddings against "
        f"the float model's: cosine {summary['median_embedding_cosine_vs_float']:.4f}, relative error "
        f"{summary['median_embedding_relative_error_vs_float']:.4f} (median); answer KL with llama.cpp's embeddings "
        f"feeding the workbench's quantized language model {fed_kl.kl_divergence:.4f} (its own vision part: "
        f"{own.kl_divergence:.4f}); image encode {summary['warm_encode_ms']} ms warm ({summary['median_encode_ms']} ms "
        f"first in a process), decode {summary['decode_tokens_per_second']} tok/s (llama.cpp's own timers)")


def convert_llamacpp(job) -> None:
    """``model.gguf`` holding the plan's integers, checked weight for weight, and ``commands.sh`` scoring it; for a
    VLM also ``mmproj.gguf`` (the vision part) and, where llama.cpp's multimodal CLI is found, its answers."""
    prep, out = job.prep, job.out
    qm = prep.qm
    vision = getattr(prep.float_lm, "is_vision", False)
    mmproj = _write_mmproj(job) if vision else None  # a VLM's vision part refused (by name) before the text is written
    job.say("writing model.gguf")
    t0 = time.perf_counter()
    path = write_gguf(qm, out / "model.gguf")
    written = time.perf_counter() - t0
    check = check_gguf(qm, path)
    if check["max_abs_diff"] != 0.0:
        raise PlanError(f"'{path}' does not hold the simulated weights (largest difference {check['max_abs_diff']:g}); "
                        "this is a bug in the GGUF writer: please report it with the plan")
    plan_bytes = sum(qm.weights[r.name].storage_bytes() for r in stored_integer_layers(qm))
    file_types = ", ".join(f"{n} x{c}" for n, c in sorted(check["types"].items()))
    job.report.details.update(gguf_check=check, gguf_bytes=path.stat().st_size, plan_integer_bytes=plan_bytes)
    job.report.details.setdefault("seconds", {})["write_gguf"] = written
    job.report.notes.append(f"model.gguf holds the plan's own integers ({file_types}): all {check['weights']:,} "
                            "weights read back by the gguf package's dequantizer equal the simulation's, so "
                            "llama.cpp runs the model the workbench measured (its kernels round activations to "
                            "8 bits for quantized weights)")
    coarse = sorted({qw.effective_group_size for qw in qm.weights.values()
                     if not qw.two_level and qw.effective_group_size != 32})
    if coarse:
        job.report.notes.append(f"groups of {', '.join(map(str, coarse))} weights are written as 32-weight blocks "
                                "repeating their scale: the same weights in a bigger file (plan with group size 32 "
                                "for the size llama.cpp counts)")
    src = shlex.quote(str(Path(prep.float_lm.path).resolve()))
    lines = ["#!/usr/bin/env bash", "# Score the plan's GGUF with llama.cpp (set LLAMA_CPP to its build/bin folder and "
             "TEXT to a text file). Run from this directory.", "set -euo pipefail", "",
             "\"$LLAMA_CPP/llama-perplexity\" -m model.gguf -f \"${TEXT:?set TEXT to a text file to score}\" -c 256",
             "# llama.cpp re-quantizing the float model itself, for comparison:",
             f"# python convert_hf_to_gguf.py {src} --outtype f16 --outfile model-f16.gguf",
             f"# \"$LLAMA_CPP/llama-quantize\" model-f16.gguf model-q4_k_m.gguf Q4_K_M", ""]
    if mmproj is not None:
        bounds = image_token_bounds(prep.float_lm.processor.image_processor)
        lines[-1:-1] = ["# Ask about a picture with llama.cpp's multimodal runtime (IMAGE: a picture file):",
                        "\"$LLAMA_CPP/llama-mtmd-cli\" -m model.gguf --mmproj mmproj.gguf "
                        "--image \"${IMAGE:?set IMAGE}\" -p \"What colour is the shape?\" -n 8 --temp 0 --jinja"
                        + (f" --image-min-tokens {bounds[0]} --image-max-tokens {bounds[1]}" if bounds else "")]
    script = out / "commands.sh"
    atomic_write_text(script, "\n".join(lines))
    script.chmod(0o755)
    cli = find_mtmd_cli() if mmproj is not None else None
    if cli is not None:
        _answers_from_mtmd(job, cli, path, mmproj)
    elif mmproj is not None:
        job.report.notes.append("llama-mtmd-cli not found (set LLAMA_CPP_DIR to a llama.cpp build; docs/targets.md): "
                                "the GGUFs are written and checked, not run")


def _base_type(plan: QuantPlan) -> str:
    p = get_precision(plan.default)
    return _gguf_type(p, plan.symmetric).upper() if p else "Q8_0"


def _write(path, lm, plan, *, quantized=None, export=None, calibration=None) -> OverrideFile:
    return write_llamacpp_tensor_types(path, lm, plan)


def _read(path, lm, export=None) -> dict[str, str]:
    return read_llamacpp_tensor_types(path, lm)


TARGET = register_target(Target(
    "llama.cpp", "llama.cpp (GGUF)", rules=None, convert=convert_llamacpp, runnable=False, signed_scales=True,
    overrides=OverrideFormat("llamacpp", _write, _read), module=__name__, int_bits=(4, 5, 8),
    layouts=("int3-k", "int4-k", "int5-k", "int6-k", "int4-min", "int5-min"),
    precision_note="llama.cpp's blocks hold symmetric 4, 5 and 8-bit codes with a float16 scale per 32 weights "
                   "(Q4_0, Q5_0, Q8_0), the int4-min / int5-min layouts (Q4_1, Q5_1: a float16 minimum beside "
                   "it) and the int3-k / int4-k / int5-k / int6-k layouts (Q3_K, Q4_K, Q5_K, Q6_K); int2, and "
                   "int3 / int6 with float16 group scales, and per-channel two-level scales (LPBQ) have no "
                   "llama.cpp block"))
