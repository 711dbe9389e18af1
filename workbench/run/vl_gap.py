"""The device comparison's vision-language rows: each target's vision path scored against the float VLM.

    rows = measure_vl_rows("demo-vl", bits=4, targets=("simulation", "htp"), work="out/devices-gap")
    print(format_vl_table(rows))

A row holds the image embeddings' error (cosine and relative error of the target's vision encoder + projector
output against the float model's, on the held-out pictures), the answer-token KL and top-1 of the whole model
with that vision output feeding the language model, image-text matching accuracy, the encoder's milliseconds per
picture and decode tokens/s. ``simulation`` is the workbench's PyTorch simulation of the plan (vision encoder and
projector at the w8a16 default, as ``workbench quantize``). A target with a vision form registers one function
(``register_vl_target``) that measures its row; a target with none registered is a row saying so. Rows go into
``DevicesGap.vl_rows`` (``devices_gap.json``), which bench/devices_gap.py, the report and the Export tab read.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import PlanError
from ..model.vision_feed import embedding_error
from ..quantize.plan import QuantPlan
from ..evaluation.images import read_image
from ..model.load import load_model
from ..model.vision_quality import measure_vision_quality, part_plan, vision_eval_set, VisionEvalSet
from ..targets.convert import convert
from .profile import image_features, time_vision_model

__all__ = ["VL_TARGETS", "VL_TABLE_HEADER", "VLTarget", "register_vl_target", "vl_targets", "vl_row", "absent_vl_row",
           "vl_measure_of", "measure_vl_rows", "simulation_vl_measure", "format_vl_table", "vl_table_cells"]

# the targets a VL row is asked of: the simulation, and the targets whose vision form other modules register
VL_TARGETS = ("simulation", "htp", "mnn-llm", "llama.cpp")
VL_TABLE_HEADER = ("target", "runtime", "embedding cosine", "embedding rel. error", "answer KL", "answer top-1",
                   "ITM accuracy", "encoder ms", "decode tok/s", "note")
VL_KEYS = ("embedding_cosine", "embedding_rel_error", "answer_kl", "answer_top1", "itm_accuracy", "encoder_ms",
           "decode_tps")


@dataclass(frozen=True)
class VLTarget:
    """A target's vision form: its runtime's title and ``measure(model, plan_doc, work) -> dict`` of ``VL_KEYS``
    (and an optional ``note``), run in a child process."""

    name: str
    runtime: str
    measure: Callable[[str, dict, str], dict]


_REGISTRY: dict[str, VLTarget] = {}


def register_vl_target(name: str, runtime: str, measure: Callable[[str, dict, str], dict]) -> None:
    """The hook a VL target fills: its function returning its measurement (a module-level function, so a child
    process can run it)."""
    _REGISTRY[name] = VLTarget(name, runtime, measure)


def vl_targets() -> dict[str, VLTarget]:
    return dict(_REGISTRY)


def vl_row(target: str, runtime: str, measured: dict, *, seconds: float | None = None, peak: int | None = None) -> dict:
    """One row of the VL table from a target's measurement; a missing figure stays None, never a made-up one."""
    row = {"target": target, "runtime": runtime, **{k: measured.get(k) for k in VL_KEYS},
           "note": measured.get("note", ""), "seconds": seconds, "peak_bytes": peak, "absent": False}
    bad = [k for k in VL_KEYS if row[k] is not None and not isinstance(row[k], (int, float))]
    if bad:
        raise PlanError(f"VL target '{target}' returned non-numbers for {', '.join(bad)}")
    return row


def absent_vl_row(target: str, why: str) -> dict:
    return {"target": target, "runtime": "", **{k: None for k in VL_KEYS}, "note": why, "seconds": None,
            "peak_bytes": None, "absent": True}


def simulation_vl_measure(model: str, plan_doc: dict, work: str, *, pictures: int | None = None,
                          decode_steps: int = 16, repeats: int = 3) -> dict:
    """The PyTorch simulation of the plan against the float VLM on the held-out pictures (run in a child);
    ``pictures``: only the first N questions and N captioned pictures (a large shape on a small machine)."""
    import torch
    from ..quantize import quantize_model
    lm = load_model(model, dtype="float32")
    plan = QuantPlan.from_dict(plan_doc)
    images = vision_eval_set()
    if pictures is not None:
        images = VisionEvalSet(images.questions[:pictures], images.captions[:pictures],
                               f"{images.source} (first {pictures} questions and captions)")
    cand = quantize_model(lm, plan, progress=False).build_model().eval()
    got, want = [], []
    with torch.inference_mode():
        for s in images.questions:
            image = read_image(s.image) if not hasattr(s.image, "size") else s.image
            inputs = lm.processor(image, s.prompt)
            got.append(np.asarray(image_features(cand, inputs).float()))
            want.append(np.asarray(image_features(lm.model, inputs).float()))
    err = embedding_error(got, want)
    q = measure_vision_quality(lm, cand, images)
    s = images.questions[0]
    inputs = lm.processor(read_image(s.image) if not hasattr(s.image, "size") else s.image, s.prompt)
    encoder, _, tps = time_vision_model(cand, inputs, pad_token_id=lm.tokenizer.pad_token_id or 0,
                                        decode_steps=decode_steps, repeats=repeats)
    return {"embedding_cosine": err["cosine"], "embedding_rel_error": err["relative_error"],
            "answer_kl": q.answer_kl, "answer_top1": q.answer_top1, "itm_accuracy": q.itm_accuracy,
            "encoder_ms": encoder, "decode_tps": tps,
            "note": f"{len(got)} questions about pictures, {q.answer_tokens} answer tokens; float model's ITM "
                    f"{q.reference_itm_accuracy:.2%}; torch on this CPU" if q.reference_itm_accuracy is not None else
                    f"{len(got)} questions about pictures, {q.answer_tokens} answer tokens; torch on this CPU"}


register_vl_target("simulation", "simulation (PyTorch)", simulation_vl_measure)


def vl_measure_of(target: str, details: dict) -> dict:
    """A VL row's figures from what ``target``'s conversion measured of its vision path (``ConversionReport.details``):
    Hexagon's ``vision_encoder`` (the HTP encoder's embeddings feeding the quantized language model), MNN-LLM's
    ``mnn_llm_vision`` (the engine reading the picture itself), llama.cpp's ``mtmd`` (llama-mtmd-cli's clip
    embeddings feeding the workbench's language model). A figure the conversion did not measure stays None."""
    if target == "htp":
        d = details.get("vision_encoder") or {}
        htp = d.get("htp")
        if not htp:
            return {"note": "the vision encoder was not run on the HTP emulator (onnxruntime-qnn missing or no --soc)"}
        e, a = htp["embeddings"]["vs_float"], htp["answers"]["whole_model"]
        return {"embedding_cosine": e["cosine"], "embedding_rel_error": e["relative_error"], "answer_kl": a["answer_kl"],
                "answer_top1": a["answer_top1"], "itm_accuracy": a["itm_accuracy"], "encoder_ms": htp["time"]["median_ms"],
                "note": f"HTP emulator ({htp['soc']}), x86 emulation times; decode: the text rows' HTP graphs"}
    if target == "mnn-llm":
        d = details.get("mnn_llm_vision")
        if not d:
            return {"note": "MNN's engine did not run the picture path"}
        e, sp = d["embeddings_vs_float"], d["speed"]
        return {"embedding_cosine": e["cosine"], "embedding_rel_error": e["relative_error"], "answer_kl": d["answer_kl"],
                "answer_top1": d["answer_top1"], "itm_accuracy": d.get("itm_accuracy"), "encoder_ms": sp["encoder_ms"],
                "decode_tps": sp["decode_tokens_per_second"], "note": "MNN.llm reading the picture; engine counters"}
    if target == "llama.cpp":
        d = details.get("mtmd")
        if not d:
            return {"note": "llama-mtmd-cli not found: set LLAMA_CPP_DIR (docs/targets.md); the GGUFs are checked only"}
        return {"embedding_cosine": d["median_embedding_cosine_vs_float"],
                "embedding_rel_error": d["median_embedding_relative_error_vs_float"],
                "answer_kl": d["answer_kl_llama_cpp_vision"], "answer_top1": d["answer_top1_llama_cpp_vision"],
                "encoder_ms": d["warm_encode_ms"], "decode_tps": d["decode_tokens_per_second"],
                "note": f"llama-mtmd-cli on {d['questions']} questions (medians; its embeddings feed the workbench's "
                        "language model for KL)"}
    raise PlanError(f"no vision-language reading for target '{target}'")


def converted_vl_measure(target: str, model: str, plan_doc: dict, work: str) -> dict:
    """Convert ``model`` with the plan for ``target`` (its vision form included) and read the row from the report."""
    htp = target == "htp"  # Hexagon's vision form comes from the qnn conversion compiled for a SoC
    report = convert(model, "qnn" if htp else target, Path(work), plan=QuantPlan.from_dict(plan_doc),
                     soc="8gen3" if htp else None)
    return vl_measure_of(target, report.details)


def htp_vl_measure(model: str, plan_doc: dict, work: str) -> dict:
    return converted_vl_measure("htp", model, plan_doc, work)


def mnn_llm_vl_measure(model: str, plan_doc: dict, work: str) -> dict:
    return converted_vl_measure("mnn-llm", model, plan_doc, work)


def llamacpp_vl_measure(model: str, plan_doc: dict, work: str) -> dict:
    return converted_vl_measure("llama.cpp", model, plan_doc, work)


register_vl_target("htp", "Hexagon HTP emulator (onnxruntime-qnn, 8 Gen 3)", htp_vl_measure)
register_vl_target("mnn-llm", "MNN.llm", mnn_llm_vl_measure)
register_vl_target("llama.cpp", "llama.cpp mtmd", llamacpp_vl_measure)


def vl_plan(model: str, plan: QuantPlan | None, bits: int | None) -> QuantPlan:
    """The plan a VL row measures: the given one, or ``bits`` for the language model with the vision encoder and
    projector at int8 (``workbench quantize``'s w8a16 default)."""
    if plan is None and bits is None:
        raise PlanError("give a plan or bits (4 or 8) for the vision-language rows")
    lm = load_model(model, dtype="float32")
    if not getattr(lm, "is_vision", False):
        raise PlanError(f"'{model}' has no vision encoder: the vision-language rows need a VLM such as demo-vl")
    return plan if plan is not None else part_plan(lm, QuantPlan.uniform(f"int{bits}"), vision="int8",
                                                   projector="int8")


def measure_vl_rows(model: str | Path, *, plan: QuantPlan | None = None, bits: int | None = None,
                    targets: Sequence[str] = VL_TARGETS, work: str | Path, pictures: int | None = None,
                    log: Callable[[str], None] | None = None) -> list[dict]:
    """One VL row per target in ``targets`` (each measured in a child process), in ``VL_TARGETS`` order;
    ``pictures`` limits the held-out questions and captioned pictures (the simulation's; a registered target gets
    it as ``pictures=`` when its function takes it)."""
    import functools
    import inspect
    from .devices_gap import in_child
    say = log or (lambda m: None)
    unknown = [t for t in targets if t not in VL_TARGETS and t not in _REGISTRY]
    if unknown:
        raise PlanError(f"unknown VL target(s) {', '.join(unknown)}; choose from {', '.join(VL_TARGETS)}")
    plan_doc = vl_plan(str(model), plan, bits).to_dict()
    rows = []
    for t in [t for t in VL_TARGETS if t in targets] + [t for t in targets if t not in VL_TARGETS]:
        entry = _REGISTRY.get(t)
        if entry is None:
            rows.append(absent_vl_row(t, f"no vision form of {t} is registered here (register_vl_target)"))
            continue
        say(f"{t} (vision): running ...")
        try:
            fn = entry.measure
            if pictures is not None and "pictures" in inspect.signature(fn).parameters:
                fn = functools.partial(fn, pictures=pictures)
            m, s, peak = in_child(fn, str(model), plan_doc, str(Path(work) / f"vl-{t}"))
            rows.append(vl_row(t, entry.runtime, m, seconds=s, peak=peak))
        except Exception as e:  # a failing target is a row saying how; the others keep theirs
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            rows.append(absent_vl_row(t, f"failed: {type(e).__name__}: {msg}"))
    return rows


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def vl_table_cells(r: dict) -> list[str]:
    return [r["target"], r["runtime"] or "-", _fmt(r["embedding_cosine"], ".5f"), _fmt(r["embedding_rel_error"], ".4f"),
            _fmt(r["answer_kl"], ".5f"), _fmt(r["answer_top1"], ".2%"), _fmt(r["itm_accuracy"], ".2%"),
            _fmt(r["encoder_ms"], ".1f"), _fmt(r["decode_tps"], ".0f"), r["note"] or ""]


def format_vl_table(rows: list[dict]) -> str:
    cells = [list(VL_TABLE_HEADER)] + [vl_table_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(VL_TABLE_HEADER) - 1)]
    return "\n".join("  ".join(c[i].ljust(w) for i, w in enumerate(widths)) + "  " + c[-1] for c in cells)
