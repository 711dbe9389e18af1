"""A VLM's vision encoder for Hexagon: its fixed-size graph quantized by the plan (QDQ, A16), compiled to a
context binary per SoC, run on onnxruntime-qnn's HTP emulator, and scored against the float model.

    vx = export_vision_encoder(lm, "out/vision")                     # workbench.onnx.vision_export
    qdq = vision_qdq(vx, qm, calibration_feeds(lm, vx), "out/vision/vision_encoder.qdq.onnx")
    info = measure_vision_encoder(prep, vx, qdq, soc=htp_soc("8gen3"), out_dir="out/vision/htp-8gen3")
    info["htp"]["embeddings"]["vs_simulation"]["cosine"], info["htp"]["answers"]["whole_model"]["answer_kl"]

Qualcomm ships each VLM's vision encoder as its own graph at w8a16 (int8 weights, 16-bit activations, min-max
calibrated on ~100 pictures) at one image size. Here the weights are the plan's own integers (the qnn target
defaults a VLM's encoder and projector to int8 when a plan comes from ``--bits``), the activations 16-bit,
min-max calibrated on the calibration pictures (the bundled demo-vl set, 64 pictures) resized to the graph's
size. Measured on the held-out pictures:

- image embeddings (the projector's output, what replaces the image tokens): cosine and relative error
  ``||a - b|| / ||b||`` of the HTP's against the CPU QDQ graph's (the simulation of what the HTP runs), the
  workbench's PyTorch simulation's and the float model's;
- answer-token KL and top-1 against the float model (``measure_vision_quality``) of the whole model with the
  encoder's embeddings injected where the image tokens are: the quantized language model fed by the HTP
  encoder, and the float language model fed by it (the encoder's own cost);
- the encoder's time per picture on the emulator, after a warm-up run (an x86 emulation of the NPU's
  arithmetic: it says nothing of a phone's speed).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ..assets import DEMO_VL_DATA_DIR
from ..errors import DataError
from ..evaluation.images import read_image, read_image_set
from ..model.vision_feed import embedding_error, injected_encoder
from ..model.vision_quality import VisionEvalSet, measure_vision_baseline, measure_vision_quality, vision_eval_set
from ..onnx.vision_export import VisionExport, encoder_feed, vision_embeddings
from ..quantize.model import QuantizedModel
from .common import native_output_to
from .htp import HtpSoc, htp_session_options, write_context_binaries
from .ort_qdq import lean_session, ort_overrides, quantize_qdq

__all__ = ["CALIBRATION_PICTURES", "CALIBRATION_SET", "VISION_GAP_ERROR", "vision_quantized", "calibration_feeds",
           "vision_qdq", "fixed_size_set", "measure_vision_encoder"]

CALIBRATION_SET = DEMO_VL_DATA_DIR / "calibration.jsonl"
CALIBRATION_PICTURES = 100  # Qualcomm calibrates its VLM encoders on ~100 pictures; the demo set has 64
VISION_GAP_ERROR = 0.05  # HTP embeddings off the CPU QDQ graph's by more (relative error): the NPU departs


def vision_quantized(qm, export: VisionExport) -> QuantizedModel:
    """``qm`` restricted to the layers the vision graph holds (encoder and projector)."""
    keep = set(export.weight_names)
    return QuantizedModel(qm.plan, qm.method, {k: v for k, v in qm.weights.items() if k in keep},
                          [r for r in qm.layers if r.name in keep],
                          float_overrides={k: v for k, v in qm.float_overrides.items() if k.startswith("model.visual.")})


def calibration_feeds(lm, export: VisionExport, images: str | Path | None = None,
                      samples: int = CALIBRATION_PICTURES) -> list[dict[str, np.ndarray]]:
    """The encoder graph's inputs for up to ``samples`` calibration pictures (each picture once), resized to the
    graph's size: ``images`` (an image set folder or records file), else the bundled demo-vl calibration set."""
    pairs = read_image_set(images or CALIBRATION_SET)
    paths = list(dict.fromkeys(p.image for p in pairs))[:samples]
    return [encoder_feed(lm, read_image(p), export) for p in paths]


def vision_qdq(export: VisionExport, qm, feeds: Sequence[Mapping[str, np.ndarray]], out_path: str | Path, *,
               activation_bits: int = 16, notes: list[str] | None = None) -> Path:
    """The encoder graph as QDQ: the plan's integers for its layers (``ort_overrides``, written from the codes by
    ``prequantize_weights``), ``activation_bits`` activations min-max calibrated on ``feeds``. The patch embedding
    (a convolution, not a layer of the plan) gets onnxruntime's 8-bit per-channel weights, as Qualcomm's w8a16."""
    view = vision_quantized(qm, export)
    doc = ort_overrides(view, export, notes=notes, twin=True)
    out_path = Path(out_path)
    quantize_qdq(export.path, out_path, feeds, init_overrides=doc["init_overrides"], activation_bits=activation_bits,
                 quantized=view, export=export)
    return out_path


def fixed_size_set(images: VisionEvalSet, size: tuple[int, int]) -> tuple[VisionEvalSet, int]:
    """``images`` with every picture not already ``size`` (height, width) resized to it, as the fixed-size encoder
    sees it (the float model is scored on the same pictures); and how many were resized."""
    from PIL import Image
    cache: dict = {}
    resized = 0

    def fit(sample):
        nonlocal resized
        if sample.image not in cache:
            img = read_image(sample.image) if isinstance(sample.image, (str, Path)) else sample.image
            if img.size != (size[1], size[0]):
                img = img.resize((size[1], size[0]), Image.Resampling.BICUBIC)
                resized += 1
                cache[sample.image] = img
            else:
                cache[sample.image] = sample.image
        return replace(sample, image=cache[sample.image])
    out = VisionEvalSet([fit(s) for s in images.questions], [fit(s) for s in images.captions], images.source)
    return out, resized


class _Encoder:
    """One encoder runtime (an onnxruntime session) with its outputs cached by picture: questions share pictures."""

    def __init__(self, session, export: VisionExport):
        self.session, self.export, self.cache = session, export, {}

    def __call__(self, pixels: np.ndarray, grid: tuple) -> np.ndarray:
        if tuple(grid) != tuple(self.export.grid_thw):
            raise DataError(f"a picture with a {grid[1]}x{grid[2]} patch grid reached the encoder graph built for "
                            f"{self.export.grid_thw[1]}x{self.export.grid_thw[2]}: resize the pictures to "
                            f"{self.export.image_size[1]}x{self.export.image_size[0]}")
        key = pixels.tobytes()
        if key not in self.cache:
            self.cache[key] = self.session.run(None, {"pixel_values": np.ascontiguousarray(pixels, np.float32)})[0]
        return self.cache[key]


def _timed(session, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict:
    """Milliseconds per picture after one warm-up run: median, min, max over ``feeds``."""
    session.run(None, dict(feeds[0]))
    ms = []
    for f in feeds:
        t0 = time.perf_counter()
        session.run(None, dict(f))
        ms.append(1e3 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "pictures": len(ms)}


def _answers(prep, images: VisionEvalSet, baseline, encoder: _Encoder) -> dict:
    """Answer-token KL / top-1 (and image-text matching) against the float model: the quantized language model and
    the float one, each fed ``encoder``'s embeddings."""
    out = {}
    for key, model in (("whole_model", prep.sim_lm.model), ("float_language_model", prep.float_lm.model)):
        with injected_encoder(model, encoder):
            q = measure_vision_quality(prep.float_lm, model, images, baseline=baseline)
        out[key] = {"answer_kl": q.answer_kl, "answer_kl_stderr": q.answer_kl_stderr, "answer_top1": q.answer_top1,
                    "itm_accuracy": q.itm_accuracy, "reference_itm_accuracy": q.reference_itm_accuracy,
                    "questions": q.questions, "answer_tokens": q.answer_tokens}
    return out


def measure_vision_encoder(prep, export: VisionExport, qdq_path: Path, *, soc: HtpSoc | None = None,
                           out_dir: str | Path | None = None, images: VisionEvalSet | None = None,
                           say: Callable[[str], None] = lambda m: None) -> dict:
    """Score the QDQ encoder on the CPU and, with ``soc``, its context binary (written to ``out_dir``) on the HTP
    emulator: embeddings against the float model and the simulations, answers of the whole model with the
    encoder's embeddings injected, time per picture. Returns the conversion's ``details.vision_encoder`` entries."""
    import onnxruntime as ort
    if soc is not None and out_dir is None:
        raise ValueError("measure_vision_encoder: give out_dir, where the context binary for the SoC is written")
    lm = prep.float_lm
    images, resized = fixed_size_set(images or vision_eval_set(), export.image_size)
    pictures = list(dict.fromkeys(s.image for s in images.questions))
    feeds = [encoder_feed(lm, read_image(p) if isinstance(p, (str, Path)) else p, export) for p in pictures]
    grid = export.grid_thw
    floats = [vision_embeddings(lm.model, f["pixel_values"], grid) for f in feeds]
    sims = [vision_embeddings(prep.sim_lm.model, f["pixel_values"], grid) for f in feeds]
    opts = ort.SessionOptions()
    lean_session(opts)
    cpu = ort.InferenceSession(str(qdq_path), opts, providers=["CPUExecutionProvider"])
    qdq = [cpu.run(None, f)[0] for f in feeds]
    info: dict = {"pictures": len(feeds), "resized_pictures": resized, "source": images.source,
                  "simulation_vs_float": embedding_error(sims, floats),
                  "qdq": {"embeddings": {"vs_float": embedding_error(qdq, floats),
                                         "vs_simulation": embedding_error(qdq, sims)},
                          "time": _timed(cpu, feeds)}}
    say(f"scoring the answers with the QDQ encoder's embeddings on {images.describe()}")
    baseline = measure_vision_baseline(lm, images)
    info["simulation_answers"] = _answers_of_simulation(prep, images, baseline)
    info["qdq"]["answers"] = _answers(prep, images, baseline, _Encoder(cpu, export))
    if soc is None:
        return info
    out = Path(out_dir)
    say(f"compiling the vision encoder for {soc.label} with onnxruntime-qnn, then running it on its HTP emulator")
    t0 = time.perf_counter()
    ctx = write_context_binaries({"vision_encoder": qdq_path}, out, soc)[0]
    compile_s = time.perf_counter() - t0
    opts = ort.SessionOptions()
    htp_session_options(soc)(opts)
    with native_output_to():
        htp = ort.InferenceSession(ctx["ctx"], opts)
    outs = [htp.run(None, f)[0] for f in feeds]
    timing = _timed(htp, feeds)
    say(f"scoring the answers with the HTP encoder's embeddings ({soc.label})")
    info["htp"] = {"soc": soc.label, "device": soc.device, "context_binary": ctx["ctx"], "bins": ctx["bin"],
                   "bytes": ctx["bytes"], "compile_seconds": compile_s,
                   "embeddings": {"vs_simulation": embedding_error(outs, qdq),
                                  "vs_workbench_simulation": embedding_error(outs, sims),
                                  "vs_float": embedding_error(outs, floats)},
                   "time": timing, "answers": _answers(prep, images, baseline, _Encoder(htp, export))}
    return info


def _answers_of_simulation(prep, images: VisionEvalSet, baseline) -> dict:
    """The workbench's PyTorch simulation of the plan, whole, against the float model on the same pictures."""
    q = measure_vision_quality(prep.float_lm, prep.sim_lm.model, images, baseline=baseline)
    return {"answer_kl": q.answer_kl, "answer_kl_stderr": q.answer_kl_stderr, "answer_top1": q.answer_top1,
            "itm_accuracy": q.itm_accuracy, "reference_itm_accuracy": q.reference_itm_accuracy}
