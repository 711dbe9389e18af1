"""Property tests over the files a user feeds the workbench: plans, calibration text, model directories, ONNX.

Whatever the content, the reader the CLI calls either accepts it or raises a WorkbenchError whose
message is one line naming the file (and the line, record or field where there is one): the CLI
prints that line and exits 2, never a traceback, and leaves no output behind. Plans and ONNX files
go through the command line itself (``main``); calibration text and model directories through the
readers the commands call, and through ``workbench calibrate`` / ``workbench info`` whenever the reader
refuses. Examples are bounded and derandomized so the module runs in well under a minute in `make test`.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import shutil

import pytest

hypothesis = pytest.importorskip("hypothesis")  # pinned in requirements.txt
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from workbench.cli import error_line, main  # noqa: E402
from workbench.errors import DataError, ModelLoadError, PlanError, WorkbenchError  # noqa: E402

# `make test` runs a fixed, bounded set; WORKBENCH_PROPERTY_EXAMPLES=500 searches longer (and at random)
EXAMPLES = os.environ.get("WORKBENCH_PROPERTY_EXAMPLES")
BOUNDED = settings(max_examples=int(EXAMPLES or 25), derandomize=EXAMPLES is None, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_serial = itertools.count()

json_scalars = st.none() | st.booleans() | st.integers(-1000, 1000) | \
    st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("inputs")


def _fresh(scratch, name: str):
    """A new directory per example (hypothesis runs many examples inside one test call)."""
    d = scratch / f"{name}-{next(_serial)}"
    d.mkdir()
    return d


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


def _cli_refuses(argv: list[str], path) -> None:
    """The command exits 2 with one line on stderr naming ``path``: what the reader's error becomes."""
    rc, err = _cli(argv)
    assert rc == 2 and err.count("\n") == 1 and str(path) in err and "Traceback" not in err, err
    assert err.startswith(f"workbench {argv[0]}: error: "), err


def _calibrate_refuses(path) -> None:
    ws = path.parent / "ws"
    _cli_refuses(["calibrate", "demo", "--data", str(path), "--samples", "4", "--seq-len", "16", "--workspace",
                  str(ws), "--json"], path)
    assert not (ws / "calibrate").exists() or not any((ws / "calibrate").iterdir())  # nothing looks complete


def _assert_one_line_naming(e: WorkbenchError, path) -> str:
    line = error_line(e)
    assert "\n" not in line and line.startswith("error: ") and str(path) in line, line
    return line


# ------------------------------------------------------------------------------------------- plans

VALID_PLAN = {"version": 1, "default": "int4", "group_size": 32, "symmetric": True, "method": "rtn",
              "rules": [{"pattern": "lm_head", "precision": "fp16"}], "meta": {}}


@st.composite
def plan_files(draw):
    """A plan with some fields replaced by arbitrary JSON, or arbitrary JSON, or damaged text."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "json", "text"]))
    if kind == "json":
        return json.dumps(draw(json_values)), None
    if kind == "text":
        good = json.dumps(VALID_PLAN)
        return good[:draw(st.integers(0, len(good) - 1))] + draw(st.text(max_size=5)), None
    doc = dict(VALID_PLAN)
    field = draw(st.sampled_from(sorted(VALID_PLAN)))
    doc[field] = draw(json_values | st.sampled_from(["false", "one", "int3", "re:(", "*", 0, -1, 1.5, True]))
    return json.dumps(doc), field


@BOUNDED
@given(plan_files())
def test_any_plan_file_loads_or_is_refused_naming_the_file_and_field(scratch, case):
    from workbench.quantize.plan import PRECISIONS, QuantPlan
    text, field = case
    d = _fresh(scratch, "plan")
    path = d / "plan.json"
    path.write_text(text, encoding="utf-8")
    try:
        plan = QuantPlan.load(path)
    except PlanError as e:
        line = _assert_one_line_naming(e, path)
        if field is not None and "not valid JSON" not in line:
            assert field in line, line
        _cli_refuses(["quantize", "demo", "--plan", str(path), "--out", str(d / "out")], path)
        assert not (d / "out").exists()
        return
    # accepted: every field has the type the workbench relies on
    assert type(plan.version) is int and type(plan.symmetric) is bool and isinstance(plan.method, str)
    assert plan.group_size is None or (type(plan.group_size) is int and plan.group_size > 0)
    assert plan.default is None or plan.default.lower() in PRECISIONS
    assert all(isinstance(r.pattern, str) for r in plan.rules)


# ------------------------------------------------------------------------------ calibration text

texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # any character UTF-8 can hold
BAD_JSONL_LINES = st.sampled_from(['{"text": 5}', '{"body": "x"}', '["a list"]', '{"text": "open', "not json",
                                   '{"text": "a", "source": 3}', "null", '{"text": ["x"]}'])


@st.composite
def jsonl_files(draw):
    """JSONL lines (raw separators such as U+2028 inside strings, blank lines), maybe one bad line."""
    rows = draw(st.lists(texts, min_size=1, max_size=6))
    lines = []
    for t in rows:
        if draw(st.booleans()) and draw(st.booleans()):
            lines.append("")
        lines.append(json.dumps({"text": t}, ensure_ascii=False))
    bad_at = None
    if draw(st.booleans()):
        bad_at = draw(st.integers(0, len(lines)))
        lines.insert(bad_at, draw(BAD_JSONL_LINES))
    return "\n".join(lines) + "\n", rows, (None if bad_at is None else bad_at + 1)


@BOUNDED
@given(jsonl_files())
def test_jsonl_lines_are_read_or_the_bad_line_is_named(scratch, case):
    from workbench.evaluation.data import read_records
    text, rows, bad_line = case
    path = _fresh(scratch, "jsonl") / "calib.jsonl"
    path.write_text(text, encoding="utf-8")
    try:
        records, fmt = read_records(path)
    except DataError as e:
        line = _assert_one_line_naming(e, path)
        expected = bad_line if bad_line is not None else None
        if expected is None:  # only an all-blank file is refused without a bad line
            assert not any(r.strip() for r in rows) or "empty" in line, line
        else:
            assert f"line {expected}:" in line, line
        _calibrate_refuses(path)
        return
    assert bad_line is None and fmt == "jsonl" and [r.text for r in records] == rows


@st.composite
def alpaca_files(draw):
    fields = st.sampled_from(["instruction", "input", "output", "text", "other"])
    records = draw(st.lists(st.dictionaries(fields, texts | json_scalars, max_size=3) | json_values, max_size=4))
    return json.dumps(records, ensure_ascii=False)


@BOUNDED
@given(alpaca_files() | json_values.map(json.dumps) | texts)
def test_alpaca_json_is_read_or_the_bad_record_is_named(scratch, text):
    from workbench.evaluation.data import read_records
    path = _fresh(scratch, "alpaca") / "calib.json"
    path.write_text(text, encoding="utf-8")
    try:
        read_records(path)
    except DataError as e:
        line = _assert_one_line_naming(e, path)
        doc = None
        with contextlib.suppress(ValueError):
            doc = json.loads(text)
        if isinstance(doc, list) and doc and "record" not in line:
            assert "empty" in line, line
        _calibrate_refuses(path)


@BOUNDED
@given(st.binary(max_size=300) | texts.map(lambda t: t.encode("utf-8")))
def test_plain_text_is_tokenized_or_refused_naming_the_file(scratch, demo_tokenizer, raw):
    from workbench.evaluation.data import load_calibration_set
    path = _fresh(scratch, "text") / "calib.txt"
    path.write_bytes(raw)
    try:
        cs = load_calibration_set(path, tokenizer=demo_tokenizer, samples=4, seq_len=16)
    except DataError as e:
        _assert_one_line_naming(e, path)
        _calibrate_refuses(path)
        return
    assert len(cs) >= 1


@BOUNDED
@given(st.lists(texts.map(lambda t: t.replace("\n", " ").replace("\r", " ")), min_size=1, max_size=60).map(" ".join),
       st.integers(8, 64))
def test_plain_text_without_any_newline_is_read_in_pieces_or_refused(scratch, demo_tokenizer, text, piece_chars):
    """A file with no newline at all streams in bounded pieces that join back to it, and calibrates or is refused."""
    from workbench.evaluation.data import load_calibration_set
    from workbench.evaluation.textio import iter_text
    path = _fresh(scratch, "oneline") / "calib.txt"
    path.write_text(text, encoding="utf-8")
    try:
        pieces = list(iter_text(path, piece_chars=piece_chars))
    except DataError as e:
        assert not text.strip() and "empty" in _assert_one_line_naming(e, path)
        return
    assert "".join(pieces) == text and all(len(p) <= piece_chars for p in pieces)
    try:
        cs = load_calibration_set(path, tokenizer=demo_tokenizer, samples=4, seq_len=16)
    except DataError as e:
        _assert_one_line_naming(e, path)
        return
    assert len(cs) >= 1 and cs.report.records == 1


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    from workbench.assets import DEMO_MODEL_DIR
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


# ------------------------------------------------------------------------------ model directories

CONFIG_FIELDS = {
    "hidden_size": st.integers(-2, 160), "intermediate_size": st.integers(-2, 300),
    "num_attention_heads": st.integers(-1, 9), "num_key_value_heads": st.integers(-1, 9),
    "num_hidden_layers": st.integers(-1, 4), "head_dim": st.integers(-1, 40), "vocab_size": st.integers(-1, 5000),
    "max_position_embeddings": st.integers(-1, 600), "tie_word_embeddings": json_scalars,
    "model_type": st.sampled_from(["qwen3", "qwen2", "llama", "bert", "mine", ""]) | json_scalars,
    "architectures": st.lists(st.sampled_from(["Qwen3ForCausalLM", "BertModel", "MyLM"]), max_size=2) | json_scalars,
    "torch_dtype": st.sampled_from(["float16", "int8", "nonsense"]) | json_scalars,
    "rms_norm_eps": json_scalars, "rope_theta": json_scalars,
}


@st.composite
def model_damage(draw):
    kind = draw(st.sampled_from(["config", "config", "config-json", "truncate", "shuffle"]))
    if kind == "config":
        fields = draw(st.lists(st.sampled_from(sorted(CONFIG_FIELDS)), min_size=1, max_size=2, unique=True))
        return kind, {f: draw(CONFIG_FIELDS[f] | json_scalars) for f in fields}
    if kind == "config-json":
        return kind, draw(json_values)
    return kind, draw(st.floats(0.0, 0.999))


@BOUNDED
@given(model_damage())
def test_a_damaged_model_directory_loads_or_is_refused_in_one_line(scratch, tiny_model_dir, damage):
    import random

    from workbench.model.load import load_model
    kind, detail = damage
    d = _fresh(scratch, "model") / "m"
    shutil.copytree(tiny_model_dir, d)
    weights = d / "model.safetensors"
    if kind == "config":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **detail}))
    elif kind == "config-json":
        (d / "config.json").write_text(json.dumps(detail))
    elif kind == "truncate":
        data = weights.read_bytes()
        weights.write_bytes(data[:int(len(data) * detail)])
    else:
        data = weights.read_bytes()
        blocks = [data[i:i + 4096] for i in range(0, len(data), 4096)]
        random.Random(detail).shuffle(blocks)
        weights.write_bytes(b"".join(blocks))
    try:
        load_model(d, load_tokenizer=False)
    except ModelLoadError as e:
        _assert_one_line_naming(e, d)
        _cli_refuses(["info", str(d), "--json"], d)


# ------------------------------------------------------------------------------------ ONNX files

@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "float"
    assert main(["export", str(tiny_model_dir), "--out", str(out), "--no-check", "--json"]) == 0
    return out


@BOUNDED
@given(st.sampled_from(["prefill.onnx", "decode.onnx"]),
       st.floats(0.0, 0.999) | st.binary(max_size=2048))
def test_a_damaged_onnx_file_is_named_by_profile_in_one_line(scratch, exported, name, damage):
    d = _fresh(scratch, "onnx")
    shutil.copytree(exported, d / "float")
    target = d / "float" / name
    data = target.read_bytes()
    target.write_bytes(data[:int(len(data) * damage)] if isinstance(damage, float) else damage)
    _cli_refuses(["profile", str(d), "--repeats", "1", "--prompt-lengths", "4", "--decode-steps", "1"], target)
