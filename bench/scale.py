"""What every `workbench` step costs on models shaped like real Qwen checkpoints: wall time and peak memory.

    python bench/scale.py                                      # the Qwen2.5-0.5B shape, every step
    python bench/scale.py --layers 2                           # smoke run: the 0.5B widths with 2 blocks
    python bench/scale.py --shapes qwen2.5-1.5b,qwen3-4b --steps quantize-rtn,convert
    python bench/scale.py --all --json --out-json scale.json   # every shape; JSON on stdout and in a file
    python bench/scale.py --steps sensitivity,plan --timeout 1800 --max-rss 8

Random-weight models shaped like Qwen2.5-0.5B, Qwen2.5-1.5B and Qwen3-4B (real vocabulary of
151,936 rows, tying, head counts; see bench/shapes.py) are built once and cached under
--models-dir. Each step then runs as its own `workbench` process, so its wall time and peak
resident memory (the child's ru_maxrss from os.wait4) are its own:

    info          workbench info MODEL                                       (load)
    calibrate     workbench calibrate MODEL                                  (default 128 x 512 tokens)
    quantize-rtn  workbench quantize MODEL --bits 4 --method rtn --out ...   (+ its evaluation, default text)
    quantize-awq  workbench quantize MODEL --bits 4 --method awq --out ...   (+ its evaluation, default text)
    quantize-gptq workbench quantize MODEL --bits 4 --method gptq --out ...  (+ its evaluation, default text)
    eval          workbench eval MODEL --ref MODEL                           (perplexity, KL, top-1; two models)
    sensitivity   workbench sensitivity MODEL                                (int8/int4 sweep, 1,024 tokens)
    plan          workbench plan MODEL --bits-per-weight 6 --out ...        (automatic plan, measured)
    export        workbench export MODEL --out ...                           (ONNX prefill/decode + checks)
    convert       workbench convert RTN-OUT --target ort-int4 --out ...      (float MODEL --bits 4 without it)
    convert-genai the same with --target ort-genai (the fused graph onnxruntime-genai runs)
    convert-gguf  the same with --target llama.cpp (the plan's own integers as one GGUF, read back and checked)
    convert-mnn-llm the same with --target mnn-llm (MNN's LLM engine directory, scored and timed by MNN.llm)
    convert-executorch the same with --target executorch (a .pte for XNNPACK holding the plan's integers, scored by
                  ExecuTorch's runtime)
    convert-edgellm the same with --target tensorrt-edgellm (Edge-LLM's ONNX bundle, read back against the plan and run
                  outside its plugins by onnxruntime; needs `make edgellm-env`)
    profile-mnn-llm workbench profile MNN-LLM-OUT --threads 2   (the engine's own prefill / decode counters)
    convert-qdq   workbench convert MODEL --bits 8 --target ort-qdq --max-tokens 256 --out ...  (static QDQ prefill
                  and decode graphs for the QNN execution provider, weights from the plan's integers, calibrated,
                  both graphs scored on onnxruntime's CPU; 256 tokens: a decode window at 0.5B takes about a minute)
    prune         workbench prune MODEL --heads 0.25 --mlp 0.2 --head-unit query --importance-tokens 512
                  --eval-tokens 2048 --out ...  (Taylor importance, slicing, saving, before/after evaluation)
    distill       workbench distill PRUNED --teacher MODEL --mode lora --steps 8 --batch-size 1 --seq-len 256
                  --validation-fraction 0.02 --eval-tokens 1024 --gradient-checkpointing  (LoRA on the pruned
                  student against the unpruned teacher, full-vocabulary soft labels; 3 held-back windows,
                  before/after on 1,024 tokens)

All steps of one shape share a fresh workspace (WORKBENCH_WORKSPACE) unless --workspace names
one, so a step pays for what it computes, and reads back only what an earlier step of the same
run legitimately produced: quantize-awq and -gptq read calibrate's statistics (same 128 x 512 defaults),
plan reads sensitivity's sweep, convert converts quantize-rtn's saved model, distill trains prune's
output. quantize-awq is skipped when calibrate failed, plan when sensitivity failed and distill when
prune failed. Each step's stdout and stderr
go to <run-dir>/<shape>/logs/<step>.out and .err; a failed step shows its last error line.

Prints one table: per shape and step, status, seconds, peak memory (MB/GB = 2^20/2^30 bytes),
and the issue's targets beside them with whether each was met:
- Qwen2.5-0.5B: RTN INT4 quantize + evaluation < 3 min and < 4 GB; AWQ INT4 < 15 min and
  < 5 GB; sensitivity + automatic plan < 15 min; convert ort-int4 < 2 min and < 4 GB; convert ort-qdq
  < 4 GB; prune < 5 min and < 6 GB; distill (8 steps of 256 tokens) < 10 min and < 8 GB;
- Qwen2.5-1.5B: every step completes, each < 9 GB peak;
- Qwen2.5-1.5B as users often bring it (``--shapes qwen2.5-1.5b-f32-untied --steps quantize-rtn``: float32 file, its
  own lm_head; every text shape has such a ``-f32-untied`` variant, bench/shapes.py): the default quantize + evaluation
  < 10 min and < 8 GB;
- Qwen3-4B: RTN INT4 quantize and convert ort-int4 complete, each < 20 GB peak;
- the vision-language shapes (``--shapes qwen3-vl-2b,qwen2.5-vl-3b --steps info,quantize-rtn``): quantize-rtn (language
  model int4, vision int8, scored on the bundled demo-vl pictures: answer KL, top-1, image-text matching) < 12 GB at
  Qwen3-VL-2B and < 20 GB at Qwen2.5-VL-3B.
With --layers the models are truncated: the targets are shown in parentheses, for orientation only.
Exits 1 when a step failed or a target was missed on a full-depth shape.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from shapes import SHAPES, is_built  # noqa: E402  (no torch import: build_shape imports it, and runs in a child)

SCALE_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-4b")
STEPS = ("info", "calibrate", "quantize-rtn", "quantize-awq", "quantize-gptq", "eval", "sensitivity", "plan", "export",
         "convert", "convert-genai", "convert-gguf", "convert-mnn-llm", "profile-mnn-llm", "convert-executorch",
         "convert-edgellm", "convert-qdq", "prune", "distill")
ALIASES = {"load": ("info",), "quantize": ("quantize-rtn", "quantize-awq", "quantize-gptq"), "rtn": ("quantize-rtn",),
           "awq": ("quantize-awq",), "gptq": ("quantize-gptq",), "evaluate": ("eval",), "convert-ort-int4": ("convert",)}
NEEDS = {"quantize-awq": "calibrate", "quantize-gptq": "calibrate", "plan": "sensitivity",
         "distill": "prune", "profile-mnn-llm": "convert-mnn-llm"}  # skipped when it failed
CONVERT_TARGET = {"convert": "ort-int4", "convert-genai": "ort-genai", "convert-gguf": "llama.cpp",
                  "convert-mnn-llm": "mnn-llm", "convert-executorch": "executorch",
                  "convert-edgellm": "tensorrt-edgellm"}  # step -> --target of a 4-bit conversion
COMMAND = {"quantize-rtn": "quantize", "quantize-awq": "quantize", "quantize-gptq": "quantize"}  # step -> subcommand
OUTPUTS = ("rtn-int4", "awq-int4", "gptq-int4", "plan.json", "onnx", "ort-int4", "ort-genai", "llama.cpp", "mnn-llm",
           "executorch", "tensorrt-edgellm", "ort-qdq", "pruned", "distilled")  # removed unless --keep-outputs
GB = 1024.0  # MiB per GiB

# (seconds, peak GiB) limits, None = no limit; a target always requires the step to complete.
_ALL_9GB = {step: (None, 9.0) for step in STEPS}
TARGETS: dict[str, dict[str, tuple[float | None, float | None]]] = {
    "qwen2.5-0.5b": {"quantize-rtn": (180.0, 4.0), "quantize-awq": (900.0, 5.0), "sensitivity+plan": (900.0, None),
                     "convert": (120.0, 4.0), "convert-genai": (120.0, 4.0), "convert-gguf": (120.0, 4.0),
                     "convert-qdq": (None, 4.0),
                     "prune": (300.0, 6.0), "distill": (600.0, 8.0)},
    "qwen2.5-1.5b": _ALL_9GB,
    # the checkpoint as users bring it after fine-tuning or dequantization: float32 file, its own lm_head (issue 54)
    "qwen2.5-1.5b-f32-untied": {"quantize-rtn": (600.0, 8.0)},
    "qwen3-4b": {"quantize-rtn": (None, 20.0), "convert": (None, 20.0)},
    # a vision-language model's quantize-rtn: the language model at int4, vision int8, scored on the demo-vl pictures
    "qwen3-vl-2b": {"info": (None, 12.0), "quantize-rtn": (None, 12.0)},
    "qwen2.5-vl-3b": {"info": (None, 20.0), "quantize-rtn": (None, 20.0)},
}


# ---------------------------------------------------------------------------------------------- pure helpers

def parse_shapes(text: str | None, all_shapes: bool = False) -> list[str]:
    """``--shapes a,b`` (or --all) -> shape names in the order given; the 0.5B shape when neither."""
    if all_shapes:
        return list(SCALE_SHAPES)
    names = [s.strip().lower() for s in (text or SCALE_SHAPES[0]).split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(f"unknown shape(s) {', '.join(unknown) or '(none)'}; choose from: {', '.join(SHAPES)}")
    return list(dict.fromkeys(names))


def parse_steps(text: str | None) -> list[str]:
    """``--steps a,b`` (names or aliases such as 'quantize', 'load') -> steps in pipeline order."""
    if not text:
        return list(STEPS)
    chosen: set[str] = set()
    for s in (s.strip().lower() for s in text.split(",")):
        if not s:
            continue
        if s in STEPS:
            chosen.add(s)
        elif s in ALIASES:
            chosen.update(ALIASES[s])
        else:
            raise ValueError(f"unknown step '{s}'; choose from: {', '.join(STEPS)} "
                             f"(or {', '.join(ALIASES)})")
    return [s for s in STEPS if s in chosen]


def shape_label(shape: str, layers: int | None) -> str:
    return f"{shape}-L{layers}" if layers else shape


def last_error_line(*texts: str) -> str:
    """The line that says why a step failed: the last one naming an error, else the last line at all."""
    lines: list[str] = []
    for text in texts:
        lines += [ln.strip() for ln in re.split(r"[\r\n]+", text or "") if ln.strip()]
    pattern = re.compile(r"error|exception|killed|out of memory", re.IGNORECASE)
    for ln in reversed(lines):
        if pattern.search(ln):
            return ln
    return lines[-1] if lines else ""


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min"


def format_mb(mb: float | None) -> str:
    if mb is None:
        return "-"
    return f"{mb:.0f} MB" if mb < GB else f"{mb / GB:.2f} GB"


def format_target(target: tuple[float | None, float | None] | None) -> str:
    if target is None:
        return ""
    seconds, gb = target
    parts = [f"< {seconds / 60:g} min" if seconds else "completes"]
    if gb:
        parts.append(f"< {gb:g} GB")
    return ", ".join(parts)


def target_met(row: dict, target: tuple[float | None, float | None] | None) -> bool | None:
    """None when there is no target; else completed, within the seconds and within the peak memory."""
    if target is None:
        return None
    if row.get("status") != "ok":
        return False
    seconds, gb = target
    if seconds is not None and (row.get("seconds") is None or row["seconds"] > seconds):
        return False
    if gb is not None and (row.get("peak_mb") is None or row["peak_mb"] > gb * GB):
        return False
    return True


def combined_row(rows: list[dict], steps: tuple[str, ...], name: str) -> dict | None:
    """One row for several steps run back to back (e.g. sensitivity + plan): summed seconds, max peak."""
    parts = [r for r in rows if r["step"] in steps]
    if len(parts) != len(steps):
        return None
    ok = all(r["status"] == "ok" for r in parts)
    peaks = [r["peak_mb"] for r in parts if r.get("peak_mb") is not None]
    return {"step": name, "status": "ok" if ok else "incomplete", "error": next((r.get("error") for r in parts
                                                                                 if r.get("error")), None),
            "seconds": sum(r["seconds"] or 0.0 for r in parts), "peak_mb": max(peaks) if peaks else None,
            "combined": list(steps)}


def scalar_fields(obj) -> dict:
    """The top-level numbers/strings of a step's --json output (lists and tables left out)."""
    if not isinstance(obj, dict):
        return {}
    return {k: v for k, v in obj.items() if isinstance(v, (int, float, str, bool)) or v is None}


def _gguf_detail(out: dict) -> str | None:
    check = (out.get("details") or {}).get("gguf_check")
    if not check:
        return None
    return (f"{check['weights']:,} weights read back, max |diff| {check['max_abs_diff']:g}, "
            f"{(out['details'].get('gguf_bytes') or 0) / 2**20:,.0f} MiB")


def _written_detail(out: dict) -> str | None:
    """The conversion's output size and its write time (the rest of the step is scoring in the engine)."""
    files = out.get("files") or []
    if not files:
        return None
    size = sum(f.get("bytes") or 0 for f in files if isinstance(f, dict))
    write = ((out.get("details") or {}).get("seconds") or {}).get("write")
    return f"{size / 2**20:,.0f} MiB written" + (f" in {write:.1f} s" if isinstance(write, (int, float)) else "")


def _profile_detail(out: dict) -> str | None:
    """The runtime's prefill times and decode speed from `workbench profile --json` (its first profile)."""
    prof = next(iter(out.get("profiles") or []), None)
    if not prof:
        return None
    prefill = (prof.get("prefill_ms") or {}).items()
    parts = [prof.get("runtime")] + [f"prefill {n} tok {ms:,.0f} ms" for n, ms in prefill]
    tps = prof.get("decode_tokens_per_second")
    if isinstance(tps, (int, float)):
        parts.append(f"decode {tps:.1f} tok/s")
    return ", ".join(p for p in parts if p)


def detail(step: str, out: dict) -> str:
    """A few figures from the step's own --json output for the table."""
    def num(key, fmt):
        v = out.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    picks = {
        "info": [num("parameters", "{:,} params")],
        "calibrate": ["read back from the workspace" if out.get("cached") else ("computed" if out else None)],
        "quantize-rtn": [num("quantize_seconds", "quantize {:.1f} s"), num("evaluate_seconds", "eval {:.1f} s"),
                         num("tokens", "{:,} tokens")],
        "quantize-awq": [num("quantize_seconds", "quantize {:.1f} s"), num("evaluate_seconds", "eval {:.1f} s"),
                         num("tokens", "{:,} tokens")],
        "quantize-gptq": [num("quantize_seconds", "quantize {:.1f} s"), num("evaluate_seconds", "eval {:.1f} s"),
                          num("tokens", "{:,} tokens")],
        "eval": [num("tokens", "{:,} tokens"), num("tokens_per_second", "{:,.0f} tok/s")],
        "sensitivity": [num("sweep_seconds", "sweep {:.1f} s"), num("trials_run", "{} trials")],
        "plan": [num("bits_per_weight", "{:.2f} bits/weight"), num("eval_tokens", "{:,} tokens")],
        "export": [num("export_seconds", "export {:.1f} s"), num("check_seconds", "checks {:.1f} s")],
        "convert": [num("top1_agreement_vs_simulation", "top-1 vs sim {:.4f}")],
        "convert-genai": [num("top1_agreement_vs_simulation", "top-1 vs sim {:.4f}")],
        "convert-gguf": [_gguf_detail(out)],
        "convert-mnn-llm": [num("top1_agreement_vs_simulation", "top-1 vs sim {:.4f}"), _written_detail(out)],
        "profile-mnn-llm": [_profile_detail(out)],
        "convert-executorch": [num("kl_divergence", "KL {:.2e}"), _written_detail(out)],
        "convert-edgellm": [_written_detail(out)],
        "convert-qdq": [num("kl_divergence", "KL {:.2e}"), (out.get("decode") or {}).get("kl_divergence") is not None
                        and f"decode KL {out['decode']['kl_divergence']:.2e}" or None],
        "prune": [num("parameters_after", "{:,} params kept"), num("seconds", "{:.1f} s in prune()")],
        "distill": [num("trainable_parameters", "{:,} trained"), num("seconds", "{:.1f} s in distill()")],
    }.get(step, [])
    return ", ".join(p for p in picks if p)


# ---------------------------------------------------------------------------------------------- running steps

def run_measured(cmd: list[str], *, out_path: Path, err_path: Path, env: dict, timeout: float | None,
                 max_rss_mb: float | None = None, cwd: Path = ROOT) -> dict:
    """Run ``cmd`` as its own process group; wall seconds, peak RSS (its ru_maxrss via wait4) and how it ended."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                start_new_session=True)
        killed = None
        sampled_max = 0.0
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                elapsed = time.perf_counter() - t0
                if killed is None and timeout and elapsed > timeout:
                    killed = "timeout"
                    _kill_group(proc.pid)
                rss = _rss_mb(proc.pid)
                if rss is not None:
                    sampled_max = max(sampled_max, rss)
                    if killed is None and max_rss_mb and rss > max_rss_mb:
                        killed = "max-rss"
                        _kill_group(proc.pid)
                time.sleep(0.2)
        except BaseException:  # Ctrl-C in the bench: take the step down with it
            _kill_group(proc.pid)
            os.wait4(proc.pid, 0)
            proc.returncode = -signal.SIGKILL
            raise
        seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code  # reaped here: Popen must not wait for it again
    return {"returncode": code, "seconds": seconds, "peak_mb": usage.ru_maxrss / 1024.0,
            "sampled_peak_mb": sampled_max or None, "killed": killed}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def workbench_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("workbench")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "workbench"]


def commands_accepting(option: str, env: dict) -> set[str]:
    """Which workbench subcommands have ``option`` (asked of the CLI's own parser, in a child process)."""
    code = ("import json\nfrom workbench.cli import build_parser\n"
            "p = build_parser()\nsub = next(a for a in p._actions if hasattr(a, 'choices') and isinstance(a.choices, dict))\n"
            "print(json.dumps({n: [o for a in sp._actions for o in a.option_strings] for n, sp in sub.choices.items()}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"could not read the workbench CLI's options: {last_error_line(r.stderr)}")
    return {name for name, opts in json.loads(r.stdout).items() if option in opts}


def step_command(step: str, model: Path, shape_dir: Path, args, rows: dict[str, dict]) -> tuple[list[str], str]:
    """The workbench argv (after the executable) for ``step``, and a note on what it ran on."""
    m = str(model)
    if step == "info":
        return ["info", m, "--json"], ""
    if step == "calibrate":
        return ["calibrate", m, "--json"], ""
    if step in ("quantize-rtn", "quantize-awq", "quantize-gptq"):
        method = step.split("-")[1]
        return ["quantize", m, "--bits", "4", "--method", method, "--out", str(shape_dir / f"{method}-int4"),
                "--json"], ""
    if step == "eval":
        return ["eval", m, "--ref", m, "--json"], ""
    if step == "sensitivity":
        return ["sensitivity", m, "--json"], ""
    if step == "plan":
        return ["plan", m, "--bits-per-weight", f"{args.plan_bits:g}", "--out", str(shape_dir / "plan.json"),
                "--json"], ""
    if step == "export":
        return ["export", m, "--out", str(shape_dir / "onnx"), "--json"], ""
    if step in CONVERT_TARGET:
        target = CONVERT_TARGET[step]
        rtn = shape_dir / "rtn-int4"
        signed = (rtn / "plan.json").is_file() and json.loads((rtn / "plan.json").read_text()).get("full_range")
        if (rtn / "quantization.json").is_file() and (target == "llama.cpp" or not signed):
            return ["convert", str(rtn), "--target", target, "--out", str(shape_dir / target), "--json"], \
                "from quantize-rtn's output"
        why = ("quantize-rtn not run" if "quantize-rtn" not in rows else
               "quantize-rtn's 16-level grid is GGUF's only" if signed else "quantize-rtn saved nothing")
        return ["convert", m, "--bits", "4", "--target", target, "--out", str(shape_dir / target),
                "--json"], f"from the float model --bits 4 ({why})"
    if step == "profile-mnn-llm":
        return ["profile", str(shape_dir / "mnn-llm"), "--threads", "2", "--json"], "2 threads"
    if step == "convert-qdq":
        return ["convert", m, "--bits", "8", "--target", "ort-qdq", "--max-tokens", "256", "--out",
                str(shape_dir / "ort-qdq"), "--json"], "256 evaluation tokens"
    if step == "prune":
        return ["prune", m, "--heads", "0.25", "--mlp", "0.2", "--head-unit", "query", "--importance-tokens", "512",
                "--eval-tokens", "2048", "--out", str(shape_dir / "pruned"), "--json"], ""
    if step == "distill":
        pruned = shape_dir / "pruned"  # prune's output (this run's, or a kept one with --run-dir)
        return ["distill", str(pruned), "--teacher", m, "--out", str(shape_dir / "distilled"), "--mode", "lora",
                "--steps", "8", "--batch-size", "1", "--seq-len", "256", "--validation-fraction", "0.02",
                "--eval-tokens", "1024", "--gradient-checkpointing", "--overwrite", "--json"], \
            "LoRA, 8 steps of 1 x 256 tokens"
    raise ValueError(step)


def build_model(shape: str, layers: int | None, models_dir: Path, env: dict, logs: Path, timeout) -> dict:
    """Build (or find) the random-weight model; a row like a step's."""
    path = models_dir / shape_label(shape, layers)
    row = {"step": "build", "model": str(path)}
    if is_built(path):
        return {**row, "status": "ok", "seconds": None, "peak_mb": None, "note": "cached"}
    code = (f"import sys; sys.path.insert(0, {str(BENCH)!r}); from shapes import build_shape; "
            f"build_shape({shape!r}, {str(path)!r}, layers={layers!r})")
    r = run_measured([sys.executable, "-c", code], out_path=logs / "build.out", err_path=logs / "build.err", env=env,
                     timeout=timeout)
    return {**row, **_status(r, logs / "build.out", logs / "build.err"), "seconds": r["seconds"],
            "peak_mb": r["peak_mb"], "note": "built"}


def _status(r: dict, out_path: Path, err_path: Path) -> dict:
    if r["killed"] == "timeout":
        return {"status": f"TIMEOUT (killed after {r['seconds']:.0f} s)", "error": "timeout"}
    if r["killed"] == "max-rss":
        return {"status": "KILLED (resident memory over --max-rss)",
                "error": "max-rss"}
    if r["returncode"] == 0:
        return {"status": "ok"}
    line = last_error_line(_read(err_path), _read(out_path))
    if r["returncode"] < 0:
        sig = signal.Signals(-r["returncode"]).name
        line = line or ("killed (out of memory?)" if sig == "SIGKILL" else "")
        return {"status": f"FAILED ({sig}): {line}".rstrip(": "), "error": line or sig}
    return {"status": f"FAILED (exit {r['returncode']}): {line}".rstrip(": "), "error": line}


def _read(path: Path, limit: int = 200_000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace")


def _parse_json(text: str):
    text = text.strip()
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except json.JSONDecodeError:
        return None


def run_shape(shape: str, args, steps: list[str], run_dir: Path, base_env: dict, device_ok: set[str],
              log=print) -> dict:
    label = shape_label(shape, args.layers)
    shape_dir = run_dir / label
    logs = shape_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    workspace = Path(args.workspace).resolve() if args.workspace else shape_dir / "workspace"
    env = {**base_env, "WORKBENCH_WORKSPACE": str(workspace)}
    build = build_model(shape, args.layers, Path(args.models_dir).expanduser(), env, logs, args.timeout)
    log(f"{label}: build {build['status']} ({build.get('note')}, {format_seconds(build['seconds'])}, "
        f"{format_mb(build['peak_mb'])})")
    model = Path(build["model"])
    rows: dict[str, dict] = {}
    for step in steps:
        row: dict = {"step": step}
        need = NEEDS.get(step)
        if build["status"] != "ok":
            row.update(status="skipped (model build failed)", seconds=None, peak_mb=None)
        elif need and need in rows and rows[need]["status"] != "ok":
            row.update(status=f"skipped ({need} failed)", seconds=None, peak_mb=None)
        else:
            argv, note = step_command(step, model, shape_dir, args, rows)
            cmd = COMMAND.get(step, step)
            if args.device and cmd in device_ok:
                argv += ["--device", args.device]
            row["command"] = " ".join(["workbench", *argv])
            r = run_measured(workbench_cmd() + argv, out_path=logs / f"{step}.out", err_path=logs / f"{step}.err",
                             env=env, timeout=args.timeout, max_rss_mb=args.max_rss * GB if args.max_rss else None)
            out = _parse_json(_read(logs / f"{step}.out")) if r["returncode"] == 0 else None
            row.update(_status(r, logs / f"{step}.out", logs / f"{step}.err"), seconds=r["seconds"],
                       peak_mb=r["peak_mb"], returncode=r["returncode"], log=str(logs / f"{step}.err"),
                       note=", ".join(p for p in (note, detail(step, out or {})) if p),
                       output=scalar_fields(out))
        rows[step] = row
        log(f"{label}: {step} {row['status']} ({format_seconds(row['seconds'])}, {format_mb(row['peak_mb'])})")
    table = list(rows.values())
    if "sensitivity" in rows and "plan" in rows:
        table.append(combined_row(table, ("sensitivity", "plan"), "sensitivity+plan"))
    targets = TARGETS.get(shape, {})
    for row in table:
        t = targets.get(row["step"])
        row["target"] = format_target(t) or None
        row["target_met"] = target_met(row, t)
    if not args.keep_outputs:
        for name in OUTPUTS:
            p = shape_dir / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if not args.workspace:
            shutil.rmtree(workspace, ignore_errors=True)
    return {"shape": shape, "label": label, "layers": args.layers, "model": build["model"], "build": build,
            "workspace": str(workspace), "steps": table}


def format_table(results: list[dict], truncated: bool) -> str:
    heads = ("shape", "step", "status", "time", "peak", "target", "met", "notes")
    lines = []
    for res in results:
        for row in [res["build"], *res["steps"]]:
            met = row.get("target_met")
            met_s = "" if met is None else ("yes" if met else "NO")
            target = row.get("target") or ""
            if truncated and target:
                target, met_s = f"({target})", f"({met_s.lower()})"
            status = row["status"] if len(row["status"]) <= 90 else row["status"][:87] + "..."
            # a step killed for time or memory ran at least this long / this big: lower bounds
            seconds = (">" if row.get("error") == "timeout" else "") + format_seconds(row.get("seconds"))
            peak = (">" if row.get("error") == "max-rss" else "") + format_mb(row.get("peak_mb"))
            lines.append((res["label"], row["step"], status, seconds, peak, target, met_s, row.get("note") or ""))
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) if lines else len(h) for i, h in enumerate(heads)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(heads), fmt(["-" * w for w in widths])] + [fmt(ln) for ln in lines])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help=f"comma-separated, from {', '.join(SCALE_SHAPES)} (default {SCALE_SHAPES[0]})")
    ap.add_argument("--all", action="store_true", help="every shape: " + ", ".join(SCALE_SHAPES))
    ap.add_argument("--steps", help=f"comma-separated subset of {','.join(STEPS)} (default: all; aliases "
                    "load, quantize, rtn, awq, gptq, evaluate)")
    ap.add_argument("--layers", type=int, help="truncate every model to this many decoder blocks (smoke runs)")
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "workbench-bench" / "shapes"),
                    help="where the random-weight models are built and reused (default %(default)s)")
    ap.add_argument("--workspace", help="workspace for every step (WORKBENCH_WORKSPACE); cached results in it hide "
                    "costs (default: a fresh one per shape in the run directory, removed afterwards)")
    ap.add_argument("--run-dir", help="logs and step outputs (default: a new temporary directory)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep quantized models, ONNX files and the "
                    "default workspace (removed after each shape otherwise; logs are always kept)")
    ap.add_argument("--device", help="passed as --device to the steps whose command accepts it")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per step before it is killed "
                    "(default %(default)g)")
    ap.add_argument("--max-rss", type=float, help="kill a step whose resident memory exceeds this many GB")
    ap.add_argument("--plan-bits", type=float, default=6.0, help="the automatic plan's bits/weight budget "
                    "(default %(default)g: between uniform INT4 and INT8)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--out-json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes, args.all)
        steps = parse_steps(args.steps)
    except ValueError as e:
        ap.error(str(e))
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be at least 1")

    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="workbench-scale-"))
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    device_ok = commands_accepting("--device", env) if args.device else set()
    device_steps = [s for s in steps if COMMAND.get(s, s) in device_ok]
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    log(f"run directory {run_dir}; steps {', '.join(steps)}; timeout {args.timeout:g} s per step")

    results: list[dict] = []
    started = time.time()
    interrupted = False
    try:
        for shape in shapes:
            results.append(run_shape(shape, args, steps, run_dir, env, device_ok, log=log))
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: results so far")

    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "seconds": time.time() - started, "run_dir": str(run_dir), "layers": args.layers,
              "steps": steps, "device": args.device, "device_passed_to": device_steps, "cpu_count": os.cpu_count(),
              "python": sys.executable, "interrupted": interrupted, "shapes": results}
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print()
        print(format_table(results, truncated=bool(args.layers)))
        print()
        if args.layers:
            print(f"models truncated to {args.layers} decoder blocks: targets (in parentheses) are for the full "
                  "models, for orientation only")
        if args.device:
            print(f"--device {args.device} passed to: {', '.join(device_steps) or 'none (no step accepts --device)'}")
        print(f"logs under {run_dir}/<shape>/logs; peak = the step process's ru_maxrss (MB/GB = 2^20/2^30 bytes)")
    failed = any(r["status"] != "ok" for res in results for r in res["steps"])
    missed = not args.layers and any(r.get("target_met") is False for res in results for r in res["steps"])
    return 1 if failed or missed or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
