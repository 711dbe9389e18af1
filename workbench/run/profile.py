"""Speed, size and memory of exported and converted models, run on this machine's CPU.

    profiles = profile_directory("out/convert")        # every runnable folder found below it
    profiles[0].decode_tokens_per_second, profiles[0].prefill_ms[128], profiles[0].size_bytes

Each folder is opened by the runner its target registers (``workbench.run.locate``: onnxruntime for the
ONNX graphs, MNN for ``.mnn``, onnxruntime-genai for an ``ort-genai`` folder), warmed up once, then timed
``repeats`` times; the median is reported. Prefill is timed per prompt length, decode as tokens
per second over ``decode_steps`` steps after a prompt. Sizes are the files on disk (external data
included); memory is the peak resident memory the runtime added while loading and running (Linux).
These are CPU figures: they rank choices against each other here, they do not predict an NPU's.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ModelLoadError, WorkbenchError, printable
from ..onnx.inspect import decode_step_bytes, context_cache_files, load_onnx
from ..files.workspace import Workspace
from ..numerics.memory import reset_peak_rss, rss_mb, settled_rss_mb
from ..targets.convert import convert, CONVERT_TARGETS, prepare_models
from .locate import CONVERSION_FILE, find_runnable, locate, not_runnable_here
from ..assets import DEMO_VL_DATA_DIR
from ..devices.vision_projection import DEFAULT_IMAGE
from ..evaluation.images import read_image
from ..model.load import load_model
from ..model.vision import is_vision_config

__all__ = ["RuntimeProfile", "profile_runtime", "profile_directory", "VisionProfile", "profile_vision_model",
           "is_vision_folder", "image_features", "time_vision_model", "build_candidates",
           "parse_prompt_lengths", "measure_read_bandwidth", "host_bandwidth", "last_level_cache_bytes",
           "DEFAULT_PROMPT_LENGTHS", "DEFAULT_CANDIDATES"]

DEFAULT_PROMPT_LENGTHS = (32, 128)
DEFAULT_CANDIDATES = ("float", "ort-int4", "ort-genai", "mnn")  # "float": the unquantized export; the rest: targets


@dataclass
class RuntimeProfile:
    """What one model costs to run here: prefill latency, decode speed, size on disk, memory."""

    name: str
    runtime: str
    files: list[str]
    size_bytes: int
    threads: int
    repeats: int
    prefill_ms: dict[int, float] = field(default_factory=dict)  # prompt length -> median milliseconds
    decode_tokens_per_second: float | None = None
    load_seconds: float = 0.0
    peak_rss_added_mb: float | None = None  # MiB (/proc's kB / 1024); shown as rss_added_mb
    decode_bytes: int | None = None  # the decode graph and its weights: what one decode step reads at most
    notes: list[str] = field(default_factory=list)
    vision: dict | None = None  # a VL folder's picture path: encoder_ms, prefill_ms, decode tokens/s (engine counters)

    def to_dict(self) -> dict:
        return asdict(self)

    def decode_bound(self, read_gbps: float, cache_bytes: int | None = None) -> float | None:
        """Tokens/s this host's read bandwidth allows when every step reads the decode graph's weights once; None
        where the graph fits in ``cache_bytes`` (the CPU's last-level cache): then each step reads it from the cache,
        which the memory's bandwidth does not bound (a "bound" there is beaten, 1.3-1.5x for the demo model)."""
        if not self.decode_bytes or (cache_bytes and self.decode_bytes <= cache_bytes):
            return None
        return read_gbps * 1e9 / self.decode_bytes

    def fraction_of_bound(self, read_gbps: float, cache_bytes: int | None = None) -> float | None:
        """Measured decode tokens/s over that bound: read the same way as a device projection's efficiency."""
        bound = self.decode_bound(read_gbps, cache_bytes)
        return self.decode_tokens_per_second / bound if bound and self.decode_tokens_per_second else None

    @property
    def rss_added_mb(self) -> float | None:
        """The resident memory the model added, in MB (10^6 bytes), the unit its size is shown in."""
        return None if self.peak_rss_added_mb is None else self.peak_rss_added_mb * 2**20 / 1e6

    def summary(self) -> str:
        pre = ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in self.prefill_ms.items())
        dec = f"; decode {self.decode_tokens_per_second:.0f} tok/s" if self.decode_tokens_per_second else ""
        mem = f"; +{self.rss_added_mb:.0f} MB RSS" if self.rss_added_mb is not None else ""
        line = f"{self.name} ({self.runtime}): {self.size_bytes / 1e6:.2f} MB; prefill {pre}{dec}{mem}"
        return line + (f"\n  {self.vision_summary()}" if self.vision else "")

    def vision_summary(self) -> str:
        """The picture path's line: encoder, prefill with the picture's tokens, first token, decode."""
        v = self.vision or {}
        if not v:
            return ""
        return (f"with a {v['image_size']}x{v['image_size']} picture: encoder {v['encoder_ms']:.2f} ms, prefill "
                f"{v['prefill_ms']:.2f} ms ({v['prompt_tokens']} tokens), first token {v['first_token_ms']:.2f} ms, "
                f"decode {v['decode_tokens_per_second']:.0f} tok/s over {v['decoded_tokens']} tokens ({v['source']})")


def parse_prompt_lengths(text: str) -> tuple[int, ...]:
    """``"32,128"`` -> ``(32, 128)``, with an error that shows the expected form."""
    try:
        lengths = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise WorkbenchError(f"prompt lengths are comma-separated positive integers, e.g. 32,128; got '{text}'")
    return lengths


def _files_of(path: Path) -> list[Path]:
    """The graph and its external-data files (same folder, named in the ONNX model), context binaries included."""
    files = [path]
    if path.suffix == ".onnx":
        from onnx.external_data_helper import uses_external_data

        proto = load_onnx(path)  # names the file when it is truncated, empty or not ONNX
        files += [f for f in context_cache_files(proto, path.parent) if f.is_file() and f not in files]
        for init in proto.graph.initializer:
            if uses_external_data(init):
                loc = next((e.value for e in init.external_data if e.key == "location"), None)
                if loc and (path.parent / loc) not in files:
                    files.append(path.parent / loc)
    return files


def _median_ms(fn, repeats: int, own=None) -> float:
    """Median milliseconds of ``fn`` after a warm-up; ``own()``, when given, is the time the runtime measured for
    the last call itself (a runtime in a child process: the pipe to it is not the runtime's time)."""
    fn()  # warm-up: first-run allocation and kernel choice are not the steady state
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t if own is None else own()) * 1000)
    return statistics.median(times)


def profile_runtime(name: str, path: str | Path, *, prompt_lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS,
                    decode_steps: int = 32, repeats: int = 5, threads: int = 1,
                    vocab_size: int | None = None) -> RuntimeProfile:
    """Time the model in ``path`` (a converted or exported folder, or its first file), opened by the runner its
    target registers (``workbench.run.locate``); prompts are fixed pseudo-random token ids (seeded)."""
    if repeats < 1 or decode_steps < 1 or not prompt_lengths or min(prompt_lengths) < 1:
        raise WorkbenchError("profile: repeats, decode_steps and every prompt length must be at least 1")
    found = locate(path)
    if found is None:
        raise WorkbenchError(f"'{path}' holds nothing a target runs; pass a `workbench export` or `workbench "
                             "convert` output")
    decode = found.decode_graph
    decode_graphs = found.decode_graphs  # a graph split into parts: each part's share of a step
    files = list(dict.fromkeys(f for m in found.model_files for f in _files_of(m)))  # shared data once
    before = settled_rss_mb()
    reset = reset_peak_rss()
    t = time.perf_counter()
    try:
        runner = found.open(threads=threads)
    except WorkbenchError:
        raise
    except Exception as e:  # the runtime's own errors for a file that parses but does not load
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"could not load '{found.entry}'" + (f" with '{decode}'" if decode not in (None, found.entry)
                                                                 else "") + f": {first}; export or convert it again") \
            from None
    load_seconds = time.perf_counter() - t
    child = getattr(runner, "out_of_process", False)  # its engine runs in a child: load, calls and memory timed there
    if child:
        load_seconds = runner.load_seconds
    own = (lambda: runner.call_seconds) if child else None
    runtime = getattr(runner, "runtime", found.target.name)
    report = RuntimeProfile(name, runtime, [str(f) for f in files], sum(f.stat().st_size for f in files), threads,
                            repeats, load_seconds=load_seconds,
                            decode_bytes=sum(decode_step_bytes(g) for g in decode_graphs) if decode_graphs else None)
    vocab = vocab_size or 1000
    rng = np.random.default_rng(0)
    for n in prompt_lengths:
        static = getattr(runner, "static_seq", None)
        if static is not None and n > static:
            report.notes.append(f"prompt of {n} tokens skipped: the static graph takes {static}")
            continue
        if static is not None and n < static:
            report.notes.append(f"prompt of {n} tokens runs padded to the static graph's {static}")
        ids = rng.integers(1, vocab, size=(1, n))
        if hasattr(runner, "prefill_seconds"):  # a runtime that times its own prompt pass (onnxruntime-genai)
            report.prefill_ms[n] = _median_ms(lambda ids=ids: runner.prefill_seconds(ids[0].tolist()), repeats,
                                              own)
        elif hasattr(runner, "prefill_feed"):  # onnxruntime: the prefill session alone, without the KV slicing
            report.prefill_ms[n] = _median_ms(lambda ids=ids: runner.prefill.run(None, runner.prefill_feed(ids[0])),
                                              repeats)
        elif hasattr(runner, "logits"):
            report.prefill_ms[n] = _median_ms(lambda ids=ids: runner.logits(ids), repeats, own)
        else:
            report.prefill_ms[n] = _median_ms(lambda ids=ids: runner.run_prefill(ids[0].tolist()), repeats, own)
    if hasattr(runner, "decode_seconds"):  # onnxruntime-genai: its own generator loop, after the prompt
        prompt = rng.integers(1, vocab, size=min(prompt_lengths)).tolist()
        runner.decode_seconds(prompt, decode_steps)  # warm-up, as for the other runtimes
        times = [runner.decode_seconds(prompt, decode_steps) for _ in range(repeats)]
        report.decode_tokens_per_second = decode_steps / statistics.median(times)
    elif hasattr(runner, "run_decode"):  # graph runners decode with the KV cache (run_prefill, then run_decode)
        prompt = rng.integers(1, vocab, size=min(prompt_lengths)).tolist()
        _, _, kv0 = runner.run_prefill(prompt)
        limit = getattr(runner, "static_past", None)
        steps = decode_steps if limit is None else max(1, min(decode_steps, limit - len(prompt)))

        def decode_run():
            kv, pos = kv0, len(prompt)
            for i in range(steps):
                _, kv, _ = runner.run_decode(int(prompt[i % len(prompt)]), kv, pos)
                pos += 1
        report.decode_tokens_per_second = steps / (_median_ms(decode_run, repeats) / 1000)
    if getattr(runner, "is_visual", False):  # a VL folder: the picture path timed by the engine's own counters
        report.vision = runner.picture_profile(decode_steps, repeats)
    if child:
        report.peak_rss_added_mb = runner.peak_rss_added_mb()
        runner.close()
    elif reset and before is not None:
        report.peak_rss_added_mb = (rss_mb("VmHWM") or before) - before
    return report


def profile_directory(directory: str | Path, *, vocab_size: int | None = None, log=None, on_model=None,
                      **kwargs) -> list[RuntimeProfile]:
    """Profile every runnable folder at or below ``directory`` (``workbench.run.locate.find_runnable``), one after
    another, each named by its path below ``directory``. ``log(line)`` gets what is skipped (default: stderr, where
    the CLI says it; a page shows it as a note, not as an error); ``on_model(i, n, name)`` before each model."""
    import sys
    say = log or (lambda line: print(f"profile: {line}", file=sys.stderr))
    root = Path(directory)
    out, failed = [], []
    for conv in sorted(root.rglob(CONVERSION_FILE)):
        target = not_runnable_here(conv.parent)
        if target is not None:
            say(f"skipped '{conv.parent}': a {target} conversion, which does not run here")
    runnable = list(find_runnable(root))
    for i, found in enumerate(runnable):
        rel = found.folder.relative_to(root)
        if on_model is not None:
            on_model(i, len(runnable), str(rel))
        try:
            out.append(profile_runtime(str(rel) if str(rel) != "." else root.name, found.folder,
                                       vocab_size=vocab_size, **kwargs))
        except WorkbenchError as e:  # one bad folder (a crashed engine included) does not cost the others theirs
            failed.append((found.folder, e))
    if not out and failed:
        raise failed[0][1]  # nothing profiled: the (first) folder's own one-line error
    for folder, e in failed:
        say(f"skipped '{printable(folder)}': {printable(str(e))}")
    return out


def build_candidates(model="demo", out_dir: str | Path = "out/profile", *, plan=None, bits: int | None = 4,
                     candidates: Sequence[str] = DEFAULT_CANDIDATES, progress: bool = False) -> Path:
    """Export the float model and convert it for each target into ``out_dir/<candidate>``, ready to profile.

    Conversions here skip their accuracy evaluation (``workbench convert`` does that); this only
    builds the files whose speed and size are compared.
    """
    from ..onnx.export import export_onnx
    unknown = [c for c in candidates if c != "float" and c not in CONVERT_TARGETS]
    if unknown:
        raise WorkbenchError(f"unknown candidate(s) {unknown}; choose from float, {', '.join(CONVERT_TARGETS)}")
    out = Path(out_dir)
    prepared = prepare_models(model, plan=plan, bits=None if plan is not None else bits, progress=progress)
    for c in candidates:
        if c == "float":
            export_onnx(prepared.float_lm, out / "float", check=False)
        else:
            convert(model, c, out / c, prepared=prepared, evaluate_outputs=False, calibration_samples=4,
                    calibration_seq_len=64, progress=progress)
    return out


# -- this host's own bound ------------------------------------------------------------------------------
BANDWIDTH_STEP = "host-bandwidth"
BANDWIDTH_METHOD = "numpy float32 max over 256 MiB, one thread, fastest of 5 after a warm-up (v2)"


def measure_read_bandwidth(nbytes: int = 256 * 2 ** 20, repeats: int = 5) -> float:
    """This machine's read bandwidth in GB/s (1e9 bytes/s): one thread reducing (SIMD max) a buffer far larger
    than its caches, fastest of ``repeats`` (a bound is what the memory can give, not its average under load).
    A float sum is slower than the memory on some CPUs (it measured half of this max here), so it is not used."""
    a = np.ones(nbytes // 4, dtype=np.float32)  # written once, so every page is resident before timing
    a.max()
    best = min(_timed(a.max) for _ in range(repeats))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _cpu_model() -> str:
    import platform
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache (Linux sysfs), or None: a decode graph smaller than it can beat the DRAM bound."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text(encoding="ascii").strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else None


def host_bandwidth(workspace=None, *, force: bool = False) -> dict:
    """This host's read bandwidth, measured once and cached in the workspace (keyed by host and CPU model):
    ``{"read_gbps", "method", "host", "cpu", "measured"}``. ``force`` measures again."""
    import platform

    ws = workspace if workspace is not None else Workspace()
    inputs = {"host": platform.node(), "cpu": _cpu_model(), "method": BANDWIDTH_METHOD}

    def compute(_partial: Path) -> dict:
        return {"read_gbps": measure_read_bandwidth(), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    art = ws.get_or_compute(BANDWIDTH_STEP, inputs, compute, force=force)
    return {**inputs, **art.manifest["result"], "artifact": str(art.path)}


# -- a vision-language model's folder, run by torch ----------------------------------------------------------------
@dataclass
class VisionProfile:
    """One picture through a VLM here: the vision encoder per image, the first token with the image's tokens
    (the encoder plus the prefill of prompt + image tokens), decode tokens/s after it."""

    name: str
    image: tuple[int, int]  # the picture as given to the processor (width, height)
    image_tokens: int
    prompt_tokens: int  # the whole prompt, image tokens included
    threads: int
    repeats: int
    encoder_ms: float
    first_token_ms: float
    decode_tokens_per_second: float
    size_bytes: int
    runtime: str = "torch (CPU)"
    notes: list[str] = field(default_factory=list)

    @property
    def prefill_ms(self) -> float:
        """The language part's share of the first token: prompt + image tokens, after the encoder."""
        return max(0.0, self.first_token_ms - self.encoder_ms)

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_ms": self.prefill_ms}

    def summary(self) -> str:
        return (f"{self.name} ({self.runtime}): image {self.image[0]}x{self.image[1]} -> {self.image_tokens} tokens; "
                f"encoder {self.encoder_ms:.1f} ms; first token {self.first_token_ms:.1f} ms for {self.prompt_tokens} "
                f"tokens; decode {self.decode_tokens_per_second:.0f} tok/s")


def is_vision_folder(path: str | Path) -> bool:
    """A model folder (float or `workbench quantize` output) whose config describes a vision-language model."""
    import json
    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and is_vision_config(json.loads(cfg.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def _profile_image(lm, size: tuple[int, int] | None):
    """The first held-out demo picture at ``size`` (default: the size the model's family is exported at, or the
    picture's own where the processor fixes the pixel count)."""
    image = read_image(sorted((DEMO_VL_DATA_DIR / "images").glob("*.png"))[0])
    proc = lm.processor.image_processor
    bounds = getattr(proc, "size", None) or {}
    fixed = bounds.get("shortest_edge") is not None and bounds.get("shortest_edge") == bounds.get("longest_edge")
    size = size or (image.size if fixed else DEFAULT_IMAGE.get(lm.model.config.model_type, image.size))
    return image if tuple(image.size) == tuple(size) else image.resize(tuple(size))


def image_features(model, inputs: dict):
    """The vision encoder's (and projector's) output for a processed picture: one tensor, whatever the family."""
    import torch
    pixel = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    out = model.model.get_image_features(**pixel)
    out = getattr(out, "pooler_output", out)
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in out]) if isinstance(out, (list, tuple)) else out


def time_vision_model(model, inputs: dict, *, pad_token_id: int = 0, decode_steps: int = 16,
                      repeats: int = 5) -> tuple[float, float, float]:
    """(encoder ms per picture, first token ms with its tokens, decode tokens/s) of a VLM in torch, each the median
    of ``repeats`` after a warm-up; decode is generating N+1 tokens minus generating 1."""
    import torch
    model.eval()
    with torch.inference_mode():
        encoder = _median_ms(lambda: image_features(model, inputs), repeats)
        first = _median_ms(lambda: model(**inputs, use_cache=True), repeats)

        def generate(n):
            return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=pad_token_id)
        one = _median_ms(lambda: generate(1), repeats)
        many = _median_ms(lambda: generate(decode_steps + 1), repeats)
    if many <= one:
        raise WorkbenchError("profile: decode took no measurable time over the first token; raise the decode steps")
    return encoder, first, decode_steps / ((many - one) / 1000)


def profile_vision_model(path: str | Path, *, image_size: tuple[int, int] | None = None, decode_steps: int = 16,
                         repeats: int = 5, threads: int = 1, question: str = "What colour is the shape?"
                         ) -> VisionProfile:
    """Time a VLM folder's vision encoder on one picture, the first token with its tokens, and decode, with torch
    on this CPU, each the median of ``repeats`` after a warm-up. A folder whose weights miss the vision part is
    refused by the loader in one line."""
    import torch
    if repeats < 1 or decode_steps < 1:
        raise WorkbenchError("profile: repeats and decode steps must be at least 1")
    if not is_vision_folder(path):
        raise WorkbenchError(f"'{path}' is not a vision-language model folder (its config.json has no vision_config)")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lm = load_model(str(path), dtype="float32")
        if lm.processor is None:
            raise WorkbenchError(f"'{path}' has no tokenizer, so no image prompt can be built: copy its tokenizer in")
        image = _profile_image(lm, image_size)
        inputs = lm.processor(image, question)
        n_image = int((inputs["input_ids"] == int(lm.model.config.image_token_id)).sum())
        encoder, first, tps = time_vision_model(lm.model, inputs, pad_token_id=lm.tokenizer.pad_token_id or 0,
                                                decode_steps=decode_steps, repeats=repeats)
    finally:
        torch.set_num_threads(previous)
    notes = ["torch on this CPU: ranks choices here, does not predict a device (`workbench project` does)"]
    grid = inputs.get("image_grid_thw")
    if grid is not None:
        patch = int(lm.processor.image_processor.patch_size)
        resized = (int(grid[0, 2]) * patch, int(grid[0, 1]) * patch)
        if resized != tuple(image.size):
            notes.append(f"the processor resizes the {image.size[0]}x{image.size[1]} picture to {resized[0]}x{resized[1]}"
                         f" (its pixel bounds and multiples of {patch * int(lm.processor.image_processor.merge_size)})")
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    return VisionProfile(Path(path).name, tuple(image.size), n_image, int(inputs["input_ids"].shape[1]), threads,
                         repeats, encoder, first, tps, size, notes=notes)
