"""llama.cpp's own multimodal runtime (``llama-mtmd-cli``, its ``tools/mtmd``) answering a question about a picture
from the workbench's ``model.gguf`` + ``mmproj.gguf``, with the times it reports.

    cli = find_mtmd_cli()                  # $LLAMA_CPP_DIR (the tree, its build/bin, or a bin folder), else None
    a = run_mtmd(cli, "Z/model.gguf", "Z/mmproj.gguf", "img.png", "What colour is the shape?", image_tokens=(4, 4))
    a.text, a.encode_ms, a.decode_tokens_per_second

llama.cpp is optional: nothing here is needed to write the GGUFs, and tests skip without the binary.
Greedy (``--temp 0``), one thread by default (ggml's worker threads spin while they wait: on a shared 2-core machine
two threads made the demo VLM's decode 1 tok/s where one thread gave 5,000), the prompt through the GGUF's own
chat template (``--jinja``), the picture at the token bounds the model's image processor has
(``--image-min-tokens`` / ``--image-max-tokens``: llama.cpp's Qwen-VL default floor of 8 tokens would resize a small
picture the workbench feeds at its own size).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import PlanError
from .processes import die_with_parent_fn

__all__ = ["MTMD_CLI", "find_mtmd_cli", "MtmdAnswer", "run_mtmd", "image_token_bounds", "parse_mtmd_times",
           "read_embedding_dump"]

MTMD_CLI = "llama-mtmd-cli"
# one picture's encode: "mtmd batch encoding done in N ms" (2026), "image slice encoded in N ms" (2025)
_ENCODE = re.compile(r"(?:mtmd batch encoding done|image slice encoded) in (\d+(?:\.\d+)?) ms")
_IMAGE_DECODE = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+(?:\.\d+)?) ms")
_PERF = re.compile(r"llama_perf_context_print:\s+(prompt eval|eval) time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)"
                   r".*?([\d.]+|inf) tokens per second")


# llama-mtmd-cli's log goes through a writer thread that, in the 2026 build tried here, now and then stops before the
# last lines (about 1 run in 6: the answer and the timers missing, exit status 0); a run whose log lacks the closing
# timer line is repeated
_WHOLE_LOG = "llama_perf_context_print:        eval time"
ATTEMPTS = 4


def find_mtmd_cli(where: str | Path | None = None) -> Path | None:
    """The ``llama-mtmd-cli`` binary under ``where`` or ``$LLAMA_CPP_DIR`` (the tree, its ``build/bin`` or a bin
    folder), or None when there is none."""
    where = where or os.environ.get("LLAMA_CPP_DIR")
    if not where:
        return None
    d = Path(where).expanduser()
    for cand in (d, d / "bin", d / "build" / "bin"):
        if (cand / MTMD_CLI).is_file() and os.access(cand / MTMD_CLI, os.X_OK):
            return cand / MTMD_CLI
    return None


def image_token_bounds(image_processor) -> tuple[int, int] | None:
    """(fewest, most) merged image tokens a Qwen-VL image processor allows (its min / max pixels over the area one
    token covers), as llama.cpp's ``--image-min-tokens`` / ``--image-max-tokens`` take them; None without bounds."""
    size = getattr(image_processor, "size", None) or {}
    lo = size.get("shortest_edge", getattr(image_processor, "min_pixels", None))
    hi = size.get("longest_edge", getattr(image_processor, "max_pixels", None))
    patch, merge = getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None)
    if not (lo and hi and patch and merge):
        return None
    area = (int(patch) * int(merge)) ** 2
    return max(1, int(lo) // area), max(1, int(hi) // area)


@dataclass
class MtmdAnswer:
    """One answer of llama.cpp's multimodal runtime and the times it printed."""

    text: str
    encode_ms: float | None  # the vision encoder + projector on the (last) picture (llama.cpp's own timer)
    image_decode_ms: float | None  # the language model's prefill of the image tokens
    prompt_tokens_per_second: float | None
    decode_tokens_per_second: float | None
    decode_tokens: int
    seconds: float  # the whole process, load included
    embeddings: np.ndarray | None = field(default=None, repr=False)  # [image tokens, LM hidden]: clip's output
    encodes_ms: list[float] = field(default_factory=list)  # every picture's encode, in order (one per --image)
    attempts: int = 1  # runs it took to get a whole log (see run_mtmd)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "embeddings"}


def parse_mtmd_times(log: str) -> dict:
    """The times ``llama-mtmd-cli`` prints: image encode and image-token prefill (ms), prompt and decode tok/s."""
    enc, dec = _ENCODE.findall(log), _IMAGE_DECODE.findall(log)
    perf = {kind: (float(ms), int(n), float(tps) if tps != "inf" else None) for kind, ms, n, tps in _PERF.findall(log)}
    return {"encode_ms": float(enc[-1]) if enc else None, "encodes_ms": [float(x) for x in enc],
            "image_decode_ms": float(dec[-1]) if dec else None,
            "prompt_tokens_per_second": perf["prompt eval"][2] if "prompt eval" in perf else None,
            "decode_tokens_per_second": perf["eval"][2] if "eval" in perf else None,
            "decode_tokens": perf["eval"][1] if "eval" in perf else 0}


def read_embedding_dump(path: Path) -> np.ndarray:
    """The image embeddings llama.cpp's clip writes where ``MTMD_DEBUG_EMBEDDINGS`` names a file: two int32
    (tokens, width), then tokens x width float32."""
    raw = Path(path).read_bytes()
    n, width = np.frombuffer(raw[:8], dtype="<i4")
    data = np.frombuffer(raw[8:], dtype="<f4")
    if n <= 0 or width <= 0 or data.size != n * width:
        raise PlanError(f"'{path}' is not an image-embedding dump of llama.cpp's clip ({data.size} values for "
                        f"{n} x {width})")
    return data.reshape(int(n), int(width)).copy()


def run_mtmd(cli: Path, model: Path, mmproj: Path, image: Path | list[Path], prompt: str, *, max_tokens: int = 8,
             threads: int = 1, image_tokens: tuple[int, int] | None = None, ctx: int = 512,
             timeout: float = 600, embeddings: bool = False, ignore_eos: bool = False) -> MtmdAnswer:
    """Ask llama.cpp's multimodal CLI about ``image``, greedily; its answer text (stdout) and times (its log);
    with ``embeddings``, also the image embeddings its vision encoder and projector computed (clip's own dump).
    Several pictures (a list) go in one prompt, each encoded in turn: the later ones time a warm encoder;
    ``ignore_eos`` writes all ``max_tokens`` (a decode rate over more than the few tokens of an answer).
    Verbose (``-v``): its times are printed at that level only."""
    images = [image] if isinstance(image, (str, Path)) else list(image)
    for p in (model, mmproj, *images):
        if not Path(p).is_file():
            raise PlanError(f"'{p}' does not exist; llama-mtmd-cli needs the model GGUF, the mmproj GGUF and a picture")
    cmd = [str(cli), "-m", str(model), "--mmproj", str(mmproj), *[a for p in images for a in ("--image", str(p))],
           "-p", prompt, "-n",
           str(max_tokens), "--temp", "0", "-t", str(threads), "-c", str(ctx), "--jinja", "--no-mmproj-offload", "-v"]
    if ignore_eos:
        cmd.append("--ignore-eos")
    if image_tokens:
        cmd += ["--image-min-tokens", str(image_tokens[0]), "--image-max-tokens", str(image_tokens[1])]
    with tempfile.TemporaryDirectory(prefix="workbench-mtmd-") as tmp:
        env = {**os.environ, "MTMD_DEBUG_EMBEDDINGS": str(Path(tmp) / "embd.bin")} if embeddings else None
        for attempt in range(1, ATTEMPTS + 1):
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                   preexec_fn=die_with_parent_fn(), errors="replace", env=env)
            except subprocess.TimeoutExpired:
                raise PlanError(f"llama-mtmd-cli did not answer within {timeout:.0f} s") from None
            seconds = time.perf_counter() - t0
            if p.returncode != 0:
                tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
                raise PlanError(f"llama-mtmd-cli failed (exit {p.returncode}): {tail}")
            if _WHOLE_LOG in p.stderr:
                break
        else:
            raise PlanError(f"llama-mtmd-cli exited {ATTEMPTS} times before writing its closing timers; its answer "
                            "and times are incomplete")
        dump = Path(tmp) / "embd.bin"
        if embeddings and not dump.is_file():
            raise PlanError("llama-mtmd-cli wrote no image embeddings (MTMD_DEBUG_EMBEDDINGS): this llama.cpp predates "
                            "the dump; build a 2026 llama.cpp")
        emb = read_embedding_dump(dump) if embeddings else None
    times = parse_mtmd_times(p.stderr + p.stdout)
    return MtmdAnswer(p.stdout.strip(), seconds=seconds, embeddings=emb, attempts=attempt, **times)
