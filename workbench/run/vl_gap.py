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

from ..errors import PlanError
from ..quantize.plan import QuantPlan

__all__ = ["VL_TARGETS", "VL_TABLE_HEADER", "VLTarget", "register_vl_target", "vl_targets", "vl_row", "absent_vl_row",
           "embedding_error", "measure_vl_rows", "simulation_vl_measure", "format_vl_table", "vl_table_cells"]

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


def embedding_error(candidate, reference) -> tuple[float, float]:
    """(mean cosine over image tokens, relative error ||c - r|| / ||r||) of two image-embedding tensors."""
    import torch
    c, r = candidate.float().reshape(-1, candidate.shape[-1]), reference.float().reshape(-1, reference.shape[-1])
    if c.shape != r.shape:
        raise PlanError(f"image embeddings differ in shape: {tuple(c.shape)} against the float model's {tuple(r.shape)}")
    cos = torch.nn.functional.cosine_similarity(c, r, dim=-1).mean().item()
    return cos, (torch.linalg.vector_norm(c - r) / torch.linalg.vector_norm(r).clamp_min(1e-12)).item()


def simulation_vl_measure(model: str, plan_doc: dict, work: str, *, pictures: int | None = None,
                          decode_steps: int = 16, repeats: int = 3) -> dict:
    """The PyTorch simulation of the plan against the float VLM on the held-out pictures (run in a child);
    ``pictures``: only the first N questions and N captioned pictures (a large shape on a small machine)."""
    import torch
    from ..model.load import load_model
    from ..model.vision_quality import VisionEvalSet, measure_vision_quality, vision_eval_set
    from ..quantize import quantize_model
    from ..evaluation.images import read_image
    from .profile import image_features, time_vision_model
    lm = load_model(model, dtype="float32")
    plan = QuantPlan.from_dict(plan_doc)
    images = vision_eval_set()
    if pictures is not None:
        images = VisionEvalSet(images.questions[:pictures], images.captions[:pictures],
                               f"{images.source} (first {pictures} questions and captions)")
    cand = quantize_model(lm, plan, progress=False).build_model().eval()
    cos, rel = [], []
    with torch.inference_mode():
        for s in images.questions:
            image = read_image(s.image) if not hasattr(s.image, "size") else s.image
            inputs = lm.processor(image, s.prompt)
            c, r = embedding_error(image_features(cand, inputs), image_features(lm.model, inputs))
            cos.append(c)
            rel.append(r)
    q = measure_vision_quality(lm, cand, images)
    s = images.questions[0]
    inputs = lm.processor(read_image(s.image) if not hasattr(s.image, "size") else s.image, s.prompt)
    encoder, _, tps = time_vision_model(cand, inputs, pad_token_id=lm.tokenizer.pad_token_id or 0,
                                        decode_steps=decode_steps, repeats=repeats)
    return {"embedding_cosine": sum(cos) / len(cos), "embedding_rel_error": sum(rel) / len(rel),
            "answer_kl": q.answer_kl, "answer_top1": q.answer_top1, "itm_accuracy": q.itm_accuracy,
            "encoder_ms": encoder, "decode_tps": tps,
            "note": f"{len(cos)} questions about pictures, {q.answer_tokens} answer tokens; float model's ITM "
                    f"{q.reference_itm_accuracy:.2%}; torch on this CPU" if q.reference_itm_accuracy is not None else
                    f"{len(cos)} questions about pictures, {q.answer_tokens} answer tokens; torch on this CPU"}


register_vl_target("simulation", "simulation (PyTorch)", simulation_vl_measure)


def vl_plan(model: str, plan: QuantPlan | None, bits: int | None) -> QuantPlan:
    """The plan a VL row measures: the given one, or ``bits`` for the language model with the vision encoder and
    projector at int8 (``workbench quantize``'s w8a16 default)."""
    from ..model.load import load_model
    from ..model.vision_quality import part_plan
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
