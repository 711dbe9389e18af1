"""Image input: every bad file refused in one line naming it, every mode to RGB, image + text sets read safely."""
from __future__ import annotations

import json
import os
import resource
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from workbench.errors import DataError
from workbench.evaluation.images import ImageTextPair, read_image, read_image_set


def refused(fn, *args, match: str, **kw) -> str:
    """The one-line DataError message ``fn`` raises, checked to contain ``match``."""
    with pytest.raises(DataError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert match in msg, msg
    return msg


def noise(size=(64, 48), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(path, width=100_000, height=100_000):
    """A valid PNG header claiming ``width x height`` RGB pixels, with a little compressed data after it."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 65536, 9)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat)
                     + png_chunk(b"IEND", b""))
    return path


# ---------------------------------------------------------------- refusals

def test_missing_file_and_directory(tmp_path):
    refused(read_image, tmp_path / "nope.png", match="nope.png' does not exist")
    refused(read_image, tmp_path, match="is a directory")


def test_random_bytes_named_png(tmp_path):
    p = tmp_path / "fake.png"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    refused(read_image, p, match="fake.png' is not an image")


def test_png_cut_in_half(tmp_path):
    full = tmp_path / "full.png"
    noise().save(full)
    read_image(full)  # the whole file reads
    cut = tmp_path / "cut.png"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    refused(read_image, cut, match="cut.png' is truncated or corrupt")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_jpeg_cut_short(tmp_path):
    full = tmp_path / "full.jpg"
    noise((96, 96)).save(full, quality=95)
    cut = tmp_path / "short.jpg"
    cut.write_bytes(full.read_bytes()[: int(full.stat().st_size * 0.6)])
    refused(read_image, cut, match="short.jpg' is truncated or corrupt")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_decompression_bomb_refused_before_decoding(tmp_path, monkeypatch):
    p = bomb_png(tmp_path / "bomb.png")
    with monkeypatch.context() as m:
        m.setattr(Image, "MAX_IMAGE_PIXELS", None)
        with Image.open(p) as img:  # the header really claims the size
            assert img.size == (100_000, 100_000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    refused(read_image, p, match="bomb.png' claims more pixels than allowed")
    # under Pillow's own limit but over ours: our line, with the size
    small_bomb = bomb_png(tmp_path / "wide.png", width=9000, height=9000)
    refused(read_image, small_bomb, match="9000 x 9000 = 81,000,000 pixels")
    refused(read_image, small_bomb, max_pixels=1000, match="more than the 1,000 allowed")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # Pillow's guard switched off: ours still holds
    refused(read_image, p, match="100000 x 100000 = 10,000,000,000 pixels")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 200, f"peak memory grew {grown_mb:.0f} MB reading a bomb"


def test_mode_with_no_rgb_meaning_refused_by_name(tmp_path):
    p = tmp_path / "float.tiff"
    Image.fromarray(np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8), "F").save(p)
    refused(read_image, p, match="pixel mode 'F'")


# ---------------------------------------------------------------- conversions

def test_rgb_passes_through_unchanged(tmp_path):
    img = noise()
    p = tmp_path / "rgb.png"
    img.save(p)
    out = read_image(p)
    assert out.mode == "RGB" and out.size == (64, 48)
    assert np.array_equal(np.asarray(out), np.asarray(img))


def test_cmyk_jpeg(tmp_path):
    p = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(p, quality=100)  # pure red in ink
    with Image.open(p) as raw:
        assert raw.mode == "CMYK"
    out = read_image(p)
    assert out.mode == "RGB"
    r, g, b = out.getpixel((16, 16))
    assert r > 240 and g < 15 and b < 15


def test_sixteen_bit_grey_png_is_scaled_not_clipped(tmp_path):
    p = tmp_path / "deep.png"
    a = np.array([[0, 32896, 65535, 257]], dtype=np.uint16).repeat(4, axis=0)
    Image.fromarray(a).save(p)
    with Image.open(p) as raw:
        assert raw.mode in ("I;16", "I")
    out = read_image(p)
    assert out.mode == "RGB"
    assert [out.getpixel((x, 0)) for x in range(4)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255), (1, 1, 1)]


def test_palette_with_transparency_composited_on_white(tmp_path):
    p = tmp_path / "pal.png"
    img = Image.new("P", (8, 8), 0)
    img.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)
    img.paste(1, (4, 0, 8, 8))
    img.info["transparency"] = 0
    img.save(p, transparency=0)
    with Image.open(p) as raw:
        assert raw.mode == "P" and "transparency" in raw.info
    out = read_image(p)
    assert out.getpixel((0, 0)) == (255, 255, 255)  # transparent black -> the white page, not black
    assert out.getpixel((6, 0)) == (0, 0, 255)


def test_rgba_and_la_composited_on_white(tmp_path):
    p = tmp_path / "rgba.png"
    Image.new("RGBA", (4, 4), (255, 0, 0, 128)).save(p)
    r, g, b = read_image(p).getpixel((0, 0))
    assert r == 255 and 125 <= g <= 129 and g == b
    q = tmp_path / "la.png"
    Image.new("LA", (4, 4), (0, 0)).save(q)
    assert read_image(q).getpixel((0, 0)) == (255, 255, 255)


def test_grey_and_bilevel(tmp_path):
    p, q = tmp_path / "l.png", tmp_path / "one.png"
    Image.new("L", (4, 4), 77).save(p)
    Image.new("1", (4, 4), 1).save(q)
    assert read_image(p).getpixel((1, 1)) == (77, 77, 77)
    assert read_image(q).getpixel((1, 1)) == (255, 255, 255)


# ---------------------------------------------------------------- image sets

def make_set(folder, rows=None, names=("a.png", "b.png", "c.png")):
    folder.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(names):
        noise((16, 16), seed=i).save(folder / n)
    rows = rows if rows is not None else [{"image": n, "text": f"picture {n}"} for n in names]
    (folder / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def test_image_set_jsonl_and_csv(tmp_path):
    folder = make_set(tmp_path / "set", rows=[{"image": "a.png", "text": "a red thing"},
                                              {"image": "b.png", "question": "What colour?", "answer": "blue"}])
    (folder / "captions.csv").write_text('image,text\nc.png,"green, mostly"\n\n')
    pairs = read_image_set(folder)
    assert [p.image.name for p in pairs] == ["a.png", "b.png", "c.png"]
    assert pairs[0] == ImageTextPair(folder.resolve() / "a.png", "a red thing", None, None, pairs[0].where)
    assert (pairs[1].text, pairs[1].question, pairs[1].answer) == (None, "What colour?", "blue")
    assert pairs[2].text == "green, mostly" and pairs[2].where.endswith("line 2")
    assert read_image_set(folder / "captions.csv")[0].text == "green, mostly"  # the captions file names the set
    (folder / "captions.tsv").write_text("image\ttext\nb.png\tsecond caption\n")
    assert read_image_set(folder)[-1].text == "second caption"


def test_image_set_missing_images_listed(tmp_path):
    rows = [{"image": f"gone{i}.png", "text": "x"} for i in range(7)] + [{"image": "a.png", "text": "y"}]
    msg = refused(read_image_set, make_set(tmp_path / "s", rows), match="7 of 8 records name images that are not")
    assert "gone0.png (line 1)" in msg and "gone4.png (line 5)" in msg and "gone5.png" not in msg
    assert "and 2 more" in msg


@pytest.mark.parametrize("row, match", [
    ({"text": "no image"}, "line 2: missing field 'image'"),
    ({"image": "a.png", "text": 3}, "line 2: field 'text' must be a string, got integer"),
    ({"image": "a.png"}, "line 2: no text"),
    ({"image": "a.png", "question": "why?"}, "line 2: has 'question' but no 'answer'"),
    (["a.png", "text"], "line 2: expected an object"),
    ({"image": "/etc/passwd", "text": "x"}, "line 2: image '/etc/passwd' is not a path inside"),
    ({"image": "../a.png", "text": "x"}, "line 2: image '../a.png' is not a path inside"),
    ({"image": "sub/../../a.png", "text": "x"}, "is not a path inside"),
])
def test_image_set_bad_records(tmp_path, row, match):
    folder = make_set(tmp_path / "s", [{"image": "a.png", "text": "fine"}, row])
    msg = refused(read_image_set, folder, match=match)
    assert "captions.jsonl" in msg


def test_image_set_symlink_leaving_the_folder(tmp_path):
    outside = tmp_path / "outside.png"
    noise((8, 8)).save(outside)
    folder = make_set(tmp_path / "s", [{"image": "link.png", "text": "x"}])
    os.symlink(outside, folder / "link.png")
    refused(read_image_set, folder, match="line 1: image 'link.png' leads outside the set's folder")
    inner = make_set(tmp_path / "t", [{"image": "inner.png", "text": "x"}])
    os.symlink(inner / "a.png", inner / "inner.png")  # a symlink that stays inside is fine
    assert read_image_set(inner)[0].image == (inner / "a.png").resolve()


def test_image_set_bad_files(tmp_path):
    refused(read_image_set, tmp_path / "none", match="does not exist")
    (tmp_path / "bare").mkdir()
    refused(read_image_set, tmp_path / "bare", match="has no captions file")
    empty = make_set(tmp_path / "e", rows=[])
    (empty / "captions.jsonl").write_text("\n\n")
    refused(read_image_set, empty, match="is empty")
    bad_json = make_set(tmp_path / "j")
    (bad_json / "captions.jsonl").write_text('{"image": "a.png", "text": "x"}\n{"image": \n')
    refused(read_image_set, bad_json, match="line 2: not valid JSON")
    bad_csv = make_set(tmp_path / "c", rows=[{"image": "a.png", "text": "x"}])
    (bad_csv / "captions.csv").write_text("file,caption\na.png,x\n")
    refused(read_image_set, bad_csv, match="needs an 'image' column")
    (bad_csv / "captions.csv").write_text("image,text\na.png\n")
    refused(read_image_set, bad_csv, match="captions.csv' line 2: no text")
    refused(read_image_set, bad_csv / "a.png", match="is not an image set's records file")


def test_thirty_two_bit_grey_read_as_sixteen_bit_range(tmp_path):
    p = tmp_path / "int.tiff"
    Image.fromarray(np.array([[0, 65535, 70000, -5]], dtype=np.int32)).save(p)
    with Image.open(p) as raw:
        assert raw.mode == "I"
    out = read_image(p)
    assert [out.getpixel((x, 0))[0] for x in range(4)] == [0, 255, 255, 0]
