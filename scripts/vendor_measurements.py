"""Regenerate assets/vendor_measurements.json from the vendors' own published measurements.

    python scripts/vendor_measurements.py                      # downloads the qai-hub-models wheel (no install)
    python scripts/vendor_measurements.py --qai-wheel qai_hub_models-0.65.0-py3-none-any.whl \\
        --rknn-llm /path/to/rknn-llm \\                        # a clone (or bare mirror) of airockchip/rknn-llm
        --jetson-ai-lab /path/to/jetson-generative-ai-playground  # and of NVIDIA-AI-IOT's Jetson AI Lab site

Three sources, read as published, nothing typed in by hand:
- Qualcomm AI Hub's measurements, shipped in the ``qai-hub-models`` wheel on PyPI: every
  ``qai_hub_models/models/<model>/perf.yaml`` of a model whose shape the workbench knows (decode tokens/s,
  prefill tokens/s and the time-to-first-token range per precision, runtime, compute unit and context length);
  ``devices_and_chipsets.yaml`` names each device's chipset. The wheel is read as a zip; installing it would pin
  an older torch.
- Rockchip's RKLLM measurements: ``benchmark.md`` of airockchip/rknn-llm at a recorded commit (TTFT, tokens/s and
  memory for 128 prompt / 64 new tokens, per board, model and dtype).
- NVIDIA's Jetson AI Lab benchmarks: ``docs/benchmarks.md`` of NVIDIA-AI-IOT/jetson-generative-ai-playground at a
  recorded commit: decode tokens/s of the Jetson Orin Nano before and after its "Super" clocks, run with MLC at
  INT4 by jetson-containers' ``packages/llm/mlc/benchmark.sh`` (q4f16_ft, a 16-token prompt, 128 new tokens).
  Its "SmolLM2" row names no size (that script runs three), so it is left out.

The vision-language models' rows (``vl_measurements``, kept apart so the text fits stay as they were) are the
same AI Hub figures for Qwen2.5-VL-7B and Qwen3-VL-2B/4B: their language part only; AI Hub publishes no separate
vision-encoder latency. ``--vl-only`` rewrites just those rows from the same wheel.

Each row keeps its source (package, version and file, or repository, commit and path), the vendor's own model
and device names, the workbench shape (``assets/model_shapes.json``) and device profile (``assets/devices``) it
is projected with, or null where the workbench has no profile for that device.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "assets" / "vendor_measurements.json"
QAI_VERSION = "0.65.0"
RKNN_LLM_REPO = "airockchip/rknn-llm"
RKNN_LLM_COMMIT = "878f9361fd3afa7e167b7079918918f78d2c1c2a"
JETSON_REPO = "NVIDIA-AI-IOT/jetson-generative-ai-playground"
JETSON_COMMIT = "8b997d2760a9d7aac4c3afa813cc51c97cc6fb87"  # the last version of docs/benchmarks.md
# how those figures were run: dusty-nv/jetson-containers packages/llm/mlc/benchmark.sh (MLC 0.1.4)
JETSON_METHOD = {"repository": "dusty-nv/jetson-containers", "commit": "e45e41fdd1bc3fbcaeab6e35e88222c81bd2b0e0",
                 "path": "packages/llm/mlc/benchmark.sh", "quantization": "q4f16_ft",
                 "prompt": "/data/prompts/completion_16.json", "prompt_tokens": 16, "max_new_tokens": 128}

# the vendors' model names -> the workbench shape (assets/model_shapes.json); fine-tunes of one base share its shape
# (AI Hub's ELYZA-JP, TAIDE and SEA-LION builds are Llama-3 8B's). Left out: llama_v3_2_3b_instruct_ssd, whose
# tokens/s come from self-speculative decoding (several tokens per verified step), and models of other families
QAI_MODELS = {
    "qwen3_0_6b": "qwen3-0.6b", "qwen3_1_7b": "qwen3-1.7b", "qwen3_4b": "qwen3-4b",
    "qwen3_4b_instruct_2507": "qwen3-4b", "qwen3_8b": "qwen3-8b",
    "llama_v3_2_1b_instruct": "llama-3.2-1b", "llama_v3_2_3b_instruct": "llama-3.2-3b",
    "llama_v3_1_8b_instruct": "llama-3.1-8b", "llama_v3_8b_instruct": "llama-3.1-8b",
    "qwen2_7b_instruct": "qwen2-7b", "smollm2_1_7b_it": "smollm2-1.7b",
    "llama_v3_1_sea_lion_3_5_8b_r": "llama-3.1-8b", "llama_v3_elyza_jp_8b": "llama-3.1-8b",
    "llama_v3_taide_8b_chat": "llama-3.1-8b",
}
# AI Hub's vision-language models -> the workbench vision shape (assets/model_shapes.json "vision_shapes") or, where
# it has none, the shape of the same language model. Their perf.yaml gives the language part's figures only (decode,
# prefill tokens/s, the time-to-first-token range of text prompts): no image's encoder latency is published
QAI_VL_MODELS = {"qwen2_5_vl_7b_instruct": "qwen2.5-7b", "qwen3_vl_2b_instruct": "qwen3-vl-2b",
                 "qwen3_vl_4b_instruct": "qwen3-vl-4b"}
RKNN_MODELS = {("Qwen2", "0.5B"): "qwen2-0.5b", ("Qwen3", "0.6B"): "qwen3-0.6b",
               ("TinyLLAMA", "1.1B"): "tinyllama-1.1b", ("Qwen2.5", "1.5B"): "qwen2.5-1.5b"}
JETSON_MODELS = {"Llama 3.1 8B": "llama-3.1-8b", "Llama 3.2 3B": "llama-3.2-3b", "Qwen2.5 7B": "qwen2.5-7b"}
JETSON_BOARDS = {"Jetson Orin Nano (original)": "jetson-orin-nano", "Jetson Orin Nano Super": "jetson-orin-nano-super"}
# a vendor's chipset or board -> the workbench's device profile (assets/devices/<name>.json)
PROFILES = {"qualcomm-snapdragon-8-elite-for-galaxy": "snapdragon-8-elite",
            "qualcomm-snapdragon-x-elite": "snapdragon-x-elite", "RK3588": "rk3588",
            "qualcomm-snapdragon-8-elite-gen5-for-galaxy": "snapdragon-8-elite-gen-5",
            "qualcomm-snapdragon-x2-elite": "snapdragon-x2-elite", "qualcomm-qcs9075": "dragonwing-iq-9075"}
# AI Hub's runtime keys -> the workbench's runtime names (workbench/devices/runtimes.py)
QAI_RUNTIMES = {"genie": "genie", "geniex_qairt": "qairt", "geniex_llamacpp": "llama.cpp"}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def qai_rows(wheel: Path, models: dict[str, str] = QAI_MODELS) -> tuple[dict, list[dict]]:
    """AI Hub's LLM measurements of ``models``, one row per (model, precision, device, runtime, unit, ctx)."""
    z = zipfile.ZipFile(wheel)
    chips = yaml.safe_load(z.read("qai_hub_models/devices_and_chipsets.yaml"))["devices"]
    version = wheel.name.split("-")[1]  # the release the wheel is (earlier ones: scripts/vendor_history.py)
    source = {"kind": "package", "package": "qai-hub-models", "version": version, "file": wheel.name,
              "sha256": _sha256(wheel.read_bytes()), "files": "qai_hub_models/models/<model>/perf.yaml, "
              "qai_hub_models/devices_and_chipsets.yaml", "publisher": "Qualcomm AI Hub"}
    rows = []
    names = set(z.namelist())
    for model, shape in models.items():
        path = f"qai_hub_models/models/{model}/perf.yaml"
        if path not in names:
            continue  # an earlier release (scripts/vendor_history.py reads those too) may not have the model yet
        perf = yaml.safe_load(z.read(path))
        parts = _num_splits(z, model)
        for precision, pd in perf["precisions"].items():
            for component, cd in pd["components"].items():
                for device, dd in cd["performance_metrics"].items():
                    for runtime, rd in dd.items():
                        if runtime not in QAI_RUNTIMES or not isinstance(rd, dict):
                            continue
                        for m in rd.get("llm_metrics", []):
                            if not m.get("tokens_per_second"):
                                continue  # AI Hub writes 0.0 where a run gave no figure: not a measurement
                            rows.append({**_qai_row(model, component, shape, precision, device, chips, runtime, m,
                                                            path), "parts": parts})
    return source, rows


def _num_splits(z: zipfile.ZipFile, model: str) -> int | None:
    """The parts AI Hub splits the model's graph into (``NUM_SPLITS`` in its model.py), None where not stated."""
    try:
        text = z.read(f"qai_hub_models/models/{model}/model.py").decode("utf-8")
    except KeyError:
        return None
    m = re.search(r"^NUM_SPLITS\s*=\s*(\d+)", text, re.M)
    return int(m.group(1)) if m else None


def _qai_row(model, component, shape, precision, device, chips, runtime, m, path) -> dict:
    name = QAI_RUNTIMES[runtime]
    unit = m.get("desired_compute_unit")
    if name == "llama.cpp":
        name = f"llama.cpp-{unit}"
    ttft = m.get("time_to_first_token_range_milliseconds") or {}
    ctx = int(m["context_length"])
    # the range runs from the shortest prompt to a full context: max / min = context / shortest prompt
    prompt = round(ctx * ttft["min"] / ttft["max"]) if ttft.get("min") and ttft.get("max") else None
    chipset = chips.get(device, {}).get("chipset")
    # a device AI Hub lists with a reference_chipset is not in its workbench: its rows repeat that chipset's
    reference = chips.get(device, {}).get("reference_chipset")
    return {"source": "qai-hub-models", "file": path, "vendor_model": model, "model": component, "shape": shape,
            "vendor_device": device, "chipset": chipset, "reference_chipset": reference,
            "device": PROFILES.get(chipset), "runtime": name,
            "compute_unit": unit, "precision": precision, "context": ctx, "prompt": prompt, "new_tokens": None,
            "decode_tps": float(m["tokens_per_second"]),
            "prefill_tps": None if m.get("prefill_tokens_per_second") is None else float(m["prefill_tokens_per_second"]),
            "ttft_ms": None if ttft.get("min") is None else float(ttft["min"]), "peak_mb": None}


def _repo_file(clone: Path, commit: str, path: str) -> str:
    """One file at a recorded commit, from a clone or a bare mirror."""
    git_dir = clone / ".git" if (clone / ".git").exists() else clone
    done = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{clone} has no {path} at commit {commit[:12]} ({done.stderr.strip() or 'not a git clone'}): "
                         "pass a full clone of the source repository that holds that commit")
    return done.stdout


def _repo_source(repo: str, commit: str, path: str, text: str, publisher: str, **more) -> dict:
    return {"kind": "repository", "repository": repo, "commit": commit, "path": path,
            "sha256": _sha256(text.encode()), "publisher": publisher, **more}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def rknn_rows(rknn_llm: Path, commit: str = RKNN_LLM_COMMIT) -> tuple[dict, list[dict]]:
    """Rockchip's table rows of the models above: a model's name is given once, on its first dtype's row."""
    text = _repo_file(rknn_llm, commit, "benchmark.md")
    source = _repo_source(RKNN_LLM_REPO, commit, "benchmark.md", text, "Rockchip")
    rows, board, model = [], None, None
    for line in text.splitlines():
        head = re.match(r"^###\s+(\S+)", line)
        if head:
            board = head.group(1)
            continue
        cells = _cells(line)
        if board is None or len(cells) != 8 or not re.match(r"^[\d.]+$", cells[5] or "x"):
            continue
        model = cells[0] or model
        shape = RKNN_MODELS.get((model, cells[1]))
        if shape is None:
            continue
        seq, new, ttft, tps, mem = (float(c) for c in cells[3:8])
        rows.append({"source": RKNN_LLM_REPO, "file": "benchmark.md", "vendor_model": f"{model} {cells[1]}",
                     "model": f"{model}-{cells[1]}", "shape": shape, "vendor_device": board, "chipset": board,
                     "reference_chipset": None, "parts": None,
                     "device": PROFILES.get(board), "runtime": "rkllm", "compute_unit": "npu", "precision": cells[2],
                     "context": int(seq + new), "prompt": int(seq), "new_tokens": int(new), "decode_tps": tps,
                     "prefill_tps": seq / ttft * 1e3, "ttft_ms": ttft, "peak_mb": mem})
    return source, rows


def jetson_rows(clone: Path, commit: str = JETSON_COMMIT) -> tuple[dict, list[dict]]:
    """NVIDIA's Orin Nano table: one row per (model, board column) of the models above."""
    path = "docs/benchmarks.md"
    text = _repo_file(clone, commit, path)
    source = _repo_source(JETSON_REPO, commit, path, text, "NVIDIA (Jetson AI Lab)", method=JETSON_METHOD)
    rows, boards = [], None
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            boards = None  # a table ends at its first line that is not a row
            continue
        cells = _cells(line)
        if cells[0] == "Model" and set(JETSON_BOARDS) <= set(cells):
            boards = {i: cells[i] for i in range(len(cells)) if cells[i] in JETSON_BOARDS}
            continue
        if boards is None or cells[0] not in JETSON_MODELS:
            continue
        prompt, new = JETSON_METHOD["prompt_tokens"], JETSON_METHOD["max_new_tokens"]
        for i, board in boards.items():
            rows.append({"source": JETSON_REPO, "file": path, "vendor_model": cells[0], "model": cells[0],
                         "shape": JETSON_MODELS[cells[0]], "vendor_device": board, "chipset": "Jetson Orin Nano",
                         "reference_chipset": None, "parts": None, "device": JETSON_BOARDS[board], "runtime": "mlc",
                         "compute_unit": "gpu", "precision": JETSON_METHOD["quantization"], "context": prompt + new,
                         "prompt": prompt, "new_tokens": new, "decode_tps": float(cells[i]), "prefill_tps": None,
                         "ttft_ms": None, "peak_mb": None})
    return source, rows


def _download_wheel(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"qai-hub-models=={QAI_VERSION}",
                    "-d", str(where)], check=True)
    return next(where.glob("qai_hub_models-*.whl"))


def _write(doc: dict, out: Path) -> None:
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp_out.replace(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qai-wheel", type=Path, help=f"qai-hub-models {QAI_VERSION} wheel (default: pip download it)")
    ap.add_argument("--vl-only", action="store_true", help="rewrite only the vision-language rows (vl_measurements) "
                    "of the existing file from the wheel")
    ap.add_argument("--rknn-llm", type=Path, help=f"a clone or bare mirror of {RKNN_LLM_REPO}")
    ap.add_argument("--jetson-ai-lab", type=Path, help=f"a clone or bare mirror of {JETSON_REPO}")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if not args.vl_only and (args.rknn_llm is None or args.jetson_ai_lab is None):
        ap.error("--rknn-llm and --jetson-ai-lab are required (or --vl-only)")
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.qai_wheel or _download_wheel(Path(tmp))
        qai_source, qai = qai_rows(wheel)
        _, vl = qai_rows(wheel, QAI_VL_MODELS)
    if args.vl_only:
        doc = json.loads(args.out.read_text(encoding="utf-8"))
        if doc["sources"]["qai-hub-models"]["sha256"] != qai_source["sha256"]:
            raise SystemExit(f"{wheel.name} is not the wheel {args.out.name} was read from: regenerate it whole")
        doc["vl_measurements"] = vl
        _write(doc, args.out)
        print(f"{len(vl)} AI Hub vision-language measurements -> {args.out}")
        return 0
    rk_source, rk = rknn_rows(args.rknn_llm)
    nv_source, nv = jetson_rows(args.jetson_ai_lab)
    doc = {"about": "Device LLM speed and memory measured and published by the vendors, regenerated by "
                    "scripts/vendor_measurements.py; nothing typed in by hand. ttft_ms is for `prompt` tokens "
                    "(AI Hub: the low end of its time-to-first-token range; Rockchip: its TTFT); peak_mb is "
                    "Rockchip's 'memory(MB)'; `device` is the workbench profile a row is projected with.",
           "sources": {"qai-hub-models": qai_source, RKNN_LLM_REPO: rk_source, JETSON_REPO: nv_source},
           "measurements": qai + rk + nv, "vl_measurements": vl}
    _write(doc, args.out)
    print(f"{len(qai)} AI Hub, {len(rk)} RKLLM and {len(nv)} Jetson AI Lab measurements -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
