"""Text files read in bounded pieces, whatever their line structure, and tokenized as far as a step needs.

A 200 MB text that is one line must not be held, split or tokenized whole: the file is decoded
``READ_BYTES`` at a time and cut into pieces of at most ``PIECE_CHARS`` characters just before a
whitespace character (a hard cut only where a window holds no whitespace at all), and each piece
is tokenized on its own, so memory is bounded by the piece size and by the tokens asked for. A
text shorter than one piece is tokenized exactly as a whole-text call would; a cut costs at most
a token's difference at each piece boundary.

    ids, extent = read_tokens(tokenizer, "big.txt", max_tokens=4096)
    extent.note()   # "read 1.0 MB of 200.0 MB of 'big.txt': ..." when the file was read only partly
"""
from __future__ import annotations

import codecs
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..errors import DataError

__all__ = ["PIECE_CHARS", "READ_BYTES", "ReadExtent", "check_text_path", "iter_text", "split_text",
           "tokenize_bounded", "read_tokens", "text_token_ids", "decode_error"]

PIECE_CHARS = 1 << 18  # 256 Ki characters per tokenizer call: tens of MB at most inside a fast tokenizer
READ_BYTES = 1 << 16  # bytes decoded at a time


@dataclass
class ReadExtent:
    """How much of a file a step read: the whole file, or only as far as it needed."""

    path: str
    bytes_read: int = 0
    file_bytes: int = 0
    complete: bool = False  # the end of the file was reached

    @property
    def partial(self) -> bool:
        return not self.complete and self.bytes_read < self.file_bytes

    def note(self, why: str = "enough for this step") -> str | None:
        """One sentence when the file was read only partly (None when it was read to its end)."""
        if not self.partial:
            return None
        mb = 1024 * 1024
        return (f"read only the first {self.bytes_read / mb:.1f} MB of {self.file_bytes / mb:.1f} MB of "
                f"'{self.path}' ({why}); the rest was not read")

    def to_dict(self) -> dict:
        return {"path": self.path, "bytes_read": self.bytes_read, "file_bytes": self.file_bytes,
                "partial": self.partial}


def check_text_path(path: str | Path, kind: str = "text", hint: str = "pass a UTF-8 text file") -> Path:
    """``path`` as a Path, or a DataError saying it is missing or a directory."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"{kind} path '{p}' is a directory; {hint}")
    if not p.is_file():
        raise DataError(f"{kind} file '{p}' does not exist; {hint}")
    return p


def decode_error(p: Path, kind: str, reason: str, at: int) -> DataError:
    return DataError(f"{kind} file '{p}' is not UTF-8 text ({reason} at byte {at}); convert it to UTF-8")


def _decoded(p: Path, kind: str, extent: ReadExtent) -> Iterator[str]:
    """The file's text ``READ_BYTES`` at a time, newlines folded as text mode does (\\r\\n and \\r to \\n)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    carry = ""
    with open(p, "rb") as f:
        while True:
            b = f.read(READ_BYTES)
            pending = len(dec.getstate()[0])
            try:
                s = dec.decode(b, final=not b)
            except UnicodeDecodeError as e:
                raise decode_error(p, kind, e.reason, extent.bytes_read - pending + e.start) from None
            extent.bytes_read += len(b)
            s = carry + s
            carry = ""
            if b and s.endswith("\r"):
                s, carry = s[:-1], "\r"  # a \r\n may straddle two reads
            if s:
                yield s.replace("\r\n", "\n").replace("\r", "\n")
            if not b:
                extent.complete = True
                return


def _cut(buf: str, piece_chars: int) -> int:
    """Where to end a piece of at most ``piece_chars``: just before the last whitespace in its second half."""
    lo = piece_chars // 2
    best = max(buf.rfind(c, lo, piece_chars) for c in " \n\t")
    if best <= 0:
        best = max((i for i in (buf.rfind(c, lo, piece_chars) for c in "\r\x0b\x0c\u3000\xa0")), default=-1)
    return best if best > 0 else piece_chars


def split_text(text: str, piece_chars: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most ``piece_chars`` characters, cut before whitespace; they join back to ``text``."""
    start = 0
    while len(text) - start > piece_chars:
        cut = _cut(text[start:start + piece_chars], piece_chars)
        yield text[start:start + cut]
        start += cut
    if start < len(text):
        yield text[start:]


def iter_text(path: str | Path, kind: str = "text", *, piece_chars: int = PIECE_CHARS,
              extent: ReadExtent | None = None, hint: str = "pass a UTF-8 text file") -> Iterator[str]:
    """A text file in pieces of at most ``piece_chars`` characters, read only as far as the caller iterates.

    Raises DataError for a missing file, a directory, bytes that are not UTF-8 (naming the byte),
    and, once the end is reached, a file holding no text at all.
    """
    p = check_text_path(path, kind, hint)
    extent = extent if extent is not None else ReadExtent(str(p))
    extent.path, extent.file_bytes = str(p), p.stat().st_size
    buf, seen_text = "", False
    for s in _decoded(p, kind, extent):
        buf += s
        while len(buf) > piece_chars:
            cut = _cut(buf, piece_chars)
            piece, buf = buf[:cut], buf[cut:]
            seen_text = seen_text or bool(piece.strip())
            yield piece
    seen_text = seen_text or bool(buf.strip())
    if not seen_text:
        raise DataError(f"{kind} file '{p}' is empty; it needs text")
    if buf:
        yield buf


def tokenize_bounded(tokenizer, text: str, *, max_tokens: int | None = None,
                     piece_chars: int = PIECE_CHARS) -> list[int]:
    """Token ids of ``text`` (no special tokens), a piece at a time, stopping once ``max_tokens`` are had."""
    ids: list[int] = []
    for piece in split_text(text, piece_chars):
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        if max_tokens is not None and len(ids) >= max_tokens:
            return ids[:max_tokens]
    return ids


def read_tokens(tokenizer, path: str | Path, *, max_tokens: int | None = None, kind: str = "text",
                piece_chars: int = PIECE_CHARS) -> tuple[torch.Tensor, ReadExtent]:
    """The first ``max_tokens`` token ids of a text file (all with None), reading no further than needed.

    Returns ``(ids, extent)``; ``extent.note()`` says when the file was read only partly. Fewer
    than 2 tokens is an error: nothing could be scored.
    """
    extent = ReadExtent(str(path))
    parts: list[torch.Tensor] = []
    n = 0
    for piece in iter_text(path, kind, piece_chars=piece_chars, extent=extent):
        got = tokenizer(piece, add_special_tokens=False)["input_ids"]
        if max_tokens is not None:
            got = got[:max_tokens - n]
        parts.append(torch.tensor(got, dtype=torch.int32))
        n += len(got)
        if max_tokens is not None and n >= max_tokens:
            break
    ids = torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)
    if len(ids) < 2:
        raise DataError(f"{kind} file '{extent.path}' has only {len(ids)} token(s); at least 2 are needed to score "
                        "anything")
    return ids, extent


def text_token_ids(tokenizer, path: str | Path, max_tokens: int | None = None, kind: str = "text") -> torch.Tensor:
    """``read_tokens``'s ids; a partial read is said as a note on the ``workbench`` logger (the CLI prints it)."""
    ids, extent = read_tokens(tokenizer, path, max_tokens=max_tokens, kind=kind)
    note = extent.note(f"enough for {max_tokens:,} tokens" if max_tokens else "")
    if note:
        logging.getLogger("workbench").info(note)
    return ids
