"""Rockchip RKNPU2, ``rknn``: an RKNN-Toolkit2 build script and calibration dataset (the toolkit is not installable here).

``rknn.build(do_quantization=True, dataset=...)`` reads a text file whose lines list one ``.npy``
per model input; ``write_rknn_bundle`` writes those from the calibration text and a
``build_rknn.py`` that loads each static graph with its fixed input sizes. (For large LLMs
Rockchip's RKLLM toolkit is the usual route; the RKNN path suits small models and sub-graphs.)
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .base import inspect_graph
from .registry import Target, register_target

__all__ = ["write_rknn_bundle", "convert_rknn", "TARGET"]

SCRIPT = '''"""Build RKNN models from the workbench's static graphs. Run where rknn-toolkit2 is installed:
    python build_rknn.py [--platform rk3588]
"""
import argparse

from rknn.api import RKNN

GRAPHS = {graphs!r}

parser = argparse.ArgumentParser()
parser.add_argument("--platform", default="{platform}")
args = parser.parse_args()
for name, spec in GRAPHS.items():
    rknn = RKNN(verbose=False)
    rknn.config(target_platform=args.platform, quantized_dtype="{dtype}", quantized_algorithm="normal",
                optimization_level=3)
    if rknn.load_onnx(model=spec["onnx"], inputs=spec["inputs"], input_size_list=spec["sizes"]) != 0:
        raise SystemExit(f"load_onnx failed for {{name}}")
    if rknn.build(do_quantization=True, dataset=spec["dataset"]) != 0:
        raise SystemExit(f"build failed for {{name}}")
    rknn.export_rknn(f"{{name}}.rknn")
    rknn.release()
'''


def write_rknn_bundle(out_dir: str | Path, graphs: Mapping[str, Path],
                      feeds: Mapping[str, Sequence[Mapping[str, np.ndarray]]], *, platform: str = "rk3588",
                      dtype: str = "w8a8") -> dict:
    """Write ``build_rknn.py`` and ``dataset_<graph>.txt`` (+ ``.npy`` inputs) for static ``graphs``."""
    import onnx
    out = Path(out_dir)
    spec = {}
    for name, path in graphs.items():
        proto = onnx.load(str(path), load_external_data=False)
        init = {i.name for i in proto.graph.initializer}
        inputs = [vi for vi in proto.graph.input if vi.name not in init]
        lines = []
        for k, feed in enumerate(feeds[name]):
            d = out / "calibration" / name / f"{k:03d}"
            d.mkdir(parents=True, exist_ok=True)
            files = []
            for vi in inputs:
                f = d / f"{vi.name}.npy"
                np.save(f, feed[vi.name])
                files.append(str(f.relative_to(out)))
            lines.append(" ".join(files))
        (out / f"dataset_{name}.txt").write_text("\n".join(lines) + "\n")
        spec[name] = {"onnx": Path(path).name, "inputs": [vi.name for vi in inputs],
                      "sizes": [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in inputs],
                      "dataset": f"dataset_{name}.txt"}
    script = out / "build_rknn.py"
    script.write_text(SCRIPT.format(graphs=spec, platform=platform, dtype=dtype))
    return {"commands": str(script), "notes": [f"quantized_dtype {dtype} for {platform}; int64 token ids are fed as "
                                               "given: if the toolkit rejects them, re-export with int32 inputs"]}


def convert_rknn(job) -> None:
    """The float model's static graphs with calibration inputs and the toolkit's build script (it quantizes itself)."""
    sx = job.export_static(job.out)
    info = write_rknn_bundle(job.out, {"prefill": sx.prefill_path, "decode": sx.decode_path}, job.feeds(sx))
    job.report.notes += info["notes"]
    job.report.details["inspection"] = inspect_graph(sx.prefill_path, "rknn").summary()


TARGET = register_target(Target("rknn", "Rockchip RKNPU2", rules="rknn", convert=convert_rknn, module=__name__))
