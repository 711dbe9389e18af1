"""Calibration text: read plain text, JSONL or Alpaca JSON, sample it, and say what was used.

    cs = load_calibration_set("calib.jsonl", tokenizer=lm.tokenizer, samples=128, seq_len=512)
    cs.samples            # list of 1-D LongTensors, each at most seq_len tokens
    print("\\n".join(cs.report.summary_lines()))

Formats, chosen by the file's extension:

* ``.jsonl`` / ``.ndjson``: one JSON object per line with a ``text`` string, optionally ``source``
  and ``lang`` strings (used for stratified sampling and the language mix); a line with
  ``instruction``/``input``/``output`` instead of ``text`` is read as an Alpaca record.
* ``.json``: a list of objects, Alpaca style (``instruction``, optional ``input``, ``output``) or
  with a ``text`` field. An Alpaca record becomes ``instruction``, ``input`` and ``output`` joined
  by blank lines (the text the model will see, without a prompt template).
* anything else: UTF-8 plain text, read as one document, in bounded pieces cut at whitespace
  (``workbench.evaluation.textio``), whatever its line structure.

The file is read only as far as the draw needs: ``samples x seq_len`` usable tokens, and at least
``MIN_POOL_TOKENS`` where the file has them (so a moderate file is sampled across its length);
the coverage report says when a file was read only partly. A JSONL line or a ``.json`` list is
parsed whole and refused above ``MAX_RECORD_BYTES``. Each record is tokenized in bounded pieces
(one call for a record shorter than ``PIECE_CHARS``). A record longer than ``seq_len`` tokens is split into
consecutive ``seq_len``-token chunks (rather than dropped, which is what loses most of a long
text in other tools); a record or final chunk shorter than ``min_tokens`` is dropped as too
short, an empty record as empty. The coverage report counts every drop with its reason and
where it happened, so nothing is dropped silently. Then ``samples`` chunks are drawn with a
seeded, stratified sample: each ``source``/``lang`` group gets a share proportional to its size.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..errors import DataError
from .textio import PIECE_CHARS, ReadExtent, check_text_path, decode_error, iter_text, tokenize_bounded
from ..assets import demo_text_path

__all__ = ["TextRecord", "CoverageReport", "CalibrationSet", "read_records", "load_calibration_set",
           "iter_records", "detect_language", "script_counts", "normalize_lang", "DEFAULT_SAMPLES", "DEFAULT_SEQ_LEN",
           "DEFAULT_MIN_TOKENS", "DROP_REASONS"]

DEFAULT_SAMPLES = 128  # what AWQ and GPTQ calibrate with; 128-256 is typical
DEFAULT_SEQ_LEN = 512
DEFAULT_MIN_TOKENS = 32  # shorter pieces say little about activation ranges and are dropped (and counted)
DROP_REASONS = ("empty", "too_short", "too_long")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
ALPACA_FIELDS = ("instruction", "input", "output")
MAX_WHERE = 5  # how many record locations a drop reason lists by name
MAX_RECORD_BYTES = 64 << 20  # a JSONL line or a .json list is parsed whole: beyond this it is refused, not held
MIN_POOL_TOKENS = 1 << 20  # tokens read at least (where the file has them), so a draw spans a moderate file
FILE_HINT = "pass a plain text, .jsonl or Alpaca .json file"

# Han ideographs: CJK Unified Ideographs, Extension A, Compatibility Ideographs, Extensions B-F
_HAN = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef]")
# Latin letters: basic ASCII letters plus Latin-1 Supplement and Latin Extended-A/B letters
_LATIN = re.compile("[A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f]")


def script_counts(text: str) -> tuple[int, int]:
    """(Han characters, Latin letters) in ``text``, by Unicode ranges."""
    return len(_HAN.findall(text)), len(_LATIN.findall(text))


def detect_language(text: str) -> str:
    """``zh`` when Han characters outnumber Latin letters, ``en`` when Latin letters do, else ``other``.

    One Han character carries about as much as a short word, so a Chinese text with English
    terms in it still counts as Chinese; this is a script test, not a language model.
    """
    han, latin = script_counts(text)
    if han == 0 and latin == 0:
        return "other"
    return "zh" if han >= latin else "en"


def normalize_lang(lang: str) -> str:
    """Map a ``lang`` field (``zh-CN``, ``zh_Hans``, ``Chinese``, ``en-US``...) to ``zh``/``en``/itself."""
    low = lang.strip().lower().replace("_", "-")
    if low.startswith("zh") or low in ("chinese", "cn", "cmn", "yue"):
        return "zh"
    if low.startswith("en") or low == "english":
        return "en"
    return low or "other"


@dataclass(frozen=True)
class TextRecord:
    """One document of a calibration file, with where it came from (``line 3``, ``record 4``)."""

    text: str
    where: str
    source: str | None = None
    lang: str | None = None


# ---------------------------------------------------------------- reading files

def _type_name(v) -> str:
    return "null" if v is None else {dict: "object", list: "array", str: "string", bool: "boolean",
                                     int: "integer", float: "number"}.get(type(v), type(v).__name__)


def _parse_record(obj, path: Path, where: str) -> TextRecord:
    """A JSON object -> TextRecord, with errors naming the file, the record and the field."""
    loc = f"'{path}' {where}"
    if not isinstance(obj, dict):
        raise DataError(f"{loc}: expected a JSON object with a 'text' field (or Alpaca 'instruction'/'output'), "
                        f"got {_type_name(obj)}")
    for name in ("source", "lang"):
        if name in obj and obj[name] is not None and not isinstance(obj[name], str):
            raise DataError(f"{loc}: field '{name}' must be a string, got {_type_name(obj[name])}")
    source, lang = obj.get("source"), obj.get("lang")
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise DataError(f"{loc}: field 'text' must be a string, got {_type_name(obj['text'])}")
        return TextRecord(obj["text"], where, source, lang)
    if "instruction" in obj or "output" in obj:
        for name in ALPACA_FIELDS:
            if name not in obj and name != "input":
                raise DataError(f"{loc}: Alpaca record is missing field '{name}' (it has "
                                f"{', '.join(repr(k) for k in obj) or 'no fields'}); each record needs "
                                "'instruction' and 'output' strings, and optionally 'input'")
            value = obj.get(name)
            if name in obj and not isinstance(value, str) and not (name == "input" and value is None):
                raise DataError(f"{loc}: field '{name}' must be a string, got {_type_name(value)}")
        parts = [obj["instruction"], obj.get("input") or "", obj["output"]]
        return TextRecord("\n\n".join(p for p in parts if p.strip()), where, source, lang)
    fields = ", ".join(repr(k) for k in obj) or "none"
    raise DataError(f"{loc}: missing field 'text' (fields present: {fields}); give each record a 'text' string, "
                    "or Alpaca 'instruction'/'input'/'output' fields")


def _jsonl_records(path: Path, kind: str, extent: ReadExtent) -> Iterator[TextRecord]:
    """JSONL records a line at a time; a line longer than ``MAX_RECORD_BYTES`` is refused, never held."""
    extent.path, extent.file_bytes = str(path), path.stat().st_size
    n, seen = 0, False
    with open(path, "rb") as f:
        while True:
            start = extent.bytes_read
            raw = f.readline(MAX_RECORD_BYTES + 1)
            if not raw:
                break
            extent.bytes_read += len(raw)
            if len(raw) > MAX_RECORD_BYTES:
                raise DataError(f"'{path}' line {n + 1} is longer than {MAX_RECORD_BYTES >> 20} MB; split it into "
                                "records of one line each (or pass it as plain text, which is read in pieces)")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise decode_error(path, kind, e.reason, start + e.start) from None
            # text mode's newlines: \r\n and a lone \r end a line too; only those end a record (not U+2028 &c.,
            # which json.dumps(..., ensure_ascii=False) leaves raw inside strings)
            text = text.replace("\r\n", "\n").replace("\r", "\n")
            for line in text[:-1].split("\n") if text.endswith("\n") else text.split("\n"):
                n += 1
                if not line.strip():
                    continue  # a blank line holds no record
                seen = True
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"'{path}' line {n}: not valid JSON ({e.msg} at column {e.colno}); each line of "
                                    "a JSONL file must be one JSON object") from None
                yield _parse_record(obj, path, f"line {n}")
    extent.complete = True
    if not seen:
        raise DataError(f"{kind} file '{path}' is empty; it needs text")


def _json_records(path: Path, kind: str, extent: ReadExtent) -> list[TextRecord]:
    """A JSON list is parsed whole, so its size is capped; JSONL is the form read only as far as needed."""
    size = path.stat().st_size
    extent.path, extent.file_bytes = str(path), size
    if size > MAX_RECORD_BYTES:
        raise DataError(f"{kind} file '{path}' is {size / 2**20:.0f} MB, more than the {MAX_RECORD_BYTES >> 20} MB a "
                        ".json list is parsed whole up to; write it as .jsonl (one record per line), which is read "
                        "only as far as needed")
    raw_bytes = path.read_bytes()
    extent.bytes_read, extent.complete = size, True
    try:
        raw = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise decode_error(path, kind, e.reason, e.start) from None
    if not raw.strip():
        raise DataError(f"{kind} file '{path}' is empty; it needs text")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"'{path}' is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); for one "
                        "object per line, name the file .jsonl") from None
    if not isinstance(data, list):
        raise DataError(f"'{path}' holds a JSON {_type_name(data)}; expected a list of records (Alpaca style: "
                        "[{\"instruction\": ..., \"input\": ..., \"output\": ...}, ...])")
    if not data:
        raise DataError(f"{kind} file '{path}' is an empty JSON list; it needs at least one record")
    # numbered from 1, as JSONL lines are
    return [_parse_record(obj, path, f"record {i}") for i, obj in enumerate(data, start=1)]


def iter_records(path: str | Path, kind: str = "calibration",
                 extent: ReadExtent | None = None) -> tuple[str, Iterator[TextRecord]]:
    """``(format, records)``, the records read lazily: only as far as the caller iterates.

    Plain text yields its one document as consecutive pieces of at most ``PIECE_CHARS`` characters
    (each ``where="whole file"``; join them for the document), so no line, however long, is held
    whole. ``extent`` (a ReadExtent) is filled in with how much of the file was read.
    """
    p = check_text_path(path, kind, FILE_HINT)
    extent = extent if extent is not None else ReadExtent(str(p))
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl", _jsonl_records(p, kind, extent)
    if suffix == ".json":
        return "alpaca", iter(_json_records(p, kind, extent))
    return "text", (TextRecord(piece, "whole file") for piece in iter_text(p, kind, extent=extent, hint=FILE_HINT))


def read_records(path: str | Path, kind: str = "calibration") -> tuple[list[TextRecord], str]:
    """Read a text file (``kind``: what it is for, named in errors) into records; returns ``(records, format)``.

    ``format`` is ``text``, ``jsonl``, ``alpaca`` (a JSON list) or ``json``. Raises DataError naming
    the file, the record and the field for anything malformed, and for a missing or empty file.
    This holds the whole file; ``iter_records`` reads only as far as needed.
    """
    fmt, stream = iter_records(path, kind)
    records = list(stream)
    if fmt == "text":
        records = [TextRecord("".join(r.text for r in records), "whole file")]
    return records, fmt


# ---------------------------------------------------------------- the coverage report

@dataclass
class CoverageReport:
    """What a calibration set kept, what it dropped and why, and its language mix.

    ``pieces`` are what records became after splitting: each has a token length and a fate
    (``sampled``, ``unused`` = usable but not drawn, ``too_short``, ``too_long``, ``empty``).
    """

    path: str
    format: str
    records: int
    seq_len: int
    min_tokens: int
    requested: int
    seed: int
    bilingual: bool
    samples: int = 0
    tokens: int = 0
    available: int = 0  # usable chunks before sampling
    available_tokens: int = 0
    dropped: dict = field(default_factory=dict)  # reason -> {"pieces", "tokens", "where": [...]}
    split_records: int = 0  # records longer than seq_len, split into chunks
    split_chunks: int = 0
    strata: dict = field(default_factory=dict)  # stratum -> {"available", "sampled", "tokens"}
    language_mix: dict = field(default_factory=dict)  # zh / en / other -> tokens sampled
    language_from: str = "script"  # "lang field", "script" or "lang field and script"
    zh_en_ratio: float | None = None  # Chinese tokens per English token; None without English
    warnings: list = field(default_factory=list)
    read_note: str | None = None  # set when the file was read only as far as the draw needed
    piece_lengths: list = field(default_factory=list, repr=False)
    piece_fates: list = field(default_factory=list, repr=False)

    @property
    def dropped_pieces(self) -> int:
        return sum(d["pieces"] for d in self.dropped.values())

    @property
    def dropped_tokens(self) -> int:
        return sum(d["tokens"] for d in self.dropped.values())

    def histogram(self, bins: int = 16) -> dict:
        """Token-length histogram of every piece by fate: ``{"edges": [...], "counts": {fate: [...]}}``.

        Bins cover 0..seq_len; one extra last bin holds pieces longer than seq_len.
        """
        width = max(1, -(-self.seq_len // bins))
        edges = [i * width for i in range(bins + 1)]
        fates = ("sampled", "unused", *DROP_REASONS)
        counts = {f: [0] * (bins + 1) for f in fates}
        for n, fate in zip(self.piece_lengths, self.piece_fates):
            i = bins if n > self.seq_len else min(n // width, bins - 1)
            counts[fate][i] += 1
        return {"edges": edges, "overflow_from": self.seq_len, "counts": {f: c for f, c in counts.items() if any(c)}}

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("piece_lengths")
        d.pop("piece_fates")
        d["dropped_pieces"] = self.dropped_pieces
        d["dropped_tokens"] = self.dropped_tokens
        d["histogram"] = self.histogram()
        return d

    def summary_lines(self) -> list[str]:
        """The report in a few sentences, for a CLI or a panel."""
        lines = [f"{self.samples} samples, {self.tokens:,} tokens kept (asked for {self.requested} of up to "
                 f"{self.seq_len} tokens) from {self.records} {self.format} record(s) in {self.path}"]
        if self.read_note:
            lines.append(self.read_note)
        if self.split_records:
            lines.append(f"{self.split_records} record(s) longer than {self.seq_len} tokens were split into "
                         f"{self.split_chunks} chunks")
        unused = self.available - self.samples
        if unused:
            lines.append(f"{unused} usable chunk(s) not drawn by the sample (seed {self.seed})")
        for reason in DROP_REASONS:
            d = self.dropped.get(reason)
            if d and d["pieces"]:
                what = {"empty": "empty", "too_short": f"shorter than {self.min_tokens} tokens",
                        "too_long": f"longer than {self.seq_len} tokens"}[reason]
                where = ", ".join(d["where"]) + (", ..." if d["pieces"] > len(d["where"]) else "")
                lines.append(f"dropped {d['pieces']} piece(s), {d['tokens']:,} tokens, {what}: {where}")
        if self.language_mix:
            mix = ", ".join(f"{k} {v:,}" for k, v in sorted(self.language_mix.items()))
            lines.append(f"language mix by tokens ({self.language_from}): {mix}")
        lines.extend(f"warning: {w}" for w in self.warnings)
        return lines


# ---------------------------------------------------------------- the calibration set

@dataclass
class CalibrationSet:
    """Token-id samples to calibrate on, each at most ``seq_len`` long, and their coverage report."""

    samples: list[torch.Tensor]
    report: CoverageReport
    seq_len: int
    where: list[str] = field(default_factory=list)  # per sample: the record (and chunk) it came from
    strata: list[str] = field(default_factory=list)
    langs: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    @property
    def fingerprint(self) -> str:
        """A hash of the token ids themselves: equal fingerprints calibrate identically."""
        h = hashlib.sha256()
        for s in self.samples:
            h.update(len(s).to_bytes(8, "little"))
            h.update(s.to(torch.int64).numpy().tobytes())
        return h.hexdigest()[:16]

    def batches(self, batch_size: int = 8) -> Iterator[torch.Tensor]:
        """``[batch, length]`` tensors of equal-length samples (no padding, so no padding statistics)."""
        by_len: dict[int, list[torch.Tensor]] = {}
        for s in self.samples:
            by_len.setdefault(len(s), []).append(s)
        for length in sorted(by_len, reverse=True):
            group = by_len[length]
            for i in range(0, len(group), batch_size):
                yield torch.stack(group[i:i + batch_size])

    def num_batches(self, batch_size: int = 8) -> int:
        counts: dict[int, int] = {}
        for s in self.samples:
            counts[len(s)] = counts.get(len(s), 0) + 1
        return sum(-(-c // batch_size) for c in counts.values())


@dataclass
class _Piece:
    ids: list[int]
    where: str
    stratum: str
    lang: str | None  # from the record's lang field, if any
    text: str | None  # the record's text when the piece is the whole record (language detection)


def _allocate(sizes: dict[str, int], n: int) -> dict[str, int]:
    """Split ``n`` draws over strata in proportion to their sizes (largest remainder), each >= 1 if possible."""
    total = sum(sizes.values())
    exact = {k: n * v / total for k, v in sizes.items()}
    quota = {k: int(x) for k, x in exact.items()}
    for k in sorted(sizes, key=lambda k: (-(exact[k] - quota[k]), list(sizes).index(k)))[:n - sum(quota.values())]:
        quota[k] += 1
    if n >= len(sizes):
        for k in sizes:
            if quota[k] == 0:  # a small stratum still gets one sample, taken from the biggest share
                donor = max(quota, key=lambda j: (quota[j], sizes[j]))
                quota[donor] -= 1
                quota[k] = 1
    return quota


def _drop(report: CoverageReport, reason: str, tokens: int, where: str) -> None:
    """Count a dropped piece under its reason (naming the first few places) and in the histogram."""
    d = report.dropped.setdefault(reason, {"pieces": 0, "tokens": 0, "where": []})
    d["pieces"] += 1
    d["tokens"] += tokens
    if len(d["where"]) < MAX_WHERE:
        d["where"].append(where)
    report.piece_lengths.append(tokens)
    report.piece_fates.append(reason)


def _stratum(rec: TextRecord, has_source: bool, has_lang: bool) -> str:
    parts = []
    if has_source:
        parts.append(rec.source or "-")
    if has_lang:
        parts.append(normalize_lang(rec.lang) if rec.lang else "-")
    return "/".join(parts) or "all"


def load_calibration_set(path: str | Path | None = None, *, tokenizer, samples: int = DEFAULT_SAMPLES,
                         seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0, bilingual: bool = False,
                         min_tokens: int | None = None, split_long: bool = True) -> CalibrationSet:
    """Read ``path`` (default: the demo model's calibration text), tokenize, split, and draw ``samples``.

    ``bilingual=True`` says the set is meant for a Chinese-English model: the report then warns
    when Chinese:English (by tokens) is below 1:1. ``split_long=False`` drops records longer than
    ``seq_len`` (as "too long") instead of splitting them.
    """
    if tokenizer is None:
        raise ValueError("a tokenizer is needed to cut calibration text into tokens; load the model with its "
                         "tokenizer (load_model(..., load_tokenizer=True))")
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 tokens, got {seq_len}")
    min_tokens = min(DEFAULT_MIN_TOKENS, seq_len) if min_tokens is None else min_tokens
    if not 1 <= min_tokens <= seq_len:
        raise ValueError(f"min_tokens must be between 1 and seq_len ({seq_len}), got {min_tokens}")
    if path is None:
        path = demo_text_path("calibration")
    extent = ReadExtent(str(path))
    fmt, stream = iter_records(path, extent=extent)
    limit = max(samples * seq_len, MIN_POOL_TOKENS)  # read as far as the draw needs, never the whole of a big file
    entries: list[tuple[TextRecord, list[int]]] = []
    if fmt == "text":  # one document, in pieces: its tokens are the pieces' tokens in order
        ids: list[int] = []
        parts: list[str] = []
        for rec in stream:
            ids.extend(tokenize_bounded(tokenizer, rec.text, max_tokens=limit - len(ids)))
            parts = parts + [rec.text] if len(parts) < 2 else parts
            if len(ids) >= limit:
                break
        entries.append((TextRecord(parts[0] if len(parts) == 1 else "", "whole file"), ids))
    else:
        usable = 0
        for rec in stream:
            ids = tokenize_bounded(tokenizer, rec.text, max_tokens=limit) if rec.text.strip() else []
            entries.append((rec, ids))
            usable += len(ids) if len(ids) >= min_tokens else 0
            if usable >= limit:
                break
    records = [rec for rec, _ in entries]
    has_source = any(r.source for r in records)
    has_lang = any(r.lang for r in records)
    report = CoverageReport(str(path), fmt, len(records), seq_len, min_tokens, samples, seed, bilingual)
    report.read_note = extent.note(f"enough for {samples} samples of {seq_len} tokens")

    pieces: list[_Piece] = []
    for rec, ids in entries:
        stratum = _stratum(rec, has_source, has_lang)
        if not ids:
            _drop(report, "empty", 0, rec.where)
        elif len(ids) < min_tokens:
            _drop(report, "too_short", len(ids), rec.where)
        elif len(ids) <= seq_len:
            pieces.append(_Piece(ids, rec.where, stratum, rec.lang, rec.text or None))
        elif not split_long:
            _drop(report, "too_long", len(ids), rec.where)
        else:
            report.split_records += 1
            starts = range(0, len(ids), seq_len)
            for c, start in enumerate(starts):
                chunk = ids[start:start + seq_len]
                where = f"{rec.where}, chunk {c + 1}/{len(starts)}"
                if len(chunk) < min_tokens:
                    _drop(report, "too_short", len(chunk), where)
                else:
                    report.split_chunks += 1
                    pieces.append(_Piece(chunk, where, stratum, rec.lang, None))
    report.available = len(pieces)
    report.available_tokens = sum(len(p.ids) for p in pieces)
    if not pieces:
        reasons = "; ".join(f"{d['pieces']} {r.replace('_', ' ')}" for r, d in report.dropped.items())
        hint = "raise --seq-len, or split long records yourself" if "too_long" in report.dropped else \
            f"give records of at least {min_tokens} tokens (in plain text a record is a paragraph: join short lines " \
            "and separate paragraphs by blank lines)"
        raise DataError(f"calibration file '{path}' gave no usable samples ({reasons}; pieces need {min_tokens} to "
                        f"{seq_len} tokens): {hint}")

    # seeded, stratified draw
    groups: dict[str, list[int]] = {}
    for k, p in enumerate(pieces):
        groups.setdefault(p.stratum, []).append(k)
    if len(pieces) <= samples:
        chosen = set(range(len(pieces)))
        if len(pieces) < samples:
            report.warnings.append(
                f"asked for {samples} samples but only {len(pieces)} usable chunk(s) of up to {seq_len} tokens "
                f"exist ({report.available_tokens:,} tokens): add text or lower --seq-len")
    else:
        rng = random.Random(seed)
        quota = _allocate({k: len(v) for k, v in groups.items()}, samples)
        chosen = set()
        for k, members in groups.items():
            chosen.update(rng.sample(members, quota[k]))
    order = sorted(chosen)

    for k, p in enumerate(pieces):
        report.piece_lengths.append(len(p.ids))
        report.piece_fates.append("sampled" if k in chosen else "unused")

    cs = CalibrationSet([], report, seq_len)
    mix: dict[str, int] = {}
    sources = set()
    for k in order:
        p = pieces[k]
        cs.samples.append(torch.tensor(p.ids, dtype=torch.long))
        cs.where.append(p.where)
        cs.strata.append(p.stratum)
        if p.lang:
            lang = normalize_lang(p.lang)
            sources.add("lang field")
        else:
            lang = detect_language(p.text if p.text is not None else tokenizer.decode(p.ids))
            sources.add("script")
        cs.langs.append(lang)
        mix[lang] = mix.get(lang, 0) + len(p.ids)
    for name, members in groups.items():
        picked = [k for k in members if k in chosen]
        report.strata[name] = {"available": len(members), "sampled": len(picked),
                               "tokens": sum(len(pieces[k].ids) for k in picked)}
    report.samples = len(cs.samples)
    report.tokens = cs.tokens
    report.language_mix = mix
    report.language_from = " and ".join(sorted(sources))
    zh, en = mix.get("zh", 0), mix.get("en", 0)
    report.zh_en_ratio = zh / en if en else None  # None: no English to compare with
    if bilingual and (zh < en or zh == 0):
        ratio = f"{zh / en:.2f}:1" if en else "0:0"
        report.warnings.append(
            f"Chinese:English is {ratio} by tokens ({zh:,} zh, {en:,} en), below 1:1 for a bilingual model: "
            "add Chinese text (or records with lang 'zh') so both languages shape the activation ranges")
    elif bilingual and en == 0:
        report.warnings.append(f"no English text ({zh:,} zh tokens) in a set meant for a bilingual model: "
                               "add English text so both languages shape the activation ranges")
    for reason, d in report.dropped.items():
        if reason != "too_short" or d["tokens"] > 0.05 * report.available_tokens:
            report.warnings.append(f"{d['pieces']} piece(s) ({d['tokens']:,} tokens) dropped as "
                                   f"{reason.replace('_', ' ')}; see the coverage report")
    return cs

