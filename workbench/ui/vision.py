"""What the app shows for a vision-language model: its parts, and the picture Generate asks about.

    panel = VisionPanel(session)          # under Load, once a VLM is loaded (``session.lm.is_vision``)
    panel.choose(panel.bundled[3])        # a bundled demo-vl picture; session.image follows
    panel.upload("photo.png", data)       # what the FileUpload does: read through read_image's checks
    display(panel)

The parts table is ``LoadedModel.parts()`` (what ``workbench info`` prints): vision encoder, projector and
language model with their module prefixes, parameters and bytes. The picture is a file: a bundled held-out
image of the demo VLM, or an upload saved under the session's outputs folder (``images/``) and read by
``workbench.evaluation.images.read_image``, so a file that is not a picture, a truncated one or a header
claiming a decompression bomb is one red line and the previous picture stays chosen.
"""
from __future__ import annotations

import html
import io
import re
from pathlib import Path

import ipywidgets as widgets

from ..assets import DEMO_VL_DATA_DIR
from ..errors import DataError
from ..evaluation.images import read_image, read_image_set
from ..units import format_bytes
from .base import StepPanel, ruled_table

__all__ = ["VisionPanel", "bundled_pictures", "bundled_questions", "parts_html", "model_words", "vision_sentences",
           "MAX_UPLOAD_BYTES", "PREVIEW_PIXELS"]

MAX_UPLOAD_BYTES = 32 << 20  # an upload crosses the page's websocket whole: beyond this, copy the file instead
PREVIEW_PIXELS = 168  # the preview's longer side; the demo's 56-pixel pictures are enlarged without smoothing
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def bundled_pictures() -> list[tuple[str, Path]]:
    """(label, path) of the demo VLM's held-out pictures, each labelled by its file name and caption."""
    pairs = read_image_set(DEMO_VL_DATA_DIR / "captions.jsonl")
    return [(f"{p.image.name}: {p.text}", p.image) for p in pairs]


def bundled_questions() -> list[str]:
    """The distinct questions of the demo VLM's held-out set, in their first order (what it was trained to answer)."""
    pairs = read_image_set(DEMO_VL_DATA_DIR / "questions.jsonl")
    return list(dict.fromkeys(p.question for p in pairs if p.question))


def parts_html(lm) -> str:
    """The parts of a VLM as a table (part, modules, parameters, bytes as stored, quantizable layers)."""
    rows = "".join(f"<tr><td><b>{html.escape(p.name)}</b></td><td><code>{html.escape(', '.join(p.prefixes))}</code>"
                   f"</td><td>{p.parameters:,}</td><td>{format_bytes(p.bytes)}</td><td>{p.layers}</td></tr>"
                   for p in lm.parts())
    return ruled_table("workbench-parts", "<th>part</th><th>modules</th><th>parameters</th><th>bytes</th>"
                       "<th>layers</th>", rows)


def model_words(lm) -> str:
    """``a vision-language model: vision encoder 448,224 parameters (896.45 kB), ...``; empty for a text model."""
    if not getattr(lm, "is_vision", False):
        return ""
    return "a vision-language model: " + ", ".join(f"{p.name} {p.parameters:,} parameters ({format_bytes(p.bytes)})"
                                                   for p in lm.parts())


def vision_sentences(q: dict) -> list[str]:
    """A quantized VLM's quality on pictures (``VisionQuality.to_dict()``) in plain words: how often it picks the
    float model's answer token, how far its answers' distribution moved, and whether it still matches pictures
    to their captions as often as the float model."""
    lines = [f"Answers about the pictures: the quantized model's most likely answer token is the float model's "
             f"{q['answer_top1']:.1%} ± {q['answer_top1_stderr']:.1%} of the time (top-1 agreement); its answer "
             f"tokens' distribution is KL {q['answer_kl']:.5f} ± {q['answer_kl_stderr']:.5f} nats from the float "
             f"model's ({q['questions']} questions, {q['answer_tokens']} answer tokens)."]
    if q.get("itm_accuracy") is not None:
        lines.append(f"Image-text matching (the picture's own caption ranked first among {q['distractors'] + 1}, "
                     f"chance {q['itm_chance']:.0%}): float model {q['reference_itm_accuracy']:.1%}, quantized "
                     f"{q['itm_accuracy']:.1%} (difference {q['itm_difference']:+.1%} ± "
                     f"{q['itm_difference_stderr']:.1%}, {q['captions']} pictures).")
    else:
        lines.append("Image-text matching: not measured (the image set has too few captioned pictures).")
    return lines


def preview_png(image) -> bytes:
    """A PNG of ``image`` with its longer side at ``PREVIEW_PIXELS`` (nearest neighbour: a small picture's pixels
    stay sharp, as the model sees them)."""
    from PIL import Image
    scale = PREVIEW_PIXELS / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    buf = io.BytesIO()
    image.resize(size, Image.NEAREST if scale >= 1 else Image.LANCZOS).save(buf, format="PNG")
    return buf.getvalue()


class VisionPanel(StepPanel):
    """A loaded VLM's parts and the picture chosen for Generate (``session.image``)."""

    def __init__(self, session):
        self._setup(log_height="60px")
        self.session = session
        self.bundled = bundled_pictures()
        self._uploaded: list[tuple[str, Path]] = []
        self.parts = widgets.HTML(parts_html(session.lm))
        self.picture = widgets.Dropdown(options=self.bundled, description="picture", layout={"width": "560px"})
        self.preview = widgets.Image(format="png", layout={"width": f"{PREVIEW_PIXELS}px",
                                                           "border": "1px solid #ddd"})
        self.upload_button = widgets.FileUpload(accept="image/*", multiple=False, description="Upload a picture",
                                                layout={"width": "auto"})
        self.upload_button.observe(self._on_upload, names="value")
        self.caption = widgets.HTML()
        self.controls = [self.picture, self.upload_button]
        super().__init__([
            widgets.HTML(f"<b>{html.escape(session.lm.name)}</b> is a vision-language model; its parts "
                         "(the Precisions tab sets each one's precision):"),
            self.parts,
            widgets.HTML("<b>Picture</b> Generate asks about: a held-out picture of the demo VLM, or your own "
                         "(PNG, JPEG, WebP, GIF, BMP, TIFF)"),
            widgets.HBox([widgets.VBox([self.picture, widgets.HBox([self.upload_button]), self.caption]),
                          self.preview]),
            self.status_line])
        self.add_class("workbench-vision")
        self.picture.observe(self._on_picture, names="value")
        if session.image is not None and session.image not in [p for _, p in self.bundled]:
            self._uploaded.append((f"uploaded: {session.image.name}", session.image))
            self.picture.options = self.bundled + self._uploaded
        self.choose(session.image or self.bundled[0][1])

    # -- actions -------------------------------------------------------------------------------------
    def choose(self, path: str | Path) -> Path | None:
        """Make the picture at ``path`` (one of the choices) the session's; its preview shows. None if refused."""
        path = Path(path)
        ok, image = self._attempt(f"reading {path.name}...", lambda: read_image(path))
        if not ok:
            return None
        if self.picture.value != path:
            self.picture.value = path  # its observer comes back here with the same path: nothing more to do
        self.preview.value = preview_png(image)
        self.caption.value = html.escape(f"{image.width} x {image.height} pixels, {path}")
        self.session.image = path
        self.status.value = ""
        return path

    def upload(self, name: str, data: bytes) -> Path | None:
        """Save an uploaded picture under the outputs folder and choose it; a bad file is one red line and the
        previous picture stays chosen."""
        ok, path = self._attempt(f"reading {name}...", lambda: self._save_upload(name, data))
        if not ok:
            return None
        label = f"uploaded: {path.name}"
        self._uploaded = [(lbl, p) for lbl, p in self._uploaded if p != path] + [(label, path)]
        self.picture.options = self.bundled + self._uploaded
        return self.choose(path)

    def _save_upload(self, name: str, data: bytes) -> Path:
        if not data:
            raise DataError(f"the uploaded file '{name}' is empty; choose a picture file")
        if len(data) > MAX_UPLOAD_BYTES:
            raise DataError(f"the uploaded file '{name}' is {len(data) / 2**20:.0f} MB, more than the "
                            f"{MAX_UPLOAD_BYTES >> 20} MB the page sends; resize it")
        folder = self.session.out_dir / "images"
        folder.mkdir(parents=True, exist_ok=True)
        safe = _SAFE_NAME.sub("_", Path(name).name).strip("._") or "picture"
        path = folder / safe
        path.write_bytes(bytes(data))
        try:
            read_image(path)  # every check before it is offered: a bad file is not left behind as a choice
        except DataError as e:
            path.unlink(missing_ok=True)
            raise DataError(str(e).replace(str(path), name)) from None
        return path

    # -- widget events ------------------------------------------------------------------------------
    def _on_picture(self, change) -> None:
        if change["new"] is not None and change["new"] != self.session.image:
            self.choose(change["new"])

    def _on_upload(self, change) -> None:
        files = change["new"]
        if not files:
            return
        f = files[0]
        self.upload(f["name"], bytes(f["content"]))
        self.upload_button.value = ()  # the same file uploaded again is a new event
