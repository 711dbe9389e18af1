"""Stream what a model writes after a prompt, a token at a time, and how fast it writes it.

    model = open_model("out/int4")          # a `workbench convert` output; "demo" or any model directory too
    gen = model.stream("A class definition", max_new_tokens=48)
    for piece in gen:
        print(piece.text, end="", flush=True)
    gen.stats.tokens_per_second, gen.stats.prefill_seconds, gen.stats.stop_reason

Runtimes: a PyTorch ``LoadedModel`` (float, or a ``workbench quantize`` output whose integer layers
compute from their codes) with its KV cache in a ``DynamicCache``; ONNX prefill/decode graphs
(``workbench export`` and ``convert`` outputs: ort-int4, ort-qdq) through ``OnnxCausalLM``; MNN
graphs (``convert --target mnn``) through ``MnnCausalLM``; an ``ort-genai`` folder through
onnxruntime-genai's runtime (``GenaiCausalLM``: its generator keeps the KV cache). The graph runners
share one shape (``run_prefill``, then ``run_decode`` with the KV cache), onnxruntime-genai hands out
its own steps (``steps()``), so one loop, ``stream_tokens``, drives every runtime;
``OnnxCausalLM.generate_greedy`` is that loop too. A converted model's tokenizer,
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

from .errors import ModelLoadError, WorkbenchError
from .models import LoadedModel
from .runtime.stream import GenerationStats, Sampling, stream_tokens

__all__ = ["Piece", "Generation", "TextGenerator", "IncrementalText", "open_model",
           "encode_prompt", "find_graphs", "GRAPH_NAMES", "DEFAULT_MAX_NEW_TOKENS"]

DEFAULT_MAX_NEW_TOKENS = 64
GRAPH_NAMES = (("prefill.onnx", "onnxruntime"), ("prefill.qdq.onnx", "onnxruntime"), ("prefill.mnn", "MNN"),
               ("model.onnx", "onnxruntime-genai"))  # the last only beside a genai_config.json (an ort-genai folder)
GENAI = "onnxruntime-genai"


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
                 sampling: Sampling | None):
        self.model, self.prompt_ids = model, [int(t) for t in prompt_ids]
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
        for token in stream_tokens(m.runner, self.prompt_ids, self.max_new_tokens, sampling=self.sampling,
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

    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               sampling: Sampling | None = None, chat: bool = False) -> Generation:
        """A generation of up to ``max_new_tokens`` after ``prompt`` (text, or token ids); runs as it is iterated."""
        ids = encode_prompt(self.tokenizer, prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        return Generation(self, ids, max_new_tokens, sampling)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Generation:
        """``stream`` run to the end: ``.text``, ``.tokens``, ``.stats``."""
        return self.stream(prompt, **kwargs).run()


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


def find_graphs(directory: str | Path) -> tuple[Path, Path | None, str] | None:
    """``(prefill, decode or None, runtime)`` of the graphs directly in ``directory``, or None when there are none."""
    d = Path(directory)
    for name, runtime in GRAPH_NAMES:
        prefill = d / name
        if runtime == GENAI and not (d / "genai_config.json").is_file():
            continue
        if prefill.is_file():
            decode = prefill.with_name(name.replace("prefill", "decode"))
            return prefill, decode if decode.is_file() else None, runtime
    return None


def _genai_settings(folder: Path) -> dict:
    """End-of-sequence ids and positions of an ort-genai folder, from its ``genai_config.json``."""
    try:
        model = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))["model"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelLoadError(f"'{folder / 'genai_config.json'}' is not onnxruntime-genai's config: convert again") \
            from None
    return {"eos_token_id": model.get("eos_token_id"), "max_position_embeddings": model.get("context_length")}


def _conversion_source(directory: Path) -> tuple[Path | None, str | None]:
    """(the float model a conversion came from, its target) from ``conversion.json``; Nones when not said."""
    try:
        doc = json.loads((directory / "conversion.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None
    if not isinstance(doc, dict):
        return None, None
    source = (doc.get("quantized_model") or {}).get("source_model")
    return (Path(source) if source else None), doc.get("target")


def _from_loaded(lm: LoadedModel, threads: int | None) -> TextGenerator:
    from .models import quantized_source, load_tokenizer_from
    tokenizer = lm.tokenizer or load_tokenizer_from(lm.path)
    gen_cfg = getattr(lm.model, "generation_config", None)
    eos, positions = _model_settings(lm.model.config.to_dict(), gen_cfg.to_dict() if gen_cfg is not None else {},
                                     tokenizer=tokenizer)
    kind = f"{lm.quantized.method} quantized" if lm.quantized is not None else "float"
    source = quantized_source(lm.path) if lm.quantized is not None else None
    return TextGenerator(lm.model, tokenizer, Path(lm.path), "PyTorch", f"{Path(lm.name).name} ({kind}, PyTorch)", eos,
                         positions, threads, Path(source) if source else None)


def open_model(model: str | Path | LoadedModel, *, tokenizer=None, source: str | Path | None = None,
               threads: int | None = 1) -> TextGenerator:
    """A model to generate with, from any of: a ``LoadedModel``; ``demo`` or a model directory (float or a
    ``workbench quantize`` output, run by PyTorch); a ``workbench convert`` or ``export`` output folder, or
    its prefill graph (run by onnxruntime or MNN). Every runtime computes on ``threads`` threads (None:
    its own default).

    A graph folder's tokenizer, end-of-sequence tokens and positions come from the model its
    ``conversion.json`` names, else from ``source`` (the float model of a folder that names none, such
    as a ``workbench export`` output), else from ``tokenizer`` alone.
    """
    from .models import load_model, load_tokenizer_from, resolve_model_path
    if isinstance(model, LoadedModel):
        return _from_loaded(model, threads)
    p = resolve_model_path(model)
    if not p.exists():
        raise ModelLoadError(f"'{p}' does not exist: pass a model directory, 'demo', or a `workbench convert` output")
    runtimes = dict(GRAPH_NAMES)
    if p.is_file():
        if p.name not in runtimes:
            raise ModelLoadError(f"'{p}' is not a prefill graph ({', '.join(runtimes)}): pass the folder "
                                 "`workbench convert` or `workbench export` wrote")
        folder, prefill, runtime = p.parent, p, runtimes[p.name]
        if runtime == GENAI and find_graphs(folder) is None:
            raise ModelLoadError(f"'{p}' has no genai_config.json beside it: pass an ort-genai folder "
                                 "(`workbench convert --target ort-genai`)")
    else:
        folder, graphs = p, find_graphs(p)
        if graphs is None:
            if (p / "config.json").is_file() or (p / "quantization.json").is_file():
                return _from_loaded(load_model(model), threads)
            _, target = _conversion_source(p)
            what = (f"is a {target} conversion, which does not run here: pick an ort-genai, ort-int4, ort-qdq or mnn "
                    "output" if target else "holds no model to generate with: pass a model directory (config.json), "
                    "or a `workbench convert` / `workbench export` output (prefill.onnx, prefill.qdq.onnx, "
                    "prefill.mnn, or model.onnx with genai_config.json)")
            raise ModelLoadError(f"'{p}' {what}")
        prefill, _, runtime = graphs
    decode = prefill.with_name(prefill.name.replace("prefill", "decode"))
    if not decode.is_file():
        raise ModelLoadError(f"'{folder}' has {prefill.name} but no {decode.name}: generation needs both graphs; "
                             "convert again")
    recorded, target = _conversion_source(folder)
    src = recorded if recorded is not None else resolve_model_path(source) if source is not None else None
    if src is not None and (src / "config.json").is_file():
        tokenizer = tokenizer or load_tokenizer_from(src)
        eos, positions = _model_settings(*_json_docs(src), tokenizer=tokenizer)
    elif runtime == GENAI:  # the folder is whole: tokenizer files and genai_config.json
        tokenizer = tokenizer or load_tokenizer_from(folder)
        eos, positions = _model_settings(_genai_settings(folder), tokenizer=tokenizer)
    elif tokenizer is not None:
        eos, positions = _model_settings(tokenizer=tokenizer)
    else:
        raise ModelLoadError(f"'{folder}' does not name the model it was converted from (no conversion.json naming "
                             "one, or that model is gone): pass the float model's directory as source")
    if runtime == "MNN":
        from .targets.mnn import MnnCausalLM
        runner = MnnCausalLM(prefill, threads=threads or 1)
    elif runtime == GENAI:
        from .targets.ort_genai import GenaiCausalLM
        runner = GenaiCausalLM(folder, threads=threads)
        positions = min(positions or runner.max_length, runner.max_length)
    else:
        from .runtime.onnx_runner import OnnxCausalLM
        runner = OnnxCausalLM(prefill, decode, threads=threads)
    kind = target or ("ort-genai" if runtime == GENAI else "ONNX export")
    return TextGenerator(runner, tokenizer, folder, runtime, f"{folder.name} ({kind}, {runtime})",
                         eos, positions, threads, src)
