"""Stream what a model writes after a prompt, a token at a time, and how fast it writes it.

    model = open_model("out/int4")          # a `workbench convert` output; "demo" or any model directory too
    gen = model.stream("A class definition", max_new_tokens=48)
    for piece in gen:
        print(piece.text, end="", flush=True)
    gen.stats.tokens_per_second, gen.stats.prefill_seconds, gen.stats.stop_reason

Runtimes: a PyTorch ``LoadedModel`` (float, or a ``workbench quantize`` output whose integer layers
compute from their codes) with its KV cache in a ``DynamicCache``; a ``workbench export`` or
``convert`` output through the runner its target registers (``workbench.run.locate.open_runner``:
``OnnxCausalLM`` for ort-int4 and ort-qdq graphs, ``MnnCausalLM`` for mnn, onnxruntime-genai's own
runtime for an ort-genai folder). The graph runners share one shape (``run_prefill``, then
``run_decode`` with the KV cache), onnxruntime-genai hands out its own steps (``steps()``), so one
loop, ``runtime.stream.stream_tokens``, drives every runtime; ``OnnxCausalLM.generate_greedy`` is
that loop too. A converted model's tokenizer,
end-of-sequence tokens and length limit come from the model it was converted from
(``conversion.json``).

Greedy by default; ``Sampling(temperature, top_k, seed)`` draws instead, reproducibly. Text is
detokenized incrementally: the whole continuation is decoded at each token and only the new suffix
is emitted, held back while it ends inside a character that spans several tokens. Tokens per
second count the tokens after the first over the time spent computing them; prefill, which yields
the first token, is timed apart, and the time a caller spends between tokens (drawing them) is not
counted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from ..errors import ModelLoadError, WorkbenchError, printable
from ..model.load import (LoadedModel, load_model, load_tokenizer_from, quantized_source, resolve_model_path,
                          TOKENIZER_FILES)
from ..runtime.stream import GenerationStats, Sampling, stream_tokens, torch_threads
from ..evaluation.images import read_image
from .locate import conversion_record, describe_files, locate, runnable_targets

__all__ = ["Piece", "Generation", "TextGenerator", "IncrementalText", "open_model",
           "encode_prompt", "DEFAULT_MAX_NEW_TOKENS"]

DEFAULT_MAX_NEW_TOKENS = 64


class IncrementalText:
    """The text of a growing token sequence, handed out as new suffixes of whole characters.

    Each ``add`` decodes the whole continuation (after a few prompt tokens, so a tokenizer that drops a
    word's leading space at the start of a text keeps it) and returns what is new; while the text ends
    in an unfinished character (U+FFFD from a partial byte sequence) nothing is returned. ``flush``
    returns what is left at the end.
    """

    ANCHOR = 4  # prompt tokens decoded in front of the continuation

    def __init__(self, tokenizer, prompt: Sequence[int] = ()):
        self.tokenizer, self.ids, self.emitted = tokenizer, [], 0
        self.anchor = [int(t) for t in prompt][-self.ANCHOR:]
        self.anchor_text = self._decode(self.anchor) if self.anchor else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self) -> str:
        if self.anchor:
            full = self._decode(self.anchor + self.ids)
            if full.startswith(self.anchor_text):
                return full[len(self.anchor_text):]
        return self._decode(self.ids)

    def _take(self, text: str) -> str:
        new = text[self.emitted:] if len(text) > self.emitted else ""
        self.emitted = max(self.emitted, len(text))
        return new

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        text = self._text()
        return "" if text.endswith("\ufffd") else self._take(text)

    def flush(self) -> str:
        return self._take(self._text())


@dataclass(frozen=True)
class Piece:
    """One step of a stream: the token made and the text it adds (possibly empty). ``token`` is None for
    the text held back to the end (a character the last tokens left unfinished)."""

    token: int | None
    text: str


class Generation:
    """One streaming generation: iterate for ``Piece``s; ``text``, ``tokens`` and ``stats`` fill as it goes."""

    def __init__(self, model: "TextGenerator", prompt_ids: Sequence[int], max_new_tokens: int,
                 sampling: Sampling | None, runner: object = None):
        self.model, self.prompt_ids = model, [int(t) for t in prompt_ids]
        self.runner = runner if runner is not None else model.runner
        self.max_new_tokens, self.sampling = max_new_tokens, sampling
        self.stats = GenerationStats(len(self.prompt_ids))
        self.tokens: list[int] = []
        self.text = ""
        self._started = False

    def __iter__(self) -> Iterator[Piece]:
        if self._started:
            raise RuntimeError("a Generation streams once; call stream() again for another")
        self._started = True
        m = self.model
        text = IncrementalText(m.tokenizer, self.prompt_ids)
        for token in stream_tokens(self.runner, self.prompt_ids, self.max_new_tokens, sampling=self.sampling,
                                   eos_ids=m.eos_ids, max_positions=m.max_positions, threads=m.threads,
                                   stats=self.stats):
            self.tokens.append(token)
            piece = Piece(token, text.add(token))
            self.text += piece.text
            yield piece
        rest = text.flush()
        if rest:
            self.text += rest
            yield Piece(None, rest)

    def run(self) -> "Generation":
        """Stream to the end without looking at the pieces."""
        for _ in self:
            pass
        return self


def encode_prompt(tokenizer, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text``: as the model's first user turn through its chat template (``chat``), or as is."""
    if not text.strip():
        raise WorkbenchError("the prompt is empty: type some text to continue")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise WorkbenchError("this model's tokenizer has no chat template: untick 'chat' to continue plain text")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(text)["input_ids"]
    return [int(t) for t in ids]


@dataclass
class TextGenerator:
    """A model that continues text: its runner, tokenizer, end-of-sequence tokens and position limit."""

    runner: object  # a PyTorch model, OnnxCausalLM, MnnCausalLM or GenaiCausalLM
    tokenizer: object
    path: Path
    runtime: str  # "PyTorch", "onnxruntime", "MNN", "onnxruntime-genai"
    name: str
    eos_ids: tuple[int, ...] = ()
    max_positions: int | None = None
    threads: int | None = None  # PyTorch's threads while generating (graph runners got theirs when loaded)
    source: Path | None = None  # the float model it was converted or quantized from; None for a float model
    images: object = None  # a vision-language model's picture-and-question preprocessing (VisionInputs); else None

    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               sampling: Sampling | None = None, chat: bool = False, image=None) -> Generation:
        """A generation of up to ``max_new_tokens`` after ``prompt`` (text, or token ids); runs as it is iterated.

        ``image`` (a PIL image or a path) asks a vision-language model about a picture: the prompt is the
        question, put after the picture through the model's chat template."""
        if image is not None:
            return self._stream_image(prompt, image, max_new_tokens, sampling)
        ids = encode_prompt(self.tokenizer, prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        return Generation(self, ids, max_new_tokens, sampling)

    def _stream_image(self, prompt, image, max_new_tokens: int, sampling: Sampling | None) -> Generation:
        if self.images is None:
            raise WorkbenchError(f"'{self.name}' has no vision encoder: it cannot take an image (drop --image, or "
                                 "pass a vision-language model such as demo-vl)")
        if not isinstance(prompt, str):
            raise WorkbenchError("a question about an image must be text, not token ids")
        if isinstance(image, (str, Path)):
            image = read_image(image)
        if hasattr(self.runner, "picture_steps"):  # a runtime that reads the picture itself (MNN-LLM's engine)
            runner, ids = self.runner.picture_steps(self.images, image, prompt)
            return Generation(self, ids, max_new_tokens, sampling, runner=runner)
        inputs = self.images(image, prompt)
        ids = [int(t) for t in inputs.pop("input_ids")[0]]
        inputs.pop("attention_mask", None)
        return Generation(self, ids, max_new_tokens, sampling, runner=_ImageRunner(self.runner, inputs, self.threads))

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Generation:
        """``stream`` run to the end: ``.text``, ``.tokens``, ``.stats``."""
        return self.stream(prompt, **kwargs).run()


class _ImageRunner:
    """A PyTorch vision-language model with one picture: the prefill takes the prompt and the picture's pixels,
    each later step one token and the KV cache (``steps()``, the shape ``stream_tokens`` drives)."""

    def __init__(self, model, image_inputs: dict, threads: int | None):
        self.model, self.image_inputs, self.threads = model, image_inputs, threads

    def steps(self, total: int) -> "_ImageSteps":
        return _ImageSteps(self.model, self.image_inputs, self.threads)


class _ImageSteps:
    def __init__(self, model, image_inputs: dict, threads: int | None):
        self.model, self.image_inputs, self.threads, self.cache = model, image_inputs, threads, None
        self.device = next(model.parameters()).device

    def _run(self, ids: list[int], **extra):
        """One forward pass; a single unpadded sequence needs no attention mask, and after the prefill the model
        places each token from the cache length and the position offset the picture left (Qwen's rope deltas)."""
        import torch
        with torch.inference_mode(), torch_threads(self.threads):
            out = self.model(input_ids=torch.tensor([ids], device=self.device), past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1, **extra)
        self.cache = out.past_key_values
        return out.logits[0, -1].float().cpu().numpy()

    def start(self, prompt: list[int]):
        from transformers import DynamicCache
        self.cache = DynamicCache()
        return self._run(prompt, **{k: v.to(self.device) for k, v in self.image_inputs.items()})

    def step(self, token: int, position: int | None = None):
        return self._run([token])


def _int_ids(value) -> list[int]:
    """A config's ``eos_token_id``: one id, a list of them, or nothing."""
    if isinstance(value, int):
        return [value]
    return [t for t in value if isinstance(t, int)] if isinstance(value, (list, tuple)) else []


def _model_settings(*docs: dict, tokenizer=None) -> tuple[tuple[int, ...], int | None]:
    """End-of-sequence ids (from a config, a generation config and the tokenizer) and the number of positions."""
    eos: list[int] = []
    for value in [d.get("eos_token_id") for d in docs] + [getattr(tokenizer, "eos_token_id", None)]:
        eos += [t for t in _int_ids(value) if t not in eos]
    positions = next((d["max_position_embeddings"] for d in docs
                      if isinstance(d.get("max_position_embeddings"), int)), None)
    return tuple(eos), positions


def _json_docs(model_dir: Path) -> list[dict]:
    docs = []
    for name in ("config.json", "generation_config.json"):
        try:
            doc = json.loads((model_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    return docs


def _conversion_source(directory: Path) -> tuple[Path | None, str | None]:
    """(the float model a conversion came from, its target) from ``conversion.json``; Nones when not said. A
    folder without one that its parent's conversion wrote (``qnn``'s ``htp-<device>``) is named by the parent's."""
    doc = conversion_record(directory)
    if doc is None and not (directory / "conversion.json").exists():
        parent = conversion_record(directory.parent)
        files = parent.get("files") if parent is not None else None
        wrote_it = isinstance(files, list) and any(
            isinstance(f, dict) and isinstance(f.get("path"), str) and Path(f["path"]).parent.name == directory.name
            for f in files)
        doc = parent if wrote_it else None
    if doc is None:
        return None, None
    source = (doc.get("quantized_model") or {}).get("source_model")
    target = doc.get("target")
    return (Path(source) if source else None), (printable(target) if isinstance(target, str) else None)


def _corrupt_conversion_record(directory: Path) -> str | None:
    """Why ``directory``'s ``conversion.json`` cannot be read as a conversion record, or None (absent or fine)."""
    path = directory / "conversion.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except ValueError as e:
        return f"not JSON: {e}"
    return None if isinstance(doc, dict) else f"a JSON {type(doc).__name__}, not an object"


def _from_loaded(lm: LoadedModel, threads: int | None) -> TextGenerator:
    tokenizer = lm.tokenizer or load_tokenizer_from(lm.path)
    gen_cfg = getattr(lm.model, "generation_config", None)
    eos, positions = _model_settings(lm.model.config.to_dict(), lm.text_config.to_dict(),
                                     gen_cfg.to_dict() if gen_cfg is not None else {}, tokenizer=tokenizer)
    kind = f"{lm.quantized.method} quantized" if lm.quantized is not None else "float"
    source = quantized_source(lm.path) if lm.quantized is not None else None
    return TextGenerator(lm.model, tokenizer, Path(lm.path), "PyTorch", f"{Path(lm.name).name} ({kind}, PyTorch)", eos,
                         positions, threads, Path(source) if source else None, images=lm.processor)


def open_model(model: str | Path | LoadedModel, *, tokenizer=None, source: str | Path | None = None,
               threads: int | None = 1) -> TextGenerator:
    """A model to generate with, from any of: a ``LoadedModel``; ``demo`` or a model directory (float or a
    ``workbench quantize`` output, run by PyTorch); a ``workbench convert`` or ``export`` output folder, or
    its first file (run by the runner its target registers: ``workbench.run.locate.open_runner``). Every
    runtime computes on ``threads`` threads (None: its own default).

    A converted folder's tokenizer, end-of-sequence tokens and positions come from the model its
    ``conversion.json`` names, else from ``source`` (the float model of a folder that names none, such
    as a ``workbench export`` output), else from the folder itself when it holds its tokenizer (an
    ort-genai folder), else from ``tokenizer`` alone.
    """
    if isinstance(model, LoadedModel):
        return _from_loaded(model, threads)
    p = resolve_model_path(model)
    if not p.exists():
        raise ModelLoadError(f"'{p}' does not exist: pass a model directory, 'demo', or a `workbench convert` output")
    found = locate(p)  # a folder or file with part of a target's files is an error naming what is missing
    if found is None:
        if (p / "config.json").is_file() or (p / "quantization.json").is_file():
            return _from_loaded(load_model(model), threads)
        _, target = _conversion_source(p)
        names = ", ".join(t.name for t in runnable_targets())
        what = (f"is a {target} conversion, which does not run here: pick an output of {names}" if target else
                "holds no model to generate with: pass a model directory (config.json), or a `workbench convert` / "
                f"`workbench export` output ({describe_files()})")
        raise ModelLoadError(f"'{p}' {what}")
    folder = found.folder
    recorded, target = _conversion_source(folder)
    src = recorded if recorded is not None else resolve_model_path(source) if source is not None else None
    own_tokenizer = any((folder / f).is_file() for f in TOKENIZER_FILES)
    if not (src is not None and (src / "config.json").is_file()) and not own_tokenizer and tokenizer is None:
        corrupt = _corrupt_conversion_record(folder)
        if corrupt:
            raise ModelLoadError(f"'{folder / 'conversion.json'}' is corrupt ({corrupt}), so it cannot say which model "
                                 "the folder was converted from: pass the float model's directory with --source "
                                 "(`workbench generate FOLDER --source MODEL_DIR`), or convert again")
        raise ModelLoadError(f"'{folder}' does not name the model it was converted from (no conversion.json naming "
                             "one, or that model is gone): pass the float model's directory as source")
    runner = found.open(threads=threads)
    if src is not None and (src / "config.json").is_file():
        tokenizer = tokenizer or load_tokenizer_from(src)
        eos, positions = _model_settings(*_json_docs(src), tokenizer=tokenizer)
    elif own_tokenizer:  # the folder is whole: its tokenizer files, and settings its runner reads (genai_config.json)
        tokenizer = tokenizer or load_tokenizer_from(folder)
        settings = [runner.generation_settings()] if hasattr(runner, "generation_settings") else _json_docs(folder)
        eos, positions = _model_settings(*settings, tokenizer=tokenizer)
    else:
        eos, positions = _model_settings(tokenizer=tokenizer)
    limit = getattr(runner, "max_length", None)  # a runtime with its own length limit (onnxruntime-genai's)
    if limit is not None:
        positions = min(positions or limit, limit)
    runtime = getattr(runner, "runtime", found.target.name)
    kind = target or (found.files[0] if found.files else found.target.name)
    # a runtime that reads pictures itself is asked as its float model is (its chat template, its image tokens)
    images = runner.picture_inputs(src, tokenizer) if hasattr(runner, "picture_inputs") and src is not None else None
    return TextGenerator(runner, tokenizer, folder, runtime, f"{folder.name} ({kind}, {runtime})",
                         eos, positions, threads, src, images=images)
