"""Quality per bit against llama.cpp's k-quants, on llama.cpp's own protocol, in one run.

    python bench/quality.py [--model demo] [--llama-cpp DIR] [--ctx 256] [--types Q3_K_M,...] [--json]

Protocol (``llama-perplexity -c CTX`` on the bundled held-out text): whole chunks of CTX tokens, the
second half of each scored, KL divergence against the float model, bits per weight over every weight
of the model (embedding and norms included).

llama.cpp side, when its build is found (``--llama-cpp DIR`` or ``$LLAMA_CPP_DIR``: its source tree or
``build/bin``, with ``llama-quantize`` and ``llama-perplexity`` built; recipe in the README): the model is
converted to an f32 GGUF by llama.cpp's own ``convert_hf_to_gguf.py``, quantized by ``llama-quantize``
to each type, and scored by ``llama-perplexity --kl-divergence`` against the f32 GGUF's logits
(its figure, with its per-token standard error). Each type's size is the bits of every tensor in its
GGUF over the model's parameters. The same GGUF weights are also read back (gguf's dequantizer) into
the PyTorch model and scored by the workbench's evaluator on the same chunks: weights alone, without
llama.cpp's rounding of activations, and paired chunk by chunk with the workbench's plan.

Workbench side: for each llama.cpp size, the best of the automatic plans at that size (a sensitivity
sweep per group size and symmetry over every registered integer precision of 3 bits or more,
``plan_for_budget`` over those and fp16, quantized with GPTQ and scale search), with its KL and
standard error over chunks (``--target NAME``: only the precisions that target carries). Its size
counts every stored code, scale and zero point (``lm.size_bytes``: norms at fp16).

``--target llama.cpp``: plans in llama.cpp's own blocks (symmetric int4 / int5 / int8 with a float16
scale per 32 weights: Q4_0 / Q5_0 / Q8_0; int3-k / int6-k: Q3_K / Q6_K), budgeted so the written GGUF
(float32 norms) is no bigger than llama.cpp's; each winner is written as a GGUF holding its own integers
(``workbench convert --target llama.cpp``), checked equal to the simulation, and scored by
``llama-perplexity --kl-divergence`` itself: llama.cpp measuring both files on its own protocol.

Without llama.cpp the k-quant sizes measured on the demo model are used (``--sizes``) and its absence is
printed. Times and peaks are not this bench's concern (``bench/quantize.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402  (bench/llama_cpp.py)

LLAMA_TYPES = ("Q3_K_M", "IQ4_NL", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
DEFAULT_SIZES = (4.55, 5.03, 5.26, 5.90, 6.58, 8.52)  # bits/weight of those types on the demo model
CONFIGS = ((32, True), (32, False), (64, True), (64, False), (128, True), (128, False))

@dataclasses.dataclass
class LlamaCpp:
    """A llama.cpp build with the tools this bench runs, and its source tree (converter, gguf-py)."""

    bin: Path
    root: Path

    @classmethod
    def find(cls, where: str | None) -> "LlamaCpp | None":
        if not (where or os.environ.get("LLAMA_CPP_DIR")):
            return None
        bin_dir, why = llama_cpp.find_bin(where, ("llama-quantize", "llama-perplexity"))
        root = llama_cpp.source_root(bin_dir) if bin_dir else None
        if root is None:
            sys.exit(why or f"no convert_hf_to_gguf.py with gguf-py above '{bin_dir}'; point --llama-cpp at the "
                     "source tree's build")
        return cls(bin_dir, root)

    def run(self, tool: str, *args: str) -> str:
        p = llama_cpp.run([str(self.bin / tool), *args], tool)
        return p.stdout + p.stderr

    def run_parsed(self, parse, tool: str, *args: str, tries: int = 6):
        """``parse`` of a tool's output. llama.cpp's log is written by a background thread that a busy machine
        can leave unflushed at exit (a summary line then missing, exit status 0): such a run is repeated."""
        for attempt in range(tries):
            try:
                return parse(self.run(tool, *args))
            except ValueError:
                if attempt == tries - 1:
                    raise


_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+±\s+([\d.]+)\s+([-\d.]+)\s+±\s+([\d.]+)\s+([-\d.]+)\s+±\s+([\d.]+)"
                  r"\s+([\d.]+)\s+±\s+([\d.]+)\s+%\s+([\d.]+)\s+±\s+([\d.]+)\s+%", re.M)


def parse_kl(output: str) -> dict:
    """The summary of ``llama-perplexity --kl-divergence``: KL and PPL(Q) with their standard errors.

    Without the summary (llama.cpp's background logger can lose the end of its output at exit) the
    per-chunk table's row for the last chunk is taken: its running means are the same figures, KL to 5
    decimals instead of 6 (``from_table`` says so).
    """
    found = {}
    for key, pattern in (("kl", r"Mean\s+KLD:\s+([-\d.e]+)\s+±\s+([-\d.e]+)"),
                         ("perplexity", r"Mean PPL\(Q\)\s+:\s+([-\d.e]+)\s+±\s+([-\d.e]+)"),
                         ("same_top", r"Same top p:\s+([-\d.e]+)\s+±\s+([-\d.e]+)")):
        m = re.search(pattern, output)
        if not m:
            return _parse_kl_table(output)
        found[key], found[key + "_se"] = float(m.group(1)), float(m.group(2))
    found["same_top"] /= 100
    found["same_top_se"] /= 100
    return found


def _parse_kl_table(output: str) -> dict:
    total = re.search(r"computing over (\d+) chunks", output)
    rows = {int(m.group(1)): m for m in _ROW.finditer(output)}
    last = rows.get(int(total.group(1))) if total else None
    if last is None:
        raise ValueError(f"llama-perplexity output has no KL summary nor the last chunk's row; is this its "
                         f"--kl-divergence output? It ends:\n{output[-1500:]}")
    g = [float(x) for x in last.groups()[1:]]
    return {"perplexity": g[0], "perplexity_se": g[1], "kl": g[4], "kl_se": g[5], "same_top": g[8] / 100,
            "same_top_se": g[9] / 100, "from_table": True}


def parse_perplexity(output: str) -> float:
    m = re.search(r"Final estimate: PPL = ([\d.]+)", output)
    if not m:
        raise ValueError("llama-perplexity output has no 'Final estimate' line")
    return float(m.group(1))


def gguf_bits_per_weight(reader) -> float:
    """Stored bits of every tensor over every parameter: llama.cpp's own BPW."""
    return 8 * sum(int(t.n_bytes) for t in reader.tensors) / sum(int(t.n_elements) for t in reader.tensors)


def load_gguf_weights(lm, reader, dequantize) -> dict[str, torch.Tensor]:
    """The GGUF's quantizable weights, dequantized, by the model's own parameter names.

    Qwen2 / Qwen3 GGUFs keep q/k rows in Hugging Face order (no rotary permutation), so the tensors map
    one to one; other architectures are refused rather than silently mis-mapped.
    """
    from workbench.targets.llamacpp import gguf_tensor_name
    arch = lm.config.model_type
    if arch not in ("qwen2", "qwen3"):
        raise SystemExit(f"reading {arch} GGUF weights back is not supported here (llama permutes q/k rows); "
                         "compare with llama-perplexity's own figures only (--no-readback)")
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for info in lm.layers:
        if info.tied_to:
            continue
        name = gguf_tensor_name(info.name)
        t = tensors.get(f"{name}.weight") or (tensors.get("token_embd.weight") if name == "output" else None)
        if t is None:
            raise SystemExit(f"GGUF has no tensor for {info.name} ({name}.weight)")
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        if tuple(w.shape) != tuple(info.shape):
            raise SystemExit(f"GGUF tensor {t.name} has shape {tuple(w.shape)}, {info.name} has {tuple(info.shape)}")
        out[info.name] = w
    return out


def evaluate_weights(lm, weights: dict[str, torch.Tensor], baseline):
    """KL of the float model with ``weights`` swapped in, on the baseline's chunks; the model is restored."""
    from workbench.evaluation.evaluate import evaluate
    modules = dict(lm.model.named_modules())
    saved = {n: modules[n].weight for n in weights}
    try:
        for n, w in weights.items():
            modules[n].weight = torch.nn.Parameter(w.to(saved[n].dtype), requires_grad=False)
        ref = baseline.report
        return evaluate(lm.model, baseline.ids, reference=baseline.outputs, ctx=ref.ctx, progress=False,
                        scheme=ref.scheme, desc="gguf weights")
    finally:
        for n, p in saved.items():
            modules[n].weight = p


def llamacpp_rows(llama: LlamaCpp, lm, baseline, text: Path, ctx: int, types, threads: int, tmp: Path,
                  readback: bool) -> tuple[list[dict], dict]:
    """Each type's BPW, llama-perplexity's KL, and (``readback``) the same weights in the workbench's evaluator."""
    gguf, dequantize = llama_cpp.gguf_module(llama.root)
    f32 = tmp / "model-f32.gguf"
    notes = llama_cpp.convert(lm.path, f32, llama.root, "f32")
    base = tmp / "base.kld"
    f32_perplexity = llama.run_parsed(parse_perplexity, "llama-perplexity", "-m", str(f32), "-f", str(text), "-c",
                                      str(ctx), "-t", str(threads), "--kl-divergence-base", str(base))
    info = {"f32_perplexity": f32_perplexity, "base": str(base),
            "converter_notes": [ln for ln in notes.splitlines() if "gpt-2" in ln]}
    rows = []
    for qtype in types:
        q = tmp / f"model-{qtype}.gguf"
        llama.run("llama-quantize", str(f32), str(q), qtype, str(threads))
        row = {"type": qtype, "bits": gguf_bits_per_weight(gguf.GGUFReader(q)), "size": q.stat().st_size,
               **llama.run_parsed(parse_kl, "llama-perplexity", "-m", str(q), "-c", str(ctx), "-t", str(threads),
                                  "--kl-divergence-base", str(base), "--kl-divergence")}
        if readback:
            rep = evaluate_weights(lm, load_gguf_weights(lm, gguf.GGUFReader(q), dequantize), baseline)
            row.update(readback_kl=rep.kl_divergence, readback_kl_se=rep.kl_stderr, report=rep)
        rows.append(row)
    return rows, info


def best_plans(lm, baseline, sizes, *, configs, calibration, workspace, sweep_tokens: int, target: str | None = None,
               offset: float = 0.0, log=print) -> list[dict]:
    """For each size, the automatic plan (GPTQ, scale search) with the least measured KL among ``configs``;
    with ``target``, among the precisions that target carries (what it can ship). ``offset``: bits/weight
    the shipped file adds beyond the plan's count (a GGUF's float32 norms), taken off each budget.
    The winner keeps its quantized model (``qm``) for writing."""
    from workbench.precision.autoplan import plan_for_budget
    from workbench.errors import PlanError
    from workbench.quantize.plan import PRECISIONS
    from workbench.quantize import measure_cost, quantize_model
    from workbench.precision.sensitivity import run_sensitivity, sweep_precisions
    from workbench.targets import get_target
    sweeps = {}
    for gs, sym in configs:
        t0 = time.perf_counter()
        integers = [p for p in sweep_precisions(sym, lm.layers) if PRECISIONS[p].bits >= 3  # int2 never pays here
                    and (target is None or get_target(target).carries(PRECISIONS[p]))]
        sweeps[gs, sym] = run_sensitivity(lm, tokens=sweep_tokens, precisions=integers, group_size=gs, symmetric=sym,
                                          workspace=workspace, progress=False)
        log(f"  sweep g{gs} {'sym' if sym else 'asym'} over {'/'.join(integers)}: {time.perf_counter() - t0:.1f} s")
    best = []
    for size in sizes:
        found = None
        for (gs, sym), sens in sweeps.items():
            try:
                pred = plan_for_budget(lm, sens, bits_per_weight=size - offset,  # fp16 and every precision swept
                                       targets=[target] if target else ())
            except PlanError:
                continue  # this group size's scales alone do not fit the size
            plan = dataclasses.replace(pred.plan, method="gptq", scale_search=True)
            qm = quantize_model(lm, plan, calibration=calibration, progress=False)
            cost = measure_cost(qm, baseline, progress=False)
            bits = 8 * lm.size_bytes(plan) / lm.parameters
            label = f"g{gs} {'sym' if sym else 'asym'}"
            log(f"  {size:.2f} bpw: {label:<10} -> {bits:.3f} bpw, KL {cost.kl_divergence:.5f}")
            if bits <= size - offset + 1e-9 and (found is None or cost.kl_divergence < found["kl"]):
                mix = {}
                for p in pred.assignments.values():
                    mix[p] = mix.get(p, 0) + 1
                embedding = next((pred.assignments[i.name] for i in lm.layers if i.kind == "embedding"), None)
                found = {"size": size, "config": label, "bits": bits, "kl": cost.kl_divergence, "embedding": embedding,
                         "kl_se": cost.kl_divergence_stderr, "perplexity": cost.perplexity, "top1": cost.top1_agreement,
                         "mix": mix, "plan": plan.to_dict(), "report": cost.report, "qm": qm}
            del qm
        best.append(found or {"size": size, "config": None})
    return best


def gguf_offset(lm) -> float:
    """Bits/weight a GGUF adds beyond the plan's count: its norms and biases are float32, the plan counts 16 bits."""
    layer_weights = {f"{i.name}.weight" for i in lm.layers}
    unique = {id(p): (n, p) for n, p in lm.model.named_parameters()}.values()
    return 16 * sum(p.numel() for n, p in unique if n not in layer_weights) / lm.parameters


def score_workbench_ggufs(llama: LlamaCpp, best: list[dict], base: Path, ctx: int, threads: int, tmp: Path) -> None:
    """Each winning plan written as GGUF with its own integers and scored by llama-perplexity itself."""
    from workbench.targets.gguf_file import check_gguf, write_gguf
    gguf, _ = llama_cpp.gguf_module(llama.root)
    for wb in best:
        qm = wb.pop("qm", None)
        if qm is None:
            continue
        path = write_gguf(qm, tmp / f"workbench-{wb['size']:.2f}.gguf")
        wb["gguf_exact"] = check_gguf(qm, path)["max_abs_diff"] == 0.0
        wb["gguf_bits"] = gguf_bits_per_weight(gguf.GGUFReader(path))
        got = llama.run_parsed(parse_kl, "llama-perplexity", "-m", str(path), "-c", str(ctx), "-t", str(threads),
                               "--kl-divergence-base", str(base), "--kl-divergence")
        wb.update(llama_kl=got["kl"], llama_kl_se=got["kl_se"], llama_same_top=got["same_top"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--llama-cpp", help="llama.cpp source tree with build/bin (default: $LLAMA_CPP_DIR)")
    ap.add_argument("--types", default=",".join(LLAMA_TYPES), help="llama-quantize types, comma-separated")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="bits/weight to plan for when llama.cpp is absent")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--configs", default=",".join(f"{g}{'s' if s else 'a'}" for g, s in CONFIGS),
                    help="group size and symmetry of the plans tried, e.g. 32s,128a")
    ap.add_argument("--sweep-tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=128, help="GPTQ calibration samples")
    ap.add_argument("--seq-len", type=int, default=512, help="GPTQ calibration sample length")
    ap.add_argument("--target", help="plan only with the precisions this target carries (e.g. ort-int4: what it "
                    "ships), not every precision the simulation has")
    ap.add_argument("--no-readback", action="store_true", help="skip reading the GGUF weights back")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from workbench.model.calibrate import calibrate
    from workbench.evaluation.evaluate import paired_difference
    from workbench.assets import demo_text_path
    from workbench.model.load import load_model
    from workbench.quantize import heldout_ids, measure_reference
    from workbench.files.workspace import Workspace

    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    configs = [(int(c[:-1]), c[-1] == "s") for c in args.configs.split(",")]
    if args.target == "llama.cpp":  # its blocks hold symmetric codes, 32 weights a float16 scale (or int3-k/int6-k)
        configs = [(32, True)]
    llama = LlamaCpp.find(args.llama_cpp)
    lm = load_model(args.model, dtype="float32")
    text = Path(demo_text_path("heldout"))
    ids = heldout_ids(lm)
    baseline = measure_reference(lm.model, ids, ctx=args.ctx, progress=False, scheme="llama.cpp")
    ref = baseline.report
    log(f"model {lm.path.name}: {lm.parameters:,} weights; held-out text {len(ids):,} tokens, {ref.windows} chunks "
        f"of {args.ctx}, {ref.tokens:,} scored; float perplexity {ref.perplexity:.3f}")
    out = {"model": str(lm.path), "parameters": lm.parameters, "ctx": args.ctx, "chunks": ref.windows,
           "target": args.target,
           "scored_tokens": ref.tokens, "perplexity": ref.perplexity}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if llama is None:
            log("llama.cpp: not found (give --llama-cpp DIR or set LLAMA_CPP_DIR; README 'llama.cpp, side by "
                "side'); planning for the sizes given by --sizes")
            lrows, sizes = [], [float(s) for s in args.sizes.split(",")]
        else:
            t0 = time.perf_counter()
            lrows, info = llamacpp_rows(llama, lm, baseline, text, args.ctx, args.types.split(","), args.threads,
                                        tmp, not args.no_readback)
            out["llama_cpp"] = {"root": str(llama.root), **info, "seconds": time.perf_counter() - t0}
            log(f"llama.cpp at {llama.root}: f32 perplexity {info['f32_perplexity']:.3f} (the workbench's "
                f"{ref.perplexity:.3f}); {len(lrows)} types in {time.perf_counter() - t0:.1f} s")
            sizes = sorted({round(r["bits"], 4) for r in lrows})
        ws = Workspace(tmp / "ws")
        t0 = time.perf_counter()
        calibration = calibrate(lm, samples=args.samples, seq_len=args.seq_len, workspace=ws, progress=False)
        offset = gguf_offset(lm) if args.target == "llama.cpp" else 0.0
        best = best_plans(lm, baseline, sizes, configs=configs, calibration=calibration, workspace=ws,
                          sweep_tokens=args.sweep_tokens, target=args.target, offset=offset, log=log)
        out["workbench_seconds"] = time.perf_counter() - t0
        if llama is not None and args.target == "llama.cpp":
            score_workbench_ggufs(llama, best, Path(info["base"]), args.ctx, args.threads, tmp)
        for wb in best:
            wb.pop("qm", None)
    rows = []
    for size, wb in zip(sizes, best):  # the reports pair chunk by chunk, then leave the printable rows
        ours, theirs = wb.pop("report", None), [r for r in lrows if round(r["bits"], 4) == size]
        for r in theirs:
            report = r.pop("report", None)
            if ours is not None and report is not None:
                d = paired_difference(ours, report, "kl")
                r["paired_kl_difference"], r["paired_kl_difference_se"] = d["mean"], d["stderr"]
        rows.append({"bits": size, "workbench": wb, **({"llama_cpp": theirs} if theirs else {})})
    out["rows"] = rows
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print()
    head = (f"{'bpw':>6} {'llama.cpp':<8} {'its KL (llama-perplexity)':>26} {'same weights, here':>19}  "
            f"{'workbench best plan':<19} {'bpw':>6} {'KL':>19} {'minus llama.cpp (paired)':>25} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    for row in rows:
        wb = row["workbench"]
        wkl = f"{wb['kl']:.5f} ± {wb['kl_se']:.5f}" if wb.get("config") else "no plan fits"
        plan = wb.get("config") or "-"
        for r in row.get("llama_cpp") or [{}]:
            theirs = f"{r['kl']:.5f} ± {r['kl_se']:.5f}" if r else "(llama.cpp absent)"
            here = f"{r['readback_kl']:.5f}" if "readback_kl" in r else ""
            diff = (f"{r['paired_kl_difference']:+.5f} ± {r['paired_kl_difference_se']:.5f}"
                    if "paired_kl_difference" in r else "")
            ratio = f"{wb['kl'] / r['kl']:.2f}x" if r and wb.get("config") else ""
            print(f"{row['bits']:>6.2f} {r.get('type', ''):<8} {theirs:>26} {here:>19}  {plan:<19} "
                  f"{wb.get('bits', float('nan')):>6.3f} {wkl:>19} {diff:>25} {ratio:>6}")
    print("\nKL: mean per scored token, KL(float || quantized). llama-perplexity's ± is its per-token standard "
          "error; the workbench's is over chunks (larger, honest about correlated tokens). 'same weights, here': "
          "the GGUF's dequantized weights in the workbench's evaluator (no activation rounding); 'minus llama.cpp' "
          "pairs the workbench's plan with those weights chunk by chunk. Plans: GPTQ with scale search, "
          "precisions per layer from the sweep:")
    for row in rows:
        wb = row["workbench"]
        if wb.get("config"):
            mix = ", ".join(f"{n} {p}" for p, n in sorted(wb["mix"].items()))
            print(f"  {row['bits']:.2f} bpw ({wb['config']}): {mix} layers, embedding {wb['embedding']}; "
                  f"perplexity {wb['perplexity']:.3f}, top-1 {wb['top1']:.4f}")
    for row in rows:
        wb = row["workbench"]
        if "llama_kl" in wb:
            theirs = min((r["kl"] for r in row.get("llama_cpp", [])), default=float("nan"))
            print(f"  {row['bits']:.2f} bpw: the plan's own GGUF ({wb['gguf_bits']:.4f} bpw as written, weights "
                  f"{'equal to' if wb['gguf_exact'] else 'DIFFERENT from'} the simulation's) scored by "
                  f"llama-perplexity: KL {wb['llama_kl']:.5f} ± {wb['llama_kl_se']:.5f}, same top token "
                  f"{wb['llama_same_top']:.4f} (llama.cpp's own type there: {theirs:.5f}, "
                  f"{wb['llama_kl'] / theirs:.2f}x)")
    kinds = f"those {args.target} carries" if args.target else \
        "every registered one (some run only in the simulation: see the README)"
    print(f"precisions: {kinds}")
    print(f"workbench side: {out['workbench_seconds']:.0f} s (calibration, sweeps, {len(configs)} plans per size)")


if __name__ == "__main__":
    main()
