"""Activation statistics: what the input of every quantizable linear layer looks like.

    cs, stats = calibrate(lm, "calib.jsonl", samples=128, seq_len=512)   # cached in the workspace
    s = stats.layers["model.layers.0.mlp.down_proj"]
    s.mean_abs, s.abs_max          # per input channel: what AWQ weighs channels by
    s.kurtosis, s.outlier_channels

Forward pre-hooks read the input of every ``nn.Linear`` (the model's weights and outputs are
not touched; the hooks are removed even when the forward fails). Per layer:

* per input channel: abs-max, mean |x| and RMS, exact over every calibration token;
* for the whole layer: mean, standard deviation and excess kurtosis (from sums of x .. x^4 over
  every value, accumulated in float64);
* percentiles of |x|, a histogram of log10 |x| (the first bin also holds zeros, the last
  everything above its edge) and the near-zero fraction, from a deterministic random subsample
  of at most ``sample_budget`` values per layer, drawn evenly from every batch (exact
  percentiles over 10^8 values would need them all in memory; 2^18 values pin a share to about
  0.2%). Near zero means below half a step of per-tensor symmetric INT8,
  ``|x| < abs_max / 254``: values that such a quantizer would round to 0;
* outlier channels: channels whose abs-max exceeds ``outlier_factor`` (default 6) times the
  layer's median channel abs-max. Outlier channels in LLM activations are usually 10-100x the
  rest (LLM.int8(), SmoothQuant), so 6x flags them without flagging ordinary spread.

Layers that read the same tensor (q/k/v, gate/up) share the work. The forward stops right
after the output layer's input has been read, so no logits are ever computed.

A vision-language model calibrates on image + text pairs (``load_image_calibration_set``: the bundled
demo-vl calibration pairs by default, or any image set folder with a captions file): each pair runs the
picture, its question and its answer (a caption answers ``CAPTION_PROMPT``) through the model, exactly as
the scorer on pictures does, so the vision encoder's and the projector's layers get statistics too, one row
per image patch, beside the language model's, one row per token.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

from ..evaluation.data import CalibrationSet, CoverageReport, load_calibration_set
from ..evaluation.images import read_image_set
from ..evaluation.vision import answer_samples
from ..errors import DataError, WorkspaceError
from ..files.workspace import Artifact, Workspace, atomic_write_bytes, atomic_write_json, model_fingerprint
from ..assets import DEMO_VL_DATA_DIR, demo_text_path
from .load import quantizable_layers
from .vision import answer_inputs

__all__ = ["LayerStats", "CalibrationStats", "ImageCalibrationSet", "load_image_calibration_set", "run_calibration",
           "calibrate", "DEFAULT_IMAGE_CALIBRATION", "importance_statistics", "reads_importance",
           "OUTLIER_FACTOR", "PERCENTILES", "HIST_EDGES", "SAMPLE_BUDGET", "STATS_VERSION", "NEAR_ZERO_DIVISOR"]

log = logging.getLogger("workbench")

STATS_VERSION = 1
OUTLIER_FACTOR = 6.0
PERCENTILES = (50.0, 90.0, 99.0, 99.9, 99.99)
HIST_LOW, HIST_HIGH, HIST_BINS = -6.0, 4.0, 40  # log10 |x| from 1e-6 to 1e4, a quarter decade per bin
HIST_EDGES = [HIST_LOW + i * (HIST_HIGH - HIST_LOW) / HIST_BINS for i in range(HIST_BINS + 1)]
SAMPLE_BUDGET = 1 << 18  # values per layer kept for percentiles, the histogram and the near-zero fraction
NEAR_ZERO_DIVISOR = 254.0  # |x| < abs_max / 254: rounds to 0 under per-tensor symmetric INT8
STATS_FILE, META_FILE = "stats.safetensors", "stats.json"
VECTOR_FIELDS = ("abs_max", "mean_abs", "rms")


@dataclass
class LayerStats:
    """Statistics of one linear layer's input over the calibration set."""

    name: str
    in_features: int
    tokens: int
    abs_max: torch.Tensor  # [in_features] float32
    mean_abs: torch.Tensor  # [in_features] float32
    rms: torch.Tensor  # [in_features] float32
    hist_counts: torch.Tensor  # [HIST_BINS] int64: the subsample's log10 |x| over HIST_EDGES
    mean: float
    std: float
    kurtosis: float  # excess (Fisher): 0 for a normal distribution
    percentiles: dict[str, float]  # "p99.9" -> value of |x|
    near_zero_fraction: float
    outlier_factor: float = OUTLIER_FACTOR

    @property
    def median_channel_max(self) -> float:
        return float(self.abs_max.median())

    @property
    def outlier_channels(self) -> list[int]:
        """Input channels whose abs-max is more than ``outlier_factor`` x the median channel's."""
        return torch.nonzero(self.abs_max > self.outlier_factor * self.median_channel_max).flatten().tolist()

    @property
    def outlier_ratio(self) -> float:
        return len(self.outlier_channels) / self.in_features

    @property
    def max_to_median(self) -> float:
        """Largest channel abs-max over the median one: how far the worst channel sticks out."""
        med = self.median_channel_max
        return float(self.abs_max.max()) / med if med > 0 else float("inf")

    @property
    def abs_max_value(self) -> float:
        return float(self.abs_max.max())

    def summary(self) -> dict:
        """The scalars, JSON-ready (no per-channel vectors)."""
        return {"name": self.name, "in_features": self.in_features, "tokens": self.tokens,
                "abs_max": self.abs_max_value, "mean_abs": float(self.mean_abs.mean()), "mean": self.mean,
                "std": self.std, "kurtosis": self.kurtosis, "percentiles": dict(self.percentiles),
                "near_zero_fraction": self.near_zero_fraction, "outlier_factor": self.outlier_factor,
                "outlier_channels": self.outlier_channels, "outlier_ratio": self.outlier_ratio,
                "max_to_median": self.max_to_median if math.isfinite(self.max_to_median) else None}


@dataclass
class CalibrationStats:
    """Per-layer input statistics of a model over a calibration set; saves as safetensors + JSON."""

    layers: dict[str, LayerStats]
    meta: dict = field(default_factory=dict)  # model, samples, tokens, seq_len, seconds, rules used
    hist_edges: list[float] = field(default_factory=lambda: list(HIST_EDGES))
    artifact: Artifact | None = field(default=None, repr=False, compare=False)  # set when from a workspace
    cached: bool = field(default=False, repr=False, compare=False)  # read back rather than computed now

    def __getitem__(self, name: str) -> LayerStats:
        return self.layers[name]

    def summary(self) -> list[dict]:
        return [s.summary() for s in self.layers.values()]

    def save(self, directory: str | Path) -> Path:
        """Write ``stats.safetensors`` (vectors, histograms) and ``stats.json`` (scalars), each atomically."""
        from safetensors.torch import save as st_save
        d = Path(directory)
        tensors = {}
        for name, s in self.layers.items():
            for f in VECTOR_FIELDS:
                tensors[f"{name}.{f}"] = getattr(s, f).contiguous()
            tensors[f"{name}.hist_counts"] = s.hist_counts.contiguous()
        atomic_write_bytes(d / STATS_FILE, st_save(tensors, metadata={"format": "workbench-calibration"}))
        layers = {name: {"in_features": s.in_features, "tokens": s.tokens, "mean": s.mean, "std": s.std,
                         "kurtosis": s.kurtosis, "percentiles": s.percentiles,
                         "near_zero_fraction": s.near_zero_fraction, "outlier_factor": s.outlier_factor}
                  for name, s in self.layers.items()}
        atomic_write_json(d / META_FILE, {"version": STATS_VERSION, "meta": self.meta, "hist_edges": self.hist_edges,
                                          "order": list(self.layers), "layers": layers})
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "CalibrationStats":
        """Read what ``save`` wrote; a missing or inconsistent file is a WorkspaceError saying what to do."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        d = Path(directory)
        meta_path, st_path = d / META_FILE, d / STATS_FILE
        for p in (meta_path, st_path):
            if not p.is_file():
                raise WorkspaceError(f"calibration statistics '{p}' are missing; run calibration again")
        try:
            doc = json.loads(meta_path.read_text(encoding="utf-8"))
            tensors = load_file(st_path)
        except (json.JSONDecodeError, UnicodeDecodeError, SafetensorError, OSError) as e:
            raise WorkspaceError(f"calibration statistics in '{d}' are corrupt ({e}); delete the directory and "
                                 "run calibration again") from None
        if doc.get("version") != STATS_VERSION:
            raise WorkspaceError(f"calibration statistics in '{d}' are version {doc.get('version')}, this workbench "
                                 f"reads version {STATS_VERSION}; run calibration again")
        layers = {}
        for name in doc.get("order") or doc["layers"]:
            s = doc["layers"][name]
            try:
                vec = {f: tensors[f"{name}.{f}"] for f in (*VECTOR_FIELDS, "hist_counts")}
            except KeyError as e:
                raise WorkspaceError(f"calibration statistics in '{d}' lack tensor {e} for layer '{name}'; "
                                     "run calibration again") from None
            layers[name] = LayerStats(name=name, **vec, **s)
        return cls(layers, doc.get("meta", {}), doc.get("hist_edges", list(HIST_EDGES)))


# ---------------------------------------------------------------- image + text calibration pairs

DEFAULT_IMAGE_CALIBRATION = DEMO_VL_DATA_DIR / "calibration.jsonl"  # 64 pictures, each with a question and answer


@dataclass
class ImageCalibrationSet:
    """Image + text pairs a vision-language model calibrates on: per pair, the model's inputs (pixels, image
    tokens, question and answer), as ``workbench.model.vision.answer_inputs`` builds them for scoring.

    Each pair is one forward of its own (pictures differ in patch count: no padding, so no padding statistics).
    The inputs are held: about 4 MB a picture at Qwen2.5-VL's 336 x 504, so 128 pictures hold ~0.5 GB."""

    inputs: list[dict[str, torch.Tensor]]
    report: CoverageReport
    seq_len: int
    where: list[str] = field(default_factory=list)  # per sample: the record it came from

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def samples(self) -> list[dict[str, torch.Tensor]]:
        """What AWQ and GPTQ capture their block inputs from (``quantize.awq.capture_block_inputs``)."""
        return self.inputs

    @property
    def tokens(self) -> int:
        return sum(int(x["input_ids"].shape[-1]) for x in self.inputs)

    @property
    def image_tokens(self) -> int:
        """Language-model positions that hold the picture (Qwen's image tokens, SmolVLM's image patches)."""
        return sum(int(x["mm_token_type_ids"].sum()) if "mm_token_type_ids" in x else 0 for x in self.inputs)

    @property
    def fingerprint(self) -> str:
        """A hash of every input tensor (pixels and token ids): equal fingerprints calibrate identically."""
        h = hashlib.sha256()
        for x in self.inputs:
            for k in sorted(x):
                t = x[k].contiguous()
                h.update(f"{k}{tuple(t.shape)}{t.dtype}".encode())
                h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]

    def batches(self, batch_size: int = 8) -> Iterator[dict[str, torch.Tensor]]:
        """One pair's inputs at a time (``batch_size`` is ignored: pictures of different sizes do not stack)."""
        yield from self.inputs

    def num_batches(self, batch_size: int = 8) -> int:
        return len(self.inputs)


def load_image_calibration_set(lm, path: str | Path | None = None, *, samples: int = 128, seq_len: int = 512,
                               seed: int = 0) -> ImageCalibrationSet:
    """Up to ``samples`` pairs of an image set (``path``: a folder with captions.jsonl / .csv / .tsv, or a records
    file; default the bundled demo-vl calibration pairs), drawn by ``seed`` when there are more, in file order.

    A record with a question and answer runs as that; one with only a caption as ``CAPTION_PROMPT`` answered by
    it. A pair longer than ``seq_len`` tokens (picture included) is dropped and reported; none left is a DataError.
    """
    if not getattr(lm, "is_vision", False) or getattr(lm, "processor", None) is None:
        raise DataError(f"'{lm.path}' is a text model: calibrate it on text (--data), not on pictures (--images)")
    source = Path(path) if path is not None else DEFAULT_IMAGE_CALIBRATION
    pairs = answer_samples(read_image_set(source))
    order = list(range(len(pairs)))
    drawn = sorted(random.Random(seed).sample(order, samples)) if len(pairs) > samples else order
    report = CoverageReport(path=str(source), format="image + text", records=len(pairs), seq_len=seq_len,
                            min_tokens=1, requested=samples, seed=seed, bilingual=False)
    chosen = set(drawn)
    inputs, where, too_long = [], [], []
    for i, sample in enumerate(pairs):
        if i not in chosen:
            report.piece_lengths.append(0)
            report.piece_fates.append("unused")
            continue
        feats, _ = answer_inputs(lm.processor, sample)
        n = int(feats["input_ids"].shape[-1])
        report.piece_lengths.append(n)
        if n > seq_len:
            report.piece_fates.append("too_long")
            too_long.append((sample.where, n))
            continue
        report.piece_fates.append("sampled")
        inputs.append(feats)
        where.append(sample.where)
    if too_long:
        report.dropped["too_long"] = {"pieces": len(too_long), "tokens": sum(n for _, n in too_long),
                                      "where": [w for w, _ in too_long[:5]]}
    if not inputs:
        raise DataError(f"no pair of '{source}' fits {seq_len} tokens with its picture (the shortest takes "
                        f"{min(n for _, n in too_long)}); raise --seq-len or use smaller pictures")
    report.available = len(pairs) - len(too_long)
    report.samples = len(inputs)
    report.tokens = sum(int(x["input_ids"].shape[-1]) for x in inputs)
    report.available_tokens = report.tokens
    return ImageCalibrationSet(inputs, report, seq_len, where)


# ---------------------------------------------------------------- accumulation

class _BatchMoments:
    """One batch of one input tensor, reduced: what every layer reading that tensor adds to its totals."""

    def __init__(self, x: torch.Tensor, generator: torch.Generator, keep: int):
        x = x.reshape(-1, x.shape[-1]).float()
        a = x.abs()
        self.rows = x.shape[0]
        self.n = x.numel()
        self.ch_max = a.amax(0).cpu()  # totals live on the CPU whatever device the model runs on
        self.ch_abs_sum = a.sum(0).double().cpu()
        x2 = x * x
        self.ch_sq_sum = x2.sum(0).double().cpu()
        x2f, xf = x2.reshape(-1), x.reshape(-1)
        # raw power sums, accumulated in float64: central moments follow at the end. Cancellation
        # would need |mean| >> std, which layer inputs (normalised or gated) do not have.
        self.powers = (float(x.sum()), float(self.ch_sq_sum.sum()),
                       float(torch.dot(x2f, xf)), float(torch.dot(x2f, x2f)))
        k = min(keep, self.n)
        idx = torch.randint(0, self.n, (k,), generator=generator)
        self.sample = x.reshape(-1)[idx.to(x.device)].cpu()


class _LayerAccumulator:
    def __init__(self, in_features: int):
        self.rows = 0
        self.ch_max = torch.zeros(in_features)
        self.ch_abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.ch_sq_sum = torch.zeros(in_features, dtype=torch.float64)
        self.n = 0
        self.powers = [0.0, 0.0, 0.0, 0.0]  # sums of x, x^2, x^3, x^4
        self.samples: list[torch.Tensor] = []

    def add(self, b: _BatchMoments) -> None:
        self.rows += b.rows
        torch.maximum(self.ch_max, b.ch_max, out=self.ch_max)
        self.ch_abs_sum += b.ch_abs_sum
        self.ch_sq_sum += b.ch_sq_sum
        self.samples.append(b.sample)
        self.n += b.n
        for i, v in enumerate(b.powers):
            self.powers[i] += v

    def moments(self) -> tuple[float, float, float]:
        """Mean, variance and excess kurtosis from the power sums."""
        n = max(self.n, 1)
        m1, m2, m3, m4 = (p / n for p in self.powers)
        var = max(m2 - m1 * m1, 0.0)
        c4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1 ** 4
        return m1, var, (c4 / (var * var) - 3.0 if var > 0 else 0.0)

    def finish(self, name: str, outlier_factor: float, sorted_cache: dict) -> LayerStats:
        # layers that read the same tensors hold the same subsample: sort it once
        key = tuple(id(t) for t in self.samples)
        if key not in sorted_cache:
            values = torch.cat(self.samples).abs().numpy() if self.samples else np.zeros(1, np.float32)
            sorted_cache[key] = np.sort(values)  # numpy's sort is far faster than torch's on CPU
        sample = sorted_cache[key]
        with np.errstate(divide="ignore"):  # log10(0) = -inf lands in the first bin
            logs = np.clip(np.log10(sample), HIST_LOW, HIST_HIGH)
        hist = torch.from_numpy(np.histogram(logs, bins=HIST_BINS, range=(HIST_LOW, HIST_HIGH))[0].astype(np.int64))
        abs_max = self.ch_max.clone()
        qs = [_sorted_quantile(sample, p / 100) for p in PERCENTILES]
        mean, var, kurt = self.moments()
        near = int(np.searchsorted(sample, float(abs_max.max()) / NEAR_ZERO_DIVISOR)) / sample.size
        return LayerStats(
            name=name, in_features=abs_max.numel(), tokens=self.rows, abs_max=abs_max,
            mean_abs=(self.ch_abs_sum / max(self.rows, 1)).float(),
            rms=(self.ch_sq_sum / max(self.rows, 1)).sqrt().float(), hist_counts=hist,
            mean=mean, std=math.sqrt(var), kurtosis=kurt,
            percentiles={f"p{p:g}": float(v) for p, v in zip(PERCENTILES, qs)},
            near_zero_fraction=near, outlier_factor=outlier_factor)


def _sorted_quantile(values: np.ndarray, q: float) -> float:
    """The ``q`` quantile of sorted ``values``, interpolated linearly (as ``torch.quantile`` does)."""
    pos = q * (values.size - 1)
    lo = int(pos)
    hi = min(lo + 1, values.size - 1)
    return float(values[lo]) + (pos - lo) * (float(values[hi]) - float(values[lo]))


@contextmanager
def _one_thread():
    """Run the statistics on one thread: these memory-bound reductions gain nothing from more, and
    on a busy machine a multi-threaded team spends several times the CPU waiting for its members."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


class _StopForward(Exception):
    """Raised once the output layer's input is read: the logits are never needed."""


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    modules = dict(model.named_modules())
    return {info.name: modules[info.name] for info in quantizable_layers(model) if info.kind == "linear"}


CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_SECONDS = 30.0  # a killed run loses at most about this much of the pass


def _save_checkpoint(path: Path, batches_done: int, n_batches: int, gen: torch.Generator, acc: dict) -> None:
    """The totals after ``batches_done`` batches, written atomically (a kill mid-write keeps the last one)."""
    import io
    state = {"batches_done": batches_done, "n_batches": n_batches, "generator": gen.get_state(),
             "layers": {name: {"rows": a.rows, "n": a.n, "powers": list(a.powers), "ch_max": a.ch_max,
                               "ch_abs_sum": a.ch_abs_sum, "ch_sq_sum": a.ch_sq_sum, "samples": a.samples}
                        for name, a in acc.items()}}
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def _load_checkpoint(path: Path, n_batches: int, acc: dict, gen: torch.Generator) -> int:
    """Restore the totals a killed run left at ``path``; the number of batches they cover (0: none usable)."""
    if not path.is_file():
        return 0
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["n_batches"] != n_batches or set(state["layers"]) != set(acc):
            return 0
        for name, a in acc.items():
            saved = state["layers"][name]
            a.rows, a.n, a.powers = int(saved["rows"]), int(saved["n"]), [float(v) for v in saved["powers"]]
            a.ch_max, a.ch_abs_sum, a.ch_sq_sum = saved["ch_max"], saved["ch_abs_sum"], saved["ch_sq_sum"]
            a.samples = list(saved["samples"])
        gen.set_state(state["generator"])
        return int(state["batches_done"])
    except Exception:  # noqa: BLE001 - a damaged checkpoint only costs the work it held: start over
        for a in acc.values():
            a.__init__(a.ch_max.numel())
        return 0


@torch.inference_mode()
def run_calibration(model: nn.Module, calib_set: CalibrationSet | ImageCalibrationSet, progress: bool = True, *,
                    batch_size: int = 8,
                    outlier_factor: float = OUTLIER_FACTOR, sample_budget: int = SAMPLE_BUDGET,
                    seed: int = 0, checkpoint: Path | None = None,
                    checkpoint_seconds: float | None = None) -> CalibrationStats:
    """Run every calibration sample through ``model`` and gather its linear layers' input statistics.

    ``calib_set`` is text (token-id batches) or a VLM's ``ImageCalibrationSet`` (one picture's inputs a forward).

    The model is left exactly as it was: no weight changes, its train/eval mode restored, and
    every hook removed even if the forward raises. With ``checkpoint`` (a file path) the totals
    are saved every ``checkpoint_seconds`` (default CHECKPOINT_SECONDS; after a batch), and a run that finds one left by a
    killed run with the same batches resumes from it: the result equals an uninterrupted run's.
    """
    from tqdm.auto import tqdm
    if not len(calib_set):
        raise ValueError("the calibration set has no samples")
    layers = _linear_layers(model)
    if not layers:
        raise ValueError("the model has no nn.Linear layers to calibrate")
    n_batches = calib_set.num_batches(batch_size)
    keep = max(1, sample_budget // n_batches)
    gen = torch.Generator().manual_seed(seed)
    acc = {name: _LayerAccumulator(m.in_features) for name, m in layers.items()}
    last: dict = {"x": None, "moments": None}  # q/k/v (and gate/up) read the same tensor: reduce it once
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def make_hook(name: str, stop: bool):
        def hook(module, args):
            x = args[0]
            if last["x"] is not x:
                with _one_thread():
                    last["x"], last["moments"] = x, _BatchMoments(x.detach(), gen, keep)
            acc[name].add(last["moments"])
            if stop:
                raise _StopForward
        return hook

    was_training = model.training
    device = next(model.parameters()).device
    handles = []
    t0 = time.perf_counter()
    every = CHECKPOINT_SECONDS if checkpoint_seconds is None else checkpoint_seconds
    resumed = _load_checkpoint(checkpoint, n_batches, acc, gen) if checkpoint is not None else 0
    if resumed:
        log.info(f"calibration resumed after batch {resumed} of {n_batches} (checkpoint {checkpoint})")
    try:
        model.eval()
        for name, m in layers.items():
            handles.append(m.register_forward_pre_hook(make_hook(name, m is output_layer)))
        saved_at = time.perf_counter()
        with tqdm(total=n_batches, initial=resumed, desc="calibrate", unit="batch", disable=not progress,
                  leave=False) as bar:
            for k, batch in enumerate(calib_set.batches(batch_size)):
                if k < resumed:
                    continue
                try:
                    if isinstance(batch, dict):  # an image + text pair: pixels, image tokens, question, answer
                        model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
                    else:
                        model(input_ids=batch.to(device), use_cache=False)
                except _StopForward:
                    pass
                last["x"] = last["moments"] = None
                bar.update(1)
                if checkpoint is not None and k + 1 < n_batches and \
                        time.perf_counter() - saved_at >= every:
                    _save_checkpoint(checkpoint, k + 1, n_batches, gen, acc)
                    saved_at = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    sorted_cache: dict = {}
    stats = {name: a.finish(name, outlier_factor, sorted_cache) for name, a in acc.items() if a.rows}
    seconds = time.perf_counter() - t0
    missing = [n for n in layers if n not in stats]
    meta = {"samples": len(calib_set), "tokens": calib_set.tokens, "seq_len": calib_set.seq_len,
            **({"images": len(calib_set), "image_tokens": calib_set.image_tokens}
               if isinstance(calib_set, ImageCalibrationSet) else {}),
            "calibration": calib_set.fingerprint, "batch_size": batch_size, "seconds": seconds,
            "outlier_factor": outlier_factor, "sample_budget": sample_budget, "seed": seed,
            "near_zero_rule": f"|x| < abs_max / {NEAR_ZERO_DIVISOR:g}", "percentiles_of": "|x|",
            "unreached_layers": missing, "resumed_after_batch": resumed}
    return CalibrationStats(stats, meta)


# ---------------------------------------------------------------- cached entry point

def calibrate(lm, data: str | Path | None = None, samples: int = 128, seq_len: int = 512,
              workspace: Workspace | None = None, *, seed: int = 0, bilingual: bool = False, batch_size: int = 8,
              outlier_factor: float = OUTLIER_FACTOR, progress: bool = True, force: bool = False,
              compute: bool = True, images: str | Path | None = None
              ) -> tuple[CalibrationSet | ImageCalibrationSet, CalibrationStats | None]:
    """Load the calibration set, then compute (or find in the workspace) the model's activation statistics.

    ``data`` defaults to the demo model's calibration text; ``workspace`` to ``Workspace()``. A vision-language
    model calibrates on image + text pairs instead: ``images`` (an image set), by default the bundled demo-vl
    pairs, unless ``data`` (text: the language model's layers only) is given. The artifact is keyed by the
    model's weights, the calibration inputs and these parameters, so a changed model or set recomputes and an
    unchanged one is read back. ``compute=False`` returns ``(set, None)`` instead of running the statistics
    pass when they are not stored yet.
    """
    vision = getattr(lm, "is_vision", False)
    if images is not None and not vision:
        raise DataError(f"'{lm.path}' is a text model (no vision encoder): calibrate it on text (--data), not on "
                        "pictures (--images)")
    if images is not None and data is not None:
        raise DataError("give --data (text: the language model's layers only) or --images (pictures: every part), "
                        "not both")
    max_pos = getattr(getattr(lm.model, "config", None), "max_position_embeddings", None)
    if max_pos and seq_len > max_pos:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_position_embeddings ({max_pos}); "
                         f"use --seq-len {max_pos} or less")
    if vision and data is None:
        data = Path(images) if images is not None else DEFAULT_IMAGE_CALIBRATION
        cs = load_image_calibration_set(lm, data, samples=samples, seq_len=seq_len, seed=seed)
    else:
        data = demo_text_path("calibration") if data is None else Path(data)
        cs = load_calibration_set(data, tokenizer=lm.tokenizer, samples=samples, seq_len=seq_len, seed=seed,
                                  bilingual=bilingual)
    ws = workspace if workspace is not None else Workspace()
    inputs = {"model": str(lm.path), "weights": model_fingerprint(lm.model), "data": str(data),
              "calibration": cs.fingerprint, "samples": samples, "seq_len": seq_len, "seed": seed,
              "batch_size": batch_size, "outlier_factor": outlier_factor, "version": STATS_VERSION}

    computed = []
    if not compute and not force and ws.find("calibrate", inputs) is None:
        return cs, None  # the caller only wants statistics that are already there

    def run(partial: Path) -> dict:
        computed.append(True)
        checkpoint = partial / CHECKPOINT_FILE  # the partial directory is keyed by these inputs: a rerun finds it
        stats = run_calibration(lm.model, cs, progress=progress, batch_size=batch_size,
                                outlier_factor=outlier_factor, seed=seed, checkpoint=checkpoint)
        stats.meta.update(model=str(lm.path), data=str(data))
        stats.save(partial)
        checkpoint.unlink(missing_ok=True)
        atomic_write_json(partial / "coverage.json", cs.report.to_dict())
        worst = max(stats.layers.values(), key=lambda s: s.max_to_median)
        return {"layers": len(stats.layers), "samples": len(cs), "tokens": cs.tokens,
                "seconds": stats.meta["seconds"], "most_outlying_layer": worst.name,
                "max_to_median": worst.max_to_median}

    art = ws.get_or_compute("calibrate", inputs, run, force=force)
    stats = CalibrationStats.load(art.path)
    stats.artifact, stats.cached = art, not computed
    return cs, stats


# what `workbench calibrate` computes by default: statistics already stored at these sizes are used first
CALIBRATE_SAMPLES, CALIBRATE_SEQ_LEN = 128, 512
# the rounding's own statistics when none are stored: 16 samples of 256 tokens, fewer on big models so the pass
# stays about a minute of a 2-core CPU (parameter-tokens, as evaluate.EVAL_BUDGET)
IMPORTANCE_SEQ_LEN, IMPORTANCE_SAMPLES = 256, (4, 16)
IMPORTANCE_BUDGET = 1e12


def importance_statistics(lm, data: str | Path | None = None, workspace: Workspace | None = None, *,
                          progress: bool = True) -> tuple[tuple[CalibrationSet, CalibrationStats], str]:
    """The activation statistics the scale search weighs each weight's error by (each input column's mean
    squared activation, as llama.cpp's importance matrix), and a line saying where they came from.

    The workspace's statistics from `workbench calibrate` on the same model and text come first; otherwise a
    short pass over the calibration text (default: the bundled one) is run and cached. The scale search with
    this importance is what beats llama.cpp's reference rounding on trained models (docs/quantize.md).
    """
    ws = workspace if workspace is not None else Workspace()
    pictures = getattr(lm, "is_vision", False) and data is None  # a VLM's importance comes from its pictures
    name = ("the bundled demo-vl calibration pictures" if pictures else "the bundled calibration text") \
        if data is None else f"'{data}'"
    max_pos = getattr(getattr(lm.model, "config", None), "max_position_embeddings", None) or CALIBRATE_SEQ_LEN
    if max_pos >= CALIBRATE_SEQ_LEN:  # `workbench calibrate`'s default statistics can exist only then
        cs, stats = calibrate(lm, data, samples=CALIBRATE_SAMPLES, seq_len=CALIBRATE_SEQ_LEN, workspace=ws,
                              progress=progress, compute=False)
        if stats is not None:
            size = f"{len(cs)} image + text pairs" if pictures else f"{len(cs)} x {CALIBRATE_SEQ_LEN} tokens"
            return (cs, stats), f"importance from the workspace's calibration statistics ({size} of {name})"
    low, high = IMPORTANCE_SAMPLES
    samples = int(min(high, max(low, IMPORTANCE_BUDGET // (max(lm.parameters, 1) * IMPORTANCE_SEQ_LEN))))
    seq_len = min(IMPORTANCE_SEQ_LEN, max_pos)
    cs, stats = calibrate(lm, data, samples=samples, seq_len=seq_len, workspace=ws, progress=progress)
    how = "stored in the workspace" if stats.cached else "computed now, kept in the workspace"
    size = f"{len(cs)} image + text pairs ({cs.tokens:,} tokens)" if pictures else f"{len(cs)} x {seq_len} tokens"
    return (cs, stats), (f"importance from {size} of {name}, every part's layers ({how}; "
                         if pictures else f"importance from {size} of {name} ({how}; ") + \
        "`workbench calibrate` for more, --no-importance for none)"


def reads_importance(plan, method: str | None = None) -> bool:
    """Whether ``plan``'s rounding weighs each weight's error by activation statistics by default: round-to-
    nearest with the scale search (AWQ and GPTQ take their own calibration)."""
    return (method or plan.method) == "rtn" and bool(plan.scale_search)
