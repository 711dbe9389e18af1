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


LOG_PROBS_MAGIC = b"_logits_"


def read_log_probs(path: Path):
    """``llama-perplexity --kl-divergence-base`` file as (tokens, records): what llama.cpp's runtime gave each
    scored position, so two files of the same text can be compared token by token.

    Layout (llama.cpp's tools/perplexity): ``_logits_``, uint32 n_ctx, int32 n_vocab, int32 n_chunk, the
    int32 tokens of every chunk, then for each scored position (the second half of each chunk but its last)
    float32 step and float32 lowest log-probability followed by n_vocab uint16 codes (padded to even):
    ``log p = lowest + step * code``, code 0 standing for anything at or below ``lowest`` (16 below the top).
    ``records`` is a read-only ``[positions, 4 + n_vocab (+1)]`` uint16 memory map.
    """
    import numpy as np
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(8) != LOG_PROBS_MAGIC:
            raise ValueError(f"{path} is not a llama-perplexity log-probability file (--kl-divergence-base)")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
    offset = 20 + 4 * int(n_ctx) * int(n_chunk)
    tokens = np.fromfile(path, dtype=np.int32, count=int(n_ctx) * int(n_chunk), offset=20)
    width = 2 * ((int(n_vocab) + 1) // 2) + 4
    positions = int(n_chunk) * (int(n_ctx) - 1 - int(n_ctx) // 2)
    if path.stat().st_size != offset + 2 * width * positions:
        raise ValueError(f"{path} holds {path.stat().st_size} bytes, not the {offset + 2 * width * positions} its "
                         f"header says ({n_chunk} chunks of {n_ctx}, {n_vocab} tokens): a partly written file?")
    records = np.memmap(path, dtype=np.uint16, mode="r", offset=offset, shape=(positions, width))
    return tokens, records, int(n_vocab)


def _log_probs(records, n_vocab: int):
    import numpy as np
    head = np.ascontiguousarray(records[:, :4]).view(np.float32)  # [n, 2]: step, lowest
    return head[:, 1:2] + head[:, :1] * records[:, 4:4 + n_vocab].astype(np.float32)


def token_kl(base: Path, other: Path, block: int = 64):
    """Per scored position, KL(base || other) from two llama-perplexity log-probability files of the same text,
    summed as llama-perplexity sums it (over the tokens whose base log-probability is above -16); their mean is
    its "Mean KLD" to within the files' 16-bit rounding of ``other``'s log-probabilities. Raises if the two
    files did not score the same tokens."""
    import numpy as np
    tok_a, rec_a, n_vocab = read_log_probs(base)
    tok_b, rec_b, n_vocab_b = read_log_probs(other)
    if n_vocab != n_vocab_b or rec_a.shape != rec_b.shape or not np.array_equal(tok_a, tok_b):
        raise ValueError(f"{base} and {other} did not score the same tokens (one model's vocabulary, one text, "
                         "one context size): a paired comparison needs both")
    out = np.empty(rec_a.shape[0], dtype=np.float64)
    for i in range(0, rec_a.shape[0], block):
        p_log, q_log = _log_probs(rec_a[i:i + block], n_vocab), _log_probs(rec_b[i:i + block], n_vocab)
        p = np.where(p_log > -16.0, np.exp(p_log), 0.0)
        out[i:i + block] = (p * (p_log - q_log)).sum(-1)
    return out


def paired_difference(a, b) -> tuple[float, float]:
    """(mean of ``a - b``, its standard error) for two per-token figures on the same tokens: the paired
    comparison, far tighter than two means' independent errors when both models err on the same tokens."""
    import numpy as np
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.size < 2:
        raise ValueError("a paired comparison needs at least two tokens")
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))
