"""Images in, safely: one decoded RGB picture per file, and image + text sets for vision-language models.

An image file is data from anywhere, so ``read_image`` refuses in one line, naming the file, whatever
would otherwise end in a traceback, a silent grey fill or an exhausted machine:

* a missing file, a directory, or a file Pillow does not recognise as an image;
* a header that claims more than ``max_pixels`` pixels (a decompression bomb: a 100,000 x 100,000 PNG is
  a few hundred bytes on disk and 30 GB decoded), checked on the header's size *before* any pixel is
  decoded; Pillow's own DecompressionBombError (raised on a header past twice its ``MAX_IMAGE_PIXELS``) becomes
  a line of the same kind, and its warning is superseded by ``max_pixels``;
* a truncated or corrupt file: the whole image is decoded at once (``load()``), and Pillow's
  ``ImageFile.LOAD_TRUNCATED_IMAGES`` is left False, so a cut-short PNG or JPEG is an error, not a picture
  with its bottom half grey;
* a pixel mode with no meaning as a colour picture (``F``, ``HSV``, ``LAB``...), refused by name.

Every other mode becomes 8-bit RGB: CMYK by Pillow's conversion (an embedded ICC profile is not applied),
16-bit grey (``I;16``, ``I``) scaled to 8 bits rather than clipped, palettes and grey expanded, and
anything with transparency (``RGBA``, ``LA``, ``PA``, a palette or grey with a transparent colour)
composited on white, the background a page or screen shows it on. EXIF orientation is applied, as a viewer
does; a multi-frame file (GIF, TIFF) gives its first frame.

An image set (``read_image_set``) is a folder of images with ``captions.jsonl`` and/or ``captions.csv`` /
``captions.tsv`` naming them::

    {"image": "cat.png", "text": "a cat asleep on a red sofa"}
    {"image": "sign.jpg", "question": "What does the sign say?", "answer": "STOP"}

``caption`` is taken where a record has no ``text``. A records file of another name (``questions.jsonl``,
``calibration.csv``) is read when it is given itself; its folder is the set's folder.

Every image path stays inside the folder (no absolute paths, no ``..``, no symlink leading out).
"""
from __future__ import annotations

import csv
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..errors import DataError, ModelLoadError
from ..files.folder_paths import inside_folder

__all__ = ["read_image", "read_image_set", "ImageTextPair", "DEFAULT_MAX_PIXELS", "CAPTION_FILES",
           "IMAGE_FIELDS", "MAX_CAPTIONS_BYTES"]

# 50 megapixels: a 48 MP phone photo passes; decoding costs at most 150 MB as RGB (200 MB as RGBA)
DEFAULT_MAX_PIXELS = 50_000_000
CAPTION_FILES = ("captions.jsonl", "captions.csv", "captions.tsv")
RECORD_SUFFIXES = (".jsonl", ".csv", ".tsv")
IMAGE_FIELDS = ("image", "text", "caption", "question", "answer")
MAX_CAPTIONS_BYTES = 64 << 20  # a captions file is read whole: beyond this it is refused, not held
MAX_LISTED = 5  # how many missing images an error names
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_DIRECT_MODES = ("RGB", "RGBX", "CMYK", "YCbCr", "L", "1", "P")
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_IMAGE_HINT = "pass a PNG, JPEG, WebP, GIF, BMP or TIFF file"


def _check_image_path(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"image path '{p}' is a directory; {_IMAGE_HINT}")
    if not p.is_file():
        raise DataError(f"image file '{p}' does not exist; {_IMAGE_HINT}")
    return p


def _bomb_error(p: Path, width: int, height: int, max_pixels: int) -> DataError:
    return DataError(f"image '{p}' claims {width} x {height} = {width * height:,} pixels, more than the "
                     f"{max_pixels:,} allowed (a decompression bomb, or a picture far larger than a model sees); "
                     "resize it, or raise max_pixels if the file is trusted")


def _sixteen_bit_to_l(img):
    """16-bit grey to 8-bit grey by scaling (65535 -> 255); Pillow's own convert clips everything above 255."""
    import numpy as np
    from PIL import Image
    a = np.clip(np.asarray(img).astype(np.float32), 0, 65535) / 257.0  # astype reads either byte order
    return Image.fromarray(np.rint(a).astype(np.uint8), mode="L")


def _to_rgb(img, p: Path):
    """An RGB copy of a loaded image; transparency composited on white; DataError naming a mode with no RGB."""
    from PIL import Image
    mode = img.mode
    if mode in _SIXTEEN_BIT:
        return _sixteen_bit_to_l(img).convert("RGB")
    if mode not in _ALPHA_MODES and mode not in _DIRECT_MODES:
        raise DataError(f"image '{p}' has pixel mode '{mode}', which has no RGB meaning here; save it as an "
                        "8-bit RGB, RGBA, grey or palette PNG or JPEG")
    has_alpha = mode in _ALPHA_MODES or (mode in ("P", "L", "RGB", "1") and "transparency" in img.info)
    if not has_alpha:
        return img.convert("RGB")
    rgba = img.convert("RGBA")  # a palette's or grey's transparent colour becomes alpha; RGBa is un-premultiplied
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def read_image(path: str | Path, *, max_pixels: int = DEFAULT_MAX_PIXELS):
    """The image at ``path`` as an 8-bit RGB ``PIL.Image.Image``, or DataError in one line saying what to do.

    The header's size is checked against ``max_pixels`` before any pixel is decoded, so memory stays
    bounded by ``max_pixels`` whatever the file claims; then the whole image is decoded, so a truncated
    file is an error here rather than a grey patch later.
    """
    import struct
    import zlib

    from PIL import Image, ImageOps, UnidentifiedImageError
    p = _check_image_path(path)
    decode_errors = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError, TypeError)
    with warnings.catch_warnings():
        # max_pixels is the bound, checked below; Pillow's warning would only be lost in a log
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(p)
        except Image.DecompressionBombError as e:  # beyond twice Pillow's MAX_IMAGE_PIXELS: refused at the header
            raise DataError(f"image '{p}' claims more pixels than allowed, a decompression bomb ({e}); resize it, or "
                            "raise max_pixels and PIL.Image.MAX_IMAGE_PIXELS if the file is trusted") from None
        except UnidentifiedImageError:
            raise DataError(f"'{p}' is not an image Pillow can read (unrecognised contents, whatever its name "
                            f"says); {_IMAGE_HINT}") from None
        except decode_errors as e:
            raise DataError(f"image '{p}' cannot be read ({type(e).__name__}: {e}); {_IMAGE_HINT}") from None
        with img:
            width, height = img.size
            if width <= 0 or height <= 0:
                raise DataError(f"image '{p}' has an empty size ({width} x {height}); {_IMAGE_HINT}")
            if width * height > max_pixels:
                raise _bomb_error(p, width, height, max_pixels)
            try:
                img.load()  # the whole decode: LOAD_TRUNCATED_IMAGES stays False, so a cut file raises here
            except Image.DecompressionBombError as e:  # a PNG text chunk or frame beyond Pillow's own limits
                raise DataError(f"image '{p}' holds more than Pillow decodes safely, a decompression bomb ({e}); "
                                "save it again without it") from None
            except decode_errors as e:
                raise DataError(f"image '{p}' is truncated or corrupt ({e}); the whole file is needed: copy or "
                                "export it again") from None
            try:
                oriented = ImageOps.exif_transpose(img)
            except decode_errors:
                oriented = img  # a broken EXIF block: the pixels are fine, leave them as stored
            return _to_rgb(oriented, p)


@dataclass(frozen=True)
class ImageTextPair:
    """One record of an image set: the image's resolved path, a caption and/or a question with its answer."""

    image: Path
    text: str | None
    question: str | None = None
    answer: str | None = None
    where: str = ""  # "'captions.jsonl' line 3", for errors that come later


def _type_name(v) -> str:
    return "null" if v is None else {dict: "object", list: "array", str: "string", bool: "boolean",
                                     int: "integer", float: "number"}.get(type(v), type(v).__name__)


def _image_path(folder: Path, named, loc: str) -> Path:
    """``folder / named`` if it stays inside ``folder``; DataError naming the record otherwise."""
    if not isinstance(named, str) or not named.strip():
        raise DataError(f"{loc}: field 'image' must be a non-empty file name inside the folder, got {named!r}")
    parts = PurePosixPath(named.replace("\\", "/")).parts
    if PurePosixPath(named).is_absolute() or PureWindowsPath(named).is_absolute() or PureWindowsPath(named).drive \
            or ".." in parts:
        raise DataError(f"{loc}: image '{named}' is not a path inside the set's folder '{folder}' (no absolute paths, "
                        "no '..'); copy the image into the folder and name it relative to it")
    try:
        return inside_folder(folder, named, loc, "image")
    except ModelLoadError:
        raise DataError(f"{loc}: image '{named}' leads outside the set's folder '{folder}' (a symlink pointing "
                        "out); copy the image itself into the folder") from None


def _record(obj, folder: Path, loc: str) -> ImageTextPair:
    if not isinstance(obj, dict):
        raise DataError(f"{loc}: expected an object with 'image' and 'text' (or 'question' and 'answer'), "
                        f"got {_type_name(obj)}")
    if "image" not in obj or obj["image"] in (None, ""):
        fields = ", ".join(repr(k) for k in obj) or "none"
        raise DataError(f"{loc}: missing field 'image' (fields present: {fields}); each record names an image "
                        "file in the folder")
    values = {}
    if obj.get("text") in (None, "") and "caption" in obj:  # a caption under its own name
        obj = {**obj, "text": obj["caption"]}
    for name in ("text", "question", "answer"):
        v = obj.get(name)
        if v is not None and not isinstance(v, str):
            raise DataError(f"{loc}: field '{name}' must be a string, got {_type_name(v)}")
        values[name] = v if v is not None and v.strip() else None
    if (values["question"] is None) != (values["answer"] is None):
        have, lack = ("question", "answer") if values["question"] is not None else ("answer", "question")
        raise DataError(f"{loc}: has '{have}' but no '{lack}'; give both, or neither")
    if values["text"] is None and values["answer"] is None:
        raise DataError(f"{loc}: no text: give a 'text' caption, or a 'question' and its 'answer'")
    return ImageTextPair(_image_path(folder, obj["image"], loc), values["text"], values["question"],
                         values["answer"], loc)


def _read_captions_bytes(p: Path) -> str:
    size = p.stat().st_size
    if size > MAX_CAPTIONS_BYTES:
        raise DataError(f"captions file '{p}' is {size / 2**20:.0f} MB, more than the {MAX_CAPTIONS_BYTES >> 20} MB "
                        "read whole; split the set into several folders")
    try:
        return p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"captions file '{p}' is not UTF-8 text ({e.reason} at byte {e.start}); convert it to "
                        "UTF-8") from None


def _jsonl_pairs(p: Path, folder: Path) -> list[ImageTextPair]:
    out = []
    for n, line in enumerate(_read_captions_bytes(p).splitlines(), start=1):
        if not line.strip():
            continue
        loc = f"'{p}' line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{loc}: not valid JSON ({e.msg} at column {e.colno}); each line is one object like "
                            '{"image": "a.png", "text": "..."}') from None
        out.append(_record(obj, folder, loc))
    return out


def _table_pairs(p: Path, folder: Path) -> list[ImageTextPair]:
    delimiter = "\t" if p.suffix.lower() == ".tsv" else ","
    reader = csv.DictReader(io.StringIO(_read_captions_bytes(p), newline=""), delimiter=delimiter)
    header = [h.strip() for h in (reader.fieldnames or [])]
    if not header:
        return []
    reader.fieldnames = header
    if "image" not in header or not ({"text", "caption", "answer"} & set(header)):
        raise DataError(f"'{p}' line 1: the header ({', '.join(header)}) needs an 'image' column and a 'text' "
                        "column (or 'question' and 'answer' columns)")
    out = []
    for row in reader:
        loc = f"'{p}' line {reader.line_num}"
        if None in row:
            raise DataError(f"{loc}: more fields than the header's {len(header)}; quote fields that hold "
                            f"'{delimiter}'")
        if not any((v or "").strip() for v in row.values()):
            continue
        out.append(_record({k: v for k, v in row.items() if k in IMAGE_FIELDS and v is not None}, folder, loc))
    return out


def _line_of(where: str) -> str:
    """``line 3`` of ``'folder/captions.jsonl' line 3``."""
    return where.rsplit("' ", 1)[-1]


def read_image_set(path: str | Path) -> list[ImageTextPair]:
    """The records of an image set: a folder (or its captions file) with ``captions.jsonl`` / ``.csv`` / ``.tsv``.

    Every captions file present is read, in ``CAPTION_FILES`` order. DataError in one line for a missing
    folder, no captions file, a record with a missing or wrong field (naming its line), an image path that
    leaves the folder, images that are not there (the first few named), and an empty set. Images are only
    checked to exist here; ``read_image`` decodes each when it is used.
    """
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix.lower() not in RECORD_SUFFIXES:
            raise DataError(f"'{p}' is not an image set's records file (.jsonl, .csv or .tsv); pass the set's "
                            f"folder, or a records file such as its {' / '.join(CAPTION_FILES)}")
        folder, files = p.parent, [p]
    elif p.is_dir():
        folder, files = p, [p / name for name in CAPTION_FILES if (p / name).is_file()]
        if not files:
            raise DataError(f"image set folder '{p}' has no captions file; add {' or '.join(CAPTION_FILES)} with "
                            'lines like {"image": "a.png", "text": "..."}')
    else:
        raise DataError(f"image set folder '{p}' does not exist; pass a folder of images with a captions.jsonl")
    pairs: list[ImageTextPair] = []
    for f in files:
        pairs.extend(_jsonl_pairs(f, folder) if f.suffix == ".jsonl" else _table_pairs(f, folder))
    if not pairs:
        raise DataError(f"image set '{p}' is empty: {', '.join(f.name for f in files)} holds no records; add lines "
                        'like {"image": "a.png", "text": "..."}')
    missing = [pr for pr in pairs if not pr.image.is_file()]
    if missing:
        named = ", ".join(f"{pr.image.relative_to(folder.resolve())} ({_line_of(pr.where)})"
                          for pr in missing[:MAX_LISTED])
        more = f" and {len(missing) - MAX_LISTED} more" if len(missing) > MAX_LISTED else ""
        raise DataError(f"image set '{p}': {len(missing)} of {len(pairs)} records name images that are not in "
                        f"'{folder}': {named}{more}; add them or remove those lines")
    return pairs
