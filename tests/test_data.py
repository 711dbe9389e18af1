"""Calibration text: formats, bad input messages, splitting, sampling, coverage and language mix."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from workbench.evaluation.data import (CalibrationSet, detect_language, load_calibration_set, normalize_lang, read_records,
                            script_counts)
from workbench.errors import DataError
from workbench.assets import DEMO_MODEL_DIR


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


EN = ("The quick brown fox jumps over the lazy dog while the compiler checks every function for errors. " * 3)
ZH = "今天我们讨论量化模型在边缘设备上的部署方法，以及如何衡量精度损失。" * 3


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- reading

def test_read_plain_text_is_one_document(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("hello\n\nworld\n", encoding="utf-8")
    records, fmt = read_records(p)
    assert fmt == "text" and len(records) == 1 and records[0].text == "hello\n\nworld\n"


def test_read_jsonl_with_source_and_lang(tmp_path):
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": "a", "source": "wiki", "lang": "en"}, {"text": "b"}])
    records, fmt = read_records(p)
    assert fmt == "jsonl"
    assert [(r.text, r.source, r.lang, r.where) for r in records] == [("a", "wiki", "en", "line 1"),
                                                                       ("b", None, None, "line 2")]


def test_read_alpaca_joins_fields(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps([{"instruction": "Translate", "input": "cat", "output": "chat"},
                             {"instruction": "Say hi", "output": "hi"}]), encoding="utf-8")
    records, fmt = read_records(p)
    assert fmt == "alpaca"
    assert records[0].text == "Translate\n\ncat\n\nchat" and records[1].text == "Say hi\n\nhi"
    assert records[1].where == "record 2"


def test_jsonl_line_may_be_an_alpaca_record(tmp_path):
    p = write_jsonl(tmp_path / "c.jsonl", [{"instruction": "Name a colour", "input": None, "output": "blue"}])
    records, _ = read_records(p)
    assert records[0].text == "Name a colour\n\nblue" and records[0].where == "line 1"


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"calibration file '.*nope\.jsonl' does not exist"):
        read_records(tmp_path / "nope.jsonl")


def test_directory_is_rejected(tmp_path):
    with pytest.raises(DataError, match="is a directory"):
        read_records(tmp_path)


def test_empty_file(tmp_path):
    p = tmp_path / "e.txt"
    p.write_text("  \n\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"calibration file '.*e\.txt' is empty"):
        read_records(p)


def test_empty_json_list(tmp_path):
    p = tmp_path / "e.json"
    p.write_text("[]", encoding="utf-8")
    with pytest.raises(DataError, match="empty JSON list"):
        read_records(p)


def test_not_utf8(tmp_path):
    p = tmp_path / "b.txt"
    p.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(DataError, match=r"'.*b\.txt' is not UTF-8 text .* at byte 3"):
        read_records(p)


def test_jsonl_missing_text_names_line_and_field(tmp_path):
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, {"text": "ok"}, {"body": "no text here", "id": 3}])
    with pytest.raises(DataError) as e:
        read_records(p)
    msg = str(e.value)
    assert "c.jsonl' line 3" in msg and "missing field 'text'" in msg and "'body', 'id'" in msg


def test_jsonl_invalid_json_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "fine"}\n\n{"text": "broken",\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl' line 3: not valid JSON"):
        read_records(p)


def test_jsonl_raw_line_separator_inside_a_string_is_text(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028/U+2029/U+0085 raw; only \\n ends a JSONL record."""
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": "one\u2028two"}, {"text": "three\u2029\x85four"}, {"body": 1}])
    with pytest.raises(DataError, match=r"c\.jsonl' line 3: missing field 'text'"):
        read_records(p)
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "one\u2028two"}, {"text": "three"}])
    records, fmt = read_records(p)
    assert fmt == "jsonl" and [r.text for r in records] == ["one\u2028two", "three"]
    assert [r.where for r in records] == ["line 1", "line 2"]


def test_jsonl_line_not_an_object(tmp_path):
    p = write_jsonl(tmp_path / "c.jsonl", [["a", "list"]])
    with pytest.raises(DataError, match=r"line 1: expected a JSON object .* got array"):
        read_records(p)


@pytest.mark.parametrize("row, field, got", [
    ({"text": 42}, "text", "integer"),
    ({"text": None}, "text", "null"),
    ({"text": "x", "source": ["a"]}, "source", "array"),
    ({"text": "x", "lang": 1.5}, "lang", "number"),
    ({"instruction": "x", "output": {"a": 1}}, "output", "object"),
    ({"instruction": 7, "output": "y"}, "instruction", "integer"),
])
def test_wrong_types_name_the_field(tmp_path, row, field, got):
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": "fine"}, row])
    with pytest.raises(DataError, match=rf"line 2: field '{field}' must be a string, got {got}"):
        read_records(p)


def test_alpaca_missing_output_names_record(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "q", "input": ""}]))
    with pytest.raises(DataError) as e:
        read_records(p)
    assert "a.json' record 2: Alpaca record is missing field 'output'" in str(e.value)
    assert "'instruction', 'input'" in str(e.value)


def test_alpaca_missing_instruction(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps([{"output": "b"}]))
    with pytest.raises(DataError, match="record 1: Alpaca record is missing field 'instruction'"):
        read_records(p)


def test_json_not_a_list_and_invalid_json(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps({"instruction": "a"}))
    with pytest.raises(DataError, match="holds a JSON object; expected a list of records"):
        read_records(p)
    p.write_text('[{"instruction": "a",}]')
    with pytest.raises(DataError, match=r"a\.json' is not valid JSON .* line 1 column"):
        read_records(p)


# ---------------------------------------------------------------- language

def test_script_counts_and_detection():
    assert script_counts("abc 中文字") == (3, 3)
    assert detect_language(ZH) == "zh" and detect_language(EN) == "en" and detect_language("1234 !!") == "other"
    assert detect_language("我们用 PyTorch 训练模型") == "zh"  # a few English terms in Chinese text
    assert normalize_lang("zh-CN") == "zh" and normalize_lang("en_US") == "en" and normalize_lang("Chinese") == "zh"
    assert normalize_lang("fr") == "fr"


def test_bilingual_warning_when_chinese_below_english(tmp_path, tok):
    rows = [{"text": EN} for _ in range(6)] + [{"text": ZH} for _ in range(2)]
    p = write_jsonl(tmp_path / "mix.jsonl", rows)
    cs = load_calibration_set(p, tokenizer=tok, samples=8, seq_len=256, min_tokens=4, bilingual=True)
    r = cs.report
    assert set(r.language_mix) == {"en", "zh"} and r.language_from == "script"
    assert r.zh_en_ratio == pytest.approx(r.language_mix["zh"] / r.language_mix["en"])
    assert r.zh_en_ratio < 1
    assert any("Chinese:English is" in w and "below 1:1" in w for w in r.warnings)
    # the same set not meant for a bilingual model: no warning
    cs = load_calibration_set(p, tokenizer=tok, samples=8, seq_len=256, min_tokens=4)
    assert not any("Chinese:English" in w for w in cs.report.warnings)


def test_no_bilingual_warning_when_chinese_dominates(tmp_path, tok):
    rows = [{"text": EN, "lang": "en"}] + [{"text": ZH, "lang": "zh-CN"} for _ in range(4)]
    p = write_jsonl(tmp_path / "mix.jsonl", rows)
    cs = load_calibration_set(p, tokenizer=tok, samples=8, seq_len=256, min_tokens=4, bilingual=True)
    assert cs.report.language_from == "lang field"
    assert cs.report.zh_en_ratio > 1
    assert not any("Chinese" in w for w in cs.report.warnings)
    assert cs.langs.count("en") == 1 and cs.langs.count("zh") >= 4  # Chinese text may split into chunks


# ---------------------------------------------------------------- splitting, dropping, sampling

def test_long_text_is_split_not_dropped(tmp_path, tok):
    p = tmp_path / "long.txt"
    p.write_text(EN * 20, encoding="utf-8")
    n = len(tok(EN * 20, add_special_tokens=False)["input_ids"])
    cs = load_calibration_set(p, tokenizer=tok, samples=1000, seq_len=64, min_tokens=8)
    r = cs.report
    assert r.split_records == 1
    tail = n % 64
    expect_chunks = n // 64 + (1 if tail >= 8 else 0)
    assert r.split_chunks == expect_chunks == len(cs.samples)
    assert all(len(s) <= 64 for s in cs.samples)
    assert r.tokens + r.dropped_tokens == n  # every token is either kept or counted as dropped
    assert any("split into" in line for line in r.summary_lines())
    assert any("asked for 1000 samples" in w for w in r.warnings)


def test_split_long_false_drops_as_too_long(tmp_path, tok):
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": EN * 10}, {"text": EN}])
    cs = load_calibration_set(p, tokenizer=tok, samples=4, seq_len=200, min_tokens=8, split_long=False)
    assert cs.report.dropped["too_long"]["pieces"] == 1 and cs.report.dropped["too_long"]["where"] == ["line 1"]
    assert len(cs) == 1 and any("too long" in w for w in cs.report.warnings)


def test_drops_are_counted_with_reasons(tmp_path, tok):
    rows = [{"text": EN}, {"text": ""}, {"text": "   "}, {"text": "hi"}, {"text": EN}]
    p = write_jsonl(tmp_path / "c.jsonl", rows)
    cs = load_calibration_set(p, tokenizer=tok, samples=10, seq_len=256, min_tokens=8)
    r = cs.report
    assert r.dropped["empty"] == {"pieces": 2, "tokens": 0, "where": ["line 2", "line 3"]}
    assert r.dropped["too_short"]["pieces"] == 1 and r.dropped["too_short"]["where"] == ["line 4"]
    assert len(cs) == 2 and cs.where == ["line 1", "line 5"]
    text = "\n".join(r.summary_lines())
    assert "dropped 2 piece(s), 0 tokens, empty: line 2, line 3" in text
    assert "shorter than 8 tokens: line 4" in text
    hist = r.histogram(bins=8)
    assert sum(hist["counts"]["empty"]) == 2 and sum(hist["counts"]["sampled"]) == 2
    d = r.to_dict()
    assert d["dropped_pieces"] == 3 and d["samples"] == 2 and "piece_lengths" not in d


def test_all_too_long_without_splitting(tmp_path, tok):
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": EN * 10}])
    with pytest.raises(DataError, match=r"no usable samples \(1 too long; .*raise --seq-len, or split long records yourself"):
        load_calibration_set(p, tokenizer=tok, samples=4, seq_len=64, split_long=False)


def test_empty_dataset_after_filtering(tmp_path, tok):
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": ""}, {"text": "hi"}])
    with pytest.raises(DataError, match=r"c\.jsonl' gave no usable samples \(1 empty; 1 too short; pieces need 8 "
                                        r"to 64 tokens\): give records of at least 8 tokens \(in plain text a "
                                        r"record is a paragraph"):
        load_calibration_set(p, tokenizer=tok, samples=4, seq_len=64, min_tokens=8)


def test_bad_parameters(tmp_path, tok):
    p = tmp_path / "c.txt"
    p.write_text(EN, encoding="utf-8")
    with pytest.raises(ValueError, match="a tokenizer is needed"):
        load_calibration_set(p, tokenizer=None)
    with pytest.raises(ValueError, match="samples must be at least 1"):
        load_calibration_set(p, tokenizer=tok, samples=0)
    with pytest.raises(ValueError, match="min_tokens must be between 1 and seq_len"):
        load_calibration_set(p, tokenizer=tok, seq_len=16, min_tokens=32)


def test_sampling_is_seeded_and_stratified(tmp_path, tok):
    rows = [{"text": f"{EN} number {i}", "source": "big"} for i in range(30)] + \
           [{"text": f"{EN} item {i}", "source": "small"} for i in range(10)]
    p = write_jsonl(tmp_path / "c.jsonl", rows)
    a = load_calibration_set(p, tokenizer=tok, samples=8, seq_len=256, seed=1)
    b = load_calibration_set(p, tokenizer=tok, samples=8, seq_len=256, seed=1)
    c = load_calibration_set(p, tokenizer=tok, samples=8, seq_len=256, seed=2)
    assert a.where == b.where and a.fingerprint == b.fingerprint
    assert a.where != c.where and a.fingerprint != c.fingerprint
    assert a.report.strata == {"big": {"available": 30, "sampled": 6, "tokens": a.report.strata["big"]["tokens"]},
                               "small": {"available": 10, "sampled": 2, "tokens": a.report.strata["small"]["tokens"]}}
    assert a.strata.count("big") == 6 and a.report.available - a.report.samples == 32


def test_small_stratum_gets_at_least_one(tmp_path, tok):
    rows = [{"text": EN, "source": "big"} for _ in range(50)] + [{"text": EN, "source": "rare"}]
    p = write_jsonl(tmp_path / "c.jsonl", rows)
    cs = load_calibration_set(p, tokenizer=tok, samples=4, seq_len=256)
    assert cs.report.strata["rare"]["sampled"] == 1 and len(cs) == 4


def test_batches_group_equal_lengths(tmp_path, tok):
    p = tmp_path / "c.txt"
    p.write_text(EN * 12, encoding="utf-8")
    cs = load_calibration_set(p, tokenizer=tok, samples=100, seq_len=32, min_tokens=4)
    batches = list(cs.batches(4))
    assert len(batches) == cs.num_batches(4)
    assert sum(b.shape[0] for b in batches) == len(cs)
    assert sum(b.numel() for b in batches) == cs.tokens
    assert isinstance(cs, CalibrationSet)


def test_default_is_the_demo_calibration_text(tok):
    cs = load_calibration_set(tokenizer=tok, samples=4, seq_len=128)
    assert cs.report.path.endswith("calibration.txt") and len(cs) == 4
    assert all(s.dtype.is_floating_point is False and s.dim() == 1 and len(s) <= 128 for s in cs.samples)


# ---------------------------------------------------------------- bounded reading

def test_plain_text_without_newlines_is_read_in_pieces_like_a_whole_read(tmp_path, tok, monkeypatch):
    """A one-line text cut into many pieces gives (nearly) the tokens of one whole-text call, as one record."""
    import workbench.evaluation.textio as textio
    text = EN * 40  # ~12 k characters, no newline
    p = tmp_path / "one.txt"
    p.write_text(text, encoding="utf-8")
    whole = load_calibration_set(p, tokenizer=tok, samples=4, seq_len=64)
    monkeypatch.setattr(textio, "PIECE_CHARS", 500)
    monkeypatch.setattr(textio.iter_text, "__kwdefaults__", {"piece_chars": 500, "extent": None,
                                                              "hint": "pass a UTF-8 text file"})
    pieces = load_calibration_set(p, tokenizer=tok, samples=4, seq_len=64)
    assert pieces.report.records == 1 and pieces.report.read_note is None
    assert abs(pieces.report.available_tokens - whole.report.available_tokens) <= len(text) // 500 + 1


def test_a_large_jsonl_is_read_only_as_far_as_the_draw_needs(tmp_path, tok):
    from workbench.evaluation.data import MIN_POOL_TOKENS
    p = write_jsonl(tmp_path / "big.jsonl", [{"text": EN * 4}] * (MIN_POOL_TOKENS // 60))
    cs = load_calibration_set(p, tokenizer=tok, samples=8, seq_len=64)
    assert len(cs) == 8 and cs.report.read_note and "read only the first" in cs.report.read_note
    assert cs.report.read_note in cs.report.summary_lines()


def test_a_jsonl_line_too_long_to_parse_is_refused(tmp_path, monkeypatch):
    import workbench.evaluation.data as data
    monkeypatch.setattr(data, "MAX_RECORD_BYTES", 1 << 20)
    p = write_jsonl(tmp_path / "c.jsonl", [{"text": "short"}, {"text": "x " * (1 << 20)}])
    with pytest.raises(DataError, match=r"c\.jsonl' line 2 is longer than 1 MB; split it"):
        read_records(p)
    q = tmp_path / "c.json"
    q.write_text(json.dumps([{"text": "x " * (1 << 20)}]))
    with pytest.raises(DataError, match=r"c\.json' is 2 MB, more than the 1 MB .* write it as \.jsonl"):
        read_records(q)


@pytest.mark.slow
def test_calibration_on_a_100mb_one_line_text_stays_bounded(tmp_path):
    """The case of the report: 8 x 128 tokens from a text that is one 100 MB line, in a child process."""
    import sys

    from conftest import run_measured
    big = tmp_path / "big.txt"
    words = "the quick brown fox jumps over the lazy dog and keeps running far away " * 10000
    with open(big, "w", encoding="utf-8") as f:
        for _ in range(100 * 1024 * 1024 // len(words) + 1):
            f.write(words)
    code = ("import json, sys; from transformers import AutoTokenizer; from workbench.evaluation.data import load_calibration_set;"
            "from workbench.assets import DEMO_MODEL_DIR; tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR);"
            "cs = load_calibration_set(sys.argv[1], tokenizer=tok, samples=8, seq_len=128);"
            "print(json.dumps({'n': len(cs), 'lens': [len(s) for s in cs.samples], 'note': cs.report.read_note,"
            "'first': tok.decode(cs.samples[0][:8])}))")
    done, peak = run_measured([sys.executable, "-c", code, str(big)])
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["n"] == 8 and out["lens"] == [128] * 8
    assert out["first"].split()[0] in words.split() and "read only the first" in out["note"]
    assert peak < 1.5 * 1024 ** 3, f"peak resident memory {peak / 1024 ** 3:.2f} GB"
