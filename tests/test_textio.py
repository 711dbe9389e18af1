"""Text read in bounded pieces: any line structure (one 100 MB line included), read only as far as needed."""
from __future__ import annotations

import json
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import run_measured  # noqa: E402
from workbench.errors import DataError  # noqa: E402
from workbench.evaluation.textio import READ_BYTES, iter_text, read_tokens, split_text, tokenize_bounded  # noqa: E402

BOUNDED = settings(max_examples=40, derandomize=True, deadline=None, database=None)
# text without any newline: words, runs of spaces and tabs, long unbroken runs, non-ASCII
no_newline = st.lists(st.sampled_from(list("ab c\tdé中文 ") + ["xxxxxxxxxxxxxxxxxxxxxxxx", "   "]),
                      max_size=120).map("".join)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from workbench.model.load import DEMO_MODEL_DIR
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@BOUNDED
@given(no_newline, st.integers(4, 64))
def test_split_text_pieces_are_bounded_and_join_back(text, piece_chars):
    pieces = list(split_text(text, piece_chars))
    assert "".join(pieces) == text
    assert all(0 < len(p) <= piece_chars for p in pieces)


@BOUNDED
@given(no_newline.filter(str.strip), st.integers(4, 64))
def test_a_file_without_newlines_streams_back_whole(tmp_path_factory, text, piece_chars):
    p = tmp_path_factory.mktemp("nl") / "t.txt"
    p.write_text(text, encoding="utf-8")
    pieces = list(iter_text(p, piece_chars=piece_chars))
    assert "".join(pieces) == text and all(len(x) <= piece_chars for x in pieces)


def test_newlines_are_folded_across_read_boundaries(tmp_path):
    p = tmp_path / "t.txt"
    raw = b"a" * (READ_BYTES - 1) + b"\r\nb\rc\r\n"
    p.write_bytes(raw)
    assert "".join(iter_text(p)) == raw.decode().replace("\r\n", "\n").replace("\r", "\n")


def test_bad_utf8_is_named_at_its_byte_in_a_later_read(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"a" * (READ_BYTES + 5) + b"\xff tail")
    with pytest.raises(DataError, match=rf"'.*t\.txt' is not UTF-8 text .* at byte {READ_BYTES + 5}\)"):
        list(iter_text(p))


def test_directory_and_missing_and_blank(tmp_path):
    with pytest.raises(DataError, match=r"text path '.*' is a directory; pass a UTF-8 text file"):
        list(iter_text(tmp_path))
    with pytest.raises(DataError, match="does not exist"):
        list(iter_text(tmp_path / "nope.txt"))
    (tmp_path / "b.txt").write_text(" \n\t " * 100)
    with pytest.raises(DataError, match="is empty"):
        list(iter_text(tmp_path / "b.txt"))


def test_short_text_tokenizes_as_one_call(tok):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    assert tokenize_bounded(tok, text) == tok(text, add_special_tokens=False)["input_ids"]
    # cut in pieces the ids stay close to the whole-text ids (a cut lies before a space)
    pieces = tokenize_bounded(tok, text, piece_chars=64)
    assert abs(len(pieces) - len(tokenize_bounded(tok, text))) <= len(text) // 64 + 1


def test_read_tokens_stops_at_the_budget_and_says_so(tmp_path, tok):
    p = tmp_path / "big.txt"
    p.write_text("lorem ipsum dolor sit amet " * 200_000, encoding="utf-8")  # 5.4 MB, one line
    ids, extent = read_tokens(tok, p, max_tokens=1000)
    assert len(ids) == 1000 and extent.partial and extent.bytes_read < p.stat().st_size / 4
    assert "read only the first" in extent.note() and str(p) in extent.note()
    small = tmp_path / "s.txt"
    small.write_text("lorem ipsum dolor sit amet " * 10, encoding="utf-8")
    ids, extent = read_tokens(tok, small, max_tokens=1000)
    assert not extent.partial and extent.note() is None and len(ids) < 1000


def _big_one_line_file(path, mb: int) -> None:
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
             "upsilon phi chi psi omega ") * 4000
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(mb * 1024 * 1024 // len(words) + 1):
            f.write(words)  # never a newline


@pytest.mark.slow
def test_eval_on_a_100mb_one_line_text_stays_bounded(tmp_path):
    """`eval --text` reads only its token budget of a huge one-line text, in bounded memory, and says so."""
    big = tmp_path / "big.txt"
    _big_one_line_file(big, 100)
    done, peak = run_measured([sys.executable, "-m", "workbench", "eval", "demo", "--text", str(big),
                                    "--max-tokens", "600", "--ctx", "128", "--json"])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["tokens"] == 600 - out["windows"] and out["text_read"]["partial"]  # a window scores from its 2nd
    assert out["text_read"]["bytes_read"] < 4 * 1024 * 1024
    # generous: the model, its runtime and the scoring take 0.5-1.7 GB here; reading the whole file took ~10 GB
    assert peak < 3 * 1024 ** 3, f"peak resident memory {peak / 1024 ** 3:.2f} GB"
