"""Decode speed on one CPU: the workbench's artifact beside the float ONNX, onnxruntime-genai's builder and llama.cpp.

    python bench/decode.py                                   # the 301 M Qwen2 shape, 2 threads
    python bench/decode.py --llama-cpp ~/llama.cpp/build/bin # or LLAMA_CPP_DIR=...: adds llama.cpp Q4_0
    python bench/decode.py --tiny --out /tmp/decode-tiny     # a tiny shape (what the test runs)

Builds a random-weight model of the shape (hidden 1024, 20 layers, MLP 2816, 16 heads / 8 KV heads,
vocabulary 32,000, untied: 301 M parameters), quantizes it by INT4 plans (embedding and head
included; group 32 as Q4_0 and the builder's default, and 128, the workbench's default), and writes
from each quantized model the workbench's ``ort-genai`` folder (and from the first its ``ort-int4``
graphs), plus the float export. Then, when present: onnxruntime-genai's model builder on the same
weights (``-p int4 -e cpu``, at block 32, its default, and 128) and llama.cpp (``convert_hf_to_gguf.py``,
``llama-quantize`` to each ``--gguf`` type, ``llama-bench``). Every artifact decodes ``--steps`` tokens on ``--threads`` threads after a
``--prompt``-token prompt (llama-bench: ``-p 0 -n STEPS``, its own loop from an empty context);
the table gives tokens/s, the bytes one decode step reads (the weights, an embedding table one row),
and the fraction of this host's read-bandwidth bound (``workbench.run.profile.host_bandwidth``) reached.
Artifacts are timed in rounds (each once a round, its fastest round kept), so a load that comes
and goes on a shared machine falls on all of them. Absent tools are reported as absent, never left out.
Keeps under 4 GB resident on the 301 M shape.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import llama_cpp  # noqa: E402  (bench/llama_cpp.py)
from shapes import SHAPES, build_model_dir  # noqa: E402  (bench/shapes.py)

SHAPE = SHAPES["qwen2-301m"]
TINY = {**SHAPE, "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 512}
LLAMA_BINARIES = ("llama-bench", "llama-quantize")
GGUF_TYPES = ("Q4_0",)


@dataclass
class Row:
    """One artifact's line: what it is, its files, what a decode step reads, how fast it decodes."""

    artifact: str
    runtime: str
    file_bytes: int | None = None
    bytes_per_token: int | None = None
    tokens_per_second: float | None = None
    note: str = ""

    def fraction(self, read_gbps: float) -> float | None:
        if not self.tokens_per_second or not self.bytes_per_token:
            return None
        return self.tokens_per_second / (read_gbps * 1e9 / self.bytes_per_token)


def build_gguf(model_dir: Path, bin_dir: Path, out: Path, kind: str) -> Path:
    """``model_dir`` as a GGUF of ``kind`` (``Q4_0``, ``Q8_0``, ...): converted to f16 once, then quantized."""
    root = llama_cpp.source_root(bin_dir)
    if root is None:
        raise RuntimeError(f"no convert_hf_to_gguf.py with gguf-py above '{bin_dir}'")
    f16 = out / "model-f16.gguf"
    if not f16.is_file():
        llama_cpp.convert(model_dir, f16, root, "f16")
    q = out / f"model-{kind}.gguf"
    if not q.is_file():
        llama_cpp.run([str(bin_dir / "llama-quantize"), str(f16), str(q), kind], "llama-quantize")
    return q


def gguf_bytes_per_token(path: Path, bin_dir: Path) -> int | None:
    """Tensor bytes of a GGUF a decode step reads: all of them, the token embedding one row."""
    root = llama_cpp.source_root(bin_dir)
    if root is None:
        return None
    try:
        gguf, _ = llama_cpp.gguf_module(root)
        total = 0
        for t in gguf.GGUFReader(str(path)).tensors:
            n = int(t.n_bytes)
            total += n // int(t.shape[-1]) if t.name == "token_embd.weight" else n
        return total
    except Exception:
        return None


def llama_bench(bin_dir: Path, gguf_path: Path, threads: int, steps: int) -> float:
    p = llama_cpp.run([str(bin_dir / "llama-bench"), "-m", str(gguf_path), "-t", str(threads), "-p", "0", "-n", str(steps),
              "-r", "1", "-o", "json"], "llama-bench")
    results = json.loads(p.stdout)
    return float(next(r["avg_ts"] for r in results if r.get("n_gen")))


class OnnxTimer:
    """The workbench's own loop over prefill/decode graphs: seconds for ``steps`` tokens after the prompt."""

    def __init__(self, prefill: Path, decode: Path, prompt: list[int], threads: int):
        from workbench.runtime.onnx_runner import OnnxCausalLM
        self.runner = OnnxCausalLM(prefill, decode, threads=threads)
        self.prompt = prompt
        _, _, self.kv0 = self.runner.run_prefill(prompt)
        self.runner.run_decode(1, self.kv0, len(prompt))  # warm-up

    def __call__(self, steps: int) -> float:
        kv, pos, t = self.kv0, len(self.prompt), time.perf_counter()
        for i in range(steps):
            _, kv, _ = self.runner.run_decode(1 + i % 7, kv, pos)
            pos += 1
        return time.perf_counter() - t


class GenaiTimer:
    """onnxruntime-genai's generate loop: seconds for ``steps`` tokens after the prompt and one token more."""

    def __init__(self, folder: Path, prompt: list[int], threads: int):
        from workbench.targets.ort_genai import GenaiCausalLM
        self.lm, self.prompt = GenaiCausalLM(folder, threads=threads), prompt
        self.lm.decode_seconds(prompt, 4)  # warm-up

    def __call__(self, steps: int) -> float:
        return self.lm.decode_seconds(self.prompt, steps)


class LlamaTimer:
    """llama-bench, one repetition a call: seconds for ``steps`` tokens from its tokens/s."""

    def __init__(self, bin_dir: Path, gguf_path: Path, threads: int):
        self.bin_dir, self.gguf, self.threads = bin_dir, gguf_path, threads

    def __call__(self, steps: int) -> float:
        return steps / llama_bench(self.bin_dir, self.gguf, self.threads, steps)


def folder_bytes(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def build_workbench(model_dir: Path, out: Path, group_sizes: list[int], with_int4: bool, say) -> dict[int, int]:
    """The float export, an ``ort-genai`` folder per group size and (optionally, at the first) the ``ort-int4``
    graphs, each from one quantized model; returns the plan's stored layer bytes per group size."""
    from workbench.targets.convert import prepare_models
    from workbench.onnx.export import export_onnx
    from workbench.quantize.plan import QuantPlan
    from workbench.targets.ort_genai import build_fused_onnx, write_genai_folder
    from workbench.targets.ort_int4 import build_nbits_onnx
    stored = {}
    for i, g in enumerate(group_sizes):
        folder, int4 = out / f"workbench-genai-g{g}", out / f"workbench-int4-g{g}"
        record = folder / "bench.json"  # written last: the folder is complete, and the plan's bytes
        if record.is_file() and (not with_int4 or i or (int4 / "decode.onnx").is_file()):
            stored[g] = json.loads(record.read_text())["plan_storage_bytes"]
            say(f"reusing {folder.name}")
            continue
        plan = QuantPlan.uniform("int4", keep_embeddings=None, group_size=g)
        say(f"quantizing {model_dir.name} (INT4 g{g}, embedding and head included)")
        prep = prepare_models(model_dir, plan=plan)
        stored[g] = prep.qm.storage_bytes()
        if not (out / "float" / "decode.onnx").is_file():
            say("exporting the float model")
            export_onnx(prep.float_lm, out / "float", check=False)
        say(f"building the ort-genai folder (g{g})")
        build_fused_onnx(prep.sim_lm.model, folder, prep.qm.precisions, accuracy_level=4)
        write_genai_folder(folder, prep.sim_lm.model, prep.float_lm.path, prep.float_lm.tokenizer)
        if with_int4 and i == 0:
            say(f"building the ort-int4 graphs (g{g})")
            build_nbits_onnx(prep.sim_lm.model, int4, prep.qm.precisions, accuracy_level=4)
        record.write_text(json.dumps({"plan_storage_bytes": stored[g]}))
        del prep
    return stored


def run_builder(model_dir: Path, out: Path, block: int) -> Path:
    """onnxruntime-genai's model builder on the same float weights: its own INT4 quantization at ``block``, for CPU."""
    dest = out / f"genai-builder-b{block}"
    if not (dest / "genai_config.json").is_file():
        llama_cpp.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", model_dir.name, "-i", str(model_dir),
              "-o", str(dest), "-p", "int4", "-e", "cpu", "-c", str(out / "builder-cache"),
              "--extra_options", f"block_size={block}"], "onnxruntime-genai's model builder")
        shutil.rmtree(out / "builder-cache", ignore_errors=True)
    return dest


def measure(args, say=print) -> tuple[list[Row], float]:
    import numpy as np

    from workbench.onnx.inspect import decode_step_bytes
    from workbench.run.profile import host_bandwidth
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.tiny else SHAPE
    say("building the model" + (" (tiny shape)" if args.tiny else " (301 M Qwen2 shape)"))
    model_dir = build_model_dir(shape, out / "model", seed=0)
    stored = build_workbench(model_dir, out, args.group_size, not args.skip_ort_int4, say)
    prompt = np.random.default_rng(0).integers(1, shape["vocab_size"], size=args.prompt).tolist()
    rows: list[Row] = []
    makers = {}  # row index -> what loads its timer, once everything is built (no runtime beside a build)

    def add(row: Row, make_timer):
        rows.append(row)
        makers[len(rows) - 1] = make_timer

    def onnx_files(folder: Path) -> list[Path]:
        return [p for p in folder.iterdir() if p.suffix in (".onnx", ".data")]

    add(Row("float ONNX (workbench export)", "onnxruntime (workbench loop)", folder_bytes(*onnx_files(out / "float")),
            decode_step_bytes(out / "float" / "decode.onnx")),
        lambda: OnnxTimer(out / "float" / "prefill.onnx", out / "float" / "decode.onnx", prompt, args.threads))
    if not args.skip_ort_int4:
        g = args.group_size[0]
        d = out / f"workbench-int4-g{g}"
        add(Row(f"workbench ort-int4 (INT4 g{g}, accuracy level 4)", "onnxruntime (workbench loop)",
                folder_bytes(*onnx_files(d)), decode_step_bytes(d / "decode.onnx")),
            lambda d=d: OnnxTimer(d / "prefill.onnx", d / "decode.onnx", prompt, args.threads))
    for g in args.group_size:
        d = out / f"workbench-genai-g{g}"
        add(Row(f"workbench ort-genai (INT4 g{g})", "onnxruntime-genai", folder_bytes(*onnx_files(d)),
                decode_step_bytes(d / "model.onnx"), note=f"the plan's layers stored: {stored[g] / 1e6:.1f} MB"),
            lambda d=d: GenaiTimer(d, prompt, args.threads))
    for block in args.builder_block:
        name = f"onnxruntime-genai builder (-p int4 -e cpu, block {block})"
        try:
            import onnxruntime_genai  # noqa: F401
            say(f"running onnxruntime-genai's model builder (block {block})")
            b = run_builder(model_dir, out, block)
            add(Row(name, "onnxruntime-genai", folder_bytes(*onnx_files(b)), decode_step_bytes(b / "model.onnx")),
                lambda b=b: GenaiTimer(b, prompt, args.threads))
        except ImportError:
            rows.append(Row(name, "onnxruntime-genai", note="absent: onnxruntime-genai not installed"))
        except RuntimeError as e:
            rows.append(Row(name, "onnxruntime-genai", note=f"failed: {e}"))
    bin_dir, why = llama_cpp.find_bin(args.llama_cpp, LLAMA_BINARIES)
    for kind in args.gguf:
        name = f"llama.cpp {kind}"
        if bin_dir is None:
            rows.append(Row(name, "llama.cpp", note=f"absent: {why}"))
            continue
        try:
            say(f"building {name}")
            g = build_gguf(model_dir, bin_dir, out, kind)
            add(Row(name, "llama.cpp (llama-bench -p 0)", g.stat().st_size, gguf_bytes_per_token(g, bin_dir)),
                lambda g=g: LlamaTimer(bin_dir, g, args.threads))
        except RuntimeError as e:
            rows.append(Row(name, "llama.cpp", note=f"failed: {e}"))
    timers = {}
    for i, make in makers.items():
        say(f"loading {rows[i].artifact}")
        timers[i] = make()
    best = {i: float("inf") for i in timers}
    for r in range(args.repeats):
        say(f"timing round {r + 1} of {args.repeats}")
        for i, timer in timers.items():
            try:
                best[i] = min(best[i], timer(args.steps))
            except RuntimeError as e:
                rows[i].note = f"failed: {e}"
    for i, seconds in best.items():
        if seconds < float("inf"):
            rows[i].tokens_per_second = args.steps / seconds
    timers.clear()
    gbps = args.bandwidth or host_bandwidth()["read_gbps"]
    return rows, gbps


def table(rows: list[Row], gbps: float) -> str:
    head = ("artifact", "file MB", "read/token MB", "tok/s", "bound tok/s", "of bound", "note")
    lines = [head]
    for r in rows:
        bound = gbps * 1e9 / r.bytes_per_token if r.bytes_per_token else None
        frac = r.fraction(gbps)
        lines.append((r.artifact, f"{r.file_bytes / 1e6:.1f}" if r.file_bytes else "-",
                      f"{r.bytes_per_token / 1e6:.1f}" if r.bytes_per_token else "-",
                      f"{r.tokens_per_second:.1f}" if r.tokens_per_second else "-",
                      f"{bound:.0f}" if bound else "-", f"{frac:.2f}" if frac is not None else "-", r.note))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/workbench-bench-decode", help="where models and artifacts are built "
                    "and reused: a second run only times them (default %(default)s)")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape instead of the 301 M one (for tests)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding (default 128)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed (default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="timing rounds, every artifact once a round; each one's "
                    "fastest is kept (default 5)")
    ap.add_argument("--group-size", default="32,128", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="INT4 group sizes of the workbench's plans, one artifact each (default %(default)s: 32 as "
                         "Q4_0 and the builder, 128 the workbench's default)")
    ap.add_argument("--builder-block", default="32,128", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="block sizes of onnxruntime-genai's builder runs, one artifact each (default %(default)s: its "
                         "default 32, and 128 beside the workbench's g128)")
    ap.add_argument("--llama-cpp", help="folder with llama-bench and llama-quantize (default: $LLAMA_CPP_DIR)")
    ap.add_argument("--gguf", default=",".join(GGUF_TYPES), type=lambda s: [x for x in s.split(",") if x],
                    help="llama.cpp types to build and time (default %(default)s)")
    ap.add_argument("--skip-ort-int4", action="store_true", help="leave out the workbench's ort-int4 graphs")
    ap.add_argument("--bandwidth", type=float, help="read bandwidth in GB/s (default: measured and cached)")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows, gbps = measure(args, say=(lambda m: print(m, file=sys.stderr)) if args.json else print)
    if args.json:
        print(json.dumps({"read_gbps": gbps, "threads": args.threads, "prompt": args.prompt, "steps": args.steps,
                          "rows": [{**asdict(r), "fraction_of_bound": r.fraction(gbps)} for r in rows]}, indent=2))
    else:
        print(f"\nbatch 1, {args.threads} threads, {args.steps} decode steps after {args.prompt} prompt tokens; "
              f"read bandwidth {gbps:.1f} GB/s; {time.perf_counter() - t0:.0f} s in all")
        print(table(rows, gbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
