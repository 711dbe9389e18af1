"""scripts/gguf_to_hf.py on hostile files: one line naming the file, exit 2, bounded memory, nothing left behind; and
its OUT_DIR taken only when new, empty or its own earlier output."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gguf_to_hf.py"
STRING, ARRAY, F32 = 8, 9, 0  # GGUF value types and the F32 tensor type
BIG = [2 ** 40, 2 ** 60]


def _text(s: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(s) if length is None else length) + s


def gguf_bytes(*, arch: str = "qwen2", tensor_count=None, kv_count=None, key_length=None, tokens_length=None,
               dim=None, version: int = 3) -> bytes:
    """A small well-formed GGUF (two metadata keys, a token list, one F32 tensor), with one field set to ``...``."""
    tokens = [b"a", b"b", b"c"]
    kvs = [_text(b"general.architecture", key_length) + struct.pack("<I", STRING) + _text(arch.encode()),
           _text(b"tokenizer.ggml.tokens") + struct.pack("<II", ARRAY, STRING)
           + struct.pack("<Q", len(tokens) if tokens_length is None else tokens_length) + b"".join(map(_text, tokens))]
    dims = [8, 3 if dim is None else dim]
    info = _text(b"token_embd.weight") + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) \
        + struct.pack("<IQ", F32, 0)
    head = b"GGUF" + struct.pack("<IQQ", version, 1 if tensor_count is None else tensor_count,
                                 len(kvs) if kv_count is None else kv_count) + b"".join(kvs) + info
    head += b"\0" * (-len(head) % 32)
    return head + struct.pack("<24f", *range(24))


def run_script(*args, cwd=None):
    """The script as a user runs it; its peak resident memory (MB) read by the wrapper that runs it."""
    wrapper = ("import resource, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], "
               "run_name='__main__')\nfinally:\n    print('PEAK_MB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss"
               " // 1024, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", wrapper, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=cwd)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    peak = int(lines.pop()[len("PEAK_MB "):])
    return proc.returncode, lines, peak


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory):
    """A GGUF of a tiny Qwen2 written by the workbench (Q8_0 layers), which the script converts."""
    import runpy
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_model
    from workbench.model.load import load_model
    from workbench.quantize import quantize_model
    from workbench.targets.gguf_file import write_gguf
    real = runpy.run_path(str(ROOT / "bench" / "real_models.py"))
    root = tmp_path_factory.mktemp("gguf")
    lm = load_model(str(build_tiny_model(root / "qwen2", "qwen2")), dtype="float32")
    qm = quantize_model(lm, real["uniform_plan"](8, full_range=True), progress=False)
    return write_gguf(qm, root / "g" / "model.gguf")


def _bad_files(real: bytes) -> dict[str, tuple[bytes, str]]:
    cases = {"empty": (b"", "the GGUF magic needs 4 bytes"),
             "garbage": (b"PK\x03\x04 not a model" * 10, re.escape("not b'GGUF'")),
             "truncated-header": (real[:30], "bytes left can hold"),
             "truncated-metadata": (real[:2000], "needs|bytes left can hold"),
             "truncated-data": (real[:len(real) * 2 // 3], "runs past the end of the file"),
             "version-1": (gguf_bytes(version=1), "GGUF version 1 "),
             "dimension-2^40": (gguf_bytes(dim=2 ** 40), "runs past the end of the file")}
    for n in BIG:
        cases[f"tensor-count-{n}"] = (gguf_bytes(tensor_count=n), f"the tensor count is {n:,}")
        cases[f"kv-count-{n}"] = (gguf_bytes(kv_count=n), f"the metadata key-value count is {n:,}")
        cases[f"key-length-{n}"] = (gguf_bytes(key_length=n), f"the length of metadata key 0 is {n:,}")
        cases[f"tokens-length-{n}"] = (gguf_bytes(tokens_length=n), f"the length of 'tokenizer.ggml.tokens' is {n:,}")
    return cases


CASES = ["empty", "garbage", "truncated-header", "truncated-metadata", "truncated-data", "version-1",
         "dimension-2^40"] + [f"{k}-{n}" for k in ("tensor-count", "kv-count", "key-length", "tokens-length")
                              for n in BIG]


@pytest.mark.parametrize("case", CASES)
def test_a_broken_gguf_is_refused_before_it_is_read(case, real_gguf, tmp_path):
    import gguf_to_hf_module as g
    data, says = _bad_files(real_gguf.read_bytes())[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(g.ModelLoadError, match="is not a whole GGUF file") as e:
        g.check_gguf(path)
    assert str(path) in str(e.value) and re.search(says, str(e.value)) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["truncated-data", "tensor-count-1152921504606846976", "tokens-length-1099511627776",
                                  "dimension-2^40"])
def test_the_script_gives_one_line_exit_2_bounded_memory_and_no_output(case, real_gguf, tmp_path):
    data, says = _bad_files(real_gguf.read_bytes())[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    out = tmp_path / "new" / "hf"
    rc, err, peak = run_script(path, out)
    assert rc == 2 and len(err) == 1 and err[0].startswith("gguf_to_hf: error: ") and str(path) in err[0], err
    assert re.search(says, err[0])
    assert not (tmp_path / "new").exists()
    # the imports (torch, transformers; more on a fresh environment's first run) and nothing of the file's claimed
    # sizes, which are terabytes
    assert peak < 2048, f"{peak} MB"


def test_an_unsupported_architecture_is_one_line_and_leaves_nothing(tmp_path):
    path = tmp_path / "odd.gguf"
    path.write_bytes(gguf_bytes(arch="nosuchnet"))
    rc, err, _ = run_script(path, tmp_path / "hf")
    assert rc == 2 and len(err) == 1, err
    assert "transformers cannot convert" in err[0] and "'nosuchnet'" in err[0] and str(path) in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]  # no OUT_DIR, no staging folder


def test_a_users_folder_is_refused_and_its_own_output_replaced(real_gguf, tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "config.json").write_text('{"mine": true}')
    rc, err, _ = run_script(real_gguf, user)
    assert rc == 2 and len(err) == 1 and "OUT_DIR" in err[0] and str(user) in err[0], err
    assert "no workbench manifest.json" in err[0] and "name a new or empty directory" in err[0]
    assert json.loads((user / "config.json").read_text()) == {"mine": True} and len(list(user.iterdir())) == 1
    import gguf_to_hf_module as g
    out = tmp_path / "hf"
    first = g.convert(real_gguf, out, "tiny==0")
    assert (out / "SOURCE.json").is_file() and (out / "manifest.json").is_file()
    assert g.convert(real_gguf, out, "tiny==1")["sha256"] == first["sha256"]  # its own earlier output: replaced
    assert json.loads((out / "SOURCE.json").read_text())["package"] == "tiny==1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]  # no staging folder left beside them


@pytest.fixture(autouse=True, scope="module")
def _module():
    """The script importable as a module (its name is not a package name)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gguf_to_hf_module", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gguf_to_hf_module"] = mod
    spec.loader.exec_module(mod)
    yield
    sys.modules.pop("gguf_to_hf_module", None)
