"""The generate panel: a converted model and the float model continue the same prompt, side by side.

    panel = GeneratePanel("out/int4")          # a `workbench convert` output (ort-genai, ort-int4, ort-qdq, mnn), an
    panel.run()                                # export, a model directory or "float"; returns the Generations
    display(panel)

Text streams into each column token by token with the decode speed (tokens/s after the first token)
and the prefill time under it. The two models run one after the other, so neither's speed is
measured while the other computes. The float model is the app session's model, else the one the
conversion came from (its ``conversion.json``). In the app (``session=``) the choices are the
session's conversions, its quantized model and the float model, and the latest conversion that
runs here is chosen. A vision-language model (the session's) answers the prompt as a question about the
picture chosen under Load (``session.image``), shown here; the quantized and the float model see the same
picture.
"""
from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as widgets

from ..errors import ModelLoadError, WorkbenchError
from ..run.generate import DEFAULT_MAX_NEW_TOKENS, Generation, TextGenerator, open_model
from ..run.locate import locate
from ..runtime.stream import STOP_WORDS, Sampling
from ..model.load import LoadedModel
from ..evaluation.images import read_image
from ..evaluation.vision import CAPTION_PROMPT
from .base import StepPanel
from .session import SessionLabel
from .vision import PREVIEW_PIXELS, bundled_questions, preview_png

__all__ = ["GeneratePanel", "FLOAT", "DEFAULT_PROMPT", "VISION_PROMPT"]

FLOAT = "float"  # the model field's value that means the float model itself
DEFAULT_PROMPT = "A class definition"
VISION_PROMPT = CAPTION_PROMPT  # a vision-language model's first question: describe the picture
KEEP_OPEN = 2  # models kept loaded between presses of Generate


class _Column(widgets.VBox):
    """One model's output: its name, the streamed text, and how fast it came."""

    def __init__(self, heading: str):
        self.name = self.default = heading
        self.heading = widgets.HTML(f"<b>{html.escape(heading)}</b>")
        self.text = widgets.HTML(layout={"border": "1px solid #ddd", "min_height": "160px", "padding": "4px"})
        self.stats = widgets.HTML()
        super().__init__([self.heading, self.text, self.stats], layout={"width": "50%"})

    def start(self, name: str) -> None:
        self.name = name
        self.heading.value = f"<b>{html.escape(name)}</b>"
        self.text.value, self.stats.value = "", "<i>waiting...</i>"

    def clear(self, note: str) -> None:
        self.name = self.default
        self.heading.value = f"<b>{html.escape(self.default)}</b>"
        self.text.value, self.stats.value = "", f"<i>{html.escape(note)}</i>"

    def show(self, gen: Generation) -> None:
        self.text.value = ("<div style='white-space:pre-wrap;font-family:monospace;font-size:12px'>"
                           f"{html.escape(gen.text)}</div>")
        s, tps = gen.stats, gen.stats.tokens_per_second
        speed = f"<b>{tps:,.1f} tok/s</b>" if tps is not None else "<b>- tok/s</b>"
        self.stats.value = (f"{speed} &nbsp; {s.new_tokens} tokens; prefill {s.prompt_tokens} tokens in "
                            f"{s.prefill_seconds * 1000:,.1f} ms" + (
            f"; stopped: {STOP_WORDS.get(s.stop_reason, s.stop_reason)}" if s.stop_reason else ""))


class GeneratePanel(StepPanel):
    """Model, prompt, max tokens and sampling; Generate streams the model's text and the float model's beside it."""

    def __init__(self, model: str | Path | None = None, *, float_model: str | Path | LoadedModel | None = None,
                 prompt: str = DEFAULT_PROMPT, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, threads: int = 1,
                 session=None):
        self.session, self.float_source = session, float_model
        self.given_model = str(model).strip() if model is not None else FLOAT
        self.results: dict[str, Generation] = {}
        self._loaded: dict[tuple, TextGenerator] = {}
        self._setup(log_height="80px")
        self.model = widgets.Text(value=self.given_model, description="model",
                                  layout={"width": "640px"},
                                  placeholder="a `workbench convert` output folder, a model directory, or 'float'")
        self.choice = widgets.Dropdown(description="choose", layout={"width": "640px"})
        self.choice.observe(self._on_choice, names="value")
        self.prompt = widgets.Textarea(value=prompt, description="prompt", layout={"width": "640px", "height": "70px"})
        self.max_tokens = widgets.BoundedIntText(value=max_new_tokens, min=1, max=4096, description="max tokens")
        self.temperature = widgets.BoundedFloatText(value=0.0, min=0.0, max=5.0, step=0.1, description="temperature",
                                                    style={"description_width": "initial"},
                                                    tooltip="0: greedy (the most likely token each step)")
        self.top_k = widgets.BoundedIntText(value=0, min=0, max=1_000_000, description="top-k",
                                            tooltip="sample among the k most likely tokens; 0: all of them")
        self.seed = widgets.IntText(value=0, description="seed")
        self.threads = widgets.BoundedIntText(value=threads, min=1, max=256, description="threads")
        self.chat = widgets.Checkbox(value=False, description="chat template", indent=False,
                                     tooltip="wrap the prompt as a user turn with the tokenizer's chat template")
        self.compare = widgets.Checkbox(value=True, description="float model beside it", indent=False)
        self.generate_button = widgets.Button(description="Generate", button_style="primary", icon="play")
        self.generate_button.on_click(lambda _: self.run())
        self.columns = {"chosen": _Column("chosen model"), "float": _Column("float model")}
        self.controls = [self.model, self.choice, self.prompt, self.max_tokens, self.temperature, self.top_k,
                         self.seed, self.threads, self.chat, self.compare, self.generate_button]
        head = [widgets.HTML("<b>Generate</b>: a converted model (ONNX Runtime, MNN), a quantized or the float model "
                             "continues your prompt, token by token, with its speed; the float model continues the "
                             "same prompt beside it (this machine's CPU, one model at a time)")]
        self.picture = widgets.Image(format="png", layout={"width": f"{PREVIEW_PIXELS // 2}px",
                                                           "border": "1px solid #ddd"})
        self.picture_note = widgets.HTML()
        self.question = widgets.Dropdown(description="ask", layout={"width": "640px"})
        self.question.observe(self._on_question, names="value")
        if session is not None:
            head.append(self._own(SessionLabel(session)))
            self._watch(session, self._on_session, ["conversions", "quantized_path", "lm"])
            self._watch(session, self._show_picture, "image")
        self.is_vision = session is not None and getattr(session.lm, "is_vision", False)
        if self.is_vision:  # a question about the picture, not text to continue
            self.question.options = [("a question the demo VLM was trained on...", "")] + \
                [(q, q) for q in bundled_questions()]
            if prompt == DEFAULT_PROMPT:
                self.prompt.value = VISION_PROMPT
            head.append(widgets.HBox([self.picture, widgets.VBox([
                widgets.HTML("<b>the picture chosen under Load</b>: the prompt is a question about it"),
                self.picture_note, self.question])]))
            self.controls.append(self.question)
            self._show_picture()
        self._refresh_choices(select_latest=model is None)
        super().__init__([
            *head, self.choice, self.model, self.prompt,
            widgets.HBox([self.max_tokens, self.temperature, self.top_k, self.seed]),
            widgets.HBox([self.threads, self.chat, self.compare, self.generate_button]),
            self.status_line, self.log_output, widgets.HBox(list(self.columns.values()))])

    # -- what can be chosen ---------------------------------------------------------------------------
    def choices(self) -> list[tuple[str, str]]:
        """(label, model field value): the session's runnable conversions (latest first), its quantized
        model, the float model; standalone, the model given and the float model."""
        options: list[tuple[str, str]] = []
        s = self.session
        if s is not None:
            for report in reversed(s.conversions):
                if locate(report.out_dir, strict=False) is not None:
                    options.append((f"{report.target}: {report.out_dir}", str(report.out_dir)))
            if s.quantized_path is not None:
                options.append((f"quantized model (PyTorch): {s.quantized_path}", str(s.quantized_path)))
        elif self.given_model not in ("", FLOAT):
            options.append((self.given_model, self.given_model))
        options.append(("float model (PyTorch)", FLOAT))
        return options

    def _refresh_choices(self, select_latest: bool) -> None:
        options = self.choices()
        current = self.model.value
        self.choice.options = options
        values = [v for _, v in options]
        self.choice.value = values[0] if select_latest or current not in values else current

    def _on_choice(self, change) -> None:
        if change["new"] is not None:
            self.model.value = change["new"]

    def _on_question(self, change) -> None:
        if change["new"]:
            self.prompt.value = change["new"]

    def _show_picture(self, _change=None) -> None:
        """The session's picture, small, where the question is typed."""
        path = self.session.image
        if path is None:
            self.picture.value, self.picture_note.value = b"", "<i>no picture chosen: choose one under Load</i>"
            return
        try:
            self.picture.value = preview_png(read_image(path))
            self.picture_note.value = f"<code>{html.escape(path.name)}</code>"
        except WorkbenchError as e:  # the file changed since it was chosen
            self.picture.value, self.picture_note.value = b"", f"<span style='color:#c0392b'>{html.escape(str(e))}</span>"

    def _on_session(self, _change) -> None:
        """Export made a conversion (or Quantize a model): offer it, and choose the newest."""
        self._refresh_choices(select_latest=True)

    # -- models ---------------------------------------------------------------------------------------
    def _open(self, what: str | Path | LoadedModel, **kwargs) -> TextGenerator:
        """Open a model once per file state and thread count (a folder converted again is opened again); the
        ``KEEP_OPEN`` most recently used stay loaded."""
        if isinstance(what, LoadedModel):
            key = ("loaded", id(what.model), self.threads.value)
        else:
            p = Path(str(what)).expanduser()
            found = locate(p, strict=False) if p.is_dir() else None
            stamp = found.entry.stat().st_mtime_ns if found is not None else None
            key = (str(p.resolve()) if p.exists() else str(what), stamp, self.threads.value)
        model = self._loaded.pop(key, None) or open_model(what, threads=self.threads.value, **kwargs)
        self._loaded[key] = model  # the most recently used last
        while len(self._loaded) > KEEP_OPEN:  # runtimes hold their weights: keep the chosen and the float model
            self._loaded.pop(next(iter(self._loaded)))
        return model

    def _float_model(self, chosen: TextGenerator | None) -> TextGenerator:
        """The session's model, else the one given, else the model ``chosen`` was converted or quantized from."""
        if self.session is not None and self.session.lm is not None:
            return self._open(self.session.lm)
        if self.float_source is not None:
            return self._open(self.float_source)
        if chosen is None:  # the float model itself chosen: the one the other choice came from
            other = next((v for _, v in self.choices() if v != FLOAT), None)
            chosen = self._open(other) if other is not None else None
        if chosen is None or chosen.source is None:
            raise ModelLoadError("no float model to compare with: give float_model, or choose a `workbench convert` "
                                 "output whose conversion.json names it")
        return self._open(chosen.source)

    def _chosen_model(self) -> TextGenerator:
        value = self.model.value.strip()
        if value in ("", FLOAT):
            return self._float_model(None)
        source = self.session.lm.path if self.session is not None and self.session.lm is not None else \
            self.float_source if isinstance(self.float_source, (str, Path)) else None
        return self._open(value, source=source)

    # -- the button ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Generation] | None:
        """Stream the chosen model's continuation, then the float model's; each column fills as tokens come."""
        ok, results = self._attempt("generating...", self._generate)
        if not ok:
            return None
        self.status.value = html.escape("; ".join(f"{self.columns[k].name}: {g.stats.summary()}"
                                                  for k, g in results.items()))
        return results

    def _generate(self) -> dict[str, Generation]:
        sampling = Sampling(self.temperature.value, self.top_k.value or None, self.seed.value)
        image = None
        if self.is_vision:
            if self.session.image is None:
                raise WorkbenchError("choose a picture first (under Load): a vision-language model answers about one")
            image = read_image(self.session.image)  # read once: both models see the same pixels
        is_float = self.model.value.strip() in ("", FLOAT)
        models = {"chosen": self._chosen_model()}
        if self.compare.value and not is_float:
            models["float"] = self._float_model(models["chosen"])
        for key, column in self.columns.items():
            if key in models:
                column.start(models[key].name)
            else:
                column.clear("the chosen model is the float model" if is_float else
                             "not compared: tick 'float model beside it'")
        self.results = {}
        for key, model in models.items():  # one after the other: neither is timed while the other computes
            gen = model.stream(self.prompt.value, max_new_tokens=self.max_tokens.value, sampling=sampling,
                               chat=self.chat.value, image=image)
            self.results[key] = gen
            for _ in gen:
                self.columns[key].show(gen)
            self.columns[key].show(gen)
        return dict(self.results)
