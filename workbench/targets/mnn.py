"""MNN: convert an ONNX graph to ``.mnn`` with the MNN Python package, and run it for evaluation.

    convert_to_mnn("sim/prefill.onnx", "mnn/prefill.mnn", weight_bits=4, block_size=128)
    runner = MnnCausalLM("mnn/prefill.mnn"); logits = runner.logits(ids)

The converter is the package's compiled extension (``_tools.mnnconvert``), called directly:
``MNN.tools.mnnconvert`` (what the ``mnnconvert`` command runs) installs a logging SDK with pip
and sends usage data on import, which nothing here may do.

Weights: MNN re-quantizes float weights itself (``--weightQuantBits``, per block of
``--weightQuantBlock``). Fed the workbench's simulated (already dequantized) weights with the
same bits and block, its asymmetric (min/max) mode reproduces them exactly (measured: zero
difference on a 4-bit grid), while its symmetric mode rescales and moves codes (about 5% of the
weight range). It applies to every MatMul with constant weights, including layers a plan keeps
in float (for example a tied ``lm_head``) unless ``keep_matmul_weights_float`` gives those weights
a leading batch axis of 1: MNN leaves batched constant MatMul operands in float (measured), and
the product is unchanged by broadcasting.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import numpy as np

from ..errors import WorkbenchError

__all__ = ["convert_to_mnn", "MnnCausalLM", "mnn_command_line", "keep_matmul_weights_float"]


def mnn_command_line(onnx_path: str | Path, mnn_path: str | Path, weight_bits: int | None = None,
                     block_size: int | None = None, asymmetric: bool = False) -> list[str]:
    """The MNNConvert arguments (also valid for the ``MNNConvert`` binary built from MNN's sources)."""
    args = ["mnnconvert", "-f", "ONNX", "--modelFile", str(onnx_path), "--MNNModel", str(mnn_path),
            "--bizCode", "workbench"]
    if weight_bits:
        args += ["--weightQuantBits", str(weight_bits)]
        if block_size:
            args += ["--weightQuantBlock", str(block_size)]
        if asymmetric:
            args.append("--weightQuantAsymmetric")
    return args


def keep_matmul_weights_float(onnx_path: str | Path, out_path: str | Path, initializers: list[str]) -> list[str]:
    """Reshape the named 2-D MatMul weights to ``[1, K, N]`` so ``--weightQuantBits`` leaves them in float.

    Weights in external data keep their bytes (the shape is all that changes), so ``out_path`` must sit
    in the same folder as ``onnx_path`` to find them.
    """
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data
    proto = onnx.load(str(onnx_path), load_external_data=False)
    wanted = set(initializers)
    users: dict[str, list] = {}
    for node in proto.graph.node:
        for i, x in enumerate(node.input):
            if x in wanted:
                users.setdefault(x, []).append((node, i))
    kept = []
    for init in proto.graph.initializer:
        if init.name in wanted and len(init.dims) == 2 and all(n.op_type == "MatMul" and i == 1
                                                                for n, i in users.get(init.name, [])):
            if uses_external_data(init):
                dims = list(init.dims)
                del init.dims[:]
                init.dims.extend([1] + dims)
            else:
                init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init)[None], init.name))
            kept.append(init.name)
    Path(out_path).write_bytes(proto.SerializeToString())
    return kept


@contextlib.contextmanager
def _quiet_fds():
    """The converter prints from C++ straight to file descriptors 1 and 2; keep that out of CLI/JSON output."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def convert_to_mnn(onnx_path: str | Path, mnn_path: str | Path, *, weight_bits: int | None = None,
                   block_size: int | None = None, asymmetric: bool = False, quiet: bool = True) -> Path:
    """Run MNN's ONNX converter in-process; the output is written atomically."""
    try:
        with _quiet_fds():  # importing the extension prints the CPU's features to stdout
            import _tools  # the MNN wheel's converter extension
    except ImportError:
        raise WorkbenchError("the MNN converter is not available: install the MNN package "
                             "(pip install -c constraints.txt MNN)") from None
    out = Path(mnn_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    tmp.unlink(missing_ok=True)
    args = mnn_command_line(onnx_path, tmp, weight_bits, block_size, asymmetric)
    ctx = _quiet_fds() if quiet else contextlib.nullcontext()
    with ctx, contextlib.redirect_stdout(io.StringIO()):
        _tools.mnnconvert(args)
    if not tmp.is_file() or tmp.stat().st_size == 0:
        raise WorkbenchError(f"MNN's converter wrote nothing for '{onnx_path}'; run `{' '.join(args)}` to see why")
    tmp.replace(out)
    return out


class MnnCausalLM:
    """A converted prefill graph run by MNN's Python runtime: ``logits(ids)`` for evaluation."""

    def __init__(self, mnn_path: str | Path, threads: int = 1):
        with _quiet_fds():  # MNN prints CPU features and the precision mode to stdout
            import MNN.expr as F
            import MNN.nn as nn
            config = {"backend": "CPU", "precision": "high", "numThread": threads}
            rt = nn.create_runtime_manager((config,))
            self.module = nn.load_module_from_file(str(mnn_path), ["input_ids", "attention_mask", "position_ids"],
                                                   ["logits"], runtime_manager=rt)
        self._F = F

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        F = self._F
        ids = np.asarray(input_ids, dtype=np.int32)
        b, n = ids.shape
        mask = np.ones_like(ids)
        pos = np.broadcast_to(np.arange(n, dtype=np.int32), ids.shape).copy()
        inputs = [F.const(a.flatten().tolist(), list(a.shape), F.NCHW, F.int) for a in (ids, mask, pos)]
        out = self.module.forward(inputs)[0]
        return np.array(out.read(), dtype=np.float32).reshape(b, n, -1)
