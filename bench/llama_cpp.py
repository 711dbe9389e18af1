"""llama.cpp beside the workbench, for the benches: find a build, convert a model with its own converter, read GGUFs.

llama.cpp is optional and never a dependency (build recipe in the README). Its location comes from a
``--llama-cpp DIR`` option or ``$LLAMA_CPP_DIR``: the source tree, its ``build/bin``, or any folder
holding the binaries with the source tree (``convert_hf_to_gguf.py`` and ``gguf-py``) at most three
levels above.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# llama.cpp's converter run unchanged, with two local allowances: a byte-level BPE tokenizer whose
# pre-tokenizer hash llama.cpp does not list (the demo model's) is written as "gpt-2" (the same regex),
# and a model without tokenizer.model skips the sentencepiece attempt (the converter expects the
# sentencepiece package installed to find out that the file is missing).
_CONVERT = r'''
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
cls = next(c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c))
pre, sp = cls.get_vocab_base_pre, cls._set_vocab_sentencepiece
def get_vocab_base_pre(self, tokenizer):
    try:
        return pre(self, tokenizer)
    except NotImplementedError:
        print("pre-tokenizer hash unknown to llama.cpp: written as gpt-2 (byte-level BPE)", file=sys.stderr)
        return "gpt-2"
def set_vocab_sentencepiece(self, *a, **k):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return sp(self, *a, **k)
cls.get_vocab_base_pre, cls._set_vocab_sentencepiece = get_vocab_base_pre, set_vocab_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outtype", sys.argv[4], "--outfile", sys.argv[3]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
'''


def find_bin(given: str | None, binaries: tuple[str, ...]) -> tuple[Path | None, str]:
    """(the folder holding ``binaries``, or None; why not) from ``given`` or ``$LLAMA_CPP_DIR``."""
    where = given or os.environ.get("LLAMA_CPP_DIR")
    if not where:
        return None, "llama.cpp not given (--llama-cpp DIR or LLAMA_CPP_DIR; build recipe in the README)"
    d = Path(where).expanduser()
    for cand in (d, d / "bin", d / "build" / "bin"):
        if all((cand / b).is_file() for b in binaries):
            return cand, ""
    return None, f"llama.cpp not found in '{d}' (no {' / '.join(binaries)} there; build recipe in the README)"


def source_root(bin_dir: Path) -> Path | None:
    """The llama.cpp source tree the binaries were built from (``convert_hf_to_gguf.py`` and ``gguf-py``)."""
    for d in (bin_dir, *bin_dir.parents[:3]):
        if (d / "convert_hf_to_gguf.py").is_file() and (d / "gguf-py").is_dir():
            return d
    return None


def run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    """A finished tool (text output captured); a failure raises with the end of its output."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{what} failed (exit {p.returncode}): {' | '.join(tail)}")
    return p


def convert(model_dir: Path, out: Path, root: Path, outtype: str = "f16") -> str:
    """``model_dir`` as a GGUF at ``out`` by llama.cpp's own converter; its notes (stderr)."""
    return run([sys.executable, "-c", _CONVERT, str(root), str(model_dir), str(out), outtype],
               "convert_hf_to_gguf.py").stderr


def gguf_module(root: Path):
    """llama.cpp's own ``gguf`` package (its source tree's copy) and its dequantizer."""
    if str(root / "gguf-py") not in sys.path:
        sys.path.insert(0, str(root / "gguf-py"))
    import gguf
    from gguf.quants import dequantize
    return gguf, dequantize
