"""Build, simulate and export RKNN models in one process, inside the rknn-toolkit2 venv (``make rknn-env``).

    .venv-rknn/bin/python workbench/targets/rknn_build.py request.json result.json

Run by file path, never imported by the workbench: it needs rknn-toolkit2's pins (numpy 1.26, onnx
1.18), which conflict with the project's, and only numpy plus ``rknn.api`` (with the torch stub
``rknn_stub`` on PYTHONPATH). A ``.rknn`` reloaded with ``load_rknn`` cannot be simulated, so each
graph is built, run by the simulator (``init_runtime()`` with no target) on the given feeds, and
exported by the same ``RKNN`` object.

The request: ``{"platform", "graphs": [{"name", "onnx", "inputs", "sizes", "quantize", "dtype",
"dataset", "float_outputs", "float_spans", "algorithm", "rknn", "feeds", "logits_dir"}]}``; ``float_ranges`` are
the ONNX outputs of MatMuls kept float16 through hybrid quantization. The result, per graph:
``ok``, ``error``, ``seconds`` (build, simulate), ``rknn_bytes``, ``logits`` (one ``.npy`` per feed).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import numpy as np


def _check(code, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed (the toolkit's log above says why)")


def _fresh(spec: dict, platform: str):
    from rknn.api import RKNN
    rknn = RKNN(verbose=False)
    _check(rknn.config(target_platform=platform, quantized_dtype=spec.get("dtype", "w8a8"),
                       quantized_algorithm=spec.get("algorithm", "normal"), optimization_level=3), "config")
    _check(rknn.load_onnx(model=spec["onnx"], inputs=spec["inputs"], input_size_list=spec["sizes"]), "load_onnx")
    return rknn


def _cfg_names(cfg: Path) -> list[str]:
    """Tensor names of a ``.quantization.cfg``, in the toolkit's graph order."""
    names, inside = [], False
    for line in cfg.read_text().splitlines():
        if line.startswith("quantize_parameters:"):
            inside = True
        elif inside and line.startswith("    ") and not line.startswith("     ") and line.rstrip().endswith(":"):
            names.append(line.strip()[:-1].strip("'\""))
        elif inside and line and not line.startswith(" "):
            break
    return names


def hybrid_pairs(names: list[str], outputs: list[str]) -> dict[str, list[str]]:
    """custom_hybrid ``[input, output]`` per ONNX output: the toolkit names a MatMul's tensors after its ONNX
    output (``logits_mm``, ``logits_mm_tp``, ``logits``); the span runs from the tensor before the first such
    name to the last one."""
    pairs = {}
    for o in outputs:
        idx = [k for k, n in enumerate(names) if n == o or n.startswith(o + "_") or n.startswith(o + "#")]
        if idx and idx[0] > 0:
            pairs[o] = [names[idx[0] - 1], names[idx[-1]]]
    return pairs


def _toolkit_name(names: list[str], onnx_name: str) -> str | None:
    """The toolkit's tensor for an ONNX tensor: the same name, else the first one named after it."""
    if onnx_name in names:
        return onnx_name
    return next((n for n in names if n.startswith(onnx_name + "_") or n.startswith(onnx_name + "#")), None)


def span_pairs(names: list[str], spans: list[list[str]]) -> list[list[str]]:
    """custom_hybrid pairs for ``[input, output]`` ONNX tensor spans (those the toolkit has under some name)."""
    pairs = []
    for start, end in spans:
        a, b = _toolkit_name(names, start), _toolkit_name(names, end)
        if a and b:
            pairs.append([a, b])
    return pairs


def _hybrid(rknn, spec: dict, platform: str, work: Path, outputs: list[str]):
    """Hybrid quantization keeping ``outputs``' MatMuls and ``float_spans`` float16; returns (rknn, kept outputs,
    refused outputs, spans kept)."""
    stem = Path(spec["onnx"]).stem
    cwd = os.getcwd()
    os.chdir(work)  # step 1 writes <model>.model / .data / .quantization.cfg here
    try:
        _check(rknn.hybrid_quantization_step1(dataset=spec["dataset"]), "hybrid_quantization_step1")
        names = _cfg_names(Path(f"{stem}.quantization.cfg"))
        pairs = hybrid_pairs(names, outputs)
        refused = [o for o in outputs if o not in pairs]
        spans = span_pairs(names, spec.get("float_spans") or [])
        rknn.release()
        rknn = _fresh(spec, platform)
        if pairs or spans:
            _check(rknn.hybrid_quantization_step1(dataset=spec["dataset"],
                                                  custom_hybrid=list(pairs.values()) + spans),
                   "hybrid_quantization_step1 (custom_hybrid)")
        rknn.release()
        from rknn.api import RKNN
        rknn = RKNN(verbose=False)
        _check(rknn.hybrid_quantization_step2(model_input=f"{stem}.model", data_input=f"{stem}.data",
                                              model_quantization_cfg=f"{stem}.quantization.cfg"),
               "hybrid_quantization_step2")
    finally:
        os.chdir(cwd)
    return rknn, list(pairs), refused, len(spans)


def build_one(spec: dict, platform: str, work: Path) -> dict:
    out = {"name": spec["name"], "ok": False, "error": None, "seconds": {}, "rknn_bytes": None, "logits": [],
           "float_kept": [], "float_refused": []}
    t0 = time.perf_counter()
    rknn = None
    try:
        rknn = _fresh(spec, platform)
        floats = spec.get("float_outputs") or []
        if spec.get("quantize") and (floats or spec.get("float_spans")):
            rknn, out["float_kept"], out["float_refused"], out["float_spans"] = _hybrid(rknn, spec, platform, work,
                                                                                       floats)
        else:
            _check(rknn.build(do_quantization=bool(spec.get("quantize")), dataset=spec.get("dataset")), "build")
        out["seconds"]["build"] = time.perf_counter() - t0
        _check(rknn.export_rknn(spec["rknn"]), "export_rknn")
        out["rknn_bytes"] = Path(spec["rknn"]).stat().st_size
        t1 = time.perf_counter()
        _check(rknn.init_runtime(), "init_runtime (simulator)")
        logits_dir = Path(spec["logits_dir"])
        logits_dir.mkdir(parents=True, exist_ok=True)
        for k, feed_path in enumerate(spec.get("feeds", [])):
            with np.load(feed_path) as feed:
                inputs = [feed[name] for name in spec["inputs"]]
            # 4-D inputs (the KV cache) are taken as they are only when said to be NCHW
            res = rknn.inference(inputs=inputs, data_format="nchw" if any(x.ndim == 4 for x in inputs) else None)
            if res is None:
                raise RuntimeError(f"the simulator returned nothing for feed {k}")
            path = logits_dir / f"{k:04d}.npy"
            np.save(path, np.asarray(res[0], np.float32))
            out["logits"].append(str(path))
        out["seconds"]["simulate"] = time.perf_counter() - t1
        out["ok"] = True
    except Exception as e:  # reported to the workbench, which turns it into its own error
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc(limit=3)
    finally:
        if rknn is not None:
            rknn.release()
    return out


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    work = Path(request.get("work") or Path(argv[2]).parent)
    results = []
    for spec in request["graphs"]:
        results.append(build_one(spec, request.get("platform", "rk3588"), work))
        Path(argv[2]).write_text(json.dumps({"graphs": results}), encoding="utf-8")  # partial results survive
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(argv[2]).write_text(json.dumps({"graphs": results, "peak_rss_bytes": peak}), encoding="utf-8")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    # this file's folder holds the workbench's own rknn.py, which would shadow the toolkit's package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main(sys.argv))
